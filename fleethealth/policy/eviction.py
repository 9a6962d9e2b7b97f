"""Straggler eviction as a payback period, with P(healthy) learned from past evictions.

Seed 000 §7 and revision R2: evicting a straggler costs one planned restart R; it pays back when
the replacement is healthy, so

    payback_s = R / (P(healthy) × straggler cost)

with straggler cost the slowdown (0.2 = the job runs 20 % slow). A 20 % straggler and R = 600 s
pays back in 600 / 0.2 = 3,000 s ≈ 50 min when the replacement is surely healthy. P(healthy) is
the posterior mean of a Beta prior updated by recorded outcomes of past evictions of the same
diagnosis class (resolved / not resolved), so when evictions stop resolving stragglers P falls,
payback grows, and the engine stops evicting — from data it already records.

The outcome loop (:class:`EvictionWatch`, owned by the engine): an allowed straggler eviction is
remembered when the engine issues it; it is *executed* when the scheduler adapter's
``scheduler_action`` event (outcome ``done``) for that recommendation comes back on ``fh.events``;
from then on :func:`judge_eviction` reads the job's later straggler findings — a straggle of at
least ``recur_share`` of the evicted one within ``settle_s`` (the replacement, or the job, is slow
again) is *unresolved*, ``settle_s`` of event time without one is *resolved* — and the outcome moves
P(healthy) of its diagnosis class. An eviction never executed (guarded, dry-run, refused) teaches
nothing and is forgotten after ``max_wait_s``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleethealth.errors import ConfigError
from fleethealth.schema import Action, Diagnosis, Event, EventKind, Finding, FindingKind, Guard, Recommendation

__all__ = ["EvictionOutcome", "EvictionWatch", "HealthyPosterior", "Payback", "payback_s", "payback",
           "judge_eviction"]


@dataclass(frozen=True)
class EvictionOutcome:
    """What happened after one eviction: ``resolved`` is True when the job's straggle went away."""

    ts: float
    node: str
    job: str
    diagnosis: Diagnosis
    resolved: bool
    finding_id: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        """Which eviction this is the outcome of: one eviction has one outcome, however often it is judged."""
        return self.finding_id, self.node, self.job


class HealthyPosterior:
    """P(replacement is healthy) per diagnosis class: the Beta(α, β) posterior mean.

    Parameters: ``alpha``, ``beta`` — the prior pseudo-counts of resolved and unresolved evictions
    (default Beta(3, 1): mean 0.75, worth four evictions of evidence). State: ``resolved_`` and
    ``unresolved_`` counts per class. Higher is more confident that evicting helps.
    """

    def __init__(self, *, alpha: float = 3.0, beta: float = 1.0) -> None:
        for name, v in (("alpha", alpha), ("beta", beta)):
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive number, got {v!r}")
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.resolved_: dict[str, int] = {}
        self.unresolved_: dict[str, int] = {}

    def record(self, diagnosis: Diagnosis | str, resolved: bool) -> None:
        key = Diagnosis(diagnosis).value
        book = self.resolved_ if resolved else self.unresolved_
        book[key] = book.get(key, 0) + 1

    def record_all(self, outcomes: Iterable[EvictionOutcome]) -> None:
        for o in outcomes:
            self.record(o.diagnosis, o.resolved)

    def counts(self, diagnosis: Diagnosis | str) -> tuple[int, int]:
        key = Diagnosis(diagnosis).value
        return self.resolved_.get(key, 0), self.unresolved_.get(key, 0)

    def mean(self, diagnosis: Diagnosis | str) -> float:
        """Posterior mean (α + resolved) / (α + β + n), in (0, 1)."""
        s, f = self.counts(diagnosis)
        return (self.alpha + s) / (self.alpha + self.beta + s + f)

    def to_state(self) -> dict[str, Any]:
        return {"resolved": dict(self.resolved_), "unresolved": dict(self.unresolved_)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.resolved_ = {str(k): int(v) for k, v in state.get("resolved", {}).items()}
        self.unresolved_ = {str(k): int(v) for k, v in state.get("unresolved", {}).items()}


def payback_s(restart_s: float, p_healthy: float, slowdown: float) -> float:
    """R / (P(healthy) × slowdown) in seconds; infinite when nothing is expected back."""
    if not (math.isfinite(restart_s) and restart_s >= 0):
        raise ConfigError(f"restart_s must be finite and >= 0, got {restart_s!r}")
    benefit = p_healthy * slowdown
    if not math.isfinite(benefit) or benefit <= 0:
        return math.inf
    return restart_s / benefit


@dataclass(frozen=True)
class Payback:
    """The eviction arithmetic for one straggler: ``worth`` when ``payback_s`` is at most
    ``margin × remaining_s`` ("well under the run's remaining time")."""

    payback_s: float
    p_healthy: float
    slowdown: float
    restart_s: float
    remaining_s: float
    margin: float

    @property
    def worth(self) -> bool:
        return self.payback_s <= self.margin * self.remaining_s

    def to_evidence(self) -> dict[str, float | None]:
        return {"payback_s": None if math.isinf(self.payback_s) else round(self.payback_s, 3),
                "p_healthy": round(self.p_healthy, 6), "slowdown": self.slowdown,
                "restart_s": self.restart_s, "remaining_s": self.remaining_s, "payback_margin": self.margin}


def payback(restart_s: float, p_healthy: float, slowdown: float, remaining_s: float,
            margin: float) -> Payback:
    return Payback(payback_s=payback_s(restart_s, p_healthy, slowdown), p_healthy=p_healthy,
                   slowdown=slowdown, restart_s=restart_s, remaining_s=remaining_s, margin=margin)


def judge_eviction(rec: Recommendation, later: Sequence[Finding], now: float, *, settle_s: float = 1800.0,
                   recur_share: float = 0.5, since: float | None = None) -> EvictionOutcome | None:
    """Did an executed straggler eviction resolve the straggle? ``None`` while it is too early to say.

    Unresolved as soon as the job shows a straggler again within ``settle_s`` of the eviction whose
    slowdown is at least ``recur_share`` of the one evicted for (the replacement is slow too: a hot
    aisle, a shared NIC, a network path); resolved once ``settle_s`` passes without one. The window
    opens at ``since`` (when the eviction took effect; default the recommendation's time).
    """
    if rec.action is not Action.EVICT or "diagnosis" not in rec.evidence:
        raise ConfigError(f"not a straggler eviction: {rec.action.value} for {rec.node}")
    diagnosis = Diagnosis(rec.evidence["diagnosis"])
    start = rec.ts if since is None else float(since)
    before = rec.evidence.get("slowdown")
    floor = recur_share * before if isinstance(before, int | float) else 0.0
    for f in later:
        if f.kind is FindingKind.STRAGGLER and f.job == rec.job and start < f.ts <= start + settle_s \
                and (f.slowdown or 0.0) >= floor:
            return EvictionOutcome(ts=f.ts, node=rec.node, job=rec.job or "", diagnosis=diagnosis, resolved=False,
                                   finding_id=rec.finding_id or "")
    if now - start < settle_s:
        return None
    return EvictionOutcome(ts=start + settle_s, node=rec.node, job=rec.job or "", diagnosis=diagnosis,
                           resolved=True, finding_id=rec.finding_id or "")


class EvictionWatch:
    """Straggler evictions on their way to an outcome (see the module docstring).

    Parameters: ``settle_s`` and ``recur_share`` of :func:`judge_eviction`; ``max_wait_s`` how long
    an issued eviction waits for its execution report. State: ``issued_`` (recommendation id →
    recommendation) and ``executed_`` (recommendation id → (recommendation, event time it took effect)).
    """

    def __init__(self, *, settle_s: float = 1800.0, recur_share: float = 0.5, max_wait_s: float = 1800.0) -> None:
        for name, v in (("settle_s", settle_s), ("recur_share", recur_share), ("max_wait_s", max_wait_s)):
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} must be a positive number, got {v!r}")
        self.settle_s = float(settle_s)
        self.recur_share = float(recur_share)
        self.max_wait_s = float(max_wait_s)
        self.issued_: dict[str, Recommendation] = {}
        self.executed_: dict[str, tuple[Recommendation, float]] = {}

    def issue(self, rec: Recommendation) -> None:
        """Remember an allowed, executable straggler eviction until its execution is reported."""
        if rec.action is Action.EVICT and rec.guard is Guard.ALLOWED and not rec.dry_run \
                and "diagnosis" in rec.evidence:
            self.issued_[rec.id] = rec

    def observe(self, events: Sequence[Event]) -> int:
        """Read scheduler-action reports; returns how many issued evictions were executed."""
        noted = 0
        for ev in events:
            if ev.kind is not EventKind.SCHEDULER_ACTION or ev.data.get("outcome") != "done" \
                    or ev.data.get("action") != Action.EVICT.value:
                continue
            rec = self.issued_.pop(str(ev.data.get("recommendation_id", "")), None)
            if rec is not None:
                self.executed_[rec.id] = (rec, max(rec.ts, ev.ts))
                noted += 1
        return noted

    def judge(self, findings: Sequence[Finding], now: float) -> list[EvictionOutcome]:
        """Outcomes decided by ``findings`` (the ones new since the last call) or by time passing."""
        out = []
        for rid, (rec, since) in list(self.executed_.items()):
            outcome = judge_eviction(rec, findings, now, settle_s=self.settle_s, recur_share=self.recur_share,
                                     since=since)
            if outcome is not None:
                del self.executed_[rid]
                out.append(outcome)
        self.issued_ = {k: r for k, r in self.issued_.items() if now - r.ts <= self.max_wait_s}
        return out

    def settled(self, keys: set[tuple[str, str, str]]) -> None:
        """Drop evictions whose outcome is already recorded (a replay after a restart judges each once)."""
        self.executed_ = {k: v for k, v in self.executed_.items()
                          if (v[0].finding_id or "", v[0].node, v[0].job or "") not in keys}

    def to_state(self) -> dict[str, Any]:
        return {"issued": [r.to_obj() for r in self.issued_.values()],
                "executed": [[r.to_obj(), since] for r, since in self.executed_.values()]}

    def load_state(self, state: Mapping[str, Any]) -> None:
        issued = [Recommendation.from_obj(dict(o)) for o in state.get("issued", ())]
        executed = [(Recommendation.from_obj(dict(o)), float(since)) for o, since in state.get("executed", ())]
        self.issued_ = {r.id: r for r in issued}
        self.executed_ = {r.id: (r, since) for r, since in executed}
