"""The policy stage: findings in, recommendations, pages and eviction outcomes out.

The detector runner composes two stages: detection (``fleethealth.detectors.pipeline``, which
returns findings) and this one. :class:`PolicyStage` is pure like the engine it wraps — no I/O, no
clock; ``now`` is the event time detection concluded at — and holds what the policy needs beyond
the findings:

* the job events (checkpoints and passing SDC checks for rollback targets, the scheduler's
  reports of executed evictions) → :meth:`PolicyEngine.observe`;
* executed evictions judged against the new findings → :class:`~fleethealth.policy.eviction.EvictionOutcome`
  (they move P(healthy) before this update's decisions; the runner records them);
* the findings → :meth:`PolicyEngine.decide`;
* interruption records, and each job's step times over the last hour (the goodput the collapse
  rule reads; ``policy.paging.goodput_window_s``) → the :class:`~fleethealth.policy.paging.Pager`
  (seed 000 R5): a page when a pattern is found, a counted report otherwise.

Step times and job ends come from detection as events (:mod:`fleethealth.payloads.progress`): a
``job_progress`` carries the event times of the steps of a job it assembled, a ``job_end`` says it
forgot the job as idle. The job stage publishes them on ``fh.events`` and the staged policy reads them
there; a runner of the whole tier hands the same events over in process, so both forms compute the
same goodput and forget the same jobs. A job's end — its ``job_end``, or its own ``job_exit``
``completed`` — makes the engine forget it (:meth:`PolicyEngine.forget_job`). The older ``steps`` /
``ended`` arguments of :meth:`PolicyStage.update` still work.

Each interruption is evaluated by the pager once the stage's clock reaches the time its record was
complete (the newest of its known, diagnosed, restart and passed times, so the downtime it cost is in
the window), with its job's goodput over the hour (the goodput window) before from the steps at or before that time: the
same figure and pages whether the steps after it arrived in the same batch (the whole tier) or later
(a policy stage reading in event-time order). :meth:`PolicyStage.flush` evaluates what still waits at
the end of input.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from fleethealth.errors import SchemaError
from fleethealth.payloads.job import ExitStatus
from fleethealth.payloads.progress import JobProgress
from fleethealth.policy.engine import PolicyEngine
from fleethealth.policy.eviction import EvictionOutcome
from fleethealth.policy.goodput import Interruption, ideal_step_time, window_goodput
from fleethealth.policy.paging import GOODPUT_MIN_WINDOW_S, GOODPUT_WINDOW_S, Pager, PageReport
from fleethealth.schema import Event, EventKind, Finding, Recommendation

__all__ = ["PolicyStage", "Decisions", "GOODPUT_WINDOW_S", "GOODPUT_MIN_WINDOW_S"]



@dataclass
class Decisions:
    """What one :meth:`PolicyStage.update` decided. ``recommendations`` include the pages;
    ``reports`` are the pager's evaluations (one per batch with fresh interruptions);
    ``outcomes`` are eviction outcomes judged now, to be recorded; ``changed`` says the engine's
    memory moved (findings decided, outcomes judged or evictions reported executed), so it is saved."""

    recommendations: list[Recommendation] = field(default_factory=list)
    outcomes: list[EvictionOutcome] = field(default_factory=list)
    reports: list[PageReport] = field(default_factory=list)
    changed: bool = False

    def extend(self, other: Decisions) -> None:
        self.recommendations += other.recommendations
        self.outcomes += other.outcomes
        self.reports += other.reports
        self.changed = self.changed or other.changed


class PolicyStage:
    """The policy engine, the pager and the goodput they read, behind one ``update``.

    ``engine`` defaults to a :class:`PolicyEngine` with its defaults (a runner passes one loaded
    from the store); ``pager`` to a :class:`Pager`; ``book`` asks the quarantine book which of some
    nodes it no longer holds (a runner passes one reading its store; none: the engine's memory stands).
    State: ``interruptions_`` (the stop's
    ``data.interruption_id`` when the detectors derived it, else the event id → record, within
    the pager's windows), ``step_ends_`` (job → event times of its steps in the last two goodput windows),
    ``job_first_`` (job → its first step's time) and ``goodput_`` (stop → the goodput figure of its
    job the pager read when it was evaluated; None without one).
    """

    def __init__(self, engine: PolicyEngine | None = None, *, pager: Pager | None = None,
                 book: Callable[[set[str]], set[str]] | None = None) -> None:
        self.engine = engine if engine is not None else PolicyEngine()
        self.pager = pager if pager is not None else Pager()
        self.book = book
        self.unbooked_: set[str] = set()  # nodes the engine took out since its runner last wrote the book
        self.interruptions_: dict[str, Interruption] = {}
        self.step_ends_: dict[str, deque[float]] = {}
        self.job_first_: dict[str, float] = {}
        self.goodput_: dict[str, float | None] = {}
        self.pending_: list[tuple[float, str, str]] = []  # (time to evaluate at, stop id, job), not evaluated yet
        self.clock_ = float("-inf")

    def update(self, findings: Sequence[Finding], events: Sequence[Event], now: float, *,
               steps: Sequence[tuple[str, float]] = (), ended: Sequence[str] = ()) -> Decisions:
        """Decide on ``findings`` concluded at event time ``now``; ``events`` are the same batch's job events.
        Findings are decided in the order of their time and id, so a runner of the whole tier and a
        policy stage that reads them from ``fh.findings`` (in another order) decide alike."""
        findings = sorted(findings, key=lambda f: (f.ts, f.id))
        self._progress(steps, ())
        self._progress([(p.job, ts) for ev in events if ev.kind is EventKind.JOB_PROGRESS
                        for p in _progress(ev) for ts in p.step_ts], ())
        out = Decisions()
        noted = self.engine.observe(events)
        out.outcomes += self.engine.judge(findings, now)
        released = self.engine.breaker_closed_  # a reset breaker's held removals are due, findings or not
        if findings or released:
            self._reconcile(findings)
            held = self.engine.quarantined_ | self.engine.drained_
            out.recommendations += self.engine.decide(findings, now)
            self.unbooked_ |= (self.engine.quarantined_ | self.engine.drained_) - held
        out.changed = bool(findings or out.outcomes or noted or released)
        for ev in events:
            if ev.kind is not EventKind.INTERRUPTION:
                continue
            key = _stop_id(ev)
            if key not in self.interruptions_:
                try:
                    self.interruptions_[key] = Interruption.from_event(ev)
                except SchemaError:
                    continue  # an interruption record without a job cannot be attributed; it is stored anyway
                self.pending_.append((_settled(ev), key, ev.job or ""))
        # an interruption record is itself evidence that its job's time has reached it
        self.clock_ = max(self.clock_, float(now),
                          *(ev.ts for ev in events if ev.kind is EventKind.INTERRUPTION))
        gone = [*ended, *(ev.job for ev in events if ev.job and (
            ev.kind is EventKind.JOB_END
            or (ev.kind is EventKind.JOB_EXIT and ev.data.get("status") == ExitStatus.COMPLETED.value)))]
        out.extend(self._evaluate(set(gone)))
        if gone:  # after their stops were evaluated, so a job's last stop still had its goodput figure
            self._progress((), gone)
            out.changed = True
        return out

    def _reconcile(self, findings: Sequence[Finding]) -> None:
        """Before deciding on nodes the engine remembers as quarantined or drained, ask the quarantine book
        (``book``: nodes -> those it no longer holds) and forget the ones released since (through the API
        or a sweep), so a new fault on them is decided afresh. Without a book, the engine's memory stands."""
        held = {f.node for f in findings} & (self.engine.quarantined_ | self.engine.drained_) - self.unbooked_
        if held and self.book is not None:
            for node in sorted(self.book(held)):
                self.engine.release(node)

    def flush(self) -> Decisions:
        """End of input: evaluate every stop still waiting for the clock to reach its time."""
        return self._evaluate(set(), everything=True)

    def _evaluate(self, ending: set[str], *, everything: bool = False) -> Decisions:
        """Evaluate the waiting stops whose time the clock has reached (or of ``ending`` jobs, or all), each
        at its own time in (time, id) order with its own job's goodput from the steps at or before it:
        the same evaluations whether the stops and steps arrive together (the whole tier) or apart, in
        event-time order (a policy stage)."""
        out = Decisions()
        due = sorted(p for p in self.pending_ if everything or p[0] <= self.clock_ or p[2] in ending)
        if not due:
            return out
        self.pending_ = [p for p in self.pending_ if p not in due]
        for at, key, job in due:
            figure = self._goodput(job, at)
            self.goodput_[key] = figure
            report = self.pager.evaluate(self.interruptions_.values(), at, goodput_1h=figure)
            out.reports.append(report)
            out.recommendations += report.to_recommendations(at)
        waiting = {k for _, k, _ in self.pending_}
        horizon = max(at for at, _, _ in due) - self.pager.recent_s - self.pager.rate_window_s
        self.interruptions_ = {k: i for k, i in self.interruptions_.items() if i.ts >= horizon or k in waiting}
        self.goodput_ = {k: g for k, g in self.goodput_.items() if k in self.interruptions_}
        return out

    def _progress(self, steps: Sequence[tuple[str, float]], ended: Sequence[str]) -> None:
        for job, ts in steps:
            ends = self.step_ends_.setdefault(job, deque())
            ends.append(ts)
            while ends and ends[0] < ts - 2 * self.pager.goodput_window_s:  # (a stop's window ends before now)
                ends.popleft()
            self.job_first_[job] = min(self.job_first_.get(job, ts), ts)
        for job in ended:
            self.step_ends_.pop(job, None)
            self.job_first_.pop(job, None)
            self.engine.forget_job(job)

    def _goodput(self, job: str, now: float) -> float | None:
        """``job``'s goodput over the pager's ``goodput_window_s`` (or its life, from ``goodput_min_window_s``
        on) up to event time ``now``, from its steps at or before ``now``; None without enough of them."""
        ends = self.step_ends_.get(job)
        if not ends:
            return None
        # each step's time once: a job_progress republished after a crash, or derived again by a replay
        # that batched the steps differently, repeats step times and must not count them twice
        ts = np.unique(np.fromiter(ends, dtype=np.float64, count=len(ends)))
        span = self.pager.goodput_window_s
        ts = ts[(ts <= now) & (ts > now - span)]  # the steps known by the stop's time
        window = min(span, now - self.job_first_[job])
        if ts.size < 3 or window < self.pager.goodput_min_window_s:
            return None
        gaps = np.diff(ts)
        gaps = gaps[gaps > 0]  # steps reported at one instant (a replay) carry no duration
        if not gaps.size:
            return None
        mine = [i for i in self.interruptions_.values() if i.job == job]
        return window_goodput(ts, ideal_step_time(gaps), mine, now, window)


def _settled(ev: Event) -> float:
    """When a stop's record was complete — the newest of its known, diagnosed, restart and passed times —
    the time its pages and its job's goodput are evaluated at (the downtime it cost is in that window)."""
    times = [ev.ts] + [v for k in ("diagnosed_ts", "restart_ts", "passed_ts")
                       if isinstance(v := ev.data.get(k), int | float) and not isinstance(v, bool) and math.isfinite(v)]
    return float(max(times))


def _stop_id(ev: Event) -> str:
    """What names one stop: the derived record's ``interruption_id`` (the same stop derived twice, with more
    or less known, is one interruption), else the event's own id."""
    sid = ev.data.get("interruption_id")
    return sid if isinstance(sid, str) and sid else ev.id


def _progress(ev: Event) -> list[JobProgress]:
    """The typed view of a ``job_progress`` event, or nothing for a malformed one (it is not stored)."""
    try:
        return [JobProgress.from_event(ev)]
    except SchemaError:
        return []
