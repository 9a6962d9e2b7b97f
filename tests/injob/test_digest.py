"""The device digest: any single flipped bit changes it; the fingerprint distance is a relative error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fleethealth.injob.digest import CHUNK, FINGERPRINT_ROW, bit_digest, fingerprint, fingerprint_distance

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _flip(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    out = t.clone()
    bits = out.reshape(-1).view(_INT[out.element_size()])
    width = out.element_size() * 8
    mask = torch.iinfo(bits.dtype).min if bit == width - 1 else 1 << bit
    bits[index] ^= mask
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
                                   torch.int8])
def test_every_single_bit_flip_changes_the_digest(dtype: torch.dtype) -> None:
    """Every bit position of the element width, at random positions in every tensor of the list."""
    gen = torch.Generator().manual_seed(1)
    if dtype.is_floating_point:
        tensors = [torch.randn(37, 11, generator=gen).to(dtype), torch.randn(129, generator=gen).to(dtype)]
    else:
        tensors = [torch.randint(-100, 100, (37, 11), generator=gen).to(dtype),
                   torch.randint(-100, 100, (129,), generator=gen).to(dtype)]
    names = ["w", "b"]
    base = bit_digest(tensors, names, canonical_zero=False)
    assert base == bit_digest([t.clone() for t in tensors], names, canonical_zero=False)
    rng = np.random.default_rng(2)
    for which in range(len(tensors)):
        for bit in range(tensors[which].element_size() * 8):
            changed = list(tensors)
            changed[which] = _flip(tensors[which], int(rng.integers(tensors[which].numel())), bit)
            d = bit_digest(changed, names, canonical_zero=False)
            assert d != base and d.hex != base.hex, (which, bit)
            assert d.mismatches(base) == [names[which]]


def test_canonical_zero_equates_only_the_sign_of_zero() -> None:
    t = torch.tensor([0.0, -0.0, 1.5, -2.25, float("nan")])
    plus = torch.tensor([0.0, 0.0, 1.5, -2.25, float("nan")])
    assert bit_digest([t]) == bit_digest([plus])
    assert bit_digest([t], canonical_zero=False) != bit_digest([plus], canonical_zero=False)
    for bit in range(31):  # every other bit of the zero element still shows
        assert bit_digest([_flip(plus, 0, bit)]) != bit_digest([plus])


def test_moving_values_changes_the_digest() -> None:
    t = torch.arange(10, dtype=torch.float32)
    swapped = t.clone()
    swapped[[2, 7]] = swapped[[7, 2]]
    assert bit_digest([t]) != bit_digest([swapped])
    assert bit_digest([t, t * 2]) != bit_digest([t * 2, t])  # same values, other tensors
    assert bit_digest([t.reshape(2, 5)]) != bit_digest([t.reshape(5, 2)])  # layout is part of it


def test_flip_beyond_the_first_chunk_and_in_the_tail_is_seen() -> None:
    """float32 pairs form 64-bit words: 2 x CHUNK + 17 floats are two chunks and one left-over float."""
    t = torch.randn(2 * CHUNK + 17, generator=torch.Generator().manual_seed(3))
    d = bit_digest([t])
    assert d.parts.shape == (3, 2)
    for index in (5, CHUNK + 3, 2 * CHUNK + 2, 2 * CHUNK + 16):
        assert bit_digest([_flip(t, index, 0)]) != d
        assert bit_digest([_flip(t, index, 31)]) != d


def test_unaligned_views_digest_like_copies() -> None:
    """Gradients inside a flat buffer (as in a DDP bucket) may start at an odd element offset."""
    buf = torch.randn(101)
    view = buf[1:50]
    assert bit_digest([view]) == bit_digest([view.clone()])
    assert bit_digest([buf[3:8].half()]) == bit_digest([buf[3:8].half().clone()])


def test_fingerprint_distance_is_zero_for_equal_and_relative_otherwise() -> None:
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(64, 32, generator=gen), torch.randn(32, generator=gen)]
    fp = fingerprint(grads)
    assert fp.shape == (2, 4) and fp[0, 3] == 64 * 32
    assert fingerprint_distance(fp, fingerprint([g.clone() for g in grads])) == 0.0
    scaled = [grads[0] * (1 + 1e-3), grads[1]]
    assert 1e-4 < fingerprint_distance(fp, fingerprint(scaled)) < 1e-2
    one = [grads[0].clone(), grads[1]]
    one[0][3, 3] += 1e-2
    assert fingerprint_distance(fp, fingerprint(one)) > 0


def test_fingerprint_distance_nonfinite_and_layout() -> None:
    nan = [torch.full((4,), float("nan"))]
    assert fingerprint_distance(fingerprint(nan), fingerprint(nan)) == 0.0
    assert fingerprint_distance(fingerprint(nan), fingerprint([torch.ones(4)])) == float("inf")
    zeros = fingerprint([torch.zeros(4)])
    assert fingerprint_distance(zeros, zeros) == 0.0
    assert fingerprint_distance(zeros, fingerprint([torch.full((4,), 1e-30)])) > 0.5  # all of it differs
    with pytest.raises(ValueError):
        fingerprint_distance(zeros, fingerprint([torch.zeros(4), torch.zeros(2)]))
    assert fingerprint_distance(zeros, fingerprint([torch.zeros(5)])) == float("inf")


def _flip_words(t: torch.Tensor, flips: list[tuple[int, int]]) -> torch.Tensor:
    """Flip bit ``bit`` of 64-bit word ``word`` for each ``(word, bit)`` (float32 pairs form a word)."""
    out = t.clone()
    words = out.reshape(-1).view(torch.int64)
    for word, bit in flips:
        words[word] ^= torch.iinfo(torch.int64).min if bit == 63 else 1 << bit
    return out


def test_double_bit_flips_in_one_chunk_are_all_caught() -> None:
    """Two flips of the same bit position in opposite directions (one word gains 2^k, the other loses
    it) cancel in a plain sum and, whenever their key bits match, in a linearly keyed sum too (about a
    quarter of all such pairs); the mixed sum catches every one, as well as random pairs."""
    t = torch.randn(4096, generator=torch.Generator().manual_seed(5))
    words = t.view(torch.int64)
    base = bit_digest([t], canonical_zero=False)
    rng = np.random.default_rng(6)
    opposite = 0
    for trial in range(1500):
        bit = int(rng.integers(64))
        if trial % 3 == 2:  # a random pair of bits in two random words
            i, j = rng.choice(words.numel(), size=2, replace=False)
            flips = [(int(i), bit), (int(j), int(rng.integers(64)))]
        else:  # same bit, one word with it clear (+2^k) and one with it set (-2^k)
            has = ((words >> bit) & 1).bool().numpy()
            clear, set_ = np.flatnonzero(~has), np.flatnonzero(has)
            if not len(clear) or not len(set_):
                continue
            flips = [(int(rng.choice(clear)), bit), (int(rng.choice(set_)), bit)]
            opposite += 1
        d = bit_digest([_flip_words(t, flips)], canonical_zero=False)
        assert d != base, (trial, flips)
    assert opposite > 900  # the hard case was really exercised


def test_fingerprint_widens_to_float64_one_chunk_at_a_time() -> None:
    """The replay fingerprint of a large gradient never holds a float64 copy of the whole tensor
    (4x a bfloat16 gradient): every float64 tensor the ops produce has at most CHUNK elements."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Largest(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor) and o.dtype == torch.float64:
                    self.largest = max(self.largest, o.numel())
            return out

    big = torch.randn(2 * CHUNK + 5, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    with _Largest() as seen:
        fp = fingerprint([big])
    assert 0 < seen.largest <= CHUNK
    ref = big.double()
    assert fp.shape == (-(-big.numel() // FINGERPRINT_ROW), 4) and fp[:, 3].sum() == big.numel()
    assert fp[:-1, 3].tolist() == [FINGERPRINT_ROW] * (len(fp) - 1) and fp[-1, 3] == 5
    assert fp[:, 0].sum() == pytest.approx(float(ref.sum()), rel=1e-9)
    assert fp[:, 1].sum() == pytest.approx(float((ref * ref).sum()), rel=1e-9)
    assert fp[0, 0] == pytest.approx(float(ref[:FINGERPRINT_ROW].sum()), rel=1e-9)


@pytest.mark.parametrize("n", [FINGERPRINT_ROW, 64 * FINGERPRINT_ROW])
def test_replay_sensitivity_does_not_fade_with_tensor_size(n: int) -> None:
    """One element moved by a tenth of the RMS is above the replay's tolerance floor in a small and in a
    4 Mi-element tensor alike (one row per tensor needed 1e-6 x n x RMS: 4 RMS at 4 Mi elements)."""
    from fleethealth.injob.replay import MIN_REPLAY_TOLERANCE

    g = torch.randn(n, generator=torch.Generator().manual_seed(3))
    moved = g.clone()
    moved[n // 3] += 0.1 * float(g.square().mean().sqrt())
    assert fingerprint_distance(fingerprint([g]), fingerprint([moved])) > MIN_REPLAY_TOLERANCE
