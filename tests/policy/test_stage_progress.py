"""What the policy stage learns of jobs passes as messages (``job_progress``, ``job_end``): the staged
policy gets the goodput figure and forgets ended jobs, and the figure does not depend on whether the
steps after a stop came in the same batch (the whole tier) or after it (a policy stage in event-time order)."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.runner import conclude
from fleethealth.detectors.stages import Stage, takes_event
from fleethealth.errors import ConfigError
from fleethealth.payloads.checkpoint import checkpoint_event
from fleethealth.payloads.job import job_exit_event
from fleethealth.payloads.progress import MAX_STEP_TIMES, JobProgress, job_end_event, job_progress_events
from fleethealth.policy.stage import PolicyStage
from fleethealth.schema import Event, EventKind, StepBatch, decode, encode

T0 = 1_767_225_600.0


def _stop(known: float, passed: float, lost: int) -> Event:
    return Event(node="n0001", ts=known, kind=EventKind.INTERRUPTION, job="j", step=300,
                 data={"interruption_id": "stop-1", "cause": "hang", "detected_by": "hang", "lost_steps": lost,
                       "restart_s": passed - known, "restart_ts": passed - 30.0, "passed_ts": passed})


def test_the_job_stage_publishes_progress_and_ends_and_ignores_its_own() -> None:
    pipe = Pipeline(job_idle_s=600.0)
    steps = [StepBatch(job="j", step=k, node="n0000", ts=T0 + 2.0 * k, ranks=np.arange(8, dtype=np.int32),
                       gpus=np.arange(8, dtype=np.int16), compute_s=np.full(8, 1.6)) for k in range(50)]
    out = conclude(pipe, None, steps)
    (progress,) = [e for e in out.progress if e.kind is EventKind.JOB_PROGRESS]
    rec = JobProgress.from_event(decode(Event, encode(progress)))
    assert rec.job == "j" and len(rec.step_ts) == pipe.steps_total_ and progress.ts == min(rec.step_ts)
    assert progress.key == "j" and not takes_event(Stage.JOB, progress) and not takes_event(Stage.NODE, progress)
    assert takes_event(Stage.POLICY, progress)
    from fleethealth.schema import Telemetry
    out = conclude(pipe, None, [Telemetry.from_columns("n0000", "r00", T0 + 3600.0, [0])])
    assert [(e.kind, e.job) for e in out.progress] == [(EventKind.JOB_END, "j")]
    many = job_progress_events([("k", T0 + i) for i in range(MAX_STEP_TIMES + 5)])
    assert [len(e.data["step_ts"]) for e in many] == [MAX_STEP_TIMES, 5]


def test_the_same_goodput_and_page_whether_later_steps_come_with_the_stop_or_after_it() -> None:
    """600 steps at 2 s, a stop known at +1230 s whose restart is passed at +3000 s with 500 steps lost, then
    steps again: one stage gets every step with the stop, the other the stop first, the later steps after."""
    before = [("j", T0 + 2.0 * k) for k in range(600)]
    after = [("j", T0 + 3000.0 + 2.0 * k) for k in range(100)]
    stop = _stop(T0 + 1230.0, T0 + 3000.0, 500)
    together = PolicyStage()
    a = together.update([], [*job_progress_events(before), *job_progress_events(after), stop], T0 + 3200.0)
    apart = PolicyStage()
    b = apart.update([], [*job_progress_events(before), stop], stop.ts)  # the group of the stop's own time
    assert b.recommendations == [] and apart.pending_  # its record completes at +3000 s: it waits
    b.extend(apart.update([], job_progress_events(after), T0 + 3000.0))
    assert together.goodput_ == apart.goodput_ and together.goodput_["stop-1"] is not None
    assert together.goodput_["stop-1"] < 0.3
    pages = [(r.id, r.ts, r.reason) for r in a.recommendations]
    assert pages and pages == [(r.id, r.ts, r.reason) for r in b.recommendations]
    assert "goodput over the last hour" in pages[0][2]


def test_a_job_end_or_a_completed_exit_makes_the_engine_forget_the_job() -> None:
    stage = PolicyStage()
    ckpt = [checkpoint_event(ts=T0, step=50, uri="ckpt://a/50", last_verified_step=50, node="n0", job=job)
            for job in ("a", "b", "c")]
    stage.update([], [*ckpt, *job_progress_events([("a", T0), ("b", T0), ("c", T0)])], T0)
    assert set(stage.engine.checkpoints_) == {"a", "b", "c"} and set(stage.step_ends_) == {"a", "b", "c"}
    done = stage.update([], [job_end_event("a", T0 + 10.0),
                             job_exit_event(ts=T0 + 10.0, status="completed", last_step=50, node="n0", job="b"),
                             job_exit_event(ts=T0 + 10.0, status="failed", last_step=50, node="n0", job="c")],
                        T0 + 10.0)
    assert done.changed and set(stage.engine.checkpoints_) == {"c"} and set(stage.step_ends_) == {"c"}


def test_progress_delivered_twice_counts_each_step_once() -> None:
    before = [("j", T0 + 2.0 * k) for k in range(600)]
    stop = _stop(T0 + 1230.0, T0 + 1230.0, 100)
    once, twice = PolicyStage(), PolicyStage()
    once.update([], [*job_progress_events(before), stop], stop.ts)
    again = job_progress_events(before[:300]) + job_progress_events(before[300:])  # batched differently
    twice.update([], [*job_progress_events(before), *again, stop], stop.ts)
    assert once.goodput_ == twice.goodput_ and once.goodput_["stop-1"] is not None


def test_the_goodput_window_and_the_history_it_needs_are_configuration_keys() -> None:
    """The collapse rule's goodput window and the history a job needs are ``policy.paging`` keys: a shorter
    window gives another figure for the same stop, a longer required history gives none."""
    from fleethealth.commands._settings import schema
    from fleethealth.policy.paging import Pager

    keys = schema().keys
    assert keys["policy.paging.goodput_window_s"].default == 3600.0
    assert keys["policy.paging.goodput_min_window_s"].default == 600.0
    before = [("j", T0 + 2.0 * k) for k in range(600)]
    stop = _stop(T0 + 1230.0, T0 + 1230.0, 100)

    def figure(**pager: float) -> float | None:
        stage = PolicyStage(pager=Pager(**pager))
        stage.update([], [*job_progress_events(before), stop], stop.ts)
        return stage.goodput_["stop-1"]

    default, short = figure(), figure(goodput_window_s=300.0, goodput_min_window_s=300.0)
    assert default is not None and short is not None and short != default
    assert figure(goodput_min_window_s=1800.0) is None  # the job is 1,230 s old: too little history
    with pytest.raises(ConfigError, match="goodput_min_window_s"):
        Pager(goodput_window_s=300.0, goodput_min_window_s=600.0)
