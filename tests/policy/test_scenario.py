"""The engine on the default fault scenario: the fleet simulator's output through the real
detectors, then the policy (docs/architecture.md "Fault scenarios" expected outcomes for the policy's part)."""

from __future__ import annotations

from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.runner import conclude
from fleethealth.policy.engine import PolicyEngine
from fleethealth.policy.stage import PolicyStage
from fleethealth.schema import Action, Diagnosis, Guard
from fleethealth.sim.fleet import FleetSim
from fleethealth.sim.scenario import Scenario


def test_default_scenario_hot_aisle_sdc_and_guards():
    sim = FleetSim(Scenario.default())
    policy = PolicyEngine(fleet_nodes=sim.n_nodes)
    pipe, stage = Pipeline(), PolicyStage(policy)
    recs, findings = [], []
    for s in sim.run():
        out = conclude(pipe, stage, sorted([*s.telemetry, *s.batches, *s.events], key=lambda m: m.ts))
        recs += out.recommendations
        findings += out.findings
    out = conclude(pipe, stage, [], final=True)
    recs += out.recommendations
    findings += out.findings

    hot = {f.node for f in findings if f.diagnosis is Diagnosis.ENVIRONMENTAL}
    assert hot and {sim.rack_of(n) for n in hot} == {"r02"}
    alerts = [r for r in recs if r.action is Action.ALERT_FACILITIES]
    assert len(alerts) == 1 and alerts[0].evidence["rack"] == "r02"
    assert not [r for r in recs if r.action is Action.EVICT and r.node in hot]
    # one straggler eviction allowed for the job within the hour; every other one held by a guard
    evicts = [r for r in recs if r.action is Action.EVICT]
    assert [r.guard for r in evicts].count(Guard.ALLOWED) == 1
    # SDC: quarantine of each corrupting node plus a rollback to a verified checkpoint
    quarantined = {r.node for r in recs if r.action is Action.QUARANTINE and r.guard is Guard.ALLOWED}
    assert quarantined == {"n0011", "n0030"}
    rollbacks = [r for r in recs if r.action is Action.ROLLBACK]
    starts = {f["node"]: f["start_step"] for f in sim.scenario.faults if f.kind.startswith("sdc_")}
    # the scenario's ground truth: every rollback lands before its fault began (seed 000 R6)
    assert {r.node for r in rollbacks} == set(starts)
    assert all(r.evidence["target_step"] <= r.evidence["bound_step"] < r.evidence["failed_step"] for r in rollbacks)
    assert all(r.evidence["target_step"] < starts[r.node] for r in rollbacks)
    # every recommendation explains itself
    assert all(r.reason and "guards_fired" in r.evidence for r in recs)
    # four nodes leave the pool (the eviction, the failure-risk drain, two quarantines), each removal
    # corroborated by the node's own stream. The simulator's lone Xid 79 on n0019 comes with no other
    # signal (its telemetry and steps go on as before), which is exactly what a forged one looks like:
    # its drain waits for a human and is not counted by the breaker; the hang's drain of n0002 then
    # follows n0007's in rack r00 and is held by the same-rack rule. Four of a limit of five: no trip.
    removing = [r for r in recs if r.action in (Action.EVICT, Action.DRAIN, Action.QUARANTINE)
                and r.guard is Guard.ALLOWED]
    assert {r.node for r in removing} == {"n0007", "n0011", "n0013", "n0030"}
    held = {(r.node, tuple(r.evidence["guards_fired"])) for r in recs
            if r.action is Action.DRAIN and r.guard is Guard.NEEDS_HUMAN}
    assert {("n0019", ("uncorroborated",)), ("n0002", ("same_rack",))} <= held
    assert not policy.breaker_.status().open and not [r for r in recs if r.action is Action.PAGE]
