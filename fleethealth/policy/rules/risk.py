"""Failure risks: a node likely to fail is drained at the job's next checkpoint boundary, a planned
restart instead of an interruption.

A ``failure_risk`` finding at or above ``failure_risk_threshold``; NVLink errors climbing at a
critical rate (a ``link`` finding of rule ``nvlink``), slow or not — a warning rate is ``none``,
reported and watched; a node whose eviction is held is not drained for its links inside the window.
"""

from __future__ import annotations

from typing import Any

from fleethealth.policy.rules.context import FATAL, RuleContext
from fleethealth.schema import Action, Finding, Guard, Recommendation

__all__ = ["failure_risk", "link_errors", "planned_drain"]


def failure_risk(ctx: RuleContext, f: Finding, now: float) -> list[Recommendation]:
    """``drain`` at the next checkpoint boundary when the probability reaches the threshold."""
    p = f.probability
    ev: dict[str, Any] = {"probability": p, "threshold": ctx.failure_risk_threshold}
    if p is None or p < ctx.failure_risk_threshold:
        return [ctx.rec(Action.NONE, f, now, f"failure risk {p} on {f.node} below the "
                        f"{ctx.failure_risk_threshold} threshold", ev)]
    if f.node in ctx.state_.drained:
        return [ctx.rec(Action.NONE, f, now, f"{f.node} already draining", ev)]
    return planned_drain(ctx, f, now, f"failure risk {p:.2f} on {f.node} (GPU {f.gpu})", ev)


def planned_drain(ctx: RuleContext, f: Finding, now: float, what: str, ev: dict[str, Any]) -> list[Recommendation]:
    """Drain ``f.node`` at the job's next checkpoint boundary: a planned restart instead of an interruption."""
    at = ctx.next_boundary(f.job)
    ev["at_step"] = at
    where = f"step {at}" if at is not None else "the next checkpoint"
    recs = ctx.guarded(Action.DRAIN, f, now, f"{what}: drain at the next checkpoint boundary ({where}), a "
                       "planned restart instead of an interruption", {**ev, "planned": True})
    if recs[0].guard is Guard.ALLOWED:
        ctx.state_.drained.add(f.node)
    return recs


def link_errors(ctx: RuleContext, f: Finding, now: float) -> list[Recommendation]:
    """NVLink error counters climbing steadily: a failure risk of its own (seed 000 §9.6), slow or not."""
    rate = f.evidence.get("errors_per_min")
    severity = f.evidence.get("severity")
    ev: dict[str, Any] = {"errors_per_min": rate, "rule": "nvlink", "severity": severity}
    if severity not in FATAL:
        return [ctx.rec(Action.NONE, f, now, f"NVLink errors climbing at {rate}/min on {f.node}: reported and "
                        "watched; a critical rate drains the node as a failure risk, a slow rank through "
                        "its straggler's NODE_LINK diagnosis", ev)]
    if f.node in ctx.state_.drained:
        return [ctx.rec(Action.NONE, f, now, f"{f.node} already draining", ev)]
    held = ctx.state_.held.get(f.node)
    if held is not None and f.ts - held[0] < ctx.state_.rate.window_s:
        # a drain restarts the job the node runs just as the held eviction would: the same hold applies
        return [ctx.rec(Action.NONE, f, now, f"NVLink errors climbing at {rate}/min on {f.node}: its eviction "
                        f"was recommended at ts={held[0]:.0f} and held ({held[1]}); one recommendation per "
                        "node", {**ev, "held_ts": held[0]})]
    return planned_drain(ctx, f, now, f"NVLink errors climbing at {rate}/min on {f.node} (GPU {f.gpu}): "
                         "a failure risk", ev)
