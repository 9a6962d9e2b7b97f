"""The policy stage and the eviction-outcome loop: an executed straggler eviction is judged against the
job's later stragglers and moves P(healthy); an eviction never carried out teaches nothing; recorded
outcomes survive a restart and are counted once."""

from __future__ import annotations

import pytest

from fleethealth.adapters.base import ActionRecord, Outcome
from fleethealth.policy.engine import PolicyEngine
from fleethealth.policy.persist import load_engine, outcomes, record_outcome, save_engine
from fleethealth.policy.stage import PolicyStage
from fleethealth.schema import Action, Diagnosis, Event, Finding, FindingKind, Guard, Recommendation

T0 = 1_767_225_600.0


def _straggler(node: str, ts: float, *, slowdown: float = 0.2, job: str = "train-1", rank: int = 107) -> Finding:
    return Finding(kind=FindingKind.STRAGGLER, node=node, ts=ts, job=job, gpu=3, rank=rank, step=100,
                   diagnosis=Diagnosis.NODE_THERMAL, z=8.0, slowdown=slowdown, detector="straggler")


def _executed(rec: Recommendation, ts: float, outcome: Outcome = Outcome.DONE) -> Event:
    """The event ``fleethealth act`` publishes on fh.events after handling ``rec``."""
    return ActionRecord(recommendation_id=rec.id, scheduler="slurm", node=rec.node, action=rec.action,
                        outcome=outcome, ts=ts, rec_ts=rec.ts, job=rec.job).to_event()


def _evict(stage: PolicyStage) -> Recommendation:
    decided = stage.update([_straggler("n0013", T0)], [], T0)
    [rec] = decided.recommendations
    assert rec.action is Action.EVICT and rec.guard is Guard.ALLOWED and decided.changed
    return rec


def test_a_replacement_that_straggles_again_lowers_p_healthy() -> None:
    stage = PolicyStage()
    rec = _evict(stage)
    executed = stage.update([], [_executed(rec, T0 + 60)], T0 + 60)
    assert executed.changed and not executed.outcomes              # carried out; too early to judge
    # a straggler before the eviction took effect says nothing about it
    assert stage.update([_straggler("n0013", T0 + 30, rank=108)], [], T0 + 70).outcomes == []
    again = stage.update([_straggler("n0014", T0 + 900, slowdown=0.18, rank=115)], [], T0 + 900)
    [outcome] = again.outcomes
    assert outcome.resolved is False and outcome.diagnosis is Diagnosis.NODE_THERMAL and outcome.node == "n0013"
    assert stage.engine.p_healthy(Diagnosis.NODE_THERMAL) == pytest.approx(3 / 5)
    # judged once: nothing more comes of this eviction
    assert stage.update([_straggler("n0015", T0 + 1000, rank=123)], [], T0 + 1000).outcomes == []


def test_an_eviction_that_ends_the_straggle_raises_p_healthy_and_the_next_payback_uses_it() -> None:
    stage = PolicyStage()
    rec = _evict(stage)
    stage.update([], [_executed(rec, T0 + 60)], T0 + 60)
    assert stage.update([], [], T0 + 1800).outcomes == []            # settle_s counts from the execution
    [outcome] = stage.update([], [], T0 + 1860).outcomes
    assert outcome.resolved is True and outcome.ts == T0 + 60 + 1800
    assert stage.engine.p_healthy(Diagnosis.NODE_THERMAL) == pytest.approx(4 / 5)
    [later] = stage.update([_straggler("n0020", T0 + 5000, rank=163)], [], T0 + 5000).recommendations
    assert later.evidence["p_healthy"] == pytest.approx(0.8) and later.evidence["p_healthy_counts"] == [1, 0]


@pytest.mark.parametrize("outcome", [Outcome.DRY_RUN, Outcome.SKIPPED_GUARD, Outcome.FAILED])
def test_an_eviction_not_carried_out_teaches_nothing(outcome: Outcome) -> None:
    stage = PolicyStage()
    rec = _evict(stage)
    stage.update([], [_executed(rec, T0 + 60, outcome)], T0 + 60)
    assert stage.update([_straggler("n0014", T0 + 900, rank=115)], [], T0 + 900).outcomes == []
    assert stage.update([], [], T0 + 4000).outcomes == []
    assert stage.engine.p_healthy(Diagnosis.NODE_THERMAL) == pytest.approx(3 / 4)


def test_a_dry_run_engine_watches_nothing() -> None:
    stage = PolicyStage(PolicyEngine(dry_run=True))
    [rec] = stage.update([_straggler("n0013", T0)], [], T0).recommendations
    assert rec.dry_run and stage.engine.watch_.issued_ == {}


def test_an_execution_report_long_after_the_recommendation_is_ignored() -> None:
    stage = PolicyStage()
    rec = _evict(stage)
    stage.update([], [], T0 + 2 * stage.engine.stale_after_s + 1)    # the actor would no longer act on it
    stage.update([], [_executed(rec, T0 + 2000)], T0 + 2000)
    assert stage.engine.watch_.executed_ == {}


def test_the_watch_and_recorded_outcomes_survive_a_restart_and_count_once(store) -> None:
    stage = PolicyStage(load_engine(store))
    rec = _evict(stage)
    stage.update([], [_executed(rec, T0 + 60)], T0 + 60)
    save_engine(store, stage.engine, T0 + 60)
    # restart: the executed eviction is still watched and is judged by the next straggler
    stage = PolicyStage(load_engine(store))
    [outcome] = stage.update([_straggler("n0014", T0 + 900, rank=115)], [], T0 + 900).outcomes
    record_outcome(store, outcome)
    # a crash before the engine state was saved: the old state is loaded, the outcome already recorded
    replayed = PolicyStage(load_engine(store))
    assert replayed.engine.watch_.executed_ == {}
    assert replayed.update([_straggler("n0014", T0 + 900, rank=115)], [], T0 + 900).outcomes == []
    record_outcome(store, outcome)                                    # even a duplicate row counts once
    assert len(outcomes(store)) == 2
    assert load_engine(store).posterior_.counts(Diagnosis.NODE_THERMAL) == (0, 1)


def test_a_job_detection_forgot_is_forgotten_by_the_engine_too():
    """Bounded state: once detection reports a job ended, the engine drops its checkpoints, marks and
    rollbacks, so the saved engine state does not grow with every job that ever ran."""
    from fleethealth.payloads.checkpoint import CheckpointRecord

    stage = PolicyStage()
    eng = stage.engine
    eng.checkpoints_["old"] = [CheckpointRecord(10, "s3://c", 5)]
    eng.last_pass_["old"] = 5
    eng.rolled_back_ |= {"old@10", "live@3"}
    stage.update([], [], 1000.0, ended=["old"])
    assert "old" not in eng.checkpoints_ and "old" not in eng.last_pass_ and eng.rolled_back_ == {"live@3"}
