"""The policy engine: what each finding becomes, the guards under a storm, replay safety."""

from __future__ import annotations

import pytest

from fleethealth.errors import ConfigError
from fleethealth.policy.engine import PolicyEngine, rack_of
from fleethealth.policy.eviction import EvictionOutcome
from fleethealth.schema import (
    Action,
    Diagnosis,
    Event,
    EventKind,
    Finding,
    FindingKind,
    Guard,
    Recommendation,
    decode,
    encode,
)

T0 = 100_000.0


def _rack(node: str) -> str:
    """The rack these tests' nodes report (eight to a rack), as the detectors copy it into a finding."""
    return f"r{int(node[1:]) // 8:02d}"


def _straggler(node="n0013", ts=T0, *, diag=Diagnosis.NODE_THERMAL, slowdown=0.2, job="train-1", rank=None,
               **evidence):
    idx = int(node[1:])
    return Finding(kind=FindingKind.STRAGGLER, node=node, ts=ts, job=job, gpu=3,
                   rank=idx * 8 + 3 if rank is None else rank, step=100, diagnosis=diag, z=8.0,
                   slowdown=slowdown, detector="straggler", evidence={"rack": _rack(node), **evidence})


SUPPORTED = {"corroboration": {"by": ["prior_fault"]}}
"""What a detector attaches to an Xid, ECC or SDC finding that the node's own stream supports."""


def _finding(kind, node="n0007", ts=T0, **kw):
    """A finding; an Xid, ECC or SDC one is corroborated unless its evidence says otherwise."""
    evidence = {"rack": _rack(node), **kw.pop("evidence", {})}
    if kind in (FindingKind.XID, FindingKind.ECC, FindingKind.SDC):
        evidence = {**SUPPORTED, **evidence}
    return Finding(kind=kind, node=node, ts=ts, job=kw.pop("job", "train-1"), gpu=kw.pop("gpu", 1),
                   detector=kw.pop("detector", "test"), evidence=evidence, **kw)


def _actions(recs, action=None, guard=None):
    return [r for r in recs if (action is None or r.action is action) and (guard is None or r.guard is guard)]


def test_a_rack_is_what_the_node_reported_never_its_name():
    def f(node, **evidence):  # corroborated: the rack rule is what this test is about
        return Finding(kind=FindingKind.XID, node=node, ts=T0, evidence={**SUPPORTED, **evidence})

    assert rack_of(f("dc1-r07-gpu03", rack="row2-rack07")) == "row2-rack07"
    assert rack_of(f("n0013")) is None                              # no rack reported: unknown, not r01
    assert rack_of(f("n0013", rack="unknown")) is None and rack_of(f("n0013", rack="")) is None
    # two drains in a row on nodes whose racks are unknown: the same-rack rule neither holds nor clears
    eng = PolicyEngine()
    first = eng.decide([f("gpu-a", code=79, rack="row2-rack07")], now=T0)
    assert _actions(first, Action.DRAIN)[0].guard is Guard.ALLOWED
    unknown = eng.decide([Finding(kind=FindingKind.XID, node="gpu-b", ts=T0 + 1, evidence={**SUPPORTED, "code": 79})],
                         now=T0 + 1)
    [drain] = _actions(unknown, Action.DRAIN)
    assert drain.guard is Guard.ALLOWED and drain.evidence.get("rack") is None
    again = eng.decide([f("gpu-c", code=79, rack="row2-rack07")], now=T0 + 2)
    assert _actions(again, Action.DRAIN)[0].guard is Guard.NEEDS_HUMAN     # the unknown one did not clear it


def test_payback_arithmetic_in_evidence():
    """Seed 000 §7: R=600 s, 20 % slow -> R / (P x 0.2); with the Beta(3,1) prior P = 0.75."""
    eng = PolicyEngine()
    [rec] = eng.decide([_straggler()], now=T0)
    assert rec.action is Action.EVICT and rec.guard is Guard.ALLOWED
    assert rec.evidence["p_healthy"] == pytest.approx(0.75)
    assert rec.evidence["payback_s"] == pytest.approx(600 / (0.75 * 0.2))
    assert rec.evidence["guards_fired"] == []
    assert "NODE_THERMAL" in rec.reason and "pays back" in rec.reason
    # a small straggler on a short remaining run does not pay back
    eng2 = PolicyEngine()
    [keep] = eng2.decide([_straggler(slowdown=0.02, remaining_s=3600.0)], now=T0)
    assert keep.action is Action.NONE and "keep running" in keep.reason
    assert keep.evidence["payback_s"] == pytest.approx(600 / (0.75 * 0.02))


def test_storm_of_50_stragglers_in_one_rack_allows_at_most_one_eviction():
    """50 node-level stragglers in rack r02 within a minute: one eviction, the rest held by guards."""
    nodes = [f"n{16 + i % 8:04d}" for i in range(50)]
    storm = [_straggler(n, T0 + i, rank=i, job=f"train-{i % 3}") for i, n in enumerate(nodes)]
    eng = PolicyEngine()
    recs = eng.decide(storm, now=T0 + 60)
    assert len(_actions(recs, Action.EVICT, Guard.ALLOWED)) == 1
    held = [r for r in recs if r.action is Action.EVICT and r.guard is not Guard.ALLOWED]
    assert held and all(r.guard in (Guard.RATE_LIMITED, Guard.NEEDS_HUMAN) for r in held)
    assert all(r.evidence["guards_fired"] for r in held)
    assert {g for r in held for g in r.evidence["guards_fired"]} >= {"same_rack"}
    # nothing else is removed from the pool
    assert not _actions(recs, Action.DRAIN) and not _actions(recs, Action.QUARANTINE)
    assert len(recs) == 50


def test_hot_aisle_storm_alerts_facilities_once_and_never_evicts():
    storm = [_straggler(f"n{16 + i % 8:04d}", T0 + i, diag=Diagnosis.ENVIRONMENTAL, rank=i, rack="r02")
             for i in range(50)]
    recs = PolicyEngine().decide(storm, now=T0 + 60)
    alerts = _actions(recs, Action.ALERT_FACILITIES)
    assert len(alerts) == 1 and alerts[0].evidence["rack"] == "r02"
    assert "hot aisle" in alerts[0].reason
    assert not _actions(recs, Action.EVICT)
    assert all(r.action is Action.NONE for r in recs if r is not alerts[0])


def test_mixed_storm_one_alert_at_most_one_eviction():
    storm = []
    for i in range(50):
        diag = Diagnosis.ENVIRONMENTAL if i % 2 else Diagnosis.NODE_THERMAL
        storm.append(_straggler(f"n{16 + i % 8:04d}", T0 + i, diag=diag, rank=i, job=f"train-{i % 2}"))
    recs = PolicyEngine().decide(storm, now=T0 + 60)
    assert len(_actions(recs, Action.ALERT_FACILITIES)) == 1
    assert len(_actions(recs, Action.EVICT, Guard.ALLOWED)) <= 1


def test_hot_aisle_new_episode_after_quiet_period():
    eng = PolicyEngine(facilities_episode_s=600)
    first = eng.decide([_straggler("n0016", T0, diag=Diagnosis.ENVIRONMENTAL)], now=T0)
    again = eng.decide([_straggler("n0017", T0 + 300, diag=Diagnosis.ENVIRONMENTAL)], now=T0 + 300)
    later = eng.decide([_straggler("n0018", T0 + 2000, diag=Diagnosis.ENVIRONMENTAL)], now=T0 + 2000)
    assert [r.action for r in first + again + later] == [Action.ALERT_FACILITIES, Action.NONE,
                                                         Action.ALERT_FACILITIES]


def test_rate_limit_one_eviction_per_hour_per_job():
    eng = PolicyEngine()
    a = eng.decide([_straggler("n0001", T0)], now=T0)
    b = eng.decide([_straggler("n0030", T0 + 1800)], now=T0 + 1800)     # other rack, same job, 30 min on
    c = eng.decide([_straggler("n0040", T0 + 1800, job="train-2")], now=T0 + 1800)  # other job
    d = eng.decide([_straggler("n0050", T0 + 3700)], now=T0 + 3700)     # more than an hour on
    assert a[0].guard is Guard.ALLOWED
    assert b[0].action is Action.EVICT and b[0].guard is Guard.RATE_LIMITED
    assert b[0].evidence["guards_fired"] == ["rate_limit"]
    assert b[0].evidence["since_last_eviction_s"] == pytest.approx(1800)
    assert c[0].guard is Guard.ALLOWED
    assert d[0].guard is Guard.ALLOWED


def test_same_rack_needs_human_until_acknowledged():
    eng = PolicyEngine()
    assert eng.decide([_straggler("n0016", T0, job="a")], now=T0)[0].guard is Guard.ALLOWED
    [held] = eng.decide([_straggler("n0017", T0 + 10, job="b")], now=T0 + 10)
    assert held.guard is Guard.NEEDS_HUMAN and held.evidence["guards_fired"] == ["same_rack"]
    assert "n0016" in held.reason
    eng.acknowledge_rack()
    assert eng.decide([_straggler("n0018", T0 + 20, job="c")], now=T0 + 20)[0].guard is Guard.ALLOWED
    # a different rack is never held by this guard
    assert eng.decide([_straggler("n0001", T0 + 30, job="d")], now=T0 + 30)[0].guard is Guard.ALLOWED


def test_unknown_cause_evicted_once_per_node_then_needs_human():
    eng = PolicyEngine(rate_window_s=60)
    first = eng.decide([_straggler("n0005", T0, diag=Diagnosis.UNKNOWN)], now=T0)
    assert first[0].action is Action.EVICT and first[0].guard is Guard.ALLOWED
    eng.acknowledge_rack()
    second = eng.decide([_straggler("n0005", T0 + 600, diag=Diagnosis.UNKNOWN)], now=T0 + 600)
    assert second[0].action is Action.EVICT and second[0].guard is Guard.NEEDS_HUMAN
    assert second[0].evidence["guards_fired"] == ["unknown_once"]
    # a NODE_THERMAL straggler on the same node is not limited by the UNKNOWN rule
    eng.acknowledge_rack()
    third = eng.decide([_straggler("n0005", T0 + 1200)], now=T0 + 1200)
    assert third[0].guard is Guard.ALLOWED


def test_network_contention_evicts_and_changes_placement():
    [rec] = PolicyEngine().decide([_straggler("n0005", diag=Diagnosis.NETWORK_CONTENTION, slowdown=0.1)], now=T0)
    assert rec.action is Action.EVICT and "change placement" in rec.reason
    assert rec.evidence["placement"] == "change"
    [link] = PolicyEngine().decide([_straggler("n0021", diag=Diagnosis.NODE_LINK, slowdown=0.15)], now=T0)
    assert link.action is Action.EVICT and link.guard is Guard.ALLOWED


def test_p_healthy_moves_with_recorded_outcomes():
    """R2: if evictions stop resolving stragglers, P(healthy) falls and the engine stops evicting."""
    eng = PolicyEngine()
    p0 = eng.p_healthy(Diagnosis.NODE_THERMAL)
    assert p0 == pytest.approx(0.75)
    f = _straggler(slowdown=0.05, remaining_s=12 * 3600.0)   # payback 600/(0.75*0.05) = 4.4 h <= 0.25 x 12 h? no
    assert eng.decide([f], now=T0)[0].action is Action.NONE
    for i in range(12):
        eng.record_outcome(EvictionOutcome(T0 + i, f"n{i:04d}", "j", Diagnosis.NODE_THERMAL, resolved=True))
    p_up = eng.p_healthy(Diagnosis.NODE_THERMAL)
    assert p_up == pytest.approx(15 / 16)
    for i in range(30):
        eng.record_outcome(EvictionOutcome(T0 + i, f"n{i:04d}", "j", Diagnosis.NODE_THERMAL, resolved=False))
    p_down = eng.p_healthy(Diagnosis.NODE_THERMAL)
    assert p_down == pytest.approx(15 / 46) and p_down < p0 < p_up
    # other classes keep the prior
    assert eng.p_healthy(Diagnosis.NODE_LINK) == pytest.approx(0.75)
    # the same 20 % straggler is evicted at the high P and not at the low one
    hi, lo = PolicyEngine(), PolicyEngine()
    for _ in range(20):
        hi.record_outcome(EvictionOutcome(T0, "n1", "j", Diagnosis.NODE_THERMAL, True))
        lo.record_outcome(EvictionOutcome(T0, "n1", "j", Diagnosis.NODE_THERMAL, False))
    g = _straggler(slowdown=0.2, remaining_s=4 * 3600.0)   # margin 0.25 -> payback must be <= 1 h
    assert hi.decide([g], now=T0)[0].action is Action.EVICT
    assert lo.decide([g], now=T0)[0].action is Action.NONE


def test_replayed_findings_yield_no_second_action():
    findings = [_straggler("n0013", T0), _finding(FindingKind.XID, "n0019", T0 + 1, evidence={"code": 79}),
                _finding(FindingKind.FAILURE_RISK, "n0007", T0 + 2, probability=0.9)]
    eng = PolicyEngine()
    first = eng.decide(findings, now=T0 + 5)
    assert [r.action for r in first] == [Action.EVICT, Action.DRAIN, Action.DRAIN]
    assert eng.decide(findings, now=T0 + 5) == []
    assert eng.decide(list(reversed(findings)), now=T0 + 50) == []
    # a restarted engine restored from saved state also refuses the replay
    restored = PolicyEngine()
    restored.load_state(eng.to_state())
    assert restored.decide(findings, now=T0 + 60) == []
    # and a fresh engine decides the same things with the same ids (deterministic)
    assert [r.id for r in PolicyEngine().decide(findings, now=T0 + 5)] == [r.id for r in first]


def test_stale_finding_is_recorded_not_acted_on():
    eng = PolicyEngine(stale_after_s=900)
    [rec] = eng.decide([_finding(FindingKind.XID, "n0019", T0, evidence={"code": 79})], now=T0 + 3600)
    assert rec.action is Action.NONE and rec.evidence["guards_fired"] == ["stale"]
    assert rec.evidence["age_s"] == pytest.approx(3600)
    # nothing was remembered as acted on: a fresh finding for the node drains it
    [fresh] = eng.decide([_finding(FindingKind.XID, "n0019", T0 + 3600, evidence={"code": 79})], now=T0 + 3600)
    assert fresh.action is Action.DRAIN and fresh.guard is Guard.ALLOWED


def test_future_dated_finding_is_stale_and_cannot_reopen_the_rate_window():
    """A finding stamped an hour ahead used to be acted on and, with the limiter comparing its own
    stamp with abs(), let a second eviction of the same job through inside the hour."""
    eng = PolicyEngine()
    [first] = eng.decide([_straggler("n0001", T0)], now=T0)
    assert first.action is Action.EVICT and first.guard is Guard.ALLOWED
    [ahead] = eng.decide([_straggler("n0030", T0 + 3700)], now=T0 + 60)
    assert ahead.action is Action.NONE and ahead.evidence["guards_fired"] == ["stale"]
    assert "after the decision time" in ahead.reason and ahead.evidence["age_s"] == pytest.approx(-3640)
    # a small skew is tolerated, but the limiter counts from the decision time: still rate limited
    [skewed] = eng.decide([_straggler("n0040", T0 + 130)], now=T0 + 120)
    assert skewed.action is Action.EVICT and skewed.guard is Guard.RATE_LIMITED
    assert skewed.evidence["since_last_eviction_s"] == pytest.approx(120)


def test_the_clock_skew_bound_is_a_configuration_key():
    """``policy.max_skew_s``: how far after the decision time a finding may be stamped before it is stale."""
    from fleethealth.commands._settings import schema

    assert schema().keys["policy.max_skew_s"].default == 60.0
    [strict] = PolicyEngine(max_skew_s=5.0).decide([_straggler("n0030", T0 + 30)], now=T0)
    assert strict.action is Action.NONE and strict.evidence["guards_fired"] == ["stale"]
    assert strict.evidence["max_skew_s"] == 5.0 and "5 s clock-skew bound" in strict.reason
    [lenient] = PolicyEngine().decide([_straggler("n0030", T0 + 30)], now=T0)
    assert lenient.action is Action.EVICT and lenient.guard is Guard.ALLOWED
    with pytest.raises(ConfigError, match="max_skew_s"):
        PolicyEngine(max_skew_s=-1.0)


def test_limiter_counts_from_decision_time_not_the_finding_stamp():
    from fleethealth.policy.guards import JobRateLimiter, is_stale

    lim = JobRateLimiter(window_s=3600)
    lim.note("j", T0 + 7200)          # a later action already recorded
    assert lim.since_last("j", T0) == 0.0   # never outside the window by being "far away"
    lim.note("j", T0)
    assert lim.since_last("j", T0 + 3600) is None and lim.since_last("j", T0 + 10) == pytest.approx(10)
    assert is_stale(T0 + 61, T0, 900) and not is_stale(T0 + 59, T0, 900) and is_stale(T0 - 901, T0, 900)


def test_breaker_trips_and_holds_until_reset():
    eng = PolicyEngine(fleet_nodes=100, breaker_share=0.05, breaker_min_nodes=3, breaker_window_s=600)
    # one node per rack (8 per rack): the same-rack rule holds no drain here, only the breaker does
    xids = [_finding(FindingKind.XID, f"n{8 * i:04d}", T0 + i, evidence={"code": 79}) for i in range(7)]
    recs = eng.decide(xids, now=T0 + 10)
    drains = _actions(recs, Action.DRAIN)
    assert [r.guard for r in drains] == [Guard.ALLOWED] * 5 + [Guard.NEEDS_HUMAN] * 2
    assert all("breaker" in r.evidence["guards_fired"] for r in drains[5:])
    pages = _actions(recs, Action.PAGE)
    assert len(pages) == 1 and "circuit breaker tripped" in pages[0].reason
    assert eng.breaker_.status().open
    # holds after the window has long passed, for every node-removing action
    later = eng.decide([_finding(FindingKind.XID, "n0050", T0 + 10_000, evidence={"code": 79}),
                        _finding(FindingKind.SDC, "n0051", T0 + 10_001, job=None)], now=T0 + 10_001)
    assert [(r.action, r.guard) for r in later] == [(Action.DRAIN, Guard.NEEDS_HUMAN),
                                                    (Action.QUARANTINE, Guard.NEEDS_HUMAN)]
    # non-removing advice still flows
    env = eng.decide([_straggler("n0060", T0 + 10_002, diag=Diagnosis.ENVIRONMENTAL)], now=T0 + 10_002)
    assert env[0].action is Action.ALERT_FACILITIES
    eng.reset_breaker()
    assert not eng.breaker_.status().open
    recs = eng.decide([_finding(FindingKind.XID, "n0070", T0 + 10_003, evidence={"code": 79})], now=T0 + 10_003)
    [ok] = [r for r in recs if r.node == "n0070"]
    # the removals the open breaker held come first: stale ones listed for a human, fresh ones decided again
    assert [(r.node, r.guard) for r in recs if r.node != "n0070"] == [
        ("n0040", Guard.NEEDS_HUMAN), ("n0048", Guard.NEEDS_HUMAN), ("n0050", Guard.ALLOWED), ("n0051", Guard.ALLOWED)]
    assert ok.action is Action.DRAIN and ok.guard is Guard.ALLOWED


def test_breaker_does_not_trip_below_share():
    eng = PolicyEngine(fleet_nodes=100, breaker_share=0.05, breaker_min_nodes=3, breaker_window_s=600)
    for i in range(10):      # five an hour apart never share a window
        eng.decide([_finding(FindingKind.XID, f"n{i:04d}", T0 + i * 700, evidence={"code": 79})],
                   now=T0 + i * 700)
    assert not eng.breaker_.status().open


def test_dry_run_marks_everything_and_still_guards():
    eng = PolicyEngine(dry_run=True)
    recs = eng.decide([_straggler("n0016", T0), _straggler("n0017", T0 + 1, rank=1)], now=T0 + 1)
    assert all(r.dry_run for r in recs) and all("dry_run" in r.evidence["guards_fired"] for r in recs)
    assert [r.guard for r in recs] == [Guard.ALLOWED, Guard.NEEDS_HUMAN]


def test_sdc_quarantines_and_rolls_back_to_the_verified_checkpoint():
    eng = PolicyEngine()
    ev = [Event(node="n0000", ts=T0 + s, kind=EventKind.CHECKPOINT, job="train-1", step=s,
                data={"step": s, "uri": f"s3://ck/{s}", "last_verified_step": lvs})
          for s, lvs in ((100, 100), (200, 150), (300, 250))]
    ev.append(Event(node="n0000", ts=T0 + 350, kind=EventKind.SDC_CHECK, job="train-1", step=350,
                    data={"check": "selfcheck", "passed": True}))
    eng.observe(ev)
    sdc = _finding(FindingKind.SDC, "n0030", T0 + 400, gpu=5, step=400,
                   evidence={"classification": "transient", "check": "selfcheck"})
    recs = eng.decide([sdc], now=T0 + 400)
    assert [r.action for r in recs] == [Action.QUARANTINE, Action.ROLLBACK]
    q, rb = recs
    assert q.node == "n0030" and q.guard is Guard.ALLOWED and "full self-test" in q.reason
    assert rb.evidence["target_step"] == 300 and rb.evidence["target_uri"] == "s3://ck/300"
    assert rb.evidence["last_verified_step"] == 350
    # a check that passed only at 250: the checkpoint at 300 is in the suspect window
    eng2 = PolicyEngine()
    eng2.observe(ev[:3])
    [_, rb2] = eng2.decide([sdc], now=T0 + 400)
    assert rb2.evidence["target_step"] == 200 and rb2.evidence["discarded_checkpoints"] == [300]
    # a second SDC finding on the same node: no second quarantine, no second rollback to the same target
    again = eng.decide([_finding(FindingKind.SDC, "n0030", T0 + 401, gpu=5, step=400,
                                 evidence={"classification": "transient", "check": "selfcheck"})], now=T0 + 401)
    assert [r.action for r in again] == [Action.NONE]


def test_sdc_without_a_clean_checkpoint_needs_a_human():
    recs = PolicyEngine().decide([_finding(FindingKind.SDC, "n0011", T0, step=120,
                                           evidence={"classification": "persistent"})], now=T0)
    rb = _actions(recs, Action.ROLLBACK)[0]
    assert rb.guard is Guard.NEEDS_HUMAN and "unrecoverable" in rb.reason


def test_sdc_from_finding_evidence_and_data_or_code():
    ck = [{"step": 100, "uri": "a", "last_verified_step": 100, "last_replay_step": 100},
          {"step": 200, "uri": "b", "last_verified_step": 150, "last_replay_step": 100}]
    recs = PolicyEngine().decide([_finding(FindingKind.SDC, "n0011", T0, step=260, evidence={
        "classification": "data_or_code", "checkpoints": ck})], now=T0)
    assert [r.action for r in recs] == [Action.PAGE, Action.ROLLBACK]
    assert recs[1].evidence["target_step"] == 100


def test_a_deterministic_fault_rolls_back_past_the_last_passing_replay_not_the_last_self_check():
    """The self-check vouched for step 150, but only the replay (step 100) can see a deterministic fault:
    checkpoint 125, written after the last passing replay, is not a target for a persistent fault."""
    ck = [{"step": s, "uri": f"c{s}", "last_verified_step": v, "last_replay_step": 100}
          for s, v in ((100, 100), (125, 100), (150, 150))]
    evidence = {"classification": "persistent", "check": "replay", "checkpoints": ck,
                "last_verified_step": 150, "last_replay_step": 100}
    recs = PolicyEngine().decide([_finding(FindingKind.SDC, "n0011", T0, step=200, evidence=evidence)], now=T0)
    rb = _actions(recs, Action.ROLLBACK)[0]
    assert rb.evidence["target_step"] == 100 and rb.evidence["bound_step"] == 100 and "replay" in rb.reason
    transient = {**evidence, "classification": "transient", "check": "selfcheck"}
    recs = PolicyEngine().decide([_finding(FindingKind.SDC, "n0030", T0, step=200, evidence=transient)], now=T0)
    assert _actions(recs, Action.ROLLBACK)[0].evidence["target_step"] == 150
    # checkpoints written before the replay mark existed carry none: a deterministic fault needs a human
    old = [{k: v for k, v in c.items() if k != "last_replay_step"} for c in ck]
    recs = PolicyEngine().decide([_finding(FindingKind.SDC, "n0011", T0, step=200, evidence={
        "classification": "persistent", "checkpoints": old})], now=T0)
    assert _actions(recs, Action.ROLLBACK)[0].guard is Guard.NEEDS_HUMAN


def test_failure_risk_drains_at_next_checkpoint_boundary():
    eng = PolicyEngine(failure_risk_threshold=0.6)
    eng.observe([Event(node="n0", ts=T0, kind=EventKind.CHECKPOINT, job="train-1", data={"step": s, "uri": ""})
                 for s in (100, 200, 300)])
    low = eng.decide([_finding(FindingKind.FAILURE_RISK, "n0007", T0, probability=0.4)], now=T0)
    assert low[0].action is Action.NONE
    [hi] = eng.decide([_finding(FindingKind.FAILURE_RISK, "n0007", T0 + 1, probability=0.8)], now=T0 + 1)
    assert hi.action is Action.DRAIN and hi.evidence["at_step"] == 400 and hi.evidence["planned"] is True
    assert "next checkpoint boundary" in hi.reason
    [dup] = eng.decide([_finding(FindingKind.FAILURE_RISK, "n0007", T0 + 2, probability=0.9)], now=T0 + 2)
    assert dup.action is Action.NONE and "already draining" in dup.reason


def test_xid_and_ecc_by_severity_and_hang():
    eng = PolicyEngine(breaker_min_nodes=50)
    cases = [
        (_finding(FindingKind.XID, "n0019", T0, evidence={"code": 79}), Action.DRAIN),
        (_finding(FindingKind.XID, "n0020", T0, evidence={"code": 13}), Action.NONE),
        (_finding(FindingKind.XID, "n0021", T0, evidence={"code": 13, "severity": "fatal"}), Action.DRAIN),
        (_finding(FindingKind.XID, "n0022", T0, evidence={"code": 79, "severity": "warning"}), Action.NONE),
        (_finding(FindingKind.XID, "n0026", T0, evidence={"code": 94, "severity": "error", "action": "none"}),
         Action.NONE),
        (_finding(FindingKind.XID, "n0027", T0, evidence={"code": 110, "severity": "critical", "action": "drain"}),
         Action.DRAIN),
        (_finding(FindingKind.XID, "n0028", T0, evidence={"code": 94, "severity": "critical", "action": "none"}),
         Action.DRAIN),
        (_finding(FindingKind.ECC, "n0029", T0, evidence={"severity": "critical"}), Action.DRAIN),
        (_finding(FindingKind.ECC, "n0031", T0, evidence={"severity": "warning", "corrected_volatile": 9.0}),
         Action.NONE),
        (_finding(FindingKind.ECC, "n0023", T0, evidence={"dbe": 2}), Action.DRAIN),
        (_finding(FindingKind.ECC, "n0024", T0, evidence={"sbe": 40}), Action.NONE),
        (_finding(FindingKind.HANG, "n0002", T0, step=450), Action.DRAIN),
        (_finding(FindingKind.THERMAL, "n0025", T0), Action.NONE),
    ]
    for f, want in cases:
        [rec] = eng.decide([f], now=T0)
        assert rec.action is want, (f, rec.reason)
        assert rec.reason and "guards_fired" in rec.evidence


def test_a_node_drained_for_a_hang_is_drained_once():
    eng = PolicyEngine()
    [first] = eng.decide([_finding(FindingKind.HANG, "n0002", T0, step=450)], now=T0)
    assert first.action is Action.DRAIN and first.guard is Guard.ALLOWED
    [again] = eng.decide([_finding(FindingKind.HANG, "n0002", T0 + 60, step=451)], now=T0 + 60)
    assert again.action is Action.NONE and "already draining" in again.reason
    [xid] = eng.decide([_finding(FindingKind.XID, "n0002", T0 + 90, evidence={"code": 79})], now=T0 + 90)
    assert xid.action is Action.NONE and "already draining" in xid.reason


def test_recommendations_round_trip_the_wire_schema():
    eng = PolicyEngine()
    recs = eng.decide([_straggler(), _straggler("n0016", T0, diag=Diagnosis.ENVIRONMENTAL),
                       _finding(FindingKind.SDC, "n0030", T0, step=10)], now=T0)
    for r in recs:
        back = decode(Recommendation, encode(r))
        assert back.id == r.id and back.evidence == r.evidence and back.guard is r.guard


def test_bad_parameters_are_clear():
    with pytest.raises(ConfigError, match="payback_margin"):
        PolicyEngine(payback_margin=0)
    with pytest.raises(ConfigError, match="failure_risk_threshold"):
        PolicyEngine(failure_risk_threshold=1.5)
    with pytest.raises(ConfigError, match="breaker_share"):
        PolicyEngine(breaker_share=2.0)
    with pytest.raises(ConfigError, match="alpha"):
        PolicyEngine(prior_alpha=0)


def test_one_recommendation_per_node_while_an_eviction_is_held():
    """A node-level fault flags all eight ranks of the node: one held eviction, then ``none``."""
    eng = PolicyEngine()
    eng.decide([_straggler("n0001", T0)], now=T0)                       # uses the job's hourly eviction
    recs = eng.decide([_straggler("n0021", T0 + 5 + r, rank=168 + r, diag=Diagnosis.NODE_LINK) for r in range(8)],
                      now=T0 + 20)
    assert [r.action for r in recs] == [Action.EVICT] + [Action.NONE] * 7
    assert recs[0].guard is Guard.RATE_LIMITED
    assert all("held" in r.reason for r in recs[1:])
    # after the window a fresh finding on the node is decided again
    [again] = eng.decide([_straggler("n0021", T0 + 4000, rank=170, diag=Diagnosis.NODE_LINK)], now=T0 + 4000)
    assert again.action is Action.EVICT and again.guard is Guard.ALLOWED


def test_judge_eviction_feeds_p_healthy():
    """The loop of R2: an eviction whose replacement straggles again counts against P(healthy)."""
    from fleethealth.policy.eviction import judge_eviction

    eng = PolicyEngine()
    [rec] = eng.decide([_straggler("n0013", T0, slowdown=0.2)], now=T0)
    assert judge_eviction(rec, [], now=T0 + 600) is None                          # too early to say
    again = _straggler("n0014", T0 + 900, slowdown=0.18, rank=5)                    # the replacement is slow too
    bad = judge_eviction(rec, [again], now=T0 + 1000)
    assert bad is not None and bad.resolved is False and bad.diagnosis is Diagnosis.NODE_THERMAL
    noise = _straggler("n0040", T0 + 900, slowdown=0.03, rank=6)                    # a small, unrelated blip
    good = judge_eviction(rec, [noise, _straggler("n0040", T0 + 900, job="other", rank=7)], now=T0 + 1800)
    assert good is not None and good.resolved is True
    eng.record_outcome(bad)
    assert eng.p_healthy(Diagnosis.NODE_THERMAL) == pytest.approx(3 / 5)
    with pytest.raises(ConfigError, match="not a straggler eviction"):
        judge_eviction(Recommendation(action=Action.DRAIN, node="n1", ts=T0, reason="x"), [], now=T0)


def test_two_drains_in_one_rack_need_a_human_and_an_sdc_quarantine_does_not():
    """The README's rule holds for drains as for evictions: after a drain in rack r00, a second node of
    r00 is held for a human (``same_rack``) while a node of another rack is drained; an acknowledgement
    clears the hold. A quarantine for SDC is exempt: a corrupting node leaves whatever its rack."""
    eng = PolicyEngine()
    recs = eng.decide([_finding(FindingKind.XID, "n0001", T0, evidence={"code": 79}),
                       _finding(FindingKind.HANG, "n0002", T0 + 1),
                       _finding(FindingKind.XID, "n0009", T0 + 2, evidence={"code": 79})], now=T0 + 3)
    drains = {r.node: r for r in _actions(recs, Action.DRAIN)}
    assert drains["n0001"].guard is Guard.ALLOWED
    assert drains["n0002"].guard is Guard.NEEDS_HUMAN and "same_rack" in drains["n0002"].evidence["guards_fired"]
    assert "n0001" in drains["n0002"].reason and "r00" in drains["n0002"].reason
    assert drains["n0009"].guard is Guard.ALLOWED            # rack r01
    # a drain and an eviction share the rule: a straggler eviction in r01 right after is held too
    [held] = eng.decide([_finding(FindingKind.STRAGGLER, "n0010", T0 + 4, job="train-2", slowdown=0.3,
                                  diagnosis=Diagnosis.NODE_THERMAL)], now=T0 + 4)
    assert held.action is Action.EVICT and held.guard is Guard.NEEDS_HUMAN
    assert "same_rack" in held.evidence["guards_fired"]
    [quarantine] = _actions(eng.decide([_finding(FindingKind.SDC, "n0011", T0 + 5, job=None)], now=T0 + 5),
                            Action.QUARANTINE)
    assert quarantine.guard is Guard.ALLOWED
    eng.acknowledge_rack()
    [again] = _actions(eng.decide([_finding(FindingKind.XID, "n0012", T0 + 6, evidence={"code": 79})],
                                  now=T0 + 6), Action.DRAIN)
    assert again.guard is Guard.ALLOWED
