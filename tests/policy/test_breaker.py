"""The fleet circuit breaker as an operator reasons about it: an absolute maximum of removals per
window beside the fleet share, and a close that never acts on findings gone stale while it was open."""

from __future__ import annotations

import orjson
import pytest

from fleethealth.errors import ConfigError
from fleethealth.policy.engine import PolicyEngine
from fleethealth.schema import Action, Finding, FindingKind, Guard

T0 = 200_000.0
SUPPORTED = {"corroboration": {"by": ["prior_fault"]}}


def _xid(node: str, ts: float) -> Finding:
    """A corroborated drain-worthy Xid on ``node`` (each node in a rack of its own)."""
    return Finding(kind=FindingKind.XID, node=node, ts=ts, job="train-1", gpu=1, detector="health.xid",
                   evidence={"rack": f"rack-{node}", "code": 79, **SUPPORTED})


def _drains(recs, guard=None):
    return [r for r in recs if r.action is Action.DRAIN and (guard is None or r.guard is guard)]


def test_the_absolute_maximum_caps_the_fleet_share():
    """10 % of 1,000 nodes would allow 100 removals an hour; the absolute maximum of 3 trips at the 4th."""
    eng = PolicyEngine(fleet_nodes=1000, breaker_share=0.1, breaker_min_nodes=2, breaker_max_nodes=3)
    recs = eng.decide([_xid(f"gpu-{i}", T0 + i) for i in range(5)], now=T0 + 5)
    assert [r.guard for r in _drains(recs)] == [Guard.ALLOWED] * 3 + [Guard.NEEDS_HUMAN] * 2
    status = eng.breaker_.status()
    assert status.open and status.threshold == 3 and "absolute maximum" in status.reason
    # without the maximum the share rules, as before
    share_only = PolicyEngine(fleet_nodes=1000, breaker_share=0.1, breaker_min_nodes=2)
    assert len(_drains(share_only.decide([_xid(f"gpu-{i}", T0 + i) for i in range(5)], now=T0 + 5),
                       Guard.ALLOWED)) == 5
    with pytest.raises(ConfigError, match="breaker_max_nodes"):
        PolicyEngine(breaker_max_nodes=-1)


def test_closing_the_breaker_lists_stale_held_removals_for_a_human_and_decides_fresh_ones():
    eng = PolicyEngine(breaker_min_nodes=2, breaker_max_nodes=2, stale_after_s=900.0)
    first = eng.decide([_xid("a", T0), _xid("b", T0 + 1), _xid("c", T0 + 2)], now=T0 + 2)
    assert [r.guard for r in _drains(first)] == [Guard.ALLOWED, Guard.ALLOWED, Guard.NEEDS_HUMAN]
    # while open: another removal is held
    (held,) = eng.decide([_xid("d", T0 + 2000)], now=T0 + 2000)
    assert held.guard is Guard.NEEDS_HUMAN and "breaker" in held.evidence["guards_fired"]
    # the engine is saved and restored while the breaker is open
    restored = PolicyEngine(breaker_min_nodes=2, breaker_max_nodes=2, stale_after_s=900.0)
    restored.load_state(orjson.loads(orjson.dumps(eng.to_state())))
    restored.reset_breaker()  # a human closes it at T0 + 2100: "c" is 2,098 s old, "d" 100 s
    recs = restored.decide([], now=T0 + 2100)
    by_node = {r.node: r for r in recs}
    assert sorted(by_node) == ["c", "d"]
    stale = by_node["c"]
    assert stale.action is Action.DRAIN and stale.guard is Guard.NEEDS_HUMAN
    assert stale.evidence["guards_fired"] == ["breaker", "stale"] and stale.evidence["held_finding_id"]
    assert "not acted on" in stale.reason and stale.finding_id.startswith("breaker_closed:")
    fresh = by_node["d"]
    assert fresh.action is Action.DRAIN and fresh.guard is Guard.ALLOWED
    # each held finding is decided once: the next decision lists nothing again
    assert restored.decide([], now=T0 + 2200) == []


def test_the_policy_stage_releases_the_held_removals_at_its_next_update_without_new_findings():
    from fleethealth.policy.stage import PolicyStage

    stage = PolicyStage(PolicyEngine(breaker_min_nodes=1, breaker_max_nodes=1, stale_after_s=900.0))
    first = stage.update([_xid("a", T0), _xid("b", T0 + 1)], [], T0 + 1)
    assert [r.guard for r in _drains(first.recommendations)] == [Guard.ALLOWED, Guard.NEEDS_HUMAN]
    stage.engine.reset_breaker()
    quiet = stage.update([], [], T0 + 1200)  # no finding in the batch: the held drain of "b" is listed now
    (listed,) = quiet.recommendations
    assert listed.node == "b" and listed.guard is Guard.NEEDS_HUMAN and quiet.changed
    assert listed.evidence["guards_fired"] == ["breaker", "stale"]
    assert stage.update([], [], T0 + 1300).recommendations == []
