"""The policy engine on the faults seen in real traffic: a hang with no culprit pages and removes no
node; NVLink errors climbing are reported as a warning and drained as a failure risk when critical,
unless the node's eviction is already held."""

from __future__ import annotations

from fleethealth.policy.engine import PolicyEngine
from fleethealth.schema import Action, Diagnosis, Finding, FindingKind, Guard

T0 = 100_000.0


def _hang(culprit: bool) -> Finding:
    evidence = {"culprit": culprit, "level": not culprit, "behind_ranks": [] if not culprit else [16],
                "behind_nodes": [] if not culprit else ["n0002"]}
    return Finding(kind=FindingKind.HANG, node="n0000", ts=T0, job="train-1", rank=None if not culprit else 16,
                   step=451, detector="hang", evidence=evidence)


def _link(severity: str, node: str = "n0021", ts: float = T0) -> Finding:
    return Finding(kind=FindingKind.LINK, node=node, ts=ts, gpu=None, detector="health.link",
                   evidence={"rule": "nvlink", "severity": severity, "errors_per_min": 42.0, "gpus": [0, 1]})


def test_a_hang_without_a_culprit_pages_and_one_with_a_culprit_drains_it():
    engine = PolicyEngine()
    [page] = engine.decide([_hang(culprit=False)], T0)
    assert page.action is Action.PAGE and page.evidence["culprit"] is False and "no node is drained" in page.reason
    assert engine.drained_ == set()
    [drain] = PolicyEngine().decide([_hang(culprit=True)], T0)
    assert drain.action is Action.DRAIN and drain.guard is Guard.ALLOWED


def test_nvlink_errors_warning_is_reported_critical_drains_as_failure_risk_and_a_held_eviction_holds_it():
    engine = PolicyEngine()
    [watch] = engine.decide([_link("warning")], T0)
    assert watch.action is Action.NONE and "watched" in watch.reason
    [drain] = engine.decide([_link("critical", ts=T0 + 60)], T0 + 60)
    assert drain.action is Action.DRAIN and drain.evidence["planned"] is True and drain.guard is Guard.ALLOWED
    # the job's rate limit held the node's eviction: a drain would restart the job the same way
    held = PolicyEngine()
    evicts = [Finding(kind=FindingKind.STRAGGLER, node=f"n00{10 + i}", ts=T0, job="train-1", gpu=3, rank=8 * i,
                      step=100, diagnosis=Diagnosis.NODE_THERMAL, z=8.0, slowdown=0.2, detector="straggler",
                      evidence={}) for i in range(2)]
    recs = held.decide(evicts, T0)
    held_node = next(r.node for r in recs if r.action is Action.EVICT and r.guard is not Guard.ALLOWED)
    [none] = held.decide([_link("critical", node=held_node, ts=T0 + 60)], T0 + 60)
    assert none.action is Action.NONE and "held" in none.reason
