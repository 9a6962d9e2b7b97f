"""``job_progress`` and ``job_end``: what the job stage tells the policy stage about a job's steps.

The policy's goodput (the pager's collapse rule) needs each job's step completion times, and its
per-job memory (checkpoints, verification marks, rollbacks) needs to know when a job is gone. Both
forms of the detector tier pass them as these events: the job stage publishes them on ``fh.events``
(keyed by job) and the policy stage reads them there; a runner of the whole tier hands the same
events to its policy in process (:func:`fleethealth.detectors.runner.conclude`). Neither is stored:
the steps themselves are, in ``rank_steps``.

``job_progress`` ``Event.data``: ``step_ts`` (the event times of the steps of the job the detectors
assembled, in the order they were assembled; at most :data:`MAX_STEP_TIMES` an event). The event's
``ts`` is the earliest of them, so a reader in event-time order has every step before an
interruption's time before it reads the interruption; ``step`` is how many steps it carries.

``job_end`` ``Event.data``: ``why`` (``idle``: no step for ``detect.pipeline.job_idle_s`` of event
time). Its ``ts`` is the detectors' event time when they forgot the job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fleethealth.errors import SchemaError
from fleethealth.schema import Event, EventKind

__all__ = ["JobProgress", "MAX_STEP_TIMES", "DERIVED_NODE", "job_progress_events", "job_end_event", "job_end_events"]

MAX_STEP_TIMES = 4096
"""Step times in one ``job_progress`` event (about 80 KiB of JSON), far below the 512 KiB message bound."""

DERIVED_NODE = "fleethealth-detect"
"""The ``node`` of events about a job as a whole that the detectors derive (no one node sent them)."""


@dataclass(frozen=True)
class JobProgress:
    """The typed view of a ``job_progress`` event: ``job`` and ``step_ts``, shape ``(n,)``."""

    job: str
    step_ts: tuple[float, ...]

    @classmethod
    def from_event(cls, event: Event) -> JobProgress:
        if event.kind is not EventKind.JOB_PROGRESS or not event.job:
            raise SchemaError("kind", f"expected a job_progress event of a job, got {event.kind.value}")
        values = event.data.get("step_ts")
        if (not isinstance(values, list) or len(values) > MAX_STEP_TIMES
                or not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                           for v in values)):
            raise SchemaError("step_ts", f"expected at most {MAX_STEP_TIMES} finite event times")
        return cls(job=event.job, step_ts=tuple(float(v) for v in values))


def job_progress_events(steps: Sequence[tuple[str, float]]) -> list[Event]:
    """``job_progress`` events for ``steps`` — ``(job, event time)`` of each step assembled, in order —
    one per job (and per :data:`MAX_STEP_TIMES` steps), in the order of each job's first step."""
    by_job: dict[str, list[float]] = {}
    for job, ts in steps:
        by_job.setdefault(job, []).append(float(ts))
    out = []
    for job, times in by_job.items():
        for i in range(0, len(times), MAX_STEP_TIMES):
            part = times[i:i + MAX_STEP_TIMES]
            out.append(Event(node=DERIVED_NODE, ts=min(part), kind=EventKind.JOB_PROGRESS, job=job, step=len(part),
                             message=f"{len(part)} step(s) of job {job} assembled", data={"step_ts": part}))
    return out


def job_end_event(job: str, ts: float, why: str = "idle") -> Event:
    """A ``job_end`` event: the detectors forgot ``job`` at event time ``ts``."""
    return Event(node=DERIVED_NODE, ts=float(ts), kind=EventKind.JOB_END, job=job,
                 message=f"job {job} ended for the detectors ({why})", data={"why": why})


def job_end_events(jobs: Iterable[str], ts: float) -> list[Event]:
    """:func:`job_end_event` of each of ``jobs`` (forgotten as idle) at event time ``ts``."""
    return [job_end_event(job, ts) for job in jobs]
