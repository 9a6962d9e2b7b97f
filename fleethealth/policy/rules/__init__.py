"""The policy's rules: what each finding becomes, one module a family.

Each rule is a pure function ``rule(ctx, finding, now) -> list[Recommendation]`` over a
:class:`~fleethealth.policy.rules.context.RuleContext` (the engine's parameters, its memory
``ctx.state_``, an :class:`~fleethealth.policy.rules.context.EngineState`, and the guards every
node-removing action passes); :func:`decide` picks the rule of a finding's kind. The engine
(:mod:`fleethealth.policy.engine`) keeps the orchestration around them: idempotency and staleness,
the breaker's held removals, the inputs other than findings, persistence.

======================  ====================================================================
module                  findings
======================  ====================================================================
:mod:`.straggler`       ``straggler``: ``evict`` or ``alert_facilities``
:mod:`.sdc`             ``sdc``: ``quarantine`` (or ``page``) and ``rollback``
:mod:`.hang`            ``hang``: ``drain``, or ``page`` with no culprit
:mod:`.hardware`        ``xid``, ``ecc``: ``drain`` by severity, advice and the Xid rulebook
:mod:`.risk`            ``failure_risk``, ``link`` (NVLink rate): a planned ``drain``
:mod:`.context`         the memory dataclass, the guards' application, the breaker's page
======================  ====================================================================

Every other kind (``thermal``, ``power_brake``, a PCIe ``link``) is ``none``: reported, and acted on
through a straggler's diagnosis.
"""

from __future__ import annotations

from fleethealth.policy.rules.context import EngineState, RuleContext, rack_of
from fleethealth.policy.rules.hang import hang
from fleethealth.policy.rules.hardware import hardware_error
from fleethealth.policy.rules.risk import failure_risk, link_errors
from fleethealth.policy.rules.sdc import sdc
from fleethealth.policy.rules.straggler import straggler
from fleethealth.schema import Action, Finding, FindingKind, Recommendation

__all__ = ["decide", "EngineState", "RuleContext", "rack_of"]

_BY_KIND = {FindingKind.STRAGGLER: straggler, FindingKind.SDC: sdc, FindingKind.FAILURE_RISK: failure_risk,
            FindingKind.HANG: hang, FindingKind.XID: hardware_error, FindingKind.ECC: hardware_error}


def decide(ctx: RuleContext, f: Finding, now: float) -> list[Recommendation]:
    """The recommendations of the rule for ``f``'s kind (a finding already checked as new and fresh)."""
    rule = _BY_KIND.get(f.kind)
    if rule is not None:
        return rule(ctx, f, now)
    if f.kind is FindingKind.LINK and f.evidence.get("rule") == "nvlink":
        return link_errors(ctx, f, now)
    return [ctx.rec(Action.NONE, f, now, f"{f.kind.value} finding reported; a node is acted on "
                    "through a straggler's diagnosis, not this signal alone", {})]
