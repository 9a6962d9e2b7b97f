"""ABFT checksums on the CPU path: the tolerance never raises a false alarm, a corrupted element
above it is located by (row, column), and at the suites' sizes the calibrated tolerance catches
every flip that changes an element by more than 10⁻³ of its row's RMS."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.errors import ConfigError
from fleethealth.kernels.abft import (
    ABFT_FLIP_BIT,
    BLOCK,
    LAMBDA,
    accumulation_u,
    checksum_verify,
    column_block,
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
            if abs(delta) > check.guaranteed_above(i, j):
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


def _row_rms(c: np.ndarray) -> np.ndarray:
    return np.sqrt(np.einsum("ij,ij->i", c, c, dtype=np.float64) / c.shape[1])


@pytest.mark.parametrize(("n", "precision", "kind"), [(512, Precision.FP32, "normal"), (512, Precision.BF16, "uniform"),
                                                      (1024, Precision.FP16, "normal"),
                                                      (2048, Precision.FP32, "uniform")])
def test_at_suite_sizes_every_flip_above_a_thousandth_of_the_row_rms_is_caught_and_located(
        n: int, precision: Precision, kind: str) -> None:
    """Sign, exponent and top-8 mantissa bits (31..15), random elements, one flip per check."""
    rng = np.random.default_rng(n + len(kind))
    a, b = _operands(rng, n, n, n, kind, precision)
    c = np.matmul(widen(np, a, precision), widen(np, b, precision))
    enc = encode_operands(CPU, a, b, precision=precision)
    healthy = verify_product(CPU, c, enc)
    assert healthy.ok and healthy.calibrated and healthy.worst_z < LAMBDA / 2
    rms = _row_rms(c)
    # The claim itself: 2·τ is below 10⁻³ of every row's RMS, for every check of both kinds.
    assert (2 * np.maximum(healthy.row_tolerance.max(axis=1), healthy.col_tolerance.max()) < 1e-3 * rms).all()
    eligible = located = 0
    flips = 170 if n < 2048 else 68
    for t in range(flips):
        bit = 15 + t % 17
        i, j = int(rng.integers(n)), int(rng.integers(n))
        before = float(c[i, j])
        flip_bit(np, c, i * n + j, bit)
        after = float(c[i, j])
        check = verify_product(CPU, c, enc)
        flip_bit(np, c, i * n + j, bit)
        if not np.isfinite(after) or abs(after - before) > 1e-3 * rms[i]:
            eligible += 1
            located += [(r, q) for r, q, _ in check.located] == [(i, j)]
    assert eligible >= flips * 0.8 and located == eligible, (eligible, located)


def test_the_bitflip_1024_cube_that_used_to_pass_is_now_caught() -> None:
    fault = Fault("bitflip", seed=2)
    broken = run_abft(CPU, 1024, 1024, 1024, fault=fault)
    hit = fault.injected[0]
    assert broken.verdict is Verdict.FAIL and broken.extra["calibrated"]
    assert (broken.mismatches[0].row, broken.mismatches[0].col) == (hit.index // 1024, hit.index % 1024)


@pytest.mark.parametrize(("n", "precision", "seeds"), [(512, Precision.FP32, range(6)), (512, Precision.BF16, range(3)),
                                                       (2048, Precision.FP32, range(1)),
                                                       (2048, Precision.BF16, range(1))])
def test_harness_fault_at_the_cpu_suite_sizes_is_guaranteed_caught_and_located(
        n: int, precision: Precision, seeds: range) -> None:
    """512 (quick) and 2048 (full) are kernels/suite.py's CPU ABFT sizes; healthy runs pass."""
    assert run_abft(CPU, n, n, n, precision=precision, seed=n).verdict is Verdict.PASS
    for seed in seeds:
        fault = Fault("bitflip", seed=seed)
        broken = run_abft(CPU, n, n, n, precision=precision, seed=seed, fault=fault)
        hit, info = fault.injected[0], broken.extra["fault"]
        assert broken.verdict is Verdict.FAIL and broken.extra["calibrated"]
        assert abs(info["delta"]) > info["guaranteed_above"] and abs(info["delta"]) >= 2.0
        assert [(m.row, m.col) for m in broken.mismatches] == [(hit.index // n, hit.index % n)]


def test_the_harness_refuses_a_flip_its_tolerance_cannot_guarantee() -> None:
    """Few checks and a large k: the rigorous bound is the tolerance and exceeds a bit-30 flip."""
    with pytest.raises(ConfigError, match="not above"):
        run_abft(CPU, 8, 8, 1 << 16, fault=Fault("bitflip", seed=0))


def test_small_pools_and_exact_products_fall_back_to_the_rigorous_bound() -> None:
    rng = np.random.default_rng(11)
    a, b = _operands(rng, 40, 30, 50, "normal", Precision.FP32)
    check = checksum_verify(CPU, a, b, a @ b)
    assert check.ok and not check.calibrated and np.isnan(check.sigma).all()
    # Small integers: C is exact, every residual is within the floor, a median would say nothing.
    ints = rng.integers(-8, 9, (600, 600)).astype(np.float32)
    check = checksum_verify(CPU, ints, ints.T.copy(), ints @ ints.T)
    assert check.ok and not check.calibrated


def test_no_false_alarm_on_calibrated_products_of_every_kind_and_odd_shapes() -> None:
    rng = np.random.default_rng(31)
    kinds = ("uniform", "normal", "positive", "scaled")
    calibrated = 0
    for run in range(36):
        m, n = (int(x) for x in rng.integers(256, 700, 2))
        k = int(rng.integers(4, 700))
        precision = list(Precision)[run % 3]
        a, b = _operands(rng, m, n, k, kinds[(run // 3) % 4], precision)
        c = np.matmul(widen(np, a, precision), widen(np, b, precision))
        check = checksum_verify(CPU, a, b, c, precision=precision)
        assert check.ok, (run, m, n, k, precision, check.max_ratio)
        calibrated += check.calibrated
        assert not check.calibrated or check.worst_z < LAMBDA / 2
    assert calibrated >= 30


def test_column_blocks_partition_the_columns_into_blocks_of_block_elements() -> None:
    for n in (1, 100, 256, 300, 4096):
        blocks = column_block(np.arange(n), n)
        assert blocks.min() == 0 and np.bincount(blocks).max() <= BLOCK
        assert blocks.max() == -(-n // BLOCK) - 1 or n < BLOCK
