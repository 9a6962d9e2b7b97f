"""Exact known-answer GEMM (small-integer and full-width products) and repeatability on the CPU path
(NumPy BLAS), with injected faults and a simulated multiplier defect."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from fleethealth.errors import ConfigError
from fleethealth.kernels.backend import Backend, Precision, encode, widen
from fleethealth.kernels.faults import Fault
from fleethealth.kernels.gemm import (
    exact_reference,
    known_problem,
    pick_magnitude,
    run_exact,
    run_repeat,
    wide_problem,
)
from fleethealth.kernels.results import Verdict

CPU = Backend.for_device("cpu")


@pytest.mark.parametrize("precision", list(Precision))
@pytest.mark.parametrize("shape", [(1, 1, 1), (37, 53, 71), (128, 96, 200)])
def test_exact_product_is_bitwise_equal_in_every_precision(precision: Precision, shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    result = run_exact(CPU, m, n, k, precision=precision, seed=7)
    assert result.verdict is Verdict.PASS, result.mismatches
    assert result.mismatch_total == 0 and result.max_error == 0.0
    assert result.unit == "TFLOP/s" and result.throughput > 0
    assert result.test == f"gemm_exact_{precision.value}"


def test_operands_are_exactly_representable_and_partial_sums_fit_the_mantissa() -> None:
    for precision in Precision:
        for k in (1, 64, 1024, 4096, 1 << 14):
            r = pick_magnitude(k, precision)
            assert r <= precision.exact_int and k * r * r <= 1 << 24
            problem = known_problem(8, 8, k, precision=precision, seed=1)
            values = problem.a.astype(np.float32)
            wide = widen(np, encode(values, precision), precision)
            assert np.array_equal(wide, values)  # the storage format holds the integers exactly
            assert np.abs(problem.a).max() <= r and (problem.a != 0).all() and (problem.b != 0).all()


def test_float64_reference_path_equals_the_int64_product() -> None:
    for problem in (known_problem(520, 520, 520, precision=Precision.FP32, seed=3),  # above the int64 limit
                    wide_problem(520, 520, 520, precision=Precision.FP32, seed=3)):
        assert np.array_equal(exact_reference(problem), problem.a @ problem.b)


def test_bad_shapes_and_magnitudes_raise_clear_errors() -> None:
    with pytest.raises(ConfigError, match="shape"):
        known_problem(0, 4, 4, precision=Precision.FP32)
    with pytest.raises(ConfigError, match="breaks exactness"):
        known_problem(4, 4, 4096, precision=Precision.BF16, r=300)
    with pytest.raises(ConfigError, match="too large"):
        pick_magnitude(1 << 25, Precision.FP32)


def test_known_problem_is_reproducible_from_its_seed() -> None:
    one = known_problem(16, 16, 16, precision=Precision.FP32, seed=11)
    two = known_problem(16, 16, 16, precision=Precision.FP32, seed=11)
    other = known_problem(16, 16, 16, precision=Precision.FP32, seed=12)
    assert np.array_equal(one.a, two.a) and np.array_equal(one.b, two.b)
    assert not np.array_equal(one.a, other.a)


@pytest.mark.parametrize("precision", list(Precision))
def test_bitflip_in_c_is_caught_and_located_with_its_bit(precision: Precision) -> None:
    m, n = 48, 40
    fault = Fault("bitflip", seed=5)
    result = run_exact(CPU, m, n, 64, precision=precision, fault=fault)
    hit = fault.injected[0]
    assert result.verdict is Verdict.FAIL and result.mismatch_total == 1
    found = result.mismatches[0]
    assert (found.where, found.row, found.col, found.bits) == ("C", hit.index // n, hit.index % n, (hit.bit,))


@pytest.mark.parametrize("operand", ["A", "B"])
def test_bitflip_in_an_operand_is_located_even_when_rounding_hides_it_in_c(operand: str) -> None:
    fault = Fault("bitflip", seed=9)
    result = run_exact(CPU, 32, 24, 40, precision=Precision.FP16, fault=fault, operand_fault=operand)
    hit = fault.injected[0]
    cols = 40 if operand == "A" else 24
    assert result.verdict is Verdict.FAIL
    first = result.mismatches[0]  # the operand, the cause, is reported before its effects in C
    assert (first.where, first.row, first.col, first.bits) == (operand, hit.index // cols, hit.index % cols,
                                                               (hit.bit,))


def test_repeat_runs_are_bitwise_identical_and_a_flip_in_one_run_is_caught() -> None:
    healthy = run_repeat(CPU, 96, 80, 112, runs=4, seed=2)
    assert healthy.verdict is Verdict.PASS and healthy.throughput > 0
    fault = Fault("bitflip", seed=4)
    broken = run_repeat(CPU, 96, 80, 112, runs=3, seed=2, fault=fault)
    hit = fault.injected[0]
    assert broken.verdict is Verdict.FAIL
    assert (broken.mismatches[0].row, broken.mismatches[0].col) == (hit.index // 80, hit.index % 80)
    assert "run 2" in broken.mismatches[0].detail
    with pytest.raises(ConfigError):
        run_repeat(CPU, 4, 4, 4, runs=1)


def test_slow_fault_stretches_the_timing_not_the_answer() -> None:
    result = run_exact(CPU, 64, 64, 64, fault=Fault("slow", slow_factor=4.0))
    assert result.verdict is Verdict.PASS
    assert result.duration_s > 0


def test_bf16_encoding_rounds_to_nearest_even() -> None:
    # 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to the even one (1.0).
    values = np.array([1.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -2.5, 256.0], dtype=np.float32)
    out = widen(np, encode(values, Precision.BF16), Precision.BF16)
    assert out.tolist() == [1.0, 1.0, 1.0 + 2.0 ** -6, -2.5, 256.0]


def _width(precision: Precision) -> int:
    return min(24, 2 * (precision.exact_int.bit_length() - 1))


@pytest.mark.parametrize("precision", list(Precision))
@pytest.mark.parametrize("k", [1, 2, 7, 96, 1024])
def test_wide_problem_products_are_full_width_and_every_partial_sum_is_exact(precision: Precision, k: int) -> None:
    w = wide_problem(12, 40, k, precision=precision, seed=3)
    width = _width(precision)
    assert np.abs(w.a).max() < precision.exact_int and np.abs(w.b).max() < precision.exact_int
    terms = w.a[:, :, None] * w.b[None, :, :]  # (m, k, n) exact products
    nonzero = terms[terms != 0]
    assert (np.abs(nonzero) % 2 == 1).all() and np.abs(nonzero).max() < 1 << width
    # Every dot product: one W-bit and (k > 1) one opposite (W−1)-bit term, all others exact zeros.
    assert (np.count_nonzero(terms, axis=1) == min(k, 2)).all()
    top = np.abs(terms).max(axis=1)
    assert (top >= 1 << (width - 1)).all()  # the full-width term: bit W−1 and bit 0 set
    positive, negative = np.where(terms > 0, terms, 0).sum(axis=1), np.where(terms < 0, -terms, 0).sum(axis=1)
    assert max(positive.max(), negative.max()) < w.sum_bound + 1 <= 1 << 24  # any subset sum is exact
    c = exact_reference(w)
    assert (c != 0).all() and np.abs(c).max() < 1 << width


def test_wide_problem_widths_cover_every_split_of_an_fp32_product() -> None:
    w = wide_problem(64, 64, 64, precision=Precision.FP32, seed=0)
    widths = {int(x).bit_length() for x in np.abs(w.a[0])}
    assert widths == set(range(2, 23))


@dataclass(frozen=True)
class _StuckLowProductBit(Backend):
    """A CPU "device" whose multiplier drops the lowest bit of its W-bit product (W = 24 for fp32
    operands, 22 for fp16, 16 for bf16): bit 24 − W of each fp32 product's pattern reads 0."""

    def matmul(self, a, b, precision: Precision):  # type: ignore[override]
        wa, wb = widen(np, a, precision), widen(np, b, precision)
        products = wa[:, :, None] * wb[None, :, :]  # fp32, exact for both known-answer problems
        bits = products.view(np.uint32)
        bits &= ~np.uint32(1 << (24 - _width(precision)))
        return products.astype(np.float64).sum(axis=1).astype(np.float32)


@pytest.mark.parametrize("precision", list(Precision))
def test_a_stuck_low_product_bit_passes_the_small_integer_case_and_fails_the_full_width_one(
        precision: Precision) -> None:
    defective = _StuckLowProductBit(device="cpu", xp=np)
    result = run_exact(defective, 24, 20, 32, precision=precision, seed=5)
    assert result.verdict is Verdict.FAIL
    assert {mm.where for mm in result.mismatches} == {"C_wide"}  # the small-integer C is bitwise right
    assert result.mismatch_total == 24 * 20  # every element of the full-width product is off by one
    first = result.mismatches[0]
    assert abs(first.observed - first.expected) == 1.0
    assert run_exact(CPU, 24, 20, 32, precision=precision, seed=5).verdict is Verdict.PASS
