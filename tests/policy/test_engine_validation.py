"""The policy's rollback lands only on validated checkpoints once a job reports validation results."""

from __future__ import annotations

from fleethealth.payloads.checkpoint import checkpoint_event
from fleethealth.payloads.validation import checkpoint_validated_event
from fleethealth.policy.engine import PolicyEngine
from fleethealth.schema import Action, Event, Finding, FindingKind, Guard, decode, encode

T0 = 100_000.0
JOB = "llm-run"


def _checkpoints(*steps: int):
    return [checkpoint_event(ts=T0 + s, step=s, uri=f"/ck/{s}", last_verified_step=s, last_replay_step=s,
                             node="gpu-a17", job=JOB) for s in steps]


def _validated(step: int, ok: bool, why: str = "tensor w norm 812 is 104x the largest"):
    return checkpoint_validated_event(ts=T0 + step + 1, step=step, uri=f"/ck/{step}",
                                      result="valid" if ok else "invalid", reasons=() if ok else (why,),
                                      node="gpu-a17", job=JOB)


def _sdc(step: int = 400) -> Finding:
    return Finding(kind=FindingKind.SDC, node="gpu-b03", ts=T0 + step, job=JOB, gpu=2, step=step, detector="sdc",
                   evidence={"classification": "transient", "check": "selfcheck",
                             "corroboration": {"by": ["second_check"]}, "rack": "rack-7"})


def _rollback(engine: PolicyEngine, step: int = 400):
    return [r for r in engine.decide([_sdc(step)], now=T0 + step) if r.action is Action.ROLLBACK]


def test_an_invalid_newest_checkpoint_is_refused_and_named():
    eng = PolicyEngine()
    eng.observe([*_checkpoints(100, 200, 300), _validated(100, True), _validated(200, True),
                 _validated(300, False)])
    [rb] = _rollback(eng)
    assert rb.guard is Guard.ALLOWED and rb.evidence["target_step"] == 200
    assert rb.evidence["validation"] == "required"
    assert rb.evidence["refused_checkpoints"] == [[300, "invalid: tensor w norm 812 is 104x the largest"]]
    assert "checkpoint step 300 refused" in rb.reason


def test_a_checkpoint_not_yet_validated_is_not_a_target_once_the_job_validates():
    eng = PolicyEngine()
    eng.observe([*_checkpoints(100, 200), _validated(100, True)])  # 200's validation has not come back
    [rb] = _rollback(eng)
    assert rb.evidence["target_step"] == 100
    assert rb.evidence["refused_checkpoints"] == [[200, "not validated"]]


def test_no_validated_checkpoint_needs_a_human():
    eng = PolicyEngine()
    eng.observe([*_checkpoints(100), _validated(100, False, "shard __0_0.distcp is missing")])
    [rb] = _rollback(eng)
    assert rb.guard is Guard.NEEDS_HUMAN and "no validated checkpoint" in rb.reason
    assert "shard __0_0.distcp is missing" in rb.reason


def test_a_job_that_never_validates_keeps_the_marks_rule_unless_validation_is_required():
    eng = PolicyEngine()
    eng.observe(_checkpoints(100, 200, 300))
    [rb] = _rollback(eng)
    assert rb.evidence["target_step"] == 300 and rb.evidence["validation"] == "not_reported"
    strict = PolicyEngine(require_validated=True)
    strict.observe(_checkpoints(100, 200, 300))
    [rb2] = _rollback(strict)
    assert rb2.guard is Guard.NEEDS_HUMAN
    assert [s for s, _ in rb2.evidence["refused_checkpoints"]] == [100, 200, 300]


def test_validations_survive_the_engine_state_round_trip_and_the_wire():
    eng = PolicyEngine()
    sent = [*_checkpoints(100, 200), _validated(100, True), _validated(200, False)]
    events = [decode(Event, encode(e)) for e in sent]
    eng.observe(events)
    again = PolicyEngine()
    again.load_state(eng.to_state())
    [rb] = _rollback(again)
    assert rb.evidence["target_step"] == 100
    again.forget_job(JOB)
    assert JOB not in again.validations_
