"""Memory patterns over host memory (the CPU path of the CUDA RawKernels in kernels/memory.cu)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fleethealth.errors import ConfigError
from fleethealth.kernels.backend import Backend
from fleethealth.kernels.faults import Fault
from fleethealth.kernels.memory import MemoryTester, Pattern, expected_words, run_memory
from fleethealth.kernels.results import Verdict

CPU = Backend.for_device("cpu")


def test_every_pattern_passes_on_healthy_memory_and_reports_bandwidth() -> None:
    results = run_memory(CPU, 1 << 20)
    assert [r.test for r in results] == [f"memory_{p.value}" for p in Pattern]
    for r in results:
        assert r.verdict is Verdict.PASS and r.mismatch_total == 0
        assert r.unit == "GB/s" and r.throughput > 0
        assert r.extra["nbytes"] == 1 << 20


def test_pattern_values_match_their_definitions() -> None:
    i = np.arange(128, dtype=np.uint64)
    walk = expected_words(1, 5, 0, 128)
    assert walk.tolist() == [1 << ((x + 5) % 64) for x in range(128)]
    assert (expected_words(2, 5, 0, 128) == ~walk).all()
    checker = expected_words(3, 0x5555_5555_5555_5555, 0, 4).tolist()
    assert checker == [0x5555_5555_5555_5555, 0xAAAA_AAAA_AAAA_AAAA] * 2
    assert (expected_words(4, 0, 64, 128) == (i + 64) * 8).all()
    assert (expected_words(0, 7, 0, 3) == 7).all()


def test_cuda_source_declares_the_same_pattern_kinds() -> None:
    """The RawKernel source cannot be compiled here; check it encodes the kinds the NumPy path uses."""
    source = (Path(__file__).parents[2] / "kernels" / "memory.cu").read_text()
    assert "case 1: return 1ULL << ((i + p) & 63ULL);" in source
    assert "case 2: return ~(1ULL << ((i + p) & 63ULL));" in source
    assert "case 3: return (i & 1ULL) ? ~p : p;" in source
    assert "default: return (i * 8ULL) ^ p;" in source
    assert set(re.findall(r"__global__ void (\w+)", source)) == {"fh_fill", "fh_check"}


@pytest.mark.parametrize("stuck", [0, 1])
def test_stuck_bit_is_caught_by_the_patterns_that_write_its_opposite(stuck: int) -> None:
    fault = Fault("stuck-bit", seed=3, stuck_value=stuck)
    tester = MemoryTester(CPU, 1 << 16, fault=fault)
    scans = {p: tester.scan(p) for p in Pattern}
    hit = fault.injected[0]
    for pattern, scan in scans.items():
        assert scan.total >= 1, pattern
        assert set(scan.offsets.tolist()) == {hit.index * 8}
        assert all(m.bits == (hit.bit,) for m in scan.mismatches())
    # A bit stuck at 1 is seen in 63 of the 64 walking-one passes (every pass but its own), at 0 in one.
    assert scans[Pattern.WALKING_ONES].total == (63 if stuck else 1)
    assert scans[Pattern.WALKING_ZEROS].total == (1 if stuck else 63)


def test_moving_inversions_sees_a_cell_that_flips_between_sweeps() -> None:
    fault = Fault("bitflip", seed=12)
    result = run_memory(CPU, 1 << 14, patterns=(Pattern.MOVING_INVERSIONS,), fault=fault)[0]
    hit = fault.injected[0]
    assert result.verdict is Verdict.FAIL
    m = result.mismatches[0]
    assert (m.where, m.offset, m.bits) == ("memory", hit.index * 8, (hit.bit,))
    assert int(m.expected, 16) ^ int(m.observed, 16) == 1 << hit.bit
    assert result.max_error == 1.0  # one bit wrong in the worst word


def test_descending_sweep_and_block_edges_cover_every_word() -> None:
    fault = Fault("bitflip", seed=0)
    tester = MemoryTester(CPU, 3 * 64 * 8 + 64 * 8, fault=fault, block_words=128)  # 4 rows, blocks of 2 rows
    words = tester.words.size
    scan = tester.scan(Pattern.ADDRESS)
    assert scan.total == 1 and scan.offsets[0] == fault.injected[0].index * 8
    assert words == 256


def test_bad_sizes_raise() -> None:
    with pytest.raises(ConfigError, match="at least"):
        MemoryTester(CPU, 100)
    with pytest.raises(ConfigError, match="multiple of 64"):
        MemoryTester(CPU, 1 << 12, block_words=100)


def test_a_dead_region_is_counted_in_full_but_only_max_errors_are_kept() -> None:
    """Corrupt every word after the fill: the host check keeps at most ``max_errors`` locations
    (a dead bank must not exhaust host memory) and still counts every mismatch."""
    tester = MemoryTester(CPU, 1 << 16, max_errors=100)
    words = (1 << 16) // 8
    ops, buf = tester.ops, np.zeros(words, dtype=np.uint64)
    ops.fill(buf, 0, 7)
    buf ^= np.uint64(1)
    from fleethealth.kernels.memory import _Check

    idx, observed, total = ops.check(buf, _Check(kind=0, p=7))
    assert total == words and idx.size == observed.size == 100
    assert (observed == np.uint64(6)).all()
