"""``JobLife``: one ``job_start`` and one ``job_exit`` per run, from rank 0 only, with the right status."""

from __future__ import annotations

import pytest

from fleethealth.injob.lifecycle import JobLife
from fleethealth.injob.reporter import Reporter
from fleethealth.payloads.job import ExitStatus, JobExit, JobStart
from fleethealth.schema import Event, EventKind


def _life(rank: int = 0) -> tuple[list[Event], JobLife]:
    seen: list[Event] = []
    reporter = Reporter(job="j", rank=rank, gpu=0, sink=seen.append, clock=lambda: 5.0)
    return seen, JobLife(reporter, world=4, first_step=0)


def test_a_completed_run_reports_start_and_exit_with_the_last_step() -> None:
    seen, life = _life()
    with life:
        for step in range(3):
            life.step = step
    assert [e.kind for e in seen] == [EventKind.JOB_START, EventKind.JOB_EXIT]
    assert JobStart.from_event(seen[0]).world == 4 and seen[0].job == "j" and seen[0].rank == 0
    assert JobExit.from_event(seen[1]) == JobExit(ExitStatus.COMPLETED, 2, "")


def test_a_halted_run_says_why_and_a_failed_one_re_raises() -> None:
    seen, life = _life()
    with life:
        life.step = 7
        life.halt("an SDC check failed at step 7")
    assert JobExit.from_event(seen[-1]) == JobExit(ExitStatus.HALTED, 7, "an SDC check failed at step 7")
    seen, life = _life()
    with pytest.raises(RuntimeError), life:
        life.step = 1
        raise RuntimeError("boom")
    assert JobExit.from_event(seen[-1]) == JobExit(ExitStatus.FAILED, 1, "RuntimeError: boom")


def test_other_ranks_stay_quiet() -> None:
    seen, life = _life(rank=3)
    with life:
        life.step = 0
    assert seen == []
