"""ABFT checksums on the CPU path: the tolerance never raises a false alarm, and a corrupted
element above it is located by (row, column)."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.errors import ConfigError
from fleethealth.kernels.abft import (
    ABFT_FLIP_BIT,
    accumulation_u,
    checksum_verify,
    encode_operands,
    gamma,
    run_abft,
    verify_product,
)
from fleethealth.kernels.backend import Backend, Precision, encode, widen
from fleethealth.kernels.faults import Fault, flip_bit
from fleethealth.kernels.results import Verdict

CPU = Backend.for_device("cpu")


def _operands(rng: np.random.Generator, m: int, n: int, k: int, kind: str, precision: Precision):
    if kind == "uniform":
        a, b = rng.uniform(-1, 1, (m, k)), rng.uniform(-1, 1, (k, n))
    elif kind == "normal":
        a, b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
    elif kind == "positive":  # no cancellation: the residual meets the magnitude head-on
        a, b = rng.uniform(0, 1, (m, k)), rng.uniform(0, 1, (k, n))
    else:  # rows and columns scaled over six orders of magnitude
        a = rng.standard_normal((m, k)) * 10.0 ** rng.uniform(-3, 3, (m, 1))
        b = rng.standard_normal((k, n)) * 10.0 ** rng.uniform(-3, 3, (1, n))
    return encode(a.astype(np.float32), precision), encode(b.astype(np.float32), precision)


def test_no_false_alarm_on_120_healthy_runs_across_shapes_dtypes_and_scales() -> None:
    rng = np.random.default_rng(2024)
    kinds = ("uniform", "normal", "positive", "scaled")
    worst = 0.0
    for run in range(120):
        m, n, k = (int(x) for x in rng.integers(1, 160, 3))
        precision = list(Precision)[run % 3]
        a, b = _operands(rng, m, n, k, kinds[run % 4], precision)
        c = np.matmul(widen(np, a, precision), widen(np, b, precision))
        check = checksum_verify(CPU, a, b, c, precision=precision)
        assert check.ok, (run, m, n, k, precision, check.max_ratio)
        worst = max(worst, check.max_ratio)
    assert 0.0 < worst <= 1.0


def test_tolerance_bounds_the_true_elementwise_error() -> None:
    """γ_k·|A|·|B| bounds |Ĉ − A·B| elementwise (A·B taken in float64, exact enough here)."""
    rng = np.random.default_rng(1)
    for k in (1, 17, 256, 2048):
        a = rng.standard_normal((64, k)).astype(np.float32)
        b = rng.standard_normal((k, 48)).astype(np.float32)
        c = (a @ b).astype(np.float64)
        exact = a.astype(np.float64) @ b.astype(np.float64)
        bound = gamma(k, accumulation_u(CPU)) * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64))
        assert (np.abs(c - exact) <= bound).all()


def test_1000_random_single_bit_flips_in_c_every_one_above_the_bound_is_located() -> None:
    rng = np.random.default_rng(7)
    flips = guaranteed = seen = 0
    for run in range(10):
        precision = list(Precision)[run % 3]
        m, n, k = 48 + run, 40 + 2 * run, 64
        a, b = _operands(rng, m, n, k, ("uniform", "normal")[run % 2], precision)
        c0 = np.matmul(widen(np, a, precision), widen(np, b, precision))
        enc = encode_operands(CPU, a, b, precision=precision)
        for _ in range(100):
            i, j, bit = int(rng.integers(m)), int(rng.integers(n)), int(rng.integers(32))
            c = c0.copy()
            flip_bit(np, c, i * n + j, bit)
            delta = float(c[i, j]) - float(c0[i, j]) if np.isfinite(c[i, j]) else np.inf
            check = verify_product(CPU, c, enc)
            flips += 1
            if abs(delta) > 2 * max(enc.row_tol[i], enc.col_tol[j]):
                guaranteed += 1
                assert [(r, q) for r, q, _ in check.located] == [(i, j)], (i, j, bit, delta)
                assert check.rows == (i,) and check.cols == (j,)
            if not check.ok:
                seen += 1
                assert check.located == () or [(r, q) for r, q, _ in check.located] == [(i, j)]
    assert flips == 1000
    # Sign, exponent and upper mantissa bits are above the bound for most elements.
    assert guaranteed >= 300 and seen >= guaranteed


def test_operand_corrupted_after_encoding_fails_its_row_check() -> None:
    rng = np.random.default_rng(3)
    a, b = _operands(rng, 50, 40, 30, "uniform", Precision.FP32)
    enc = encode_operands(CPU, a, b)
    bad = a.copy()
    flip_bit(np, bad, 17 * 30 + 4, 30)  # A[17, 4]: exponent top bit
    check = verify_product(CPU, bad @ b, enc)
    assert check.rows == (17,)
    assert len(check.cols) > 1  # the error spreads along row 17 of C


def test_nan_and_inf_in_c_are_detected() -> None:
    rng = np.random.default_rng(4)
    a, b = _operands(rng, 20, 20, 20, "normal", Precision.FP32)
    c = a @ b
    c[3, 5] = np.nan
    check = checksum_verify(CPU, a, b, c)
    assert (3, 5) in [(r, q) for r, q, _ in check.located] and check.max_ratio == np.inf
    c = a @ b
    c[7, 1] = np.inf
    assert [(r, q) for r, q, _ in checksum_verify(CPU, a, b, c).located] == [(7, 1)]


def test_run_abft_reports_throughput_overhead_and_the_injected_element() -> None:
    healthy = run_abft(CPU, 96, 64, 128, seed=1)
    assert healthy.verdict is Verdict.PASS and healthy.throughput > 0
    assert {"gemm_s", "encode_s", "verify_s", "overhead"} <= set(healthy.extra)
    fault = Fault("bitflip", seed=8)
    broken = run_abft(CPU, 96, 64, 128, precision=Precision.BF16, seed=1, fault=fault)
    hit = fault.injected[0]
    assert hit.bit == ABFT_FLIP_BIT and broken.verdict is Verdict.FAIL
    assert (broken.mismatches[0].row, broken.mismatches[0].col) == (hit.index // 64, hit.index % 64)


def test_bad_input_raises_clear_errors() -> None:
    with pytest.raises(ConfigError, match="no error bound"):
        gamma(1 << 24, 2.0 ** -24)
    a = np.ones((3, 4), np.float32)
    with pytest.raises(ConfigError, match="do not multiply"):
        checksum_verify(CPU, a, np.ones((5, 2), np.float32), np.ones((3, 2), np.float32))
    enc = encode_operands(CPU, a, np.ones((4, 2), np.float32))
    with pytest.raises(ConfigError, match="encoding is for"):
        verify_product(CPU, np.ones((2, 2), np.float32), enc)
