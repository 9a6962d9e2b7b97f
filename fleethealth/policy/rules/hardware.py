"""Xid and ECC errors: ``drain`` for critical severity, a catalogue advice of ``drain`` (the finding's
``evidence["action"]``; without one, the Xid rulebook :mod:`fleethealth.xid` for the code), and
uncorrectable errors or a failed row remap; else ``none``, reported."""

from __future__ import annotations

from fleethealth.evidence import EccEvidence, XidEvidence
from fleethealth.policy.rules.context import FATAL, MILD, RuleContext
from fleethealth.schema import Action, Finding, FindingKind, Guard, Recommendation
from fleethealth.xid import lookup as xid_lookup

__all__ = ["hardware_error"]


def hardware_error(ctx: RuleContext, f: Finding, now: float) -> list[Recommendation]:
    """An Xid or ECC finding: ``drain`` for a node fault by severity or advice, else ``none``."""
    code: int | None = None
    if f.kind is FindingKind.XID:
        xid = XidEvidence.from_evidence(f.evidence)
        sev, code, advised = xid.severity, xid.code, xid.action  # advised: the detector's catalog advice
        if advised in (Action.DRAIN, Action.NONE) and sev not in FATAL:
            fatal = advised is Action.DRAIN
        else:  # no advice given: the same rulebook the detector reads (fleethealth.xid)
            fatal = sev in FATAL or (sev not in MILD and code is not None and xid_lookup(code).drains)
        what = f"Xid {code}" + (f" ({sev})" if sev else "")
    else:
        ecc = EccEvidence.from_evidence(f.evidence)
        sev = ecc.severity
        fatal = sev in FATAL or (sev not in MILD and ecc.uncorrectable_seen) or ecc.remap_failure
        what = "ECC " + (sev or ("uncorrectable" if fatal else "correctable")) + " errors"
    ev = {"code": code, "severity": sev or None}
    if not fatal:
        return [ctx.rec(Action.NONE, f, now, f"{what} on {f.node}: not a node fault by severity; reported",
                        ev)]
    if f.node in ctx.state_.drained:
        return [ctx.rec(Action.NONE, f, now, f"{what} on {f.node}: already draining", ev)]
    recs = ctx.guarded(Action.DRAIN, f, now, f"{what} on {f.node} (GPU {f.gpu}): drain the node", ev)
    if recs[0].guard is Guard.ALLOWED:
        ctx.state_.drained.add(f.node)
    return recs
