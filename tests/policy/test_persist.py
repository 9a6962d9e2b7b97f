"""The engine's state, eviction history and breaker in a real chDB store: a restarted engine
refuses replays, P(healthy) comes from the recorded outcomes, and an operator's reset in the
store closes a tripped breaker."""

from __future__ import annotations

import pytest

from fleethealth.policy.eviction import EvictionOutcome
from fleethealth.policy.persist import (
    breaker_record,
    load_engine,
    outcomes,
    record_outcome,
    reset_breaker,
    save_engine,
    sync_breaker,
)
from fleethealth.schema import Action, Diagnosis, Finding, FindingKind, Guard

T0 = 1_800_000_000.0


def _rack(node):  # the rack each test node reports, eight to a rack
    return f"r{int(node[1:]) // 8:02d}"


def _xid(node, ts):
    return Finding(kind=FindingKind.XID, node=node, ts=ts, job="train-1", gpu=0, detector="xid",
                   evidence={"code": 79, "rack": _rack(node), "corroboration": {"by": ["gpu_off_bus"]}})


def _straggler(node, ts, slowdown=0.2):
    return Finding(kind=FindingKind.STRAGGLER, node=node, ts=ts, job="train-1", gpu=1, rank=9, step=300,
                   diagnosis=Diagnosis.NODE_THERMAL, slowdown=slowdown, detector="straggler",
                   evidence={"rack": _rack(node)})


def test_restarted_engine_refuses_replay_and_keeps_guards(store):
    eng = load_engine(store)
    first = eng.decide([_xid("n0019", T0 - 1), _straggler("n0013", T0)], now=T0 + 2)
    assert [r.guard for r in first] == [Guard.ALLOWED, Guard.ALLOWED]
    save_engine(store, eng, T0 + 2)
    restarted = load_engine(store)
    assert restarted.decide([_xid("n0019", T0 - 1), _straggler("n0013", T0)], now=T0 + 3) == []
    [held] = restarted.decide([_straggler("n0014", T0 + 10)], now=T0 + 10)   # same job, same rack
    assert held.guard is Guard.NEEDS_HUMAN and set(held.evidence["guards_fired"]) == {"same_rack", "rate_limit"}
    save_engine(store, restarted, T0 + 10)
    assert load_engine(store).rack_.last_rack_ == "r01"


def test_p_healthy_comes_from_recorded_outcomes(store):
    assert load_engine(store).p_healthy(Diagnosis.NODE_THERMAL) == pytest.approx(0.75)
    for k in range(6):
        record_outcome(store, EvictionOutcome(T0 + k, f"n{k:04d}", "train-1", Diagnosis.NODE_THERMAL,
                                              resolved=False, finding_id=f"f{k}"))
    record_outcome(store, EvictionOutcome(T0 + 9, "n0100", "train-1", Diagnosis.NODE_LINK, resolved=True))
    assert len(outcomes(store)) == 7
    eng = load_engine(store)
    assert eng.p_healthy(Diagnosis.NODE_THERMAL) == pytest.approx(3 / 10)
    assert eng.p_healthy(Diagnosis.NODE_LINK) == pytest.approx(4 / 5)
    # at P = 0.3 a 20 % straggler pays back in 600 / 0.06 s = 2.8 h: worth it with 24 h left
    # (margin 0.25 x 24 h = 6 h), not with 8 h left (2 h)
    [rec] = eng.decide([_straggler("n0013", T0 + 100, 0.2)], now=T0 + 100)
    assert rec.action is Action.EVICT
    eng2 = load_engine(store, default_remaining_s=8 * 3600.0)
    [rec2] = eng2.decide([_straggler("n0013", T0 + 100, 0.2)], now=T0 + 100)
    assert rec2.action is Action.NONE and rec2.evidence["p_healthy"] == pytest.approx(0.3)


def test_breaker_trip_is_stored_and_reset_by_an_operator(store):
    eng = load_engine(store, breaker_min_nodes=2, fleet_nodes=10, breaker_share=0.1)
    recs = eng.decide([_xid(f"n{8 * i:04d}", T0 + i) for i in range(4)], now=T0 + 5)  # one per rack
    assert [r.guard for r in recs if r.action is Action.DRAIN].count(Guard.ALLOWED) == 2
    save_engine(store, eng, T0 + 5)
    stored = breaker_record(store)
    assert stored is not None and stored.open and stored.tripped_ts == pytest.approx(T0 + 5)
    # another process loading the engine sees the breaker open
    other = load_engine(store, breaker_min_nodes=2, fleet_nodes=10, breaker_share=0.1)
    [held] = other.decide([_xid("n0050", T0 + 50_000)], now=T0 + 50_000)
    assert held.guard is Guard.NEEDS_HUMAN and "breaker" in held.evidence["guards_fired"]
    # an operator resets it in the store (POST /v1/breaker/reset); the running engine picks it up
    rec = reset_breaker(store, T0 + 60_000, by="alice")
    assert not rec.open and rec.reset_by == "alice"
    sync_breaker(store, other)
    assert not other.breaker_.open_
    recs = other.decide([_xid("n0051", T0 + 60_001)], now=T0 + 60_001)
    [ok] = [r for r in recs if r.node == "n0051"]
    assert ok.guard is Guard.ALLOWED
    # what the open breaker held is older than the staleness bound by now: listed for a human, never acted on
    listed = [r for r in recs if r.node != "n0051"]
    assert [r.node for r in listed] == ["n0016", "n0024", "n0050"]
    assert all(r.guard is Guard.NEEDS_HUMAN and r.evidence["guards_fired"] == ["breaker", "stale"] for r in listed)
