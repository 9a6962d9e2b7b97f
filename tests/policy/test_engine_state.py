"""The engine's memory as saved: a state written before the rules moved to ``policy/rules/`` still
loads, round-trips unchanged, and the engine restored from it decides what the engine that wrote it
decided, with the same recommendation ids; a fresh engine decides the recorded history the same way.

``data/engine_state_v1.json`` was written by ``PolicyEngine.to_state`` as of the commit before the
move (its ``written_by``), from :func:`_before`; its ``after`` rows are what an engine restored from
that state then recommended for :func:`_after`. The history fills every part of the memory:
evictions (allowed, rate-limited, UNKNOWN), an executed eviction judged, a hot-aisle episode,
drains, an SDC quarantine and rollback over validated checkpoints, the breaker tripped with removals
held, its reset and the held removals decided again, a release and a forgotten job.
"""

from __future__ import annotations

import dataclasses
import pathlib

import orjson
import pytest

from fleethealth.payloads.checkpoint import checkpoint_event
from fleethealth.payloads.validation import checkpoint_validated_event
from fleethealth.policy.engine import EngineState, PolicyEngine
from fleethealth.schema import Diagnosis, Event, EventKind, Finding, FindingKind

FIXTURE = pathlib.Path(__file__).parent / "data" / "engine_state_v1.json"
T0 = 100_000.0
JOB = "train-1"
PARAMS = {"breaker_max_nodes": 5, "rate_window_s": 3600.0}
SUPPORTED = {"corroboration": {"by": ["prior_fault"]}}


def _rack(node):
    return f"r{int(node[1:]) // 8:02d}"


def _straggler(node, ts, diag=Diagnosis.NODE_THERMAL, slowdown=0.3, job=JOB, **evidence):
    return Finding(kind=FindingKind.STRAGGLER, node=node, ts=ts, job=job, gpu=3, rank=int(node[1:]) * 8 + 3,
                   step=100, diagnosis=diag, z=8.0, slowdown=slowdown, detector="straggler",
                   evidence={"rack": _rack(node), **evidence})


def _finding(kind, node, ts, job=JOB, **kw):
    evidence = {"rack": _rack(node), **kw.pop("evidence", {})}
    if kind in (FindingKind.XID, FindingKind.ECC, FindingKind.SDC):
        evidence = {**SUPPORTED, **evidence}
    return Finding(kind=kind, node=node, ts=ts, job=job, gpu=kw.pop("gpu", 1), detector="test",
                   evidence=evidence, **kw)


def _before(engine):
    """Phase one: what the engine decides while its memory fills; returns the recommendations."""
    out = []
    engine.set_remaining(JOB, 5 * 86_400.0)
    engine.observe([checkpoint_event(ts=T0 + s, step=s, uri=f"/ck/{s}", last_verified_step=s, last_replay_step=s,
                                     node="n0001", job=JOB) for s in (100, 200, 300)]
                   + [checkpoint_validated_event(ts=T0 + 201, step=200, uri="/ck/200", result="valid", reasons=(),
                                                 node="n0001", job=JOB),
                      checkpoint_validated_event(ts=T0 + 301, step=300, uri="/ck/300", result="invalid",
                                                 reasons=("norm 104x",), node="n0001", job=JOB),
                      Event(node="n0001", ts=T0 + 250, kind=EventKind.SDC_CHECK, job=JOB, step=250,
                            data={"passed": True, "check": "selfcheck"}),
                      Event(node="n0001", ts=T0 + 150, kind=EventKind.SDC_CHECK, job=JOB, step=150,
                            data={"passed": True, "check": "replay"})])
    t = T0 + 400
    first = engine.decide([_straggler("n0013", t)], now=t)
    out += first
    engine.observe([Event(node="n0013", ts=t + 30, kind=EventKind.SCHEDULER_ACTION, job=JOB,
                          data={"outcome": "done", "action": "evict", "recommendation_id": first[0].id})])
    out += engine.decide([_straggler("n0021", t + 40, diag=Diagnosis.UNKNOWN, job="train-2")], now=t + 40)
    out += engine.decide([_straggler("n0029", t + 50)], now=t + 50)   # rate limited: held
    out += engine.decide([_straggler("n0070", t + 60, diag=Diagnosis.ENVIRONMENTAL)], now=t + 60)
    out += engine.decide([_finding(FindingKind.XID, "n0030", t + 70, evidence={"code": 79})], now=t + 70)
    out += engine.decide([_finding(FindingKind.SDC, "n0040", t + 80, step=320,
                                  evidence={"classification": "transient", "check": "selfcheck"})], now=t + 80)
    out += engine.decide([_finding(FindingKind.FAILURE_RISK, "n0050", t + 90, probability=0.9)], now=t + 90)
    out += engine.decide([_finding(FindingKind.HANG, "n0060", t + 100, step=330)], now=t + 100)
    out += engine.decide([_finding(FindingKind.ECC, "n0081", t + 110, evidence={"severity": "critical"})],
                         now=t + 110)
    # the breaker trips (more than breaker_max_nodes removed in its window) and holds what follows
    out += engine.decide([_finding(FindingKind.XID, "n0090", t + 120, evidence={"code": 79})], now=t + 120)
    out += engine.decide([_finding(FindingKind.XID, "n0099", t + 130, evidence={"code": 48})], now=t + 130)
    return out


def _after(engine):
    """Phase two, on the engine phase one left (or one restored from its saved state)."""
    t = T0 + 600
    out = []
    out += [engine.judge([_straggler("n0014", t - 1, slowdown=0.3)], now=t - 1)]  # the evicted straggle recurs
    out += engine.decide([_straggler("n0013", t, slowdown=0.35)], now=t)          # outcome judged: not resolved
    out += engine.decide([_finding(FindingKind.SDC, "n0040", t + 5, step=340,
                                  evidence={"classification": "transient"})], now=t + 5)
    out += engine.decide([_finding(FindingKind.LINK, "n0107", t + 10, evidence={"rule": "nvlink",
                                  "severity": "critical", "errors_per_min": 30})], now=t + 10)
    engine.reset_breaker()
    out += engine.decide([_straggler("n0071", t + 20, diag=Diagnosis.ENVIRONMENTAL)], now=t + 20)
    out += engine.decide([_finding(FindingKind.HANG, "n0110", t + 30, evidence={"culprit": False})], now=t + 30)
    out += engine.decide([_finding(FindingKind.FAILURE_RISK, "n0050", t + 40, probability=0.95)], now=t + 40)
    out += engine.decide([_finding(FindingKind.THERMAL, "n0120", t + 50)], now=t + 50)
    engine.release("n0040")
    out += engine.decide([_finding(FindingKind.SDC, "n0040", t + 60, step=380,
                                  evidence={"classification": "transient"})], now=t + 60)
    engine.forget_job("train-2")
    return out


def _rows(recs: list) -> list[dict]:
    out = []
    for r in recs:
        if isinstance(r, list):  # what judge returned
            out.append({"outcomes": [[o.node, o.job, o.diagnosis.value, o.resolved, o.finding_id, o.ts] for o in r]})
        else:
            out.append({"id": r.id, **r.to_obj()})
    return orjson.loads(orjson.dumps(out))


@pytest.fixture(scope="module")
def saved() -> dict:
    return orjson.loads(FIXTURE.read_bytes())


def test_a_fresh_engine_decides_the_recorded_history_with_the_same_ids(saved: dict) -> None:
    engine = PolicyEngine(**saved["params"])
    assert _rows(_before(engine)) == saved["before"]
    assert orjson.loads(orjson.dumps(engine.to_state())) == saved["state"]


def test_a_state_saved_before_the_move_loads_and_decides_the_same(saved: dict) -> None:
    engine = PolicyEngine(**saved["params"])
    engine.load_state(saved["state"])
    assert orjson.loads(orjson.dumps(engine.to_state())) == saved["state"]    # round trip, key for key
    assert _rows(_after(engine)) == saved["after"]
    assert orjson.loads(orjson.dumps(engine.to_state())) == saved["state_after"]


def test_the_engine_memory_is_one_dataclass_saved_field_for_field(saved: dict) -> None:
    engine = PolicyEngine(**saved["params"])
    engine.load_state(saved["state"])
    assert isinstance(engine.state_, EngineState)
    fields = {f.name for f in dataclasses.fields(EngineState)}
    assert set(engine.to_state()) == fields                  # every field saved, nothing saved beside them
    # beside state_ the engine holds only its parameters: numbers and flags set at construction
    others = {k: v for k, v in vars(engine).items() if k != "state_"}
    assert others and all(isinstance(v, int | float | bool) for v in others.values()), others
    # the engine's name_ attributes are the dataclass's fields, not copies
    assert engine.drained_ is engine.state_.drained and engine.breaker_ is engine.state_.breaker
    engine.release("n0030")
    assert "n0030" not in engine.state_.drained and "n0030" not in engine.drained_
