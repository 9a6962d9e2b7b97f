"""The Xid rulebook: the named codes carry the meaning and advice of NVIDIA's catalog, and every
code the policy acts on, or the health rules report, resolves through this one catalog."""

from __future__ import annotations

import pytest

from fleethealth.detectors.health import HealthRules
from fleethealth.policy.engine import PolicyEngine
from fleethealth.schema import Action, Event, EventKind, Finding, FindingKind
from fleethealth.xid import APPLICATION_CODES, DRAIN_CODES, XID_CATALOG, XidSeverity, lookup

T0 = 1_767_225_600.0


def test_catalog_covers_the_named_codes_with_severity_and_action():
    for code in (13, 31, 43, 48, 63, 64, 74, 79, 92, 94, 95, 119, 120):
        info = XID_CATALOG[code]
        assert info.code == code and info.name and info.remedy
    for code in (48, 64, 74, 79, 95, 119, 120):
        assert lookup(code).severity is XidSeverity.CRITICAL and lookup(code).action is Action.DRAIN
    assert lookup(63).severity is XidSeverity.WARNING and lookup(63).action is Action.NONE
    unknown = lookup(9999)
    assert unknown.action is Action.PAGE and unknown.severity is XidSeverity.WARNING


def test_the_memory_codes_are_not_confused():
    # 92: a high rate of *corrected* errors is a warning and a trend, never a drain
    assert lookup(92).severity is XidSeverity.WARNING and not lookup(92).drains
    # 94: contained uncorrectable error: hardware, but only the application was hit
    assert lookup(94).hardware and lookup(94).severity is XidSeverity.ERROR and not lookup(94).drains
    # 95: uncontained: every context on the GPU is suspect
    assert lookup(95).drains and lookup(95).hardware
    assert 94 not in APPLICATION_CODES and 92 not in DRAIN_CODES


def test_application_codes_are_never_hardware_and_never_drain():
    assert {13, 31, 43} <= APPLICATION_CODES
    assert not APPLICATION_CODES & DRAIN_CODES
    assert all(not XID_CATALOG[c].hardware for c in APPLICATION_CODES)


def _xid_finding(code: int, **evidence) -> Finding:
    return Finding(kind=FindingKind.XID, node="n0003", ts=T0, gpu=1, detector="health.xid",
                   evidence={"code": code, **evidence})


@pytest.mark.parametrize("code", sorted(XID_CATALOG))
def test_policy_acts_on_a_code_exactly_as_the_catalog_advises(code):
    """Without the detector's advice in the evidence, the engine falls back on the same catalog."""
    [rec] = PolicyEngine().decide([_xid_finding(code)], T0)
    assert (rec.action is Action.DRAIN) is XID_CATALOG[code].drains


def test_every_code_the_policy_drains_for_is_in_the_catalog():
    """Sweep the code space: a drain by code alone only ever comes from a catalog entry advising it."""
    drained = set()
    for code in range(0, 200):
        [rec] = PolicyEngine().decide([_xid_finding(code)], T0)
        if rec.action is Action.DRAIN:
            drained.add(code)
    assert drained == DRAIN_CODES and drained <= set(XID_CATALOG)


def test_health_rules_and_policy_agree_end_to_end():
    rules = HealthRules()
    for code in (92, 94, 95, 79, 13):
        [f] = rules.check([], [Event(node="n0003", ts=T0, kind=EventKind.XID, gpu=1, code=code)])
        [rec] = PolicyEngine().decide([f], T0)
        assert f.evidence["action"] == lookup(code).action.value
        assert (rec.action is Action.DRAIN) is lookup(code).drains, code
