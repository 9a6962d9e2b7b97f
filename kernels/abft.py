"""ABFT (Huang & Abraham, 1984): verify C = A·B through row and column checksums, locate a bad element.

For any C = A·B, the column sums and row sums obey

    eᵀC = (eᵀA)·B        (n column checks)
    C·e = A·(B·e)        (m row checks)

The right-hand sides cost two matrix-vector products, O(mk + kn), against the GEMM's O(mnk).
A single wrong element C[i, j] = true + δ moves row check i and column check j by δ and no other,
so the intersection of the failing row and column locates it, and δ estimates the error.

**Tolerance (why a healthy run never fails).** The device accumulates in fp32 with unit roundoff
u (2^-24 round-to-nearest; 2^-23 is used on GPUs, whose tensor cores may truncate while
accumulating). For any summation order the computed product obeys the classical bound
(Higham, *Accuracy and Stability of Numerical Algorithms*, §3.5)

    |Ĉ − A·B| <= γ_k · |A|·|B|,       γ_k = k·u / (1 − k·u)

elementwise. Products of fp16/bf16 operands are exact in fp32, so the bound holds for them too.
The checksums themselves are formed in fp32 (unit roundoff u_w = 2^-24) from the same operands:
forming eᵀĈ costs at most γ_m(u_w)·eᵀ|Ĉ|, and forming (eᵀA)·B at most γ_{m+k}(u_w)·(eᵀ|A|)·|B|.
Summing the elementwise bound over column j and adding both gives the tolerance

    τ_col[j] = (γ_k(u) + γ_{m+k}(u_w) + γ_m(u_w)·(1 + γ_k(u))) · M_j + m·k·2^-149,   M = (eᵀ|A|)·|B|

using eᵀ|Ĉ| <= (1 + γ_k(u))·M on a healthy run, and symmetrically ``τ_row[i]`` with
M = |A|·(|B|·e) and n in place of m. M is computed in fp32 too; being a sum of non-negative
terms, the computed value is divided by (1 − γ_{m+k}(u_w)) to make it an upper bound, and τ is
widened by 2^-20 relative for its own arithmetic (2^-149, the smallest fp32 subnormal, covers
products that underflow). A healthy run satisfies
|residual| <= τ in every check, so it never raises a false alarm, for any shape and precision.

A corruption δ at (i, j) is guaranteed to fail both of its checks, and so to be located, when
|δ| > 2·max(τ_row[i], τ_col[j]); in practice that is every flip of the sign bit, the exponent and
the upper mantissa bits, while flips of the lowest mantissa bits are within rounding noise and
invisible to any tolerance-based check (the exact known-answer test in
:mod:`fleethealth.kernels.gemm` catches those).

The work splits as in Huang & Abraham's scheme: :func:`encode_operands` forms the operand
checksums and tolerances once per operand pair (streaming over row blocks of about
``chunk_bytes`` so each block's absolute values stay in cache; A is read once and B twice), and
:func:`verify_product` checks each product with two matrix-vector products over C alone. Forming the checks
in fp32 rather than fp64 keeps the verification within a few per cent of the GEMM on a CPU at the
price of a tolerance about three times wider.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleethealth.errors import ConfigError
from fleethealth.kernels.backend import Backend, Precision, encode, widen
from fleethealth.kernels.faults import Fault
from fleethealth.kernels.gemm import gemm_tflops
from fleethealth.kernels.results import MAX_REPORTED, Mismatch, SelfTestResult, Verdict

__all__ = [
    "AbftCheck",
    "AbftEncoding",
    "gamma",
    "accumulation_u",
    "encode_operands",
    "verify_product",
    "checksum_verify",
    "run_abft",
    "ABFT_FLIP_BIT",
]

_U32 = 2.0 ** -24
_TINY = 2.0 ** -149
_MAX_PAIRS = 4096
ABFT_FLIP_BIT = 30
"""The bit the ``bitflip`` fault flips in the ABFT test: the exponent's top bit, a change no
tolerance can hide (x·2^±128, or inf/NaN), so an injected fault is always a detectable one."""


def gamma(n: int, u: float) -> float:
    """γ_n = n·u / (1 − n·u), the relative error bound of an n-term dot product."""
    nu = n * u
    if nu >= 1.0:
        raise ConfigError(f"no error bound: n·u = {nu:.3g} >= 1 (n={n}, u={u:.3g})")
    return nu / (1.0 - nu)


def accumulation_u(backend: Backend) -> float:
    """Unit roundoff of fp32 accumulation on this device: 2^-24 (CPU BLAS rounds to nearest),
    2^-23 on a GPU (tensor-core accumulation may truncate)."""
    return 2.0 ** -23 if backend.is_gpu else 2.0 ** -24


@dataclass(frozen=True, eq=False)
class AbftCheck:
    """One checksum verification of C = A·B.

    ``row_residual`` (m,) is C·e − A·(B·e), ``col_residual`` (n,) is eᵀC − (eᵀA)·B (host float64);
    ``row_tolerance`` / ``col_tolerance`` are their bounds. ``rows`` / ``cols`` are the checks that
    failed; ``located`` pairs a failing row with a failing column whose residuals agree, as
    (row, col, δ) where δ estimates the error in C[row, col]. ``max_ratio`` is the largest
    residual / tolerance: at most 1 on a healthy run, above 1 is a detection (inf for NaN).
    """

    row_residual: np.ndarray
    row_tolerance: np.ndarray
    col_residual: np.ndarray
    col_tolerance: np.ndarray
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    located: tuple[tuple[int, int, float], ...]
    max_ratio: float

    @property
    def ok(self) -> bool:
        return not self.rows and not self.cols


def _blocks(rows: int, cols: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    step = max(1, chunk_bytes // (8 * max(cols, 1)))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _ratio(residual: np.ndarray, tolerance: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.abs(residual) / tolerance
    ratio = np.where(tolerance > 0, ratio, np.where(residual == 0, 0.0, np.inf))
    return np.where(np.isnan(ratio), np.inf, ratio)


@dataclass(frozen=True, eq=False)
class AbftEncoding:
    """The checksums of one operand pair (Huang & Abraham's encoded matrices, kept as vectors).

    ``col_ref`` (n,) is (eᵀA)·B and ``row_ref`` (m,) is A·(B·e), the values the column and row sums
    of C must match; ``col_tol`` / ``row_tol`` are their tolerances (module docstring). Built once
    per operand pair by :func:`encode_operands`; every product of that pair is then checked by
    :func:`verify_product` with one pass over C. Vectors live on the backend's device.
    """

    m: int
    n: int
    k: int
    col_ref: Any
    row_ref: Any
    col_tol: np.ndarray
    row_tol: np.ndarray


def encode_operands(backend: Backend, a: Any, b: Any, *, precision: Precision = Precision.FP32,
                    u_acc: float | None = None, chunk_bytes: int = 1 << 20) -> AbftEncoding:
    """Checksums and tolerances for products of ``a`` (m×k) and ``b`` (k×n), given in
    ``precision``'s storage format on ``backend``'s device."""
    xp = backend.xp
    m, k = a.shape
    k2, n = b.shape
    if k2 != k:
        raise ConfigError(f"shapes do not multiply: A {a.shape}, B {b.shape}")
    u = accumulation_u(backend) if u_acc is None else u_acc
    f32 = xp.float32

    def wide(block: Any) -> Any:
        return widen(xp, block, precision)

    def ones(count: int) -> Any:
        return xp.ones(count, dtype=f32)

    ones_n = ones(n)
    b_e = xp.empty(k, dtype=f32)
    b_abs_e = xp.empty(k, dtype=f32)
    for l0, l1 in _blocks(k, n, chunk_bytes):
        blk = wide(b[l0:l1])
        b_e[l0:l1] = blk @ ones_n
        b_abs_e[l0:l1] = xp.abs(blk) @ ones_n
    e_a = xp.zeros(k, dtype=f32)
    e_abs_a = xp.zeros(k, dtype=f32)
    row_ref = xp.empty(m, dtype=f32)
    row_mag = xp.empty(m, dtype=f32)
    for i0, i1 in _blocks(m, k, chunk_bytes):
        blk = wide(a[i0:i1])
        mag = xp.abs(blk)
        e_a += ones(i1 - i0) @ blk
        e_abs_a += ones(i1 - i0) @ mag
        row_ref[i0:i1] = blk @ b_e
        row_mag[i0:i1] = mag @ b_abs_e
    col_ref = xp.zeros(n, dtype=f32)
    col_mag = xp.zeros(n, dtype=f32)
    for l0, l1 in _blocks(k, n, chunk_bytes):
        blk = wide(b[l0:l1])
        col_ref += e_a[l0:l1] @ blk
        col_mag += e_abs_a[l0:l1] @ xp.abs(blk)
    host = backend.to_host
    return AbftEncoding(m=m, n=n, k=k, col_ref=col_ref, row_ref=row_ref,
                        col_tol=_tolerance(host(col_mag), u, k=k, across=m),
                        row_tol=_tolerance(host(row_mag), u, k=k, across=n))


def verify_product(backend: Backend, c: Any, enc: AbftEncoding) -> AbftCheck:
    """Check one product ``c`` (m×n fp32, on the device) against its operands' checksums."""
    xp = backend.xp
    if tuple(c.shape) != (enc.m, enc.n):
        raise ConfigError(f"C has shape {tuple(c.shape)}, the encoding is for {(enc.m, enc.n)}")
    with np.errstate(over="ignore", invalid="ignore"):  # a corrupted C may hold inf or NaN: that is a finding
        row_res = xp.matmul(c, xp.ones(enc.n, dtype=xp.float32)).astype(xp.float64) - enc.row_ref
        col_res = xp.matmul(xp.ones(enc.m, dtype=xp.float32), c).astype(xp.float64) - enc.col_ref
    return _decide(backend.to_host(row_res), enc.row_tol, backend.to_host(col_res), enc.col_tol)


def checksum_verify(backend: Backend, a: Any, b: Any, c: Any, *, precision: Precision = Precision.FP32,
                    u_acc: float | None = None) -> AbftCheck:
    """Encode ``a`` and ``b`` and check ``c`` in one call (:func:`encode_operands`, :func:`verify_product`)."""
    if tuple(c.shape) != (a.shape[0], b.shape[1]):
        raise ConfigError(f"shapes do not multiply: A {a.shape}, B {b.shape}, C {c.shape}")
    return verify_product(backend, c, encode_operands(backend, a, b, precision=precision, u_acc=u_acc))


def _tolerance(mag: np.ndarray, u_acc: float, *, k: int, across: int) -> np.ndarray:
    """τ = (γ_k(u) + γ_{a+k}(u_w) + γ_a(u_w)·(1 + γ_k(u))) · M̂/(1 − γ_{a+k}(u_w)) · (1 + 2^-20) + a·k·2^-149."""
    g_k = gamma(k, u_acc)
    g_ref = gamma(across + k, _U32)
    upper = mag.astype(np.float64) / (1.0 - g_ref)
    return (g_k + g_ref + gamma(across, _U32) * (1.0 + g_k)) * upper * (1.0 + 2.0 ** -20) + across * k * _TINY


def _decide(row_res: np.ndarray, row_tol: np.ndarray, col_res: np.ndarray, col_tol: np.ndarray) -> AbftCheck:
    row_ratio = _ratio(row_res, row_tol)
    col_ratio = _ratio(col_res, col_tol)
    rows = np.flatnonzero(row_ratio > 1.0)
    cols = np.flatnonzero(col_ratio > 1.0)
    located: list[tuple[int, int, float]] = []
    if rows.size and cols.size and rows.size * cols.size <= _MAX_PAIRS:
        dr = row_res[rows][:, None]
        dc = col_res[cols][None, :]
        with np.errstate(invalid="ignore"):
            agree = np.abs(dr - dc) <= row_tol[rows][:, None] + col_tol[cols][None, :]
        agree |= ~np.isfinite(dr) & ~np.isfinite(dc)
        if not agree.any() and rows.size == 1 and cols.size == 1:
            agree[:] = True
        for ri, ci in zip(*np.nonzero(agree), strict=True):
            located.append((int(rows[ri]), int(cols[ci]), float(row_res[rows[ri]])))
    max_ratio = float(max(row_ratio.max(initial=0.0), col_ratio.max(initial=0.0)))
    return AbftCheck(row_residual=row_res, row_tolerance=row_tol, col_residual=col_res, col_tolerance=col_tol,
                     rows=tuple(rows.tolist()), cols=tuple(cols.tolist()), located=tuple(located),
                     max_ratio=max_ratio)


def run_abft(backend: Backend, m: int, n: int, k: int, *, precision: Precision = Precision.FP32, seed: int = 0,
             suite: str = "adhoc", iters: int = 1, fault: Fault | None = None) -> SelfTestResult:
    """GEMM of seeded random operands (uniform in [-1, 1)) verified by checksums.

    ``fault`` (harness only) flips bit :data:`ABFT_FLIP_BIT` of one random element of C after the
    product. Throughput is the GEMM's; ``extra`` holds ``encode_s`` (checksums of the operands, once
    per operand pair), ``verify_s`` (checking this product) and ``overhead`` (verify_s / gemm_s).
    """
    precision = Precision(precision)
    rng = np.random.default_rng(seed)
    a_host = encode(rng.uniform(-1.0, 1.0, (m, k)).astype(np.float32), precision)
    b_host = encode(rng.uniform(-1.0, 1.0, (k, n)).astype(np.float32), precision)
    with backend.activate():
        a = backend.asarray(a_host)
        b = backend.asarray(b_host)
        backend.matmul(a, b, precision)
        outs, gemm_s = backend.timed(lambda: [backend.matmul(a, b, precision) for _ in range(max(1, iters))])
        c = outs[-1]
        gemm_s /= max(1, iters)
        del outs
        if fault is not None:
            fault.flip_element(backend.xp, c, "C", bit=ABFT_FLIP_BIT)
        enc, encode_s = backend.timed(lambda: encode_operands(backend, a, b, precision=precision))
        check, verify_s = backend.timed(lambda: verify_product(backend, c, enc))
    mismatches = tuple(Mismatch(where="C", row=i, col=j, observed=None,
                                detail=f"checksum residual {d:.6g}") for i, j, d in check.located)
    if not check.ok and not mismatches:
        mismatches = (Mismatch(where="C", detail=f"failing rows {list(check.rows[:8])} "
                                                 f"cols {list(check.cols[:8])}"),)
    gemm_s = fault.stretch(gemm_s) if fault is not None else gemm_s
    total = max(len(check.located), min(len(check.rows), len(check.cols)), 0 if check.ok else 1)
    return SelfTestResult(
        suite=suite, test=f"gemm_abft_{precision.value}", device=backend.device,
        verdict=Verdict.PASS if check.ok else Verdict.FAIL, duration_s=gemm_s + encode_s + verify_s,
        throughput=gemm_tflops(m, n, k, gemm_s), unit="TFLOP/s",
        max_error=check.max_ratio if math.isfinite(check.max_ratio) else math.inf,
        mismatches=mismatches[:MAX_REPORTED], mismatch_total=total, model=backend.model,
        detail=f"m={m} n={n} k={k} seed={seed}; max residual/tolerance {check.max_ratio:.3g}",
        extra={"m": m, "n": n, "k": k, "gemm_s": gemm_s, "encode_s": encode_s, "verify_s": verify_s,
               "overhead": verify_s / gemm_s if gemm_s > 0 else math.inf})
