"""Hang detector: progress in event time, one finding per stall naming the ranks behind, with the
watchdog stacks; interruptions, finished jobs and restarts are not hangs."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.detectors.hang import HangDetector
from fleethealth.errors import ConfigError, SchemaError
from fleethealth.schema import Event, EventKind, FindingKind, StepBatch

GPUS = 8


def _batches(step, ts, nodes=4, skip=(), job="train-1"):
    out = []
    for n in range(nodes):
        ranks = np.arange(n * GPUS, (n + 1) * GPUS, dtype=np.int32)
        keep = np.array([int(r) not in skip for r in ranks])
        if keep.any():
            out.append(StepBatch(job=job, step=step, node=f"n{n:04d}", ts=ts, ranks=ranks[keep],
                                 gpus=(ranks[keep] % GPUS).astype(np.int16), compute_s=np.full(keep.sum(), 1.6)))
    return out


def _report(rank, ts, stuck="compute", job="train-1"):
    return Event(node=f"n{rank // GPUS:04d}", ts=ts, kind=EventKind.HANG_REPORT, job=job, rank=rank, gpu=rank % GPUS,
                 step=10, data={"stacks": f"stack-{stuck}", "last_collective": None, "timeout_s": 90.0})


def _feed(det, steps=10, step_s=2.0, t0=1000.0, **kw):
    out = []
    for s in range(steps):
        out += det.check(_batches(s, t0 + step_s * s, **kw), [], t0 + step_s * s)
    return out


def test_simulated_hang_is_one_finding_naming_the_node_with_its_stacks():
    """The fleet simulator's hang fault: n0002 stops reporting at step 30, watchdogs dump stacks
    after 90 s, the job is interrupted at 120 s and restarts."""
    from fleethealth.sim.fleet import FleetSim
    from fleethealth.sim.scenario import Scenario

    sim = FleetSim(Scenario.from_obj({"seed": 5, "fleet": {"racks": 2, "nodes_per_rack": 4, "gpus_per_node": 8},
                                      "job": {"steps": 60},
                                      "faults": [{"kind": "hang", "node": "n0002", "step": 30}]}))
    det = HangDetector()
    found = []
    for frame in sim.run():
        found += det.check(frame.batches, frame.events, frame.ts)
    assert len(found) == 1
    f = found[0]
    assert f.kind is FindingKind.HANG and f.node == "n0002" and f.job == "train-1" and f.step == 30
    assert f.rank is None and f.evidence["behind_ranks"] == list(range(16, 24))
    assert f.evidence["behind_nodes"] == ["n0002"] and f.evidence["why"] == "timeout"
    stacked = {s["rank"] for s in f.evidence["stacks"]}
    assert set(range(16, 24)) <= stacked and f.evidence["stacks"][0]["rank"] == 16
    assert "GPU not responding" in f.evidence["stacks"][0]["stacks"]
    hang_start = sim.step_ts(30)
    assert hang_start + 30.0 < f.ts <= hang_start + 120.0


def test_timeout_is_three_p99_step_times_with_a_floor():
    det = HangDetector(min_timeout_s=5.0)
    _feed(det, steps=50, step_s=20.0)
    assert det.timeout_s("train-1") == pytest.approx(60.0)
    assert HangDetector().timeout_s("nope") == 30.0
    fast = HangDetector()
    _feed(fast, steps=50, step_s=1.0)
    assert fast.timeout_s("train-1") == 30.0


def test_behind_rank_without_stacks_is_reported_after_the_grace_period():
    det = HangDetector(stack_grace_s=60.0)
    _feed(det, steps=10)
    t = 1018.0
    assert det.check(_batches(10, t + 2, skip={9}), [], t + 2) == []
    assert det.check([], [], t + 2 + 30.0) == []
    assert det.check([], [], t + 2 + 89.0) == []
    (f,) = det.check([], [], t + 2 + 200.0)
    assert f.rank == 9 and f.gpu == 1 and f.node == "n0001" and f.step == 10
    assert f.ts == pytest.approx(t + 2 + 30.0 + 60.0) and f.evidence["stacks"] == []
    assert det.check([], [], t + 5000.0) == []  # once per episode


def test_stacks_of_the_behind_rank_release_the_finding_early():
    det = HangDetector()
    _feed(det, steps=10)
    det.check(_batches(10, 1020.0, skip={9}), [], 1020.0)
    assert det.check([], [_report(9, 1045.0)], 1045.0) == []  # before the deadline
    (f,) = det.check([], [], 1051.0)
    assert f.ts == pytest.approx(1050.0) and f.evidence["stacks"][0]["stacks"] == "stack-compute"


def test_level_ranks_with_odd_stack_out_name_the_culprit():
    det = HangDetector()
    _feed(det, steps=10)
    reports = [_report(r, 1040.0, stuck="allreduce") for r in range(32) if r != 13] + [_report(13, 1040.0)]
    (f,) = det.check([], reports, 1060.0)
    assert f.rank == 13 and f.node == "n0001" and f.evidence["behind_count"] == 1


def test_finished_job_is_idle_not_hung():
    det = HangDetector()
    _feed(det, steps=10)
    assert det.check([], [], 1e6) == []
    assert det.idle_total_ == 1


def test_interruption_before_the_deadline_is_not_a_hang_and_restart_starts_afresh():
    det = HangDetector()
    _feed(det, steps=10)
    det.check(_batches(10, 1020.0, skip={3}), [], 1020.0)
    lost = Event(node="n0000", ts=1022.0, kind=EventKind.INTERRUPTION, job="train-1", gpu=3,
                 data={"cause": "gpu_failure"})
    assert det.check([], [lost], 1500.0) == []
    # resumed from a checkpoint at an earlier step: progress again, no hang
    assert _feed(det, steps=5, t0=2000.0) == []
    assert det.check([], [], 2010.0) == []


def test_progress_resuming_after_the_deadline_reports_the_stall():
    det = HangDetector(stack_grace_s=600.0)
    _feed(det, steps=10)
    det.check(_batches(10, 1020.0, skip={0}), [], 1020.0)
    (f,) = det.check(_batches(11, 1100.0), [], 1100.0)
    assert f.evidence["why"] == "resumed" and f.rank == 0 and f.ts == 1100.0


def test_one_call_with_the_whole_stream_equals_step_by_step():
    stream = [(_batches(s, 1000.0 + 2 * s, skip={5} if s >= 10 else ()), 1000.0 + 2 * s) for s in range(20)]
    a, b = HangDetector(), HangDetector()
    step_by_step = []
    for batches, ts in stream:
        step_by_step += a.check(batches, [], ts)
    step_by_step += a.check([], [], 1300.0)
    at_once = b.check([x for batches, _ in stream for x in batches], [], 1300.0)
    assert [f.to_obj() for f in step_by_step] == [f.to_obj() for f in at_once]
    assert len(at_once) == 1 and at_once[0].rank == 5


def test_bad_now_and_parameters():
    with pytest.raises(SchemaError, match="now"):
        HangDetector().check([], [], float("nan"))
    with pytest.raises(ConfigError, match="quantile"):
        HangDetector(quantile=2.0).check([], [], 0.0)
    det = HangDetector()
    assert det.check([], [_report(1, 5.0, job="unknown")], 5.0) == []
    assert det.ignored_events_total_ == 1


def test_every_rank_level_while_the_nodes_live_on_is_a_hang_without_a_culprit():
    """Steps stop at step 9 for every rank, no watchdog report, telemetry goes on: at deadline +
    stack_grace_s one finding with no rank, ``culprit`` false; with the nodes silent too it is idle."""
    det = HangDetector(min_timeout_s=30.0, stack_grace_s=60.0)
    assert _feed(det) == []
    alive = {f"n{n:04d}": 1018.0 for n in range(4)}
    for ts in np.arange(1020.0, 1200.0, 2.0).tolist():
        alive.update(dict.fromkeys(alive, ts))
        found = det.check([], [], ts, alive=alive)
        if found:
            break
    (f,) = found
    assert f.kind is FindingKind.HANG and f.rank is None and f.gpu is None and f.step == 10
    assert f.ts == 1018.0 + 30.0 + 60.0 and f.evidence["culprit"] is False and f.evidence["level"] is True
    assert f.evidence["last_step"] == 9 and f.evidence["nodes_reporting"] == 4
    quiet = HangDetector(min_timeout_s=30.0, stack_grace_s=60.0)
    _feed(quiet)
    assert quiet.check([], [], 1300.0, alive=dict.fromkeys(alive, 1018.0)) == [] and quiet.idle_total_ == 1


def test_steps_delivered_late_with_times_before_the_deadline_withdraw_it():
    """The clock (other inputs) passes the deadline while the steps input stalls; the backlog then
    arrives carrying its own earlier times: the job progressed, no hang, not even a resumed one."""
    det = HangDetector(min_timeout_s=30.0, stack_grace_s=60.0)
    _feed(det)
    assert det.check([], [], 1060.0, alive=dict.fromkeys([f"n{n:04d}" for n in range(4)], 1060.0)) == []
    assert det.jobs_["train-1"].deadline == 1048.0
    late = [b for s in range(10, 40) for b in _batches(s, 1000.0 + 2.0 * s)]
    assert det.check(late, [], 1080.0) == [] and det.clock_ahead_total_ == 1


def test_a_failed_exit_before_the_deadline_is_not_a_hang_and_the_restart_starts_afresh():
    """The in-job library's ``job_exit`` (a lost GPU) ends the run before its deadline; the restarted run's
    ``job_start`` and batches from an earlier step are progress, not a stall."""
    from fleethealth.payloads.job import job_exit_event, job_start_event

    det = HangDetector()
    _feed(det, steps=10)
    det.check(_batches(10, 1020.0, skip={3}), [], 1020.0)
    failed = job_exit_event(ts=1022.0, status="failed", last_step=10, node="n0000", job="train-1", rank=0)
    assert det.check([], [failed], 1500.0) == []
    restart = job_start_event(ts=1990.0, world=32, first_step=6, node="n0000", job="train-1", rank=0)
    assert det.check([], [restart], 1995.0) == []
    assert _feed(det, steps=12, t0=2000.0) == [] and det.check([], [], 2030.0) == []
