"""Collective known-answer tests: the exact-sum arithmetic, bus bandwidth, culprit naming, and one
real run across three CPU processes with torch's gloo backend."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.errors import ConfigError
from fleethealth.kernels.collective import (
    RankReport,
    _diff,
    bus_bandwidth,
    contribution,
    expected_sum,
    merge_reports,
    run_gloo,
)
from fleethealth.kernels.faults import Fault
from fleethealth.kernels.results import Verdict


def test_known_sum_is_exact_and_contributions_differ_per_rank() -> None:
    world, n = 5, 4096
    total = sum(contribution(r, n).astype(np.int64) for r in range(world))
    assert np.array_equal(expected_sum(world, n), total.astype(np.float32))
    assert np.abs(contribution(0, n)).max() <= 254
    assert not np.array_equal(contribution(0, n), contribution(1, n))
    with pytest.raises(ConfigError):
        expected_sum(70_000, 4)


def test_bus_bandwidth_follows_nccl_tests() -> None:
    assert bus_bandwidth("all_reduce", 1_000_000_000, 4, 1.0) == pytest.approx(1.5)
    assert bus_bandwidth("all_gather", 1_000_000_000, 4, 1.0) == pytest.approx(3.0)
    with pytest.raises(ConfigError):
        bus_bandwidth("broadcast", 1, 2, 1.0)


def _report(rank: int, world: int, n: int, reduce_bad: bool, slot_bad: int | None) -> RankReport:
    want = expected_sum(world, n)
    got = want.copy()
    if reduce_bad:
        got[3] += 1
    slots = {s: _diff(contribution(s, n), contribution(s, n)) for s in range(world)}
    contributions = {}
    if slot_bad is not None:
        wrong = contribution(slot_bad, n)
        wrong[3] += 1
        slots[slot_bad] = _diff(wrong, contribution(slot_bad, n))
        contributions = dict(slots)
    return RankReport(rank=rank, world=world, elements=n, all_reduce=_diff(got, want), all_gather=slots,
                      contributions=contributions, all_reduce_s=0.01, all_gather_s=0.01)


def test_a_wrong_contribution_names_its_rank_and_a_wrong_reduction_names_the_receiver() -> None:
    world, n = 4, 64
    bad_input = merge_reports([_report(r, world, n, True, 2) for r in range(world)], suite="quick", device="cpu",
                              model="cpu")
    reduce, gather = bad_input
    assert reduce.verdict is Verdict.FAIL and {m.rank for m in reduce.mismatches} == {2}
    assert gather.extra["ranks_named"] == [2] and gather.mismatches[0].index == 3
    bad_sum = merge_reports([_report(r, world, n, r == 1, None) for r in range(world)], suite="quick",
                            device="cpu", model="cpu")
    assert bad_sum[0].extra["ranks_named"] == [1] and "contributions correct" in bad_sum[0].mismatches[0].detail
    assert bad_sum[1].verdict is Verdict.PASS


def test_three_gloo_processes_catch_a_corrupted_contribution_and_name_the_rank() -> None:
    """One real run (three processes take ~10 s to import torch on two cores): rank 1's
    contribution has one flipped bit; the healthy ranks' slots must stay clean."""
    fault = Fault("bitflip", seed=21)
    reduce, gather = run_gloo(3, elements=1 << 12, iters=2, fault=fault, corrupt_rank=1, timeout_s=60)
    hit = fault.injected[0]
    assert hit.where == "rank 1"
    assert gather.verdict is Verdict.FAIL and gather.extra["ranks_named"] == [1]
    assert all(m.index == hit.index and m.bits == (hit.bit,) for m in gather.mismatches)
    assert gather.mismatch_total == 3  # every rank saw slot 1 wrong, and nothing else
    if reduce.verdict is Verdict.FAIL:  # a flip of a low mantissa bit can round away in the sum
        assert reduce.extra["ranks_named"] == [1]
    assert gather.throughput > 0 and reduce.throughput > 0 and gather.unit == "GB/s"
