"""Pipeline stages reported as groups: ``instrument(group=stage)`` / ``StepTimer(group=)`` put ``g``
on the datagram, the probe's aggregator carries it into the step batch's ``groups``, and the
straggler detector compares each rank with its own stage only."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fleethealth.detectors.straggler import StragglerDetector
from fleethealth.injob.timer import StepTimer
from fleethealth.probe.aggregator import StepAggregator
from fleethealth.probe.daemon import DatagramListener
from fleethealth.wire import parse

STAGES, PER_STAGE, STEPS, ONSET, SLOW = 2, 4, 60, 30, 2
"""Two stages of four ranks; stage 1's steps take twice stage 0's; rank 2 (stage 0) slows 30 % at ONSET."""


def _run(tmp_path, *, with_groups: bool) -> list:
    path = str(tmp_path / f"probe-{with_groups}.sock")
    listener = DatagramListener(path)
    agg = StepAggregator("node-a", timeout_s=5.0)
    timers = [StepTimer("pp", r, gpu=r, group=(r // PER_STAGE) if with_groups else None, socket_path=path,
                        cuda=False) for r in range(STAGES * PER_STAGE)]
    rng = np.random.default_rng(7)
    batches = []
    for step in range(STEPS):
        for r, timer in enumerate(timers):
            base = 0.1 * (1 + r // PER_STAGE) * (1 + 0.002 * rng.standard_normal())
            timer.report(step, base * (1.3 if r == SLOW and step >= ONSET else 1.0), ts=1000.0 + step)
        now = 10.0 + step  # the probe's clock: step 0 goes out when the aggregator has learnt the ranks
        for datagram in listener.receive():
            agg.feed(datagram, 0.0 if step == 0 else now, time.time())
        batches.extend(agg.drain(now).batches)
    for timer in timers:
        timer.close()
    listener.close()
    assert len(batches) == STEPS, f"{len(batches)} batches from {STEPS} steps"
    return batches


def _findings(batches: list) -> list[tuple[int, int]]:
    det = StragglerDetector(min_group=3)
    out = []
    for b in sorted(batches, key=lambda b: b.step):
        out += [(f.rank, f.step) for f in det.check(b.step, b.ranks, b.compute_s, b.groups)]
    return out


def test_stages_are_compared_within_themselves(tmp_path) -> None:
    batches = _run(tmp_path, with_groups=True)
    assert batches[0].groups.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    found = _findings(batches)
    assert found and {r for r, _ in found} == {SLOW} and min(s for _, s in found) >= ONSET, found


def test_without_groups_the_slower_stage_is_flagged_instead(tmp_path) -> None:
    batches = _run(tmp_path, with_groups=False)
    assert batches[0].groups is None
    found = {r for r, _ in _findings(batches)}
    assert found & set(range(PER_STAGE, 2 * PER_STAGE)), found  # stage 1's ranks, healthy, look slow


@pytest.mark.parametrize("g", [-1, "1", 1.5, True, 2**31])
def test_a_bad_group_on_the_wire_is_refused(g: object) -> None:
    import orjson

    datagram = orjson.dumps({"t": "c", "job": "j", "rank": 0, "gpu": 0, "step": 1, "s": 0.1, "ts": 1.0, "g": g})
    with pytest.raises(ValueError, match="group"):
        parse(datagram)
