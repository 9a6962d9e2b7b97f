"""The job lifecycle: ``interruption`` events derived from the job's own records and the detectors'
findings, with the four MTTR phases of seed 002 (detection, isolation & scheduling, reconfiguration,
reload & replay) measured from the signals' event times; bad lifecycle input never raises."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import Producer, ensure_topics
from fleethealth.detectors.batch import Batch
from fleethealth.detectors.lifecycle import LifecycleTracker
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.runner import Runner, conclude
from fleethealth.errors import ConfigError, SchemaError
from fleethealth.ids import interruption
from fleethealth.payloads.checkpoint import checkpoint_event
from fleethealth.payloads.hang_report import hang_report_event
from fleethealth.payloads.job import job_exit_event, job_start_event
from fleethealth.policy.goodput import Interruption
from fleethealth.policy.stage import PolicyStage
from fleethealth.schema import Event, EventKind, Message, StepBatch, StepBlock, Telemetry
from fleethealth.store import open_store

T0 = 1_767_225_600.0
STEP_S = 2.0
CKPT = "ckpt://j/step-00000050"


def _batches(step: int, ts: float, *, nodes: Sequence[str] = ("n0000", "n0001")) -> list[StepBatch]:
    out = []
    for n in nodes:
        first = 2 * int(n[1:])
        ranks = np.array([first, first + 1], dtype=np.int32)
        out.append(StepBatch(job="j", step=step, node=n, ts=ts, ranks=ranks, gpus=(ranks % 2).astype(np.int16),
                             compute_s=np.full(2, 1.6)))
    return out


def _start(ts: float, first_step: int = 0, resumed_from: str | None = None) -> Event:
    return job_start_event(ts=ts, world=4, first_step=first_step, resumed_from=resumed_from, node="n0000", job="j",
                           rank=0)


def _exit(ts: float, status: str = "failed", last_step: int | None = 60, reason: str = "NCCL error") -> Event:
    return job_exit_event(ts=ts, status=status, last_step=last_step, reason=reason, node="n0000", job="j", rank=0)


def _lost_gpu_run() -> list[Message]:
    """Steps 0..60 every 2 s, a checkpoint at 50; the GPU of rank 3 lost (Xid 79) a second after step 60, the
    run fails at +10 s, is restarted at +100 s from the checkpoint (first step 51), loads it for 20 s, replays
    51..60 and goes on to 62, past its old high-water step."""
    msgs: list[Message] = [_start(T0 - 5.0)]
    for k in range(61):
        msgs += _batches(k, T0 + STEP_S * k)
    msgs.append(checkpoint_event(ts=T0 + 100.0 + 0.5, step=50, uri=CKPT, last_verified_step=50, node="n0000", job="j"))
    good = T0 + STEP_S * 60
    msgs.append(Event(node="n0001", ts=good + 1.0, kind=EventKind.XID, job="j", gpu=1, code=79,
                      message="GPU has fallen off the bus"))
    msgs.append(_exit(good + 10.0))
    restart = good + 100.0
    msgs.append(_start(restart, first_step=51, resumed_from=CKPT))
    for k in range(51, 63):
        msgs += _batches(k, restart + 20.0 + STEP_S * (k - 50))
    return sorted(msgs, key=lambda m: m.ts)


def _through_pipeline(msgs: Sequence[Message], chunk: int) -> tuple[list[Event], Pipeline]:
    pipe, stage = Pipeline(), PolicyStage()
    derived: list[Event] = []
    for i in range(0, len(msgs), chunk):
        out = conclude(pipe, stage, msgs[i:i + chunk], final=i + chunk >= len(msgs))
        derived += out.events
    return derived, pipe


def test_a_lost_gpu_and_a_restart_from_a_checkpoint_give_each_phase() -> None:
    msgs = _lost_gpu_run()
    (ev,), pipe = _through_pipeline(msgs, chunk=7)
    good = T0 + STEP_S * 60
    rec = Interruption.from_event(ev)
    assert (ev.kind, ev.job, ev.node, ev.gpu, ev.step, ev.ts) == (EventKind.INTERRUPTION, "j", "n0001", 1, 60,
                                                                    good + 10.0)
    assert (rec.cause, rec.detected_by, ev.data["diagnosed_by"]) == ("gpu_failure", "job_exit", "xid")
    assert rec.detection_s == pytest.approx(10.0)          # last good step -> the failed exit
    assert rec.isolation_s == pytest.approx(0.0)           # the Xid named the GPU before the exit came
    assert rec.reconfiguration_s == pytest.approx(90.0)    # -> the restarted run's job_start
    assert rec.reload_s == pytest.approx(20.0)             # -> its first step, less that step's own 2 s
    assert ev.data["recompute_s"] == pytest.approx(20.0)   # steps 51..60 again, until 61 passes the old 60
    assert ev.data["recompute_measured"] is True and ev.data["passed"] is True
    assert rec.lost_steps == 10 and rec.restart_s == pytest.approx(110.0)
    assert ev.data["interruption_id"] == interruption("j", 60, good)
    assert ev.data["resumed_from"] == CKPT and ev.data["first_step"] == 51
    # the replayed steps were assembled again (restart of step assembly), and the run is no hang
    assert pipe.assembler.late_total == 0
    assert not [f for f in pipe.hang.check([], [], good + 1000.0)]


def test_the_same_input_in_any_batching_derives_the_same_event() -> None:
    msgs = _lost_gpu_run()
    one, _ = _through_pipeline(msgs, chunk=len(msgs))
    small, _ = _through_pipeline(msgs, chunk=3)
    assert [e.to_obj() for e in one] == [e.to_obj() for e in small] and one[0].id == small[0].id


def test_through_the_broker_and_the_runner_into_the_store(tmp_path) -> None:
    """The same scripted run on the real broker and chDB: the runner stores the derived interruption with
    the input events, once, and the policy stage's pager saw it."""
    msgs = _lost_gpu_run()
    with EmbeddedBroker() as broker:
        ensure_topics(broker.dsn, partitions=1)
        with Producer(broker.dsn, event_time_stamps=True) as producer:
            for m in msgs:
                producer.publish(m)
            producer.flush()
        with open_store(f"chdb://{tmp_path}/store") as store:
            store.migrate()
            with Runner(broker.dsn, store, group=f"life-{uuid.uuid4().hex[:8]}", publish=False,
                        registry=CollectorRegistry(), session_timeout_s=2.0, max_poll_interval_s=2.0,
                        max_records=50) as runner:
                deadline = time.monotonic() + 60
                while runner.consumer.consumed_total < len(msgs) and time.monotonic() < deadline:
                    runner.process_once(0.5)
                runner.drain()
                seen = dict(runner.policy.interruptions_)
            stored = [e for e in store.events(job="j") if e.kind is EventKind.INTERRUPTION]
    assert len(stored) == 1
    (ev,) = stored
    assert (ev.node, ev.step, ev.data["cause"], ev.data["lost_steps"]) == ("n0001", 60, "gpu_failure", 10)
    assert (ev.data["detection_s"], ev.data["reconfiguration_s"], ev.data["reload_s"]) == (10.0, 90.0, 20.0)
    assert list(seen) == [ev.data["interruption_id"]]


def test_a_hang_killed_and_restarted_without_an_exit_record() -> None:
    """Rank 3 stops after step 39 while the others finish 40; its watchdog's stacks come 60 s later; the run is
    killed without an exit record and restarted at +400 s from step 26. Known at the hang's deadline
    (last progress + the 30 s step timeout), diagnosed at the hang finding, restarted at the start."""
    msgs: list[Message] = [_start(T0 - 5.0)]
    for k in range(40):
        msgs += _batches(k, T0 + STEP_S * k)
    good = T0 + STEP_S * 40
    msgs.append(_batches(40, good)[0])  # n0001 (ranks 2, 3) never reports step 40
    msgs += [hang_report_event(ts=good + 60.0, stacks="cudaStreamSynchronize", timeout_s=60.0, node="n0001",
                               job="j", rank=r, gpu=r % 2, step=40) for r in (2, 3)]
    msgs += [Telemetry.from_columns(n, "r00", good + t, [0, 1]) for t in range(0, 400, 10) for n in ("n0000", "n0001")]
    msgs.append(_start(good + 400.0, first_step=26, resumed_from="ckpt://j/step-00000025"))
    for k in range(26, 45):
        msgs += _batches(k, good + 400.0 + 10.0 + STEP_S * (k - 25))
    (ev,), pipe = _through_pipeline(sorted(msgs, key=lambda m: m.ts), chunk=40)
    d = ev.data
    assert (d["cause"], d["detected_by"], d["diagnosed_by"], ev.node, d["exit_status"]) == (
        "hang", "hang", "hang", "n0001", None)
    assert d["detection_s"] == pytest.approx(30.0) and d["isolation_s"] == pytest.approx(30.0)
    assert d["reconfiguration_s"] == pytest.approx(340.0) and d["reload_s"] == pytest.approx(10.0)
    assert d["lost_steps"] == 15 and d["recompute_s"] == pytest.approx(30.0)   # 26..40 again, then 41
    assert [f.kind.value for f in pipe.hang.check([], [], good + 2000.0)] == []


def test_steps_going_back_without_a_start_are_a_restart() -> None:
    """A job without the in-job library: its steps stop after 30 and come back 200 s later from step 21."""
    msgs: list[Message] = []
    for k in range(31):
        msgs += _batches(k, T0 + STEP_S * k)
    good = T0 + STEP_S * 30
    for k in range(21, 36):
        msgs += _batches(k, good + 200.0 + STEP_S * (k - 21))
    (ev,), pipe = _through_pipeline(msgs, chunk=11)
    d = ev.data
    assert (d["cause"], d["detected_by"], d["restarted_by"], d["first_step"], d["lost_steps"]) == (
        "unknown", "step_timeout", "step_rewind", 21, 10)
    assert d["detection_s"] == pytest.approx(30.0)                          # the step timeout ran out
    assert d["reconfiguration_s"] == pytest.approx(200.0 - STEP_S - 30.0)   # the first new step less its own time
    assert d["recompute_s"] == pytest.approx(20.0)
    assert pipe.lifecycle.rewinds_total_ == 1 and pipe.assembler.late_total == 0


def test_a_failed_run_never_restarted_is_reported_once_after_the_wait() -> None:
    det = LifecycleTracker(restart_wait_s=600.0)
    assert det.check([], [_start(T0 - 5.0)], T0) == []
    det.check([b for k in range(10) for b in _batches(k, T0 + STEP_S * k)], [], T0 + 20.0)
    assert det.check([], [_exit(T0 + 30.0, last_step=9)], T0 + 30.0) == []
    assert det.check([], [], T0 + 600.0) == []
    (ev,) = det.check([], [], T0 + 631.0)
    d = ev.data
    assert (d["restarted"], d["lost_steps"], d["cause"], d["reason"]) == (False, 0, "job_failed", "NCCL error")
    assert d["detection_s"] == pytest.approx(30.0 - 18.0) and d["reconfiguration_s"] == 0.0
    # a start that comes much later after all: the same stop, not a second interruption
    det.check([], [_start(T0 + 5000.0, first_step=0)], T0 + 5000.0)
    assert det.check(_batches(0, T0 + 5010.0) + _batches(10, T0 + 5030.0), [], T0 + 5030.0) == []
    assert det.update(Batch(final=True), T0 + 5030.0) == []  # the end of input concludes nothing more


def test_bad_lifecycle_input_is_counted_never_raised() -> None:
    det = LifecycleTracker()
    # an exit of a job never started or seen: taken at its word (a completed one ends nothing)
    assert det.check([], [_exit(T0, status="completed", last_step=None)], T0) == []
    assert det.unstarted_exits_total_ == 1
    # a start, the same start redelivered, a second start with nothing in between: one run
    det.check([], [_start(T0 + 10.0), _start(T0 + 10.0), _start(T0 + 11.0)], T0 + 11.0)
    assert det.duplicate_starts_total_ == 2
    det.check([b for k in range(5) for b in _batches(k, T0 + 20.0 + STEP_S * k)], [], T0 + 30.0)
    # malformed records and ones without a job
    broken = [Event(node="n0000", ts=T0 + 31.0, kind=EventKind.JOB_START, job="j", data={"world": "four"}),
              Event(node="n0000", ts=T0 + 31.0, kind=EventKind.JOB_EXIT, job="j", data={"status": "exploded"}),
              Event(node="n0000", ts=T0 + 31.0, kind=EventKind.JOB_EXIT, data={"status": "failed"})]
    assert det.check([], broken, T0 + 31.0) == []
    assert det.invalid_total_ == 2
    # the failed exit, redelivered; a batch of the old run delivered after the restart (stale)
    det.check([], [_exit(T0 + 40.0, last_step=4), _exit(T0 + 40.0, last_step=4)], T0 + 40.0)
    assert det.duplicate_exits_total_ == 1
    det.check([], [_start(T0 + 100.0, first_step=3)], T0 + 100.0)
    det.check(_batches(3, T0 + 35.0), [], T0 + 101.0)
    assert det.stale_total_ == 2  # one batch per node
    (ev,) = det.check([b for k in range(3, 7) for b in _batches(k, T0 + 110.0 + STEP_S * k)], [], T0 + 130.0)
    assert ev.data["lost_steps"] == 2 and ev.step == 4
    # a resumed start of a job whose earlier runs were never seen derives nothing
    assert det.check([], [job_start_event(ts=T0, world=2, first_step=500, resumed_from="x", node="n9",
                                           job="other")], T0 + 131.0) == []
    assert det.unseen_restarts_total_ == 1
    with pytest.raises(SchemaError, match="now"):
        det.check([], [], float("nan"))
    with pytest.raises(ConfigError, match="rewind_gap_s"):
        LifecycleTracker(rewind_gap_s=-1.0).check([], [])


def test_a_stall_that_clears_by_itself_is_no_interruption() -> None:
    """A hang finding, then the steps go on past it with no restart: a long step, not a stop."""
    msgs: list[Message] = []
    for k in range(20):
        msgs += _batches(k, T0 + STEP_S * k)
    good = T0 + STEP_S * 20
    msgs.append(_batches(20, good)[0])
    msgs += [Telemetry.from_columns(n, "r00", good + t, [0, 1]) for t in range(0, 300, 10) for n in ("n0000", "n0001")]
    for k in range(21, 30):
        msgs += _batches(k, good + 300.0 + STEP_S * (k - 20))
    derived, pipe = _through_pipeline(sorted(msgs, key=lambda m: m.ts), chunk=25)
    assert derived == [] and pipe.lifecycle.stalls_cleared_total_ == 1


def test_the_simulated_fleet_hang_and_lost_gpu_are_derived_with_their_causes() -> None:
    """The simulator writes no interruption; its job records give the detectors both stops of a small
    scenario, with the phases the simulator's timeline implies (a 120 s hang, a 600 s restart of which
    30 % is the checkpoint load)."""
    from fleethealth.sim import FleetSim, Scenario

    scenario = Scenario.from_obj({"seed": 4, "fleet": {"racks": 1, "nodes_per_rack": 4, "gpus_per_node": 2},
                                  "job": {"steps": 120, "step_time_s": 2.0},
                                  "faults": [{"kind": "hang", "node": "n0002", "gpu": 1, "step": 50},
                                             {"kind": "ecc_precursor", "node": "n0001", "gpu": 0, "start_step": 5,
                                              "fail_step": 90}]})
    sim = FleetSim(scenario)
    msgs = sorted((m for tick in sim.run() for m in (*tick.telemetry, *tick.batches, *tick.events)),
                  key=lambda m: m.ts)
    assert not [m for m in msgs if isinstance(m, Event) and m.kind is EventKind.INTERRUPTION]
    derived, _ = _through_pipeline(msgs, chunk=500)
    got = [(e.data["cause"], e.node, e.step, e.data["lost_steps"]) for e in derived]
    assert got == [("hang", "n0002", 50, 0), ("gpu_failure", "n0001", 90, 15)]
    hang, lost = (e.data for e in derived)
    assert hang["detection_s"] == pytest.approx(30.0) and hang["isolation_s"] == pytest.approx(60.0)
    assert hang["detection_s"] + hang["restart_s"] == pytest.approx(120.0 + 600.0, abs=0.5)
    assert hang["reload_s"] == pytest.approx(180.0, abs=0.5)
    assert lost["resumed_from"] == "ckpt://train-1/step-00000075" and lost["recompute_measured"] is False
    assert lost["recompute_s"] == pytest.approx(15 * lost["step_s"])
    assert lost["detection_s"] + lost["restart_s"] == pytest.approx(600.0, abs=0.5)  # the 600 s gap after the step


def test_a_run_halted_by_its_own_failed_check_is_an_sdc_interruption() -> None:
    """The in-job library halts on a failed self-check (``job_exit`` ``halted``); the launcher rolls back to
    the checkpoint at 20 and restarts on a spare: cause ``sdc``, on the node of the SDC finding."""
    from fleethealth.schema import Finding, FindingKind

    det = LifecycleTracker()
    det.check([], [_start(T0 - 5.0)])
    det.check([b for k in range(31) for b in _batches(k, T0 + STEP_S * k)], [])
    sdc = Finding(kind=FindingKind.SDC, node="n0001", ts=T0 + 60.5, job="j", gpu=0, rank=2, step=30,
                  detector="sdc.selfcheck")
    det.check([], [_exit(T0 + 61.0, status="halted", last_step=30, reason="SDC check failed at step 30")],
               findings=[sdc])
    det.check([], [_start(T0 + 70.0, first_step=21, resumed_from="ckpt://j/step-00000020")])
    (ev,) = det.check([b for k in range(21, 32) for b in _batches(k, T0 + 75.0 + STEP_S * (k - 20))], [])
    d = ev.data
    assert (d["cause"], ev.node, ev.rank, d["exit_status"], d["culprit"], d["lost_steps"]) == (
        "sdc", "n0001", 2, "halted", True, 10)
    assert d["detection_s"] == pytest.approx(1.0) and d["isolation_s"] == 0.0 and d["reload_s"] == pytest.approx(5.0)
    assert Interruption.from_event(ev).node == "n0001"


def _block(first: int, ts: float, n: int = 10) -> StepBlock:
    return StepBlock.of([b for k in range(first, first + n) for b in _batches(k, ts + STEP_S * (k - first),
                                                                           nodes=("n0000",))])


def test_takes_whole_answers_without_changing_anything_and_its_answer_serves_only_the_next_update() -> None:
    """The pipeline asks ``takes_whole(block)`` and then updates with that block: the answer is kept for
    that update alone (not state), so a state with it is the same as without it, a forget drops it, and
    an update with another block plans that block afresh."""
    asked, plain = LifecycleTracker(), LifecycleTracker()
    for det in (asked, plain):
        det.update(Batch(events=[_start(T0 - 5.0)], steps=[_block(0, T0)]), T0 + 20.0)
    first, second = _block(10, T0 + 20.0), _block(20, T0 + 40.0)
    assert asked.takes_whole(first) and asked.state_dict().tree == plain.state_dict().tree
    asked.update(Batch(steps=[first], conclude=False), T0 + 40.0)
    plain.update(Batch(steps=[first], conclude=False), T0 + 40.0)
    assert asked.state_dict().tree == plain.state_dict().tree
    assert asked.takes_whole(second)  # asked about one block, then updated with another: planned afresh
    rewind = _block(5, T0 + 45.0)  # the counter goes back: a restart, taken step by step
    markers = asked.update(Batch(steps=[rewind], conclude=False), T0 + 45.0)
    assert [(m.kind, m.step) for m in markers] == [(EventKind.JOB_START, 5)]
    asked.takes_whole(second)
    asked.forget(jobs=["j"])  # a forget in between drops the answer: the job is unknown again
    assert asked.update(Batch(steps=[second], conclude=False), T0 + 60.0) == []
    assert "j" in asked.jobs_ and asked.jobs_["j"].top == 29
