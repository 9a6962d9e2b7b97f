"""GEMM known-answer tests: exact integer products compared bitwise, and repeatability.

**Exact known answer.** A (m×k) and B (k×n) hold non-zero integers in [-r, r] drawn from a
generator seeded by ``seed``. Their product is computed on the host in int64. The device computes
C = A·B in the operand precision with fp32 accumulation, and C must equal the reference
**bitwise**. That holds for any summation order, blocking or tensor-core tiling because every
value involved is an exactly representable integer:

* operands: r <= 2^p for the format's p significand bits (fp32 24, fp16 11, bf16 8);
* each product |a·b| <= r^2 and each partial sum <= k·r^2 <= 2^24, so every fp32 addition is exact
  (no rounding can occur), whatever order the hardware adds in;
* operands are non-zero, so no product is -0 and an exact zero sum is +0 in every order.

:func:`pick_magnitude` chooses the largest r meeting both limits for k. A flip of any bit of C
changes its pattern and is caught. The test also reads its operands back after the product and
compares them bitwise with the seeded originals: a flip in device memory holding A or B can be
rounded away in C, but never in the operand itself, so it is caught and located too.

**Full-width known answer.** Small integers occupy only the top 7 bits of each significand, so
their products never set the low-order bits of the multiplier's result: a multiplier whose lowest
product bit is stuck would pass. :func:`wide_problem` builds a second product of the same shape
whose exact result needs every bit of the product. For a format with p significand bits (fp32
24, fp16 11, bf16 8) let W = min(24, 2p), the width of the exact product of two of its values
that fp32 can hold. Every column j of B has two non-zero entries, in rows 2q and 2q + 1
(q = j mod ⌊k/2⌋), so C[i, j] = s·(P0 − P1) with

* P0 = |A[i, 2q]·B[2q, j]| an odd integer in (2^(W−1), 2^W): exactly W significant bits, the lowest
  one set, so the fp32 result uses its whole significand (fp16 and bf16: the whole 22- or 16-bit
  product of the tensor-core multiplier). Its factors are odd integers of p_a and W − p_a bits,
  each at least √2 times its bit-width's smallest value, and p_a cycles through every split the
  format allows (fp32: 2..22), so the full-width products come from factors of every width;
* P1 = |A[i, 2q + 1]·B[2q + 1, j]| an odd integer in (2^(W−2), 2^(W−1)), of the opposite sign;
* every other term is a product with an exact zero.

Every partial sum, in any order, is then ±0, ±P0, ∓P1 or ±(P0 − P1): integers of magnitude below
2^W <= 2^24, exact in fp32. The result 0 < P0 − P1 < 2^W is never zero, so the sign of zero never
matters, and C must again equal the int64 reference bitwise. With k = 1 the single term is P0.
:func:`run_exact` checks both products and reports the full-width one's mismatches as ``C_wide``.

**Repeatability.** The same GEMM on the same random (non-integer) operands, run ``runs`` times on
one device, must give bitwise identical results (cuBLAS and BLAS are deterministic for a fixed
shape, device and library).

Every run reports its throughput in TFLOP/s (2·m·n·k per product).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from fleethealth.errors import ConfigError
from fleethealth.kernels.backend import Backend, Precision, encode, raw_bits
from fleethealth.kernels.faults import Fault
from fleethealth.kernels.results import MAX_REPORTED, Mismatch, SelfTestResult, Verdict, bits_of

__all__ = [
    "KnownProblem",
    "pick_magnitude",
    "known_problem",
    "wide_problem",
    "exact_reference",
    "locate_bits",
    "run_exact",
    "run_repeat",
    "gemm_tflops",
]

_INT64_REFERENCE_MACS = 1 << 27
"""Above this many multiply-adds the int64 reference is taken from float64 BLAS (see exact_reference)."""


def gemm_tflops(m: int, n: int, k: int, seconds: float) -> float:
    """Throughput of one m×k·k×n product that took ``seconds``: 2·m·n·k / s / 1e12."""
    return 2.0 * m * n * k / seconds / 1e12 if seconds > 0 else math.inf


def pick_magnitude(k: int, precision: Precision) -> int:
    """Largest r with r <= the format's exact-integer limit, k·r^2 <= 2^24, and r <= 127."""
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    r = min(math.isqrt((1 << 24) // k), precision.exact_int, 127)
    if r < 1:
        raise ConfigError(f"k={k} is too large for an exact fp32-accumulated product (k must be <= 2^24)")
    return r


@dataclass(frozen=True)
class KnownProblem:
    """Seeded integer operands (int64, host) of an exact GEMM, the operand magnitude bound ``r``
    and ``partial_bound``, a bound on |every partial sum| in any order (k·r² unless given)."""

    a: np.ndarray
    b: np.ndarray
    r: int
    seed: int
    partial_bound: int | None = None

    @property
    def sum_bound(self) -> int:
        return self.partial_bound if self.partial_bound is not None else self.shape[2] * self.r * self.r

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.a.shape[0], self.b.shape[1], self.a.shape[1]


def known_problem(m: int, n: int, k: int, *, precision: Precision, seed: int = 0,
                  r: int | None = None) -> KnownProblem:
    """Operands of non-zero integers in [-r, r], reproducible from ``seed``."""
    if min(m, n, k) < 1:
        raise ConfigError(f"shape must be positive, got m={m} n={n} k={k}")
    limit = pick_magnitude(k, precision)
    r = limit if r is None else int(r)
    if not 1 <= r <= limit:
        raise ConfigError(f"r={r} breaks exactness for k={k} in {precision} (must be 1..{limit})")
    rng = np.random.default_rng(seed)

    def draw(shape: tuple[int, int]) -> np.ndarray:
        mag = rng.integers(1, r + 1, size=shape, dtype=np.int64)
        return np.where(rng.random(shape) < 0.5, -mag, mag)

    return KnownProblem(a=draw((m, k)), b=draw((k, n)), r=r, seed=seed)


def _significand_bits(precision: Precision) -> int:
    return precision.exact_int.bit_length() - 1


def _odd(rng: np.random.Generator, bits: int, size: int | tuple[int, ...]) -> np.ndarray:
    """Odd integers of exactly ``bits`` bits, each above 2^(bits−1)·√2 (int64)."""
    lo = math.isqrt(1 << (2 * bits - 1)) + 1
    hi = (1 << bits) - 1
    return 2 * rng.integers(lo // 2, (hi - 1) // 2 + 1, size=size, dtype=np.int64) + 1


def wide_problem(m: int, n: int, k: int, *, precision: Precision, seed: int = 0) -> KnownProblem:
    """Operands whose exact product needs full-width products (module docstring, "Full-width")."""
    if min(m, n, k) < 1:
        raise ConfigError(f"shape must be positive, got m={m} n={n} k={k}")
    p = _significand_bits(precision)
    width = min(24, 2 * p)
    rng = np.random.default_rng(seed + 0x5EED)
    a = np.empty((m, k), dtype=np.int64)
    b = np.zeros((k, n), dtype=np.int64)
    splits = []
    for col in range(k):
        total = width - col % 2  # even terms: W-bit products, odd terms: (W−1)-bit
        lo, hi = max(2, total - p), min(p, total - 2)
        pa = lo + (col // 2) % (hi - lo + 1)
        splits.append((pa, total - pa))
        a[:, col] = _odd(rng, pa, m)
    a *= np.where(rng.random((m, 1)) < 0.5, -1, 1)
    pairs = max(1, k // 2)
    sign = np.where(rng.random(n) < 0.5, -1, 1)
    for j in range(n):
        q = j % pairs
        for col, s in ((2 * q, 1), (2 * q + 1, -1)):
            if col < k:
                b[col, j] = s * sign[j] * int(_odd(rng, splits[col][1], 1)[0])
    return KnownProblem(a=a, b=b, r=int(max(np.abs(a).max(), np.abs(b).max())), seed=seed,
                        partial_bound=(1 << width) - 1)


def exact_reference(problem: KnownProblem) -> np.ndarray:
    """The exact product in int64.

    Small shapes use int64 matmul directly. Large ones use float64 BLAS and convert to int64: every
    partial sum is an integer of magnitude <= ``problem.sum_bound`` <= 2^24 < 2^53, and every product
    below it, so the float64 product is exact and the conversion loses nothing
    (``tests/kernels/test_gemm.py`` checks both agree).
    """
    m, n, k = problem.shape
    if m * n * k <= _INT64_REFERENCE_MACS:
        return problem.a @ problem.b
    if problem.sum_bound >= 1 << 53:
        raise ConfigError("operands too large for an exact float64 reference")
    return (problem.a.astype(np.float64) @ problem.b.astype(np.float64)).astype(np.int64)


def locate_bits(backend: Backend, observed: Any, expected: Any, where: str,
                *, as_float: bool = True) -> tuple[int, tuple[Mismatch, ...]]:
    """Compare two same-shape arrays bitwise; return the count and the first located mismatches.

    ``observed`` and ``expected`` live on the backend's device; only the located elements come to
    the host. Each mismatch names (row, col) of a 2-D array and the differing bit positions.
    """
    xp = backend.xp
    obs = raw_bits(observed).reshape(-1)
    exp = raw_bits(expected).reshape(-1)
    idx = xp.flatnonzero(obs != exp)
    total = int(idx.size)
    if total == 0:
        return 0, ()
    first = idx[:MAX_REPORTED]  # index on the device; only these few values travel to the host
    got_bits = backend.to_host(obs[first])
    want_bits = backend.to_host(exp[first])
    got_vals = backend.to_host(observed.reshape(-1)[first])
    want_vals = backend.to_host(expected.reshape(-1)[first])
    idx = backend.to_host(first)
    cols = observed.shape[1] if observed.ndim == 2 else 1
    out = []
    for i, ob, wb, ov, wv in zip(idx.tolist(), got_bits.tolist(), want_bits.tolist(), got_vals.tolist(),
                                 want_vals.tolist(), strict=True):
        out.append(Mismatch(where=where, row=i // cols, col=i % cols, bits=bits_of(int(ob) ^ int(wb)),
                            expected=_value(wv, as_float), observed=_value(ov, as_float)))
    return total, tuple(out)


def _value(v: Any, as_float: bool) -> float | int | str:
    if not as_float:
        return int(v)
    v = float(v)
    return v if math.isfinite(v) else str(v)


def run_exact(backend: Backend, m: int, n: int, k: int, *, precision: Precision = Precision.FP32,
              seed: int = 0, suite: str = "adhoc", iters: int = 1, fault: Fault | None = None,
              operand_fault: str | None = None) -> SelfTestResult:
    """Exact known-answer GEMM on ``backend``; bitwise comparison of C and of the operands, then of
    the full-width product (:func:`wide_problem`, same shape, untimed; mismatches ``C_wide``).

    The product is timed over ``iters`` back-to-back runs (throughput is their mean); the last
    result is the one checked.

    ``fault`` (harness only) flips one bit: in C after the product, or, with
    ``operand_fault="A"``/``"B"``, in that operand on the device before the product.
    """
    precision = Precision(precision)
    if operand_fault not in (None, "A", "B"):
        raise ConfigError(f"operand_fault must be 'A' or 'B', got {operand_fault!r}")
    problem = known_problem(m, n, k, precision=precision, seed=seed)
    reference = exact_reference(problem)
    a_host = encode(problem.a.astype(np.float32), precision)
    b_host = encode(problem.b.astype(np.float32), precision)
    xp = backend.xp
    with backend.activate():
        a = backend.asarray(a_host)
        b = backend.asarray(b_host)
        if fault is not None and operand_fault is not None:
            fault.flip_element(xp, a if operand_fault == "A" else b, operand_fault)
        backend.matmul(a, b, precision)  # warm-up: library load, kernel selection
        outs, seconds = backend.timed(lambda: [backend.matmul(a, b, precision) for _ in range(max(1, iters))])
        c = outs[-1]
        seconds /= max(1, iters)
        del outs
        if fault is not None and operand_fault is None:
            fault.flip_element(xp, c, "C")
        expected = backend.asarray(reference.astype(np.float32))
        total, found = 0, ()
        # Operands first: a corrupted operand is the cause, the wrong C elements its effect.
        for name, dev, host in (("A", a, a_host), ("B", b, b_host)):
            n_bad, bad = locate_bits(backend, dev, backend.asarray(host), name,
                                     as_float=precision is not Precision.BF16)
            total += n_bad
            found += bad
        n_bad, bad = locate_bits(backend, c, expected, "C")
        total += n_bad
        found += bad
        max_error = float(xp.max(xp.abs(c.astype(xp.float64) - expected.astype(xp.float64))))
        del c, expected
        wide = wide_problem(m, n, k, precision=precision, seed=seed)
        wide_ref = backend.asarray(exact_reference(wide).astype(np.float32))
        c_wide = backend.matmul(backend.asarray(encode(wide.a.astype(np.float32), precision)),
                                backend.asarray(encode(wide.b.astype(np.float32), precision)), precision)
        n_bad, bad = locate_bits(backend, c_wide, wide_ref, "C_wide")
        total += n_bad
        found += bad
        if n_bad:
            wide_error = float(xp.max(xp.abs(c_wide.astype(xp.float64) - wide_ref.astype(xp.float64))))
            max_error = max(max_error, wide_error) if math.isfinite(wide_error) else math.inf
    seconds = fault.stretch(seconds) if fault is not None else seconds
    return SelfTestResult(
        suite=suite, test=f"gemm_exact_{precision.value}", device=backend.device,
        verdict=Verdict.FAIL if total else Verdict.PASS, duration_s=seconds,
        throughput=gemm_tflops(m, n, k, seconds), unit="TFLOP/s",
        max_error=max_error if math.isfinite(max_error) else math.inf, mismatches=found[:MAX_REPORTED],
        mismatch_total=total, model=backend.model,
        detail=f"m={m} n={n} k={k} r={problem.r} seed={seed}; full-width products of "
               f"{min(24, 2 * _significand_bits(precision))} bits",
        extra={"m": m, "n": n, "k": k, "r": problem.r, "wide_bits": min(24, 2 * _significand_bits(precision))})


def run_repeat(backend: Backend, m: int, n: int, k: int, *, runs: int = 3, precision: Precision = Precision.FP32,
               seed: int = 0, suite: str = "adhoc", fault: Fault | None = None) -> SelfTestResult:
    """The same GEMM ``runs`` times on random normal operands; every result must equal the first
    bitwise. ``fault`` (harness only) flips one bit of the last run's output."""
    if runs < 2:
        raise ConfigError(f"repeatability needs at least 2 runs, got {runs}")
    precision = Precision(precision)
    rng = np.random.default_rng(seed)
    a_host = encode(rng.standard_normal((m, k), dtype=np.float32), precision)
    b_host = encode(rng.standard_normal((k, n), dtype=np.float32), precision)
    total = 0
    max_error = 0.0
    found: tuple[Mismatch, ...] = ()
    times = []
    with backend.activate():
        a = backend.asarray(a_host)
        b = backend.asarray(b_host)
        first, seconds = backend.timed(lambda: backend.matmul(a, b, precision))
        times.append(seconds)
        for run in range(1, runs):
            c, seconds = backend.timed(lambda: backend.matmul(a, b, precision))
            times.append(seconds)
            if fault is not None and run == runs - 1:
                fault.flip_element(backend.xp, c, "C")
            n_bad, bad = locate_bits(backend, c, first, "C")
            if n_bad:
                diff = float(backend.xp.max(backend.xp.abs(c.astype("float64") - first.astype("float64"))))
                max_error = max(max_error, diff) if math.isfinite(diff) else math.inf
            total += n_bad
            found += tuple(replace(mm, detail=f"run {run} differs from run 0") for mm in bad)
    seconds = float(np.median(times))
    seconds = fault.stretch(seconds) if fault is not None else seconds
    return SelfTestResult(
        suite=suite, test=f"gemm_repeat_{precision.value}", device=backend.device,
        verdict=Verdict.FAIL if total else Verdict.PASS, duration_s=float(sum(times)),
        throughput=gemm_tflops(m, n, k, seconds), unit="TFLOP/s", max_error=max_error,
        mismatches=found[:MAX_REPORTED], mismatch_total=total, model=backend.model,
        detail=f"m={m} n={n} k={k} runs={runs} seed={seed}", extra={"m": m, "n": n, "k": k, "runs": runs})
