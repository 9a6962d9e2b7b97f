"""Done-when check: at least 1,000 random single-bit flips injected into A, B, C or the memory
region are all detected, and each is located (matrix, row, column and bit; or byte offset and bit)."""

from __future__ import annotations

import numpy as np

from fleethealth.kernels.backend import Backend, Precision
from fleethealth.kernels.faults import Fault
from fleethealth.kernels.gemm import run_exact
from fleethealth.kernels.memory import MemoryTester, Pattern
from fleethealth.kernels.results import Verdict

CPU = Backend.for_device("cpu")


def test_600_flips_in_gemm_operands_and_output_are_all_detected_and_located() -> None:
    rng = np.random.default_rng(99)
    m, n, k = 20, 24, 28
    cols = {"A": k, "B": n, "C": n}
    seen = 0
    for trial in range(600):
        where = ("A", "B", "C")[trial % 3]
        precision = list(Precision)[(trial // 3) % 3]
        fault = Fault("bitflip", seed=int(rng.integers(1 << 31)))
        result = run_exact(CPU, m, n, k, precision=precision, seed=trial, fault=fault,
                           operand_fault=None if where == "C" else where)
        hit = fault.injected[0]
        assert result.verdict is Verdict.FAIL, (trial, where, hit)
        first = result.mismatches[0]
        assert (first.where, first.row, first.col, first.bits) == (
            where, hit.index // cols[where], hit.index % cols[where], (hit.bit,)), (trial, hit, first)
        seen += 1
    assert seen == 600


def test_500_flips_in_the_memory_region_are_all_detected_with_offset_and_bit() -> None:
    rng = np.random.default_rng(5)
    patterns = list(Pattern)
    for trial in range(500):
        fault = Fault("bitflip", seed=int(rng.integers(1 << 31)))
        tester = MemoryTester(CPU, 4096, fault=fault)
        scan = tester.scan(patterns[trial % len(patterns)])
        hit = fault.injected[0]
        assert scan.total == 1, (trial, hit)
        found = scan.mismatches()[0]
        assert (found.offset, found.bits) == (hit.index * 8, (hit.bit,))
        assert found.address == tester.base_address + hit.index * 8


def test_100_healthy_runs_of_each_method_raise_no_false_alarm() -> None:
    rng = np.random.default_rng(17)
    for trial in range(100):
        m, n, k = (int(x) for x in rng.integers(1, 48, 3))
        exact = run_exact(CPU, m, n, k, precision=list(Precision)[trial % 3], seed=trial)
        assert exact.verdict is Verdict.PASS, (trial, exact.mismatches)
        scan = MemoryTester(CPU, 512 * int(rng.integers(1, 9))).scan(list(Pattern)[trial % len(Pattern)])
        assert scan.total == 0
