"""Kubernetes adapter against hand-written API fixtures (no API server runs on these machines).

Each test replays one file of ``tests/adapters/fixtures/``: JSON exchanges written by hand from the
Kubernetes API reference (Node, PodList, Event, Eviction and Status objects in the shape a v1.31
server returns), not recordings of a real server. A small HTTP server on 127.0.0.1 (fixture
``k8s_replay``) lets the official ``kubernetes`` client talk to it over real HTTP and checks every
request it makes (method, path, query, content type, JSON body) against the fixture.
"""

from __future__ import annotations

import pytest

from fleethealth.adapters import Actor, KubernetesAdapter, LeftAlone, Outcome, SchedulerError, UnknownNode
from fleethealth.adapters.kubernetes import (
    AT_ANNOTATION,
    CONDITION_TYPE,
    OWNER,
    OWNER_LABEL,
    REASON_ANNOTATION,
    TAINT_KEY,
    DrainIncomplete,
    Operation,
)
from fleethealth.schema import Action, Guard, Recommendation

TS = 1795900000.0  # 2026-11-28T21:06:40Z
CORDON_ONLY = {Action.EVICT: Operation.CORDON, Action.DRAIN: Operation.CORDON, Action.QUARANTINE: Operation.CORDON}


class _Time:
    """Clock and sleep for the adapter: sleeping advances the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _adapter(api, *, cordon_only: bool = False, time: _Time | None = None, **kw) -> KubernetesAdapter:
    time = time or _Time()
    return KubernetesAdapter(api, operations=CORDON_ONLY if cordon_only else None, grace_period_s=120,
                             sleep=time.sleep, clock=time.clock, rng=lambda: 0.5, **kw)


def _rec(node: str = "n0013", action: Action = Action.QUARANTINE, **kw) -> Recommendation:
    return Recommendation(action=action, node=node, ts=TS, reason="sdc: bitwise self-check mismatch on GPU 5",
                          job="train-1", finding_id="0d5e7c1a9b3f2e4d6c8a0b1c", **kw)


def test_cordon_taints_marks_ownership_and_keeps_other_taints(k8s_replay):
    replay = k8s_replay("cordon_taint_condition.json")
    ops = _adapter(replay.api, cordon_only=True).apply(_rec())
    replay.assert_all_replayed()
    assert ops == (f"PATCH /api/v1/nodes/n0013 unschedulable=true taint {TAINT_KEY}=cordon:NoSchedule "
                   f"label {OWNER_LABEL}={OWNER}",
                   f"PATCH /api/v1/nodes/n0013/status condition {CONDITION_TYPE}=True reason=FleetHealthQuarantine")
    body = replay.seen[1]["body"]
    assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in body["spec"]["taints"]
    assert body["metadata"]["labels"] == {OWNER_LABEL: OWNER}
    assert set(body["metadata"]["annotations"]) == {REASON_ANNOTATION, AT_ANNOTATION}
    assert replay.seen[-1]["path"] == "/api/v1/namespaces/default/events"  # one Event on the node


def test_drain_evicts_pods_through_the_eviction_api_and_waits_out_a_pdb(k8s_replay):
    """drain_evict.json: the Job and ReplicaSet pods are evicted (policy/v1, grace period 120 s); the
    DaemonSet, mirror and finished pods are not; the PodDisruptionBudget's 429 is retried a round later."""
    replay = k8s_replay("drain_evict.json")
    time = _Time()
    ops = _adapter(replay.api, time=time).apply(_rec())  # quarantine -> drain
    replay.assert_all_replayed()
    assert ops[2:] == ("POST /api/v1/namespaces/team-a/pods/train-1-worker-13/eviction",
                       "POST /api/v1/namespaces/team-b/pods/web-7d9f-x2k4q/eviction")
    assert time.slept == [5.0]  # one PDB retry round, no API backoff
    evictions = [r for r in replay.seen if r["path"].endswith("/eviction")]
    assert {r["body"]["kind"] for r in evictions} == {"Eviction"}
    assert all(r["body"]["deleteOptions"] == {"gracePeriodSeconds": 120} for r in evictions)


def test_drain_never_overrides_a_pdb_and_reports_the_blocked_pod(k8s_replay):
    replay = k8s_replay("drain_pdb_blocked.json")
    time = _Time()
    adapter = _adapter(replay.api, time=time, drain_timeout_s=9.0)
    with pytest.raises(DrainIncomplete, match="1 pods not evicted .team-b/web-7d9f-x2k4q.") as err:
        adapter.apply(_rec())
    replay.assert_all_replayed()  # the Event is written although the drain is incomplete
    assert err.value.blocked == ("team-b/web-7d9f-x2k4q",)
    assert not any(r["method"] == "DELETE" for r in replay.seen)
    record = Actor(_adapter(k8s_replay("drain_pdb_blocked.json").api, drain_timeout_s=9.0),
                   clock=lambda: TS).handle(_rec())
    assert record.outcome is Outcome.FAILED and "tried again later" in record.detail


def test_replayed_recommendation_makes_no_write(k8s_replay):
    replay = k8s_replay("already_applied.json")
    assert _adapter(replay.api).apply(_rec()) == ()
    replay.assert_all_replayed()
    assert [r["method"] for r in replay.seen] == ["GET", "GET"]


def test_conflict_is_retried_on_a_fresh_read(k8s_replay):
    replay = k8s_replay("conflict_retry.json")
    time = _Time()
    ops = _adapter(replay.api, cordon_only=True, time=time).apply(_rec())
    replay.assert_all_replayed()
    assert len(ops) == 2
    assert replay.seen[3]["body"]["metadata"]["resourceVersion"] == "48220"
    assert time.slept == [0.25]  # backoff 0.5 s x jitter 0.5


def test_server_errors_are_retried_with_bounded_jittered_backoff(k8s_replay):
    replay = k8s_replay("server_errors_retry.json")
    time = _Time()
    assert len(_adapter(replay.api, cordon_only=True, time=time).apply(_rec())) == 2
    replay.assert_all_replayed()
    assert time.slept == [0.25, 0.25]  # each call's first retry
    failing = k8s_replay("server_errors_retry.json")
    with pytest.raises(SchedulerError, match="HTTP 503"):
        _adapter(failing.api, cordon_only=True, retries=1).apply(_rec())  # no retries left: one clear error


def test_opted_out_node_is_left_alone(k8s_replay):
    replay = k8s_replay("opt_out.json")
    record = Actor(_adapter(replay.api), clock=lambda: TS).handle(_rec())
    replay.assert_all_replayed()
    assert record.outcome is Outcome.SKIPPED_NOT_OURS and "fleethealth.io/opt-out=true" in record.detail
    with pytest.raises(LeftAlone):
        _adapter(k8s_replay("opt_out.json").api).release("n0013", ts=TS)


def test_unknown_node_raises_and_writes_nothing(k8s_replay):
    replay = k8s_replay("unknown_node.json")
    with pytest.raises(UnknownNode, match="n0099"):
        _adapter(replay.api).apply(_rec(node="n0099"))
    replay.assert_all_replayed()


def test_release_uncordons_only_a_cordon_fleethealth_made(k8s_replay):
    """release.json: the node carries fleethealth's owner label, so it is uncordoned and the marks go.
    release_human_cordon.json: a person cordoned it (no label), so the patch leaves
    ``spec.unschedulable`` alone and only the taint and annotations go (the replay fails on any other body)."""
    ours = k8s_replay("release.json")
    ops = _adapter(ours.api).release("n0013", ts=1795921200.0, message="passing full self-test")
    ours.assert_all_replayed()
    assert ops[0].startswith("PATCH /api/v1/nodes/n0013 unschedulable=false") and len(ops) == 2
    assert ours.seen[1]["body"]["metadata"]["labels"] == {OWNER_LABEL: None}
    assert ours.seen[-1]["body"]["type"] == "Normal"
    human = k8s_replay("release_human_cordon.json")
    ops = _adapter(human.api).release("n0013", ts=1795921200.0, message="passing full self-test")
    human.assert_all_replayed()
    assert "unschedulable" not in human.seen[1]["body"]["spec"] and "cordon not ours, kept" in ops[0]


def test_bad_node_names_never_reach_the_api(k8s_replay):
    replay = k8s_replay("unknown_node.json")
    adapter = _adapter(replay.api)
    for bad in ("N0013", "n0013 ", "n[0000-0999]", "-n1", "a/b"):
        with pytest.raises(SchedulerError, match="refusing node name|not a Kubernetes node name"):
            adapter.apply(_rec(node=bad))
    assert replay.seen == []


def test_actions_map_to_operations_and_dry_run_makes_no_request(k8s_replay):
    replay = k8s_replay("already_applied.json")
    actor = Actor(_adapter(replay.api), dry_run=True, clock=lambda: TS)
    for k, action in enumerate((Action.EVICT, Action.DRAIN, Action.QUARANTINE)):
        planned = actor.handle(_rec(node=f"n001{k}", action=action))
        assert planned.outcome is Outcome.DRY_RUN and any("eviction" in op for op in planned.operations)
    planned = Actor(_adapter(replay.api), dry_run=True, clock=lambda: TS).handle(_rec())
    assert planned.outcome is Outcome.DRY_RUN and "taint fleethealth.io/unhealthy=drain" in planned.operations[0]
    assert any("eviction" in op for op in planned.operations)
    cordon = Actor(_adapter(replay.api, cordon_only=True), dry_run=True, clock=lambda: TS).handle(_rec())
    assert not any("eviction" in op for op in cordon.operations)
    held = Actor(_adapter(replay.api), clock=lambda: TS).handle(_rec(guard=Guard.RATE_LIMITED))
    assert held.outcome is Outcome.SKIPPED_GUARD
    facilities = Actor(_adapter(replay.api), clock=lambda: TS).handle(_rec(action=Action.ALERT_FACILITIES))
    assert facilities.outcome is Outcome.SKIPPED_UNSUPPORTED
    assert replay.seen == []


def test_replay_refuses_a_request_that_is_not_in_the_fixture(k8s_replay):
    """The harness itself: a write the fixture does not hold fails the call and is reported."""
    replay = k8s_replay("already_applied.json")
    with pytest.raises(SchedulerError, match="HTTP 500"):
        _adapter(replay.api, cordon_only=True).apply(_rec())  # taint value cordon, not drain: a write
    assert replay.mismatches and any(m.startswith("request #2 differs") and "'method': 'PATCH'" in m
                                     for m in replay.mismatches)


def test_the_sweep_returns_a_node_the_quarantine_book_releases(k8s_replay, store):
    """apply_release with the adapter: the book releases the node after a complete passing full suite
    (a recorded real CPU run), then fleethealth's cordon, taint and marks come off the node."""
    import json
    from pathlib import Path

    from fleethealth.kernels.results import SelfTestResult
    from fleethealth.policy import quarantine
    from fleethealth.sweeps.launch import NodeRun
    from fleethealth.sweeps.release import apply_release, release_decision

    recorded = Path(__file__).parents[1] / "sweeps" / "recordings" / "full_cpu_pass.jsonl"
    results = tuple(SelfTestResult.from_data({**json.loads(line), "node": "n0013"})
                    for line in recorded.read_text().splitlines())
    quarantine.quarantine(store, "n0013", "sdc from cross-rank replay", ts=1000.0)
    replay = k8s_replay("resume_after_sweep.json")
    adapter = _adapter(replay.api, wall_clock=lambda: 1795921200.0)
    assert apply_release(store, release_decision(NodeRun("n0013", "full", 0, results), quarantined=True), adapter)
    replay.assert_all_replayed()
    assert quarantine.record(store, "n0013") is None
    assert replay.seen[1]["body"]["spec"]["unschedulable"] is False


def test_drain_refuses_unmanaged_and_emptydir_pods_as_kubectl_does(k8s_replay):
    """drain_refused.json: a pod no controller manages and a pod with emptyDir data make the drain
    refuse (kubectl drain without --force / --delete-emptydir-data): the node stays cordoned, no pod
    is evicted, the Event and the error name both pods and the option that allows each; kube-system
    pods are left running."""
    from fleethealth.adapters.kubernetes import DrainRefused

    replay = k8s_replay("drain_refused.json")
    with pytest.raises(DrainRefused, match="refused.*team-c/debug-shell.*act.drain_force.*team-b/cache-5c8d-p7r2n"
                                           ".*act.drain_delete_emptydir_data") as err:
        _adapter(replay.api).apply(_rec())
    replay.assert_all_replayed()
    assert err.value.blocked == ("team-c/debug-shell", "team-b/cache-5c8d-p7r2n")
    assert not any(r["path"].endswith("/eviction") for r in replay.seen)
    record = Actor(_adapter(k8s_replay("drain_refused.json").api), clock=lambda: TS).handle(_rec())
    assert record.outcome is Outcome.FAILED and "debug-shell" in record.detail


def test_drain_with_force_and_emptydir_allowed_evicts_them_but_not_kube_system(k8s_replay):
    replay = k8s_replay("drain_forced.json")
    ops = _adapter(replay.api, force=True, delete_emptydir_data=True).apply(_rec())
    replay.assert_all_replayed()
    assert ops[2:] == ("POST /api/v1/namespaces/team-a/pods/train-1-worker-13/eviction",
                       "POST /api/v1/namespaces/team-c/pods/debug-shell/eviction",
                       "POST /api/v1/namespaces/team-b/pods/cache-5c8d-p7r2n/eviction")
    assert not any("kube-system" in r["path"] for r in replay.seen)


def test_act_passes_the_drain_options_from_its_settings(monkeypatch):
    from fleethealth.commands import build_parser
    from fleethealth.commands._settings import load_settings

    monkeypatch.setenv("FLEETHEALTH_ACT_DRAIN_FORCE", "true")
    argv = ["act", "--set", "act.drain_skip_namespaces=kube-system, gpu-operator"]
    s = load_settings(build_parser().parse_args(argv))
    assert s["act.drain_force"] is True and s["act.drain_delete_emptydir_data"] is False
    assert s["act.drain_skip_namespaces"] == "kube-system, gpu-operator"
