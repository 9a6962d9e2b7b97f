"""Typed evidence: the health rules write the same JSON object as before, the policy reads it back
typed, and a finding from another producer (missing or odd keys) reads as "not said"."""

from __future__ import annotations

import numpy as np

from fleethealth.detectors.health import HealthRules
from fleethealth.evidence import EccEvidence, StragglerEvidence, XidEvidence
from fleethealth.schema import Action, Event, EventKind, Telemetry


def test_an_xid_finding_keeps_its_wire_shape_and_reads_back_typed():
    [f] = HealthRules().check([], [Event(node="n0019", ts=5.0, kind=EventKind.XID, gpu=6, code=79, message="m")])
    support = f.evidence.pop("corroboration")  # n0019 sent no telemetry: the event stands alone
    assert support["by"] == [] and "no telemetry from n0019" in support["missing"]
    assert f.evidence == {"severity": "critical", "code": 79, "name": "GPU has fallen off the bus",
                          "action": "drain", "remedy": f.evidence["remedy"], "hardware": True, "message": "m"}
    facts = XidEvidence.from_evidence(f.evidence)
    assert (facts.code, facts.action, facts.severity, facts.escalated_from) == (79, Action.DRAIN, "critical", None)
    assert facts.to_evidence() == f.evidence


def test_an_ecc_finding_keeps_its_wire_shape_and_escalation():
    cols = {k: np.zeros(2) for k in ("ecc_dbe_volatile", "remap_failure", "remap_pending", "retired_pending",
                                     "retired_sbe", "retired_dbe", "ecc_sbe_volatile")}
    rules = HealthRules()
    pending = {**cols, "remap_pending": np.array([0.0, 1.0])}
    [warn] = rules.check([Telemetry.from_columns("n0001", "r00", 1.0, [0, 1], **pending)])
    broken = {**pending, "ecc_dbe_volatile": np.array([0.0, 2.0])}
    [crit] = rules.check([Telemetry.from_columns("n0001", "r00", 2.0, [0, 1], **broken)])
    assert list(warn.evidence) == ["severity", "reasons", "uncorrectable", "remap_failure", "remap_pending",
                                   "retired_pages", "remapped_rows", "corrected_volatile"]
    facts = EccEvidence.from_evidence(crit.evidence)
    assert facts.severity == "critical" and facts.escalated_from == "warning" and facts.uncorrectable_seen
    assert crit.evidence.pop("corroboration")["by"] == ["prior_fault"]  # the warning episode before it
    assert facts.reasons == ("uncorrectable", "pending") and facts.to_evidence() == crit.evidence


def test_evidence_from_another_producer_reads_as_not_said():
    assert XidEvidence.from_evidence({"xid": 48, "action": "reboot", "severity": None}) == XidEvidence(code=48)
    assert EccEvidence.from_evidence({"dbe": 1}).uncorrectable_seen
    assert not EccEvidence.from_evidence({"uncorrectable": float("nan")}).uncorrectable_seen
    odd = StragglerEvidence.from_evidence({"rack": "", "remaining_s": -5, "slowdown": True})
    assert odd == StragglerEvidence()
    assert StragglerEvidence.from_evidence({"rack": "r02", "remaining_s": 60, "slowdown": 0.2}) == \
        StragglerEvidence(rack="r02", remaining_s=60.0, slowdown=0.2)
