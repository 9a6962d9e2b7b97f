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
  rule reads) → the :class:`~fleethealth.policy.paging.Pager` (seed 000 R5): a page when a pattern
  is found, a counted report otherwise.

Step times come from detection as ``steps`` — (job, event time) of each step it assembled, in
order — and ``ended``, the jobs it forgot as idle, so both stages agree on which jobs exist.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fleethealth.errors import SchemaError
from fleethealth.policy.engine import PolicyEngine
from fleethealth.policy.eviction import EvictionOutcome
from fleethealth.policy.goodput import Interruption, ideal_step_time, window_goodput
from fleethealth.policy.paging import Pager, PageReport
from fleethealth.schema import Event, EventKind, Finding, Recommendation

__all__ = ["PolicyStage", "Decisions", "GOODPUT_WINDOW_S", "GOODPUT_MIN_WINDOW_S"]

GOODPUT_WINDOW_S = 3600.0
"""Goodput for the pager's collapse rule is measured over the last hour (seed 000 R5)."""
GOODPUT_MIN_WINDOW_S = 600.0
"""A job younger than this has too little history for a goodput figure."""


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
    from the store); ``pager`` to a :class:`Pager`. State: ``interruptions_`` (the stop's
    ``data.interruption_id`` when the detectors derived it, else the event id → record, within
    the pager's windows), ``step_ends_`` (job → event times of its steps in the last hour) and
    ``job_first_`` (job → its first step's time).
    """

    def __init__(self, engine: PolicyEngine | None = None, *, pager: Pager | None = None) -> None:
        self.engine = engine if engine is not None else PolicyEngine()
        self.pager = pager if pager is not None else Pager()
        self.interruptions_: dict[str, Interruption] = {}
        self.step_ends_: dict[str, deque[float]] = {}
        self.job_first_: dict[str, float] = {}

    def update(self, findings: Sequence[Finding], events: Sequence[Event], now: float, *,
               steps: Sequence[tuple[str, float]] = (), ended: Sequence[str] = ()) -> Decisions:
        """Decide on ``findings`` concluded at event time ``now``; ``events`` are the same batch's job events.
        Findings are decided in the order of their time and id, so a runner of the whole tier and a
        policy stage that reads them from ``fh.findings`` (in another order) decide alike."""
        findings = sorted(findings, key=lambda f: (f.ts, f.id))
        self._progress(steps, ended)
        out = Decisions()
        noted = self.engine.observe(events)
        out.outcomes += self.engine.judge(findings, now)
        if findings:
            out.recommendations += self.engine.decide(findings, now)
        out.changed = bool(findings or out.outcomes or noted)
        fresh: set[str] = set()
        at = now  # an interruption record is itself evidence that its job's time has reached it
        for ev in events:
            if ev.kind is not EventKind.INTERRUPTION:
                continue
            key = _stop_id(ev)
            if key not in self.interruptions_:
                try:
                    self.interruptions_[key] = Interruption.from_event(ev)
                except SchemaError:
                    continue  # an interruption record without a job cannot be attributed; it is stored anyway
                fresh.add(ev.job or "")
                at = max(at, ev.ts)
        if fresh:
            horizon = at - self.pager.recent_s - self.pager.rate_window_s
            self.interruptions_ = {k: i for k, i in self.interruptions_.items() if i.ts >= horizon}
            report = self.pager.evaluate(self.interruptions_.values(), at, goodput_1h=self._worst_goodput(fresh, at))
            out.reports.append(report)
            out.recommendations += report.to_recommendations(at)
        return out

    def _progress(self, steps: Sequence[tuple[str, float]], ended: Sequence[str]) -> None:
        for job, ts in steps:
            ends = self.step_ends_.setdefault(job, deque())
            ends.append(ts)
            while ends and ends[0] < ts - GOODPUT_WINDOW_S:
                ends.popleft()
            self.job_first_.setdefault(job, ts)
        for job in ended:
            self.step_ends_.pop(job, None)
            self.job_first_.pop(job, None)
            self.engine.forget_job(job)

    def _worst_goodput(self, jobs: set[str], now: float) -> float | None:
        """The lowest goodput over the last hour (or the job's life, from 10 minutes on) among ``jobs``."""
        values = []
        for job in jobs:
            ends = self.step_ends_.get(job)
            if not ends or len(ends) < 3:
                continue
            window = min(GOODPUT_WINDOW_S, now - self.job_first_[job])
            if window < GOODPUT_MIN_WINDOW_S:
                continue
            ts = np.fromiter(ends, dtype=np.float64, count=len(ends))
            gaps = np.diff(ts)
            gaps = gaps[gaps > 0]  # steps reported at one instant (a replay) carry no duration
            if gaps.size:
                mine = [i for i in self.interruptions_.values() if i.job == job]
                values.append(window_goodput(ts, ideal_step_time(gaps), mine, now, window))
        return min(values, default=None)


def _stop_id(ev: Event) -> str:
    """What names one stop: the derived record's ``interruption_id`` (the same stop derived twice, with more
    or less known, is one interruption), else the event's own id."""
    sid = ev.data.get("interruption_id")
    return sid if isinstance(sid, str) and sid else ev.id
