"""Gradient digests computed on the device: a bitwise one for the self-check, a numeric fingerprint
for the cross-rank replay.

**Bitwise digest.** Each tensor's raw bits are read as 64-bit words (float32 pairs, bfloat16 /
float16 quadruples, float64 as is; the few elements left over are widened one by one) and cut into
chunks of :data:`CHUNK` words. Per chunk the device computes two wrapping (two's complement,
modulo 2^64) integer sums::

    s1 = sum(words)            s2 = sum(mix(words XOR key[position]))
    mix(x) = x ^= x >>> 29;  x *= 0xBF58476D1CE4E5B9;  x ^= x >>> 32    (>>>: logical shift)

``key`` is a fixed pseudo-random word per position, so ``s2`` also changes when values move. ``mix``
is a bijection of 64-bit words (xorshift and multiplication by an odd constant are invertible) and
is not linear, so two changes in different words of a chunk cancel in ``s2`` only by a 2^-64-ish
accident: a linear keyed sum would miss two flips of the same bit position in opposite directions
whenever the two key bits match, about a quarter of all double flips. Only these ``2 x chunks``
integers leave the device (the gradients never do); the host hashes them with the dtypes and shapes
into a 128-bit hex string, compared with ``==``. A single flipped bit changes one word by +-2^k with
k < 64, which is never 0 modulo 2^64, so it always changes ``s1`` and the digest. The one deliberate
exception: with ``canonical_zero`` (the default) -0.0 and +0.0 count as equal, because accumulating
a gradient into a zeroed buffer turns -0.0 into +0.0 and is not a fault. Modular sums are
associative and commutative, so the digest is deterministic on every device and equal across
devices for equal bits.

**Fingerprint.** For the replay, where two devices legitimately differ in the last bits, every
:data:`FINGERPRINT_ROW` elements of each tensor give one row ``[sum, sum of squares, key-signed
sum, n]`` in float64; :func:`fingerprint_distance` scales the differences by their Cauchy-Schwarz
bounds, so the distance is a relative error in [0, inf). Rows of a fixed size keep the replay's
sensitivity from fading with the tensor's size: a row's distance is normalised by its own
magnitude (about ``row x RMS`` for the sums), so with one row per tensor the smallest single-element
error above a 1e-6 tolerance grew with n (worst of four elements: 1 RMS at 10^6 elements, 7 at
10^7, 16 at 10^8; up to 1e-6 x n x RMS for an element near zero); with rows of 65,536 elements it
is 0.066 RMS at every size (``bench/replay_sensitivity.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["CHUNK", "FINGERPRINT_ROW", "BitDigest", "PendingDigest", "bit_digest", "bit_digest_async", "fingerprint",
           "fingerprint_distance"]

CHUNK = 1 << 20
"""64-bit words per chunk; the position key is this long (8 MiB on each device)."""
FINGERPRINT_ROW = 1 << 16
"""Elements per fingerprint row (divides :data:`CHUNK`): the replay compares each row on its own."""

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = 0xBF58476D1CE4E5B9 - (1 << 64)  # an odd 64-bit constant (splitmix64's), as a signed int64
_LOW = {k: (1 << (64 - k)) - 1 for k in (29, 32)}  # masks turning ``>> k`` into a logical shift
_keys: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def _key(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    cache = (str(device), dtype)
    key = _keys.get(cache)
    if key is None:
        gen = torch.Generator().manual_seed(0x5DC_F1EE7)
        info = torch.iinfo(dtype)
        key = torch.randint(info.min, info.max, (CHUNK,), generator=gen, dtype=torch.int64).to(dtype)
        key = _keys[cache] = key.to(device)
    return key


def _rows(t: torch.Tensor, canonical_zero: bool) -> list[torch.Tensor]:
    """The ``(s1, s2)`` rows of one tensor, still on its device (int64, shape ``(2,)`` each)."""
    t = t.detach()
    if canonical_zero and t.is_floating_point():
        t = t + 0.0  # -0.0 + 0.0 == +0.0; every other value (NaN payloads included) is unchanged
    flat = t.reshape(-1)
    per_word = 8 // flat.element_size()
    n = flat.numel()
    m = n - n % per_word
    try:
        words = flat[:m].view(torch.int64)
    except RuntimeError:  # a view at an odd offset (e.g. inside a DDP bucket): realign by copying
        words = flat[:m].clone().view(torch.int64)
    key = _key(flat.device, torch.int64)
    rows = [torch.stack([chunk.sum(), _mixed_sum(chunk, key)]) for chunk in words.split(CHUNK)]
    if m < n:  # fewer than 8 bytes' worth of elements left: widen each (exact)
        tail = flat[m:].view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
        rows.append(torch.stack([tail.sum(), _mixed_sum(tail, key)]))
    return rows


def _mixed_sum(words: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``sum(mix(words ^ key))`` on the device with wrapping int64 arithmetic (see the module doc).

    Two scratch buffers of the chunk's size, updated in place; logical shifts are arithmetic shifts
    with the sign-extended bits masked off."""
    x = torch.bitwise_xor(words, key[:words.numel()])
    t = torch.bitwise_right_shift(x, 29)
    x ^= t.bitwise_and_(_LOW[29])
    x.mul_(_MIX)
    torch.bitwise_right_shift(x, 32, out=t)
    x ^= t.bitwise_and_(_LOW[32])
    return x.sum()


@dataclass(frozen=True, eq=False)
class BitDigest:
    """A bitwise digest of a list of tensors. ``parts`` has shape ``(chunks, 2)`` (int64 sums);
    ``bounds[i]:bounds[i + 1]`` are the rows of tensor ``i``; ``names`` label the tensors.

    Equality is exact (``==`` on the integer sums and the layout); :meth:`mismatches` names the tensors
    whose bits differ.
    """

    parts: np.ndarray
    bounds: tuple[int, ...]
    layout: tuple[str, ...]
    names: tuple[str, ...]

    @property
    def hex(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update("|".join(self.layout).encode())
        h.update(np.ascontiguousarray(self.parts, dtype="<i8").tobytes())
        return h.hexdigest()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BitDigest):
            return NotImplemented
        return self.layout == other.layout and np.array_equal(self.parts, other.parts)

    def __hash__(self) -> int:
        return hash(self.hex)

    def mismatches(self, other: BitDigest) -> list[str]:
        """Names of the tensors whose bits differ (all of them when the layouts differ)."""
        if self.layout != other.layout:
            return list(self.names)
        out = []
        for i, name in enumerate(self.names):
            a, b = self.bounds[i], self.bounds[i + 1]
            if not np.array_equal(self.parts[a:b], other.parts[a:b]):
                out.append(name)
        return out


class PendingDigest:
    """A digest whose integer sums are still on the device; :meth:`result` copies them (one sync)."""

    def __init__(self, parts: list[torch.Tensor], bounds: tuple[int, ...], layout: tuple[str, ...],
                 names: tuple[str, ...]) -> None:
        self._parts = torch.stack(parts) if parts else None
        self._bounds, self._layout, self._names = bounds, layout, names

    def result(self) -> BitDigest:
        parts = (np.zeros((0, 2), dtype=np.int64) if self._parts is None
                 else self._parts.cpu().numpy().astype(np.int64))
        return BitDigest(parts=parts, bounds=self._bounds, layout=self._layout, names=self._names)


def bit_digest_async(tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None, *,
                     canonical_zero: bool = True) -> PendingDigest:
    """Queue the digest of ``tensors`` on their device without waiting for it (see the module doc)."""
    names = tuple(names) if names is not None else tuple(str(i) for i in range(len(tensors)))
    if len(names) != len(tensors):
        raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
    parts: list[torch.Tensor] = []
    bounds = [0]
    layout = []
    for t in tensors:
        layout.append(f"{t.dtype}{tuple(t.shape)}")
        parts += _rows(t, canonical_zero)
        bounds.append(len(parts))
    return PendingDigest(parts, tuple(bounds), tuple(layout), names)


def bit_digest(tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None, *,
               canonical_zero: bool = True) -> BitDigest:
    """The bitwise digest of ``tensors`` (see the module doc); one device sync."""
    return bit_digest_async(tensors, names, canonical_zero=canonical_zero).result()


def fingerprint(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """One row ``[sum, sum of squares, key-signed sum, n]`` in float64 per :data:`FINGERPRINT_ROW`
    elements of each tensor (a tensor of at most that many elements is one row), in tensor order;
    shape ``(rows, 4)``.

    Each tensor is widened to float64 one chunk of :data:`CHUNK` elements at a time (three
    row-wise reductions per chunk), so the temporary memory is a few chunks (tens of MiB), not four
    times the largest gradient."""
    rows: list[torch.Tensor] = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        key = _key(flat.device, torch.int64)
        if flat.numel() == 0:
            rows.append(torch.zeros(1, 4, dtype=torch.float64, device=flat.device))
            continue
        for part in flat.split(CHUNK):  # widened chunk by chunk: float64 scratch stays <= CHUNK elements
            chunk = part.to(torch.float64)
            m = chunk.numel()
            sign = 1.0 - 2.0 * (key[:m] & 1).to(torch.float64)
            count = -(-m // FINGERPRINT_ROW)
            pad = count * FINGERPRINT_ROW - m
            if pad:
                chunk = torch.nn.functional.pad(chunk, (0, pad))
                sign = torch.nn.functional.pad(sign, (0, pad))
            c, s = chunk.view(count, FINGERPRINT_ROW), sign.view(count, FINGERPRINT_ROW)
            n = torch.full((count,), float(FINGERPRINT_ROW), dtype=torch.float64, device=flat.device)
            n[-1] = FINGERPRINT_ROW - pad
            rows.append(torch.stack([c.sum(dim=1), (c * c).sum(dim=1), (c * s).sum(dim=1), n], dim=1))
    if not rows:
        return np.zeros((0, 4))
    return torch.cat(rows).cpu().numpy()


def _scaled(a: np.ndarray, b: np.ndarray, scale: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = np.abs(a - b)
        out = np.where(scale > 0, diff / np.where(scale > 0, scale, 1.0), np.where(diff == 0, 0.0, np.inf))
    same_nonfinite = ~np.isfinite(a) & ~np.isfinite(b) & ((a == b) | (np.isnan(a) & np.isnan(b)))
    out = np.where(same_nonfinite, 0.0, out)
    return np.where(np.isnan(out), np.inf, out)


def fingerprint_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Relative distance between two fingerprints of the same tensors: 0 when bitwise equal.

    Each tensor's sums are scaled by ``sqrt(sumsq * n) + sqrt(n) * rms`` (their Cauchy-Schwarz bound,
    plus the same bound for a tensor at the whole gradient's RMS, so a tensor whose gradient is pure
    rounding noise, e.g. a bias ahead of a normalisation, does not dominate); sums of squares by
    ``sumsq + n * rms^2``. Matching NaN / inf entries count as equal; NaN or inf against a finite
    value gives ``inf``. Raises ``ValueError`` when the shapes differ.
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2 or a.shape[1] != 4:
        raise ValueError(f"fingerprints of different layouts: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    if not np.array_equal(a[:, 3], b[:, 3]):
        return float("inf")
    n = a[:, 3]
    with np.errstate(invalid="ignore", over="ignore"):
        sq = np.fmax(a[:, 1], b[:, 1])
        finite = np.isfinite(sq)
        ms = float(sq[finite].sum() / max(n[finite].sum(), 1.0)) if finite.any() else 0.0
        bound = np.sqrt(sq * n) + np.sqrt(n * ms)
        sq_scale = sq + n * ms
    d = np.stack([_scaled(a[:, 0], b[:, 0], bound), _scaled(a[:, 1], b[:, 1], sq_scale),
                  _scaled(a[:, 2], b[:, 2], bound)])
    return float(d.max())
