"""Straggler eviction as a payback period, with P(healthy) learned from past evictions.

Seed 000 §7 and revision R2: evicting a straggler costs one planned restart R; it pays back when
the replacement is healthy, so

    payback_s = R / (P(healthy) × straggler cost)

with straggler cost the slowdown (0.2 = the job runs 20 % slow). A 20 % straggler and R = 600 s
pays back in 600 / 0.2 = 3,000 s ≈ 50 min when the replacement is surely healthy. P(healthy) is
the posterior mean of a Beta prior updated by recorded outcomes of past evictions of the same
diagnosis class (resolved / not resolved), so when evictions stop resolving stragglers P falls,
payback grows, and the engine stops evicting — from data it already records.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleethealth.errors import ConfigError
from fleethealth.schema import Action, Diagnosis, Finding, FindingKind, Recommendation

__all__ = ["EvictionOutcome", "HealthyPosterior", "Payback", "payback_s", "payback", "judge_eviction"]


@dataclass(frozen=True)
class EvictionOutcome:
    """What happened after one eviction: ``resolved`` is True when the job's straggle went away."""

    ts: float
    node: str
    job: str
    diagnosis: Diagnosis
    resolved: bool
    finding_id: str = ""


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
                   recur_share: float = 0.5) -> EvictionOutcome | None:
    """Did an executed straggler eviction resolve the straggle? ``None`` while it is too early to say.

    Unresolved as soon as the job shows a straggler again within ``settle_s`` of the eviction whose
    slowdown is at least ``recur_share`` of the one evicted for (the replacement is slow too: a hot
    aisle, a shared NIC, a network path); resolved once ``settle_s`` passes without one.
    """
    if rec.action is not Action.EVICT or "diagnosis" not in rec.evidence:
        raise ConfigError(f"not a straggler eviction: {rec.action.value} for {rec.node}")
    diagnosis = Diagnosis(rec.evidence["diagnosis"])
    before = rec.evidence.get("slowdown")
    floor = recur_share * before if isinstance(before, int | float) else 0.0
    for f in later:
        if f.kind is FindingKind.STRAGGLER and f.job == rec.job and rec.ts < f.ts <= rec.ts + settle_s \
                and (f.slowdown or 0.0) >= floor:
            return EvictionOutcome(ts=f.ts, node=rec.node, job=rec.job or "", diagnosis=diagnosis, resolved=False,
                                   finding_id=rec.finding_id or "")
    if now - rec.ts < settle_s:
        return None
    return EvictionOutcome(ts=rec.ts + settle_s, node=rec.node, job=rec.job or "", diagnosis=diagnosis,
                           resolved=True, finding_id=rec.finding_id or "")
