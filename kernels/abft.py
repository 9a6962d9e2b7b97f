"""ABFT (Huang & Abraham, 1984): verify C = A·B through blocked row and column checksums, locate a bad element.

For any C = A·B and any partition of the columns into blocks J and of the rows into blocks I,

    Σ_{j∈J} C[i, j] = A[i, :]·(Σ_{j∈J} B[:, j])        (row check (i, J))
    Σ_{i∈I} C[i, j] = (Σ_{i∈I} A[i, :])·B[:, j]        (column check (I, j))

The right-hand sides are fixed by the operands (:func:`encode_operands`, once per operand pair);
the left-hand sides cost two passes over C (:func:`verify_product`), O(mn) against the GEMM's
O(mnk). A check sums :data:`BLOCK` = 256 elements, so one block's magnitude does not hide
another's (row blocks are 256 consecutive rows; column blocks are 256 columns interleaved across
the row, :func:`column_block`, which lets both sums be strided BLAS passes over C). A single wrong
element C[i, j] = true + δ moves exactly one row check, (i, J(j)), and one column check, (I(i), j),
by δ: the pair that fails and agrees on δ locates it, and δ estimates the error.

**Where a healthy residual comes from.** The references are formed in fp64 from the exactly
widened operands; their error is below 2^-50 of the magnitudes. Each check's sum of C is formed
as fp32 partial sums of 16 elements added in fp64. A healthy residual is then the GEMM's own
rounding error summed over 256 elements plus the rounding of 16-term fp32 sums: thousands of
independent rounding errors per check, none dominant (one long fp32 sum per check would add a
heavy-tailed term as large as the GEMM's).

**Tolerance: calibrated on the product's own residuals.** The worst-case bound γ_k·|A|·|B|
(Higham, *Accuracy and Stability of Numerical Algorithms*, §3.5), and even the probabilistic
λ·√k·u·|A|·|B| (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019), assume partial sums as large as
Σ|a·b|; for mean-zero operands they exceed the real error about 10³× (probabilistic) and
10⁵–10⁶× (worst case), which hides sign and exponent flips at n >= 1024. The real error is
measured instead. By the central limit theorem over its roundings, a healthy check's residual
r_c is close to N(0, (σ·w_c)²) with the per-check scale w_c = ‖A[i, :]‖₂·‖B[:, J]‖_F (column
check: ‖A[I, :]‖_F·‖B[:, j]‖₂): every rounding error is proportional to the partial sum it
rounds, whose mean square is proportional to ‖a_i‖²·‖b_j‖² in any summation order when the rows
of A and columns of B are homogeneous up to scale, as :func:`run_abft`'s random operands are.
One σ per direction is estimated from all checks of the product itself, robustly:
σ̂ = median(|r_c| / w_c) / 0.6745 (a few faulty checks among thousands cannot move a median).
A check fails when

    |r_c| > τ_c = max(floor_c, min(λ·σ̂·w_c, worst_c)),     λ = :data:`LAMBDA` = 24,

where ``worst_c`` = (γ_k(u) + γ_256(2^-24)·(1 + γ_k(u)) + γ_{k+256}(2^-53))·M_c is the rigorous
bound (M_c the check's block sum of |A|·|B|) and ``floor_c`` = γ_{k+256}(2^-53)·M_c the fp64
reference's own error, the one term that is not rounding noise of the kind σ̂ measures.
``worst_c`` caps the calibrated tolerance, so a corruption broad enough to inflate σ̂ is judged
no more leniently than by the rigorous bound.

**False-alarm probability.** With N >= :data:`MIN_POOL` = 512 checks per direction, the median
of N half-normal values falls below half its true value with probability < 10^-30; outside that
event λ·σ̂ >= 12σ, which a Gaussian residual exceeds with probability 3.6·10^-33 per check
(typically σ̂ is within 5 % of σ, and the margin is 24σ). The Gaussian tail is the model's
assumption, so the benchmark measures the tail instead: over 1,018 healthy products (every input
dtype; uniform, normal, all-positive and rows/columns scaled over six orders of magnitude;
m, n in 256..768, k in 8..1024 and the full-size 1024³..4096³ products) none failed, and the
largest healthy |r_c| / (σ̂·w_c) was 10.5 (bf16, scaled operands, a column block dominated by
one row), against λ = 24; for uniform and normal operands it stays near 5. Where a direction has
fewer than 512 checks, or more than 1 % of them are within ``floor_c`` (an exact or nearly exact
product, where a median says nothing), the tolerance is the rigorous ``worst_c`` and a healthy
run cannot fail at all.

**What it catches.** A corruption δ at (i, j) fails both its checks, and is located, whenever
|δ| > 2·max(τ_row, τ_col) (:meth:`AbftCheck.guaranteed_above`; the healthy part of each residual
is within τ). On the CPU, for fp32, fp16 and bf16 inputs and standard-normal and uniform
operands at n = 1024, 2048 and 4096, ``bench/abft.py`` caught and located every one of 11,800
flips of the sign, exponent and top 8 mantissa bits that changed an element by more than 10⁻³
of its row's RMS (2τ is below that everywhere at these sizes; the table is by bit position).
Flips of the lowest mantissa bits are within rounding noise and invisible to any
tolerance-based check; the exact known-answer tests in :mod:`fleethealth.kernels.gemm` catch
those. On a GPU the accumulation order and rounding (tensor cores may truncate; u = 2^-23 in
``worst_c``) enter only through σ̂, which is measured on the device itself; the CuPy path runs
the same array code but has not been measured here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleethealth.errors import ConfigError
from fleethealth.kernels.backend import Backend, Precision, encode, widen
from fleethealth.kernels.faults import Fault, flip_bit
from fleethealth.kernels.gemm import gemm_tflops
from fleethealth.kernels.results import MAX_REPORTED, Mismatch, SelfTestResult, Verdict

__all__ = [
    "AbftCheck",
    "AbftEncoding",
    "BLOCK",
    "LAMBDA",
    "MIN_POOL",
    "column_block",
    "gamma",
    "accumulation_u",
    "encode_operands",
    "verify_product",
    "checksum_verify",
    "run_abft",
    "ABFT_FLIP_BIT",
]

BLOCK = 256
"""Elements summed by one check: the width of a row check's column block and the height of a
column check's row block."""
LAMBDA = 24.0
"""A calibrated check fails above λ·σ̂·w_c (module docstring)."""
MIN_POOL = 512
"""Fewest checks in one direction for σ̂ to be estimated; below, the rigorous bound applies."""
MAX_EXACT_FRACTION = 0.01
"""Above this fraction of checks exact to within their floor, the rigorous bound applies."""
_PARTIAL = 16  # elements in one fp32 partial sum of a block (see _block_sums)
_MAD = 0.6744897501960817  # median of |Z| for Z ~ N(0, 1)
_U32 = 2.0 ** -24
_U64 = 2.0 ** -53
_TINY = 2.0 ** -149
_MAX_PAIRS = 4096
ABFT_FLIP_BIT = 30
"""The bit the ``bitflip`` fault flips in the ABFT test: the exponent's top bit. Whatever the
element x, the flip changes it by at least 2 (|x| >= 2 becomes a subnormal or zero; |x| < 2 is
multiplied by 2^128 or becomes inf/NaN; 0 becomes 2), and :func:`run_abft` checks that this is
above :meth:`AbftCheck.guaranteed_above` for the product, so an injected fault is always one the
method claims to detect."""


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


def _nblocks(size: int, block: int) -> int:
    return max(1, -(-size // block))


def _layout(n: int, block: int) -> tuple[int, int, int, int]:
    """(blocks, partial length L, partials per check P, stride) of the column partition of n columns.

    Columns are padded to blocks·block; fp32 partial r (0 <= r < stride = blocks·P) sums the L
    columns r, r + stride, r + 2·stride, ...; row check J sums partials J·P .. J·P + P − 1. So the
    column block of column j is (j mod stride) // P: 256 columns, interleaved across the row, which
    lets both partial sums be formed as strided BLAS products over C without copying it.
    """
    blocks = _nblocks(n, block)
    length = min(block, _PARTIAL)
    parts = block // length
    return blocks, length, parts, blocks * parts


def column_block(j: Any, n: int, block: int = BLOCK) -> Any:
    """The row-check block holding column ``j`` (an int or an integer array) of an n-column C."""
    _, _, parts, stride = _layout(n, block)
    return (j % stride) // parts


def _padded(xp: Any, x: Any, rows: int, cols: int) -> Any:
    if tuple(x.shape) == (rows, cols):
        return x
    out = xp.zeros((rows, cols), dtype=x.dtype)
    out[: x.shape[0], : x.shape[1]] = x
    return out


def _column_block_sums(xp: Any, x: Any, block: int) -> Any:
    """(r, blocks) sums of x (r × n) over each column block, in x's dtype (used in fp64)."""
    r, n = x.shape
    blocks, length, parts, stride = _layout(n, block)
    wide = _padded(xp, x, r, blocks * block)
    return wide.reshape(r, length, stride).sum(axis=1).reshape(r, blocks, parts).sum(axis=2)


def _row_block_sums(xp: Any, x: Any, block: int) -> Any:
    """(blocks, c) sums of x (m × c) over each block of ``block`` consecutive rows."""
    m, c = x.shape
    blocks = _nblocks(m, block)
    return _padded(xp, x, blocks * block, c).reshape(blocks, block, c).sum(axis=1)


def _block_sums(xp: Any, c: Any, block: int) -> tuple[Any, Any]:
    """Row-check sums (m, n_blocks) and column-check sums (m_blocks, n) of C, float64.

    Each check's sum is formed as fp32 partial sums of ``_PARTIAL`` = 16 elements (batched BLAS
    vector-matrix products with a vector of ones, strided views of C: the fastest passes over C
    on both paths), added in fp64. The fp32 rounding is then that of 16-term sums: small beside
    the GEMM's own, and close to Gaussian across checks, where one long fp32 sum per check would
    add a heavy-tailed term of the GEMM's size. A shape that is not a multiple of ``block`` is
    padded with zeros (a copy; the suites' sizes never need it).
    """
    m, n = c.shape
    nb, length, parts, stride = _layout(n, block)
    mb = _nblocks(m, block)
    ones = xp.ones(length, dtype=xp.float32)
    wide = _padded(xp, c, m, nb * block)
    row_parts = xp.matmul(ones, wide.reshape(m, length, stride))  # (m, stride) fp32
    rows = row_parts.reshape(m, nb, parts).astype(xp.float64).sum(axis=2)
    tall = _padded(xp, c, mb * block, n)
    col_parts = xp.matmul(ones, tall.reshape(mb * parts, length, n))  # (mb·parts, n) fp32
    cols = col_parts.reshape(mb, parts, n).astype(xp.float64).sum(axis=1)
    return rows, cols


def _ratio(residual: np.ndarray, tolerance: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.abs(residual) / tolerance
    ratio = np.where(tolerance > 0, ratio, np.where(residual == 0, 0.0, np.inf))
    return np.where(np.isnan(ratio), np.inf, ratio)


@dataclass(frozen=True, eq=False)
class AbftCheck:
    """One checksum verification of C = A·B.

    ``row_residual`` (m, n_blocks) holds Σ_{j∈J} C[i, j] − A[i, :]·B[:, J]·e and ``col_residual``
    (m_blocks, n) the column counterparts (host float64); ``row_tolerance`` / ``col_tolerance``
    are their bounds τ. ``rows`` / ``cols`` are the rows and columns of C with a failing check;
    ``located`` pairs a failing row check with the failing column check of the same block whose
    residual agrees, as (row, col, δ) where δ estimates the error in C[row, col]. ``max_ratio`` is
    the largest |residual| / τ: at most 1 on a healthy run, above 1 is a detection (inf for NaN).
    ``calibrated`` says whether τ came from σ̂ (both directions) or from the rigorous bound;
    ``sigma`` is σ̂ per direction (row, column; NaN where not calibrated) and ``worst_z`` the
    largest |r_c| / (σ̂·w_c) over the checks that passed (how close the healthy tail came to λ).
    """

    row_residual: np.ndarray
    row_tolerance: np.ndarray
    col_residual: np.ndarray
    col_tolerance: np.ndarray
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    located: tuple[tuple[int, int, float], ...]
    max_ratio: float
    block: int = BLOCK
    calibrated: bool = False
    sigma: tuple[float, float] = (math.nan, math.nan)
    worst_z: float = math.nan

    @property
    def ok(self) -> bool:
        return not self.rows and not self.cols

    def guaranteed_above(self, row: int, col: int) -> float:
        """|δ| above which an error in C[row, col] fails both its checks and is located:
        twice the larger of their tolerances (the healthy part of each residual is within τ)."""
        blk = int(column_block(col, self.col_residual.shape[1], self.block))
        return 2.0 * max(float(self.row_tolerance[row, blk]),
                         float(self.col_tolerance[row // self.block, col]))


@dataclass(frozen=True, eq=False)
class AbftEncoding:
    """The blocked checksums of one operand pair (Huang & Abraham's encoded matrices, kept small).

    ``row_ref`` (m, n_blocks) and ``col_ref`` (m_blocks, n) are the fp64 values the block sums of
    C must match, on the backend's device (row check (i, J) covers the columns j with
    :func:`column_block` (j) = J, column check (I, j) the rows I·block .. I·block + block − 1). On the host:
    ``row_scale`` / ``col_scale`` (w_c), ``row_floor`` / ``col_floor`` and ``row_worst`` /
    ``col_worst`` (module docstring). Built once per operand pair by :func:`encode_operands`;
    every product of that pair is then checked by :func:`verify_product` with two passes over C.
    """

    m: int
    n: int
    k: int
    block: int
    row_ref: Any
    col_ref: Any
    row_scale: np.ndarray
    col_scale: np.ndarray
    row_floor: np.ndarray
    col_floor: np.ndarray
    row_worst: np.ndarray
    col_worst: np.ndarray


def encode_operands(backend: Backend, a: Any, b: Any, *, precision: Precision = Precision.FP32,
                    u_acc: float | None = None, block: int = BLOCK, chunk_bytes: int | None = None) -> AbftEncoding:
    """Blocked checksums, scales and bounds for products of ``a`` (m×k) and ``b`` (k×n), given in
    ``precision``'s storage format on ``backend``'s device; all formed in fp64.

    The operands are widened to fp64 a slab of rows at a time (about ``chunk_bytes`` each, 8 MiB
    on a CPU so a slab stays in cache, 1 GiB on a GPU): B is read twice and A once, and no fp64
    copy of a whole operand is ever made.
    """
    xp = backend.xp
    m, k = a.shape
    k2, n = b.shape
    if k2 != k:
        raise ConfigError(f"shapes do not multiply: A {a.shape}, B {b.shape}")
    if block < 1 or block % min(block, _PARTIAL):
        raise ConfigError(f"block must be a positive multiple of {_PARTIAL} or below it, got {block}")
    u = accumulation_u(backend) if u_acc is None else u_acc
    chunk = chunk_bytes if chunk_bytes is not None else (1 << 30 if backend.is_gpu else 8 << 20)
    f64 = xp.float64
    nb, mb = _nblocks(n, block), _nblocks(m, block)

    def slab(x: Any, r0: int, r1: int) -> Any:
        return widen(xp, x[r0:r1], precision).astype(f64)

    # B, pass 1: column-block sums of B and |B|, squared column norms.
    b_blk = xp.empty((k, nb), dtype=f64)
    b_abs_blk = xp.empty((k, nb), dtype=f64)
    b_sq = xp.zeros(n, dtype=f64)
    for l0, l1 in _slabs(k, n, 1, chunk):
        part = slab(b, l0, l1)
        b_blk[l0:l1] = _column_block_sums(xp, part, block)
        b_sq += xp.einsum("ij,ij->j", part, part)
        xp.abs(part, out=part)
        b_abs_blk[l0:l1] = _column_block_sums(xp, part, block)
    # A, one pass in whole row blocks: row references and magnitudes, row-block sums of A and |A|.
    row_ref = xp.empty((m, nb), dtype=f64)
    row_mag = xp.empty((m, nb), dtype=f64)
    a_sq = xp.empty(m, dtype=f64)
    a_blk = xp.empty((mb, k), dtype=f64)
    a_abs_blk = xp.empty((mb, k), dtype=f64)
    for i0, i1 in _slabs(m, k, block, chunk):
        part = slab(a, i0, i1)
        rows = slice(i0 // block, -(-i1 // block))
        row_ref[i0:i1] = part @ b_blk
        a_sq[i0:i1] = xp.einsum("ij,ij->i", part, part)
        a_blk[rows] = _row_block_sums(xp, part, block)
        xp.abs(part, out=part)
        row_mag[i0:i1] = part @ b_abs_blk
        a_abs_blk[rows] = _row_block_sums(xp, part, block)
    # B, pass 2: column references and magnitudes.
    col_ref = xp.zeros((mb, n), dtype=f64)
    col_mag = xp.zeros((mb, n), dtype=f64)
    for l0, l1 in _slabs(k, n, 1, chunk):
        part = slab(b, l0, l1)
        col_ref += a_blk[:, l0:l1] @ part
        xp.abs(part, out=part)
        col_mag += a_abs_blk[:, l0:l1] @ part
    row_scale = xp.sqrt(a_sq)[:, None] * xp.sqrt(_column_block_sums(xp, b_sq[None, :], block))
    col_scale = xp.sqrt(_row_block_sums(xp, a_sq[:, None], block)) * xp.sqrt(b_sq)[None, :]
    host = backend.to_host
    row_floor, row_worst = _bounds(host(row_mag), u, k=k, b=min(block, n))
    col_floor, col_worst = _bounds(host(col_mag), u, k=k, b=min(block, m))
    return AbftEncoding(m=m, n=n, k=k, block=block, row_ref=row_ref, col_ref=col_ref,
                        row_scale=host(row_scale), col_scale=host(col_scale), row_floor=row_floor,
                        col_floor=col_floor, row_worst=row_worst, col_worst=col_worst)


def _slabs(rows: int, cols: int, multiple: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Row ranges of about ``chunk_bytes`` of fp64, each a whole number of ``multiple`` rows."""
    step = max(1, chunk_bytes // (8 * max(cols, 1) * multiple)) * multiple
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _bounds(mag: np.ndarray, u_acc: float, *, k: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(floor, worst) for checks summing ``b`` elements of k-term products with block magnitude
    M̂ = ``mag`` (computed in fp64, widened by γ_{k+b}(2^-53) to an upper bound).

    worst = (γ_k(u) + γ_b(2^-24)·(1 + γ_k(u)) + γ_{k+b}(2^-53))·M + b·k·2^-149 bounds the GEMM's
    rounding, the fp32 block sum of C and the fp64 reference; floor = γ_{k+b}(2^-53)·M + b·k·2^-149
    is the reference's alone, the one error that is not rounding noise of the kind σ̂ measures.
    Both are widened by 2^-20 relative for their own arithmetic.
    """
    g_k = gamma(k, u_acc)
    g_64 = gamma(k + b + 2, _U64)
    upper = mag.astype(np.float64) * (1.0 + g_64)
    tiny = b * k * _TINY
    floor = g_64 * upper * (1.0 + 2.0 ** -20) + tiny
    worst = (g_k + gamma(b, _U32) * (1.0 + g_k) + g_64) * upper * (1.0 + 2.0 ** -20) + tiny
    return floor, worst


def verify_product(backend: Backend, c: Any, enc: AbftEncoding) -> AbftCheck:
    """Check one product ``c`` (m×n fp32, on the device) against its operands' checksums."""
    xp = backend.xp
    if tuple(c.shape) != (enc.m, enc.n):
        raise ConfigError(f"C has shape {tuple(c.shape)}, the encoding is for {(enc.m, enc.n)}")
    if backend.is_gpu and os.environ.get("CUPY_TF32") == "1":
        raise ConfigError("CUPY_TF32=1 lets cuBLAS round the checksums' fp32 operands to TF32; unset it")
    with np.errstate(over="ignore", invalid="ignore"):  # a corrupted C may hold inf or NaN: that is a finding
        row_sums, col_sums = _block_sums(xp, c, enc.block)
        row_res = row_sums - enc.row_ref
        col_res = col_sums - enc.col_ref
    return _decide(backend.to_host(row_res), backend.to_host(col_res), enc)


def checksum_verify(backend: Backend, a: Any, b: Any, c: Any, *, precision: Precision = Precision.FP32,
                    u_acc: float | None = None, block: int = BLOCK) -> AbftCheck:
    """Encode ``a`` and ``b`` and check ``c`` in one call (:func:`encode_operands`, :func:`verify_product`)."""
    if tuple(c.shape) != (a.shape[0], b.shape[1]):
        raise ConfigError(f"shapes do not multiply: A {a.shape}, B {b.shape}, C {c.shape}")
    return verify_product(backend, c, encode_operands(backend, a, b, precision=precision, u_acc=u_acc,
                                                      block=block))


def _tolerance(res: np.ndarray, scale: np.ndarray, floor: np.ndarray,
               worst: np.ndarray) -> tuple[np.ndarray, float]:
    """τ for one direction's checks and σ̂ (NaN when the pool cannot be calibrated)."""
    with np.errstate(invalid="ignore"):
        exact = int(np.count_nonzero(np.abs(res) <= floor))
    if res.size < MIN_POOL or exact > MAX_EXACT_FRACTION * res.size:
        return worst, math.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.abs(res) / scale
    z = z[np.isfinite(z)]
    if z.size < MIN_POOL:
        return worst, math.nan
    sigma = float(np.partition(z, z.size // 2)[z.size // 2]) / _MAD
    return np.maximum(floor, np.minimum(LAMBDA * sigma * scale, worst)), sigma


def _decide(row_res: np.ndarray, col_res: np.ndarray, enc: AbftEncoding) -> AbftCheck:
    row_tol, row_sigma = _tolerance(row_res, enc.row_scale, enc.row_floor, enc.row_worst)
    col_tol, col_sigma = _tolerance(col_res, enc.col_scale, enc.col_floor, enc.col_worst)
    row_ratio = _ratio(row_res, row_tol)
    col_ratio = _ratio(col_res, col_tol)
    row_bad = np.nonzero(row_ratio > 1.0)  # (i, J)
    col_bad = np.nonzero(col_ratio > 1.0)  # (I, j)
    located = _locate(row_res, row_tol, row_bad, col_res, col_tol, col_bad, enc.block, enc.n)
    max_ratio = float(max(row_ratio.max(initial=0.0), col_ratio.max(initial=0.0)))
    worst_z = math.nan
    if not (math.isnan(row_sigma) or math.isnan(col_sigma)):
        with np.errstate(divide="ignore", invalid="ignore"):
            zr = np.where(row_ratio <= 1.0, np.abs(row_res) / (row_sigma * enc.row_scale), 0.0)
            zc = np.where(col_ratio <= 1.0, np.abs(col_res) / (col_sigma * enc.col_scale), 0.0)
        worst_z = float(max(np.nanmax(zr, initial=0.0), np.nanmax(zc, initial=0.0)))
    return AbftCheck(row_residual=row_res, row_tolerance=row_tol, col_residual=col_res, col_tolerance=col_tol,
                     rows=tuple(np.unique(row_bad[0]).tolist()), cols=tuple(np.unique(col_bad[1]).tolist()),
                     located=located, max_ratio=max_ratio, block=enc.block,
                     calibrated=not (math.isnan(row_sigma) or math.isnan(col_sigma)),
                     sigma=(row_sigma, col_sigma), worst_z=worst_z)


def _locate(row_res: np.ndarray, row_tol: np.ndarray, row_bad: tuple[np.ndarray, np.ndarray],
            col_res: np.ndarray, col_tol: np.ndarray, col_bad: tuple[np.ndarray, np.ndarray],
            block: int, n: int) -> tuple[tuple[int, int, float], ...]:
    """Pair each failing row check (i, J) with the failing column checks (I, j) of the same block
    (i in I, j in J) whose residuals agree within their tolerances; a block with exactly one
    failing check of each kind pairs them even when they disagree (e.g. inf against NaN)."""
    ri, rj = row_bad
    ci, cj = col_bad
    if not ri.size or not ci.size or ri.size > _MAX_PAIRS or ci.size > _MAX_PAIRS:
        return ()  # nothing to pair, or a corruption too broad to be one element
    by_block: dict[tuple[int, int], list[int]] = {}
    for q, (bi, j) in enumerate(zip(ci.tolist(), cj.tolist(), strict=True)):
        by_block.setdefault((bi, int(column_block(j, n, block))), []).append(q)
    rows_in: dict[tuple[int, int], int] = {}
    for i, bj in zip(ri.tolist(), rj.tolist(), strict=True):
        key = (i // block, bj)
        rows_in[key] = rows_in.get(key, 0) + 1
    located: list[tuple[int, int, float]] = []
    for i, bj in zip(ri.tolist(), rj.tolist(), strict=True):
        key = (i // block, bj)
        partners = by_block.get(key, ())
        if len(located) >= _MAX_PAIRS:
            break
        dr = float(row_res[i, bj])
        for q in partners:
            j = int(cj[q])
            dc = float(col_res[ci[q], j])
            agree = (not math.isfinite(dr) and not math.isfinite(dc)) or \
                abs(dr - dc) <= float(row_tol[i, bj]) + float(col_tol[ci[q], j])
            if agree or (len(partners) == 1 and rows_in[key] == 1):
                located.append((i, j, dr))
    return tuple(sorted(located))


def run_abft(backend: Backend, m: int, n: int, k: int, *, precision: Precision = Precision.FP32, seed: int = 0,
             suite: str = "adhoc", iters: int = 1, fault: Fault | None = None) -> SelfTestResult:
    """GEMM of seeded random operands (uniform in [-1, 1)) verified by checksums.

    ``fault`` (harness only) flips bit :data:`ABFT_FLIP_BIT` of one random element of C after the
    product, and raises :class:`~fleethealth.errors.ConfigError` if that flip is not one the
    check guarantees to catch and locate at this size (it always is at the suites' sizes).
    Throughput is the GEMM's; ``extra`` holds ``encode_s`` (checksums of the operands, once per
    operand pair), ``verify_s`` (checking this product), ``overhead`` (verify_s / gemm_s),
    ``calibrated`` and, under a fault, ``fault`` (row, col, bit, delta, guaranteed_above).
    """
    precision = Precision(precision)
    rng = np.random.default_rng(seed)
    a_host = encode(rng.uniform(-1.0, 1.0, (m, k)).astype(np.float32), precision)
    b_host = encode(rng.uniform(-1.0, 1.0, (k, n)).astype(np.float32), precision)
    injected: dict[str, Any] | None = None
    with backend.activate():
        a = backend.asarray(a_host)
        b = backend.asarray(b_host)
        backend.matmul(a, b, precision)
        outs, gemm_s = backend.timed(lambda: [backend.matmul(a, b, precision) for _ in range(max(1, iters))])
        c = outs[-1]
        gemm_s /= max(1, iters)
        del outs
        if fault is not None:
            hit = fault.flip_element(backend.xp, c, "C", bit=ABFT_FLIP_BIT)
            if hit is not None:
                injected = _flip_record(backend, c, hit.index, hit.bit)
        enc, encode_s = backend.timed(lambda: encode_operands(backend, a, b, precision=precision))
        check, verify_s = backend.timed(lambda: verify_product(backend, c, enc))
    if injected is not None:
        limit = check.guaranteed_above(injected["row"], injected["col"])
        injected["guaranteed_above"] = limit
        if not abs(injected["delta"]) > limit:
            raise ConfigError(f"an injected flip of bit {ABFT_FLIP_BIT} changed C by {injected['delta']:.3g}, "
                              f"not above the {limit:.3g} ABFT guarantees at m={m} n={n} k={k}; "
                              "use a larger or smaller product")
    mismatches = tuple(Mismatch(where="C", row=i, col=j, observed=None,
                                detail=f"checksum residual {d:.6g}") for i, j, d in check.located)
    if not check.ok and not mismatches:
        mismatches = (Mismatch(where="C", detail=f"failing rows {list(check.rows[:8])} "
                                                 f"cols {list(check.cols[:8])}"),)
    gemm_s = fault.stretch(gemm_s) if fault is not None else gemm_s
    total = max(len(check.located), min(len(check.rows), len(check.cols)), 0 if check.ok else 1)
    extra: dict[str, Any] = {"m": m, "n": n, "k": k, "gemm_s": gemm_s, "encode_s": encode_s, "verify_s": verify_s,
                             "overhead": verify_s / gemm_s if gemm_s > 0 else math.inf,
                             "calibrated": check.calibrated}
    if injected is not None:
        extra["fault"] = injected
    return SelfTestResult(
        suite=suite, test=f"gemm_abft_{precision.value}", device=backend.device,
        verdict=Verdict.PASS if check.ok else Verdict.FAIL, duration_s=gemm_s + encode_s + verify_s,
        throughput=gemm_tflops(m, n, k, gemm_s), unit="TFLOP/s",
        max_error=check.max_ratio if math.isfinite(check.max_ratio) else math.inf,
        mismatches=mismatches[:MAX_REPORTED], mismatch_total=total, model=backend.model,
        detail=f"m={m} n={n} k={k} seed={seed}; max residual/tolerance {check.max_ratio:.3g}"
               f"{'' if check.calibrated else ' (rigorous bound)'}",
        extra=extra)


def _flip_record(backend: Backend, c: Any, index: int, bit: int) -> dict[str, Any]:
    """Where a flip landed in C and by how much it changed the element (inf when it made it non-finite)."""
    after = backend.to_host(c.reshape(-1)[index:index + 1]).copy()
    before = after.copy()
    flip_bit(np, before, 0, bit)
    delta = float(after[0]) - float(before[0])
    n = int(c.shape[1])
    return {"row": index // n, "col": index % n, "bit": bit, "delta": delta if math.isfinite(delta) else math.inf}
