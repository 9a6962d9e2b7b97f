"""Hangs: drain the node named so the restart does not land on it; a hang with no culprit (every rank
level) pages, since no node is to blame."""

from __future__ import annotations

from fleethealth.policy.rules.context import RuleContext
from fleethealth.schema import Action, Finding, Guard, Recommendation

__all__ = ["hang"]


def hang(ctx: RuleContext, f: Finding, now: float) -> list[Recommendation]:
    """``drain`` of the node a hang names, or ``page`` when no rank is to blame."""
    ev = {"step": f.step}
    if f.evidence.get("culprit") is False:
        return [ctx.rec(Action.PAGE, f, now, f"job {f.job} hung at step {f.step} with every rank level "
                        "(a network or storage hang?): no rank to blame, so no node is drained; a human "
                        "must look", {**ev, "culprit": False})]
    if f.node in ctx.state_.drained:
        return [ctx.rec(Action.NONE, f, now, f"hang attributed to {f.node}: already draining", ev)]
    recs = ctx.guarded(Action.DRAIN, f, now, f"hang attributed to {f.node}: drain it so the restart "
                       "does not land on the same node", ev)
    if recs[0].guard is Guard.ALLOWED:
        ctx.state_.drained.add(f.node)
    return recs
