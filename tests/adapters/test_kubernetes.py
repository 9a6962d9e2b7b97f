"""Kubernetes adapter against recorded API exchanges (no API server runs on these machines).

Each test replays one file of ``tests/adapters/recordings/`` through a small HTTP server on
127.0.0.1 (fixture ``k8s_replay``): the official ``kubernetes`` client talks to it over real
HTTP, the server checks every request it makes (method, path, query, content type, JSON body)
against the recording and answers with the recorded Node or Status object.
"""

from __future__ import annotations

import pytest

from fleethealth.adapters import Actor, KubernetesAdapter, Outcome, SchedulerError, UnknownNode
from fleethealth.adapters.kubernetes import CONDITION_TYPE, CORDON_ANNOTATION, TAINT_KEY
from fleethealth.schema import Action, Guard, Recommendation

TS = 1795900000.0  # 2026-11-28T21:06:40Z


def _rec(node: str = "n0013", action: Action = Action.QUARANTINE, **kw) -> Recommendation:
    return Recommendation(action=action, node=node, ts=TS, reason="sdc: bitwise self-check mismatch on GPU 5",
                          job="train-1", finding_id="0d5e7c1a9b3f2e4d6c8a0b1c", **kw)


def test_cordon_taint_and_condition_keep_other_taints(k8s_replay):
    replay = k8s_replay("cordon_taint_condition.json")
    ops = KubernetesAdapter(replay.api).apply(_rec())
    replay.assert_all_replayed()
    assert ops == (f"PATCH /api/v1/nodes/n0013 unschedulable=true taint {TAINT_KEY}=quarantine:NoSchedule",
                   f"PATCH /api/v1/nodes/n0013/status condition {CONDITION_TYPE}=True reason=FleetHealthQuarantine")
    taints = replay.seen[1]["body"]["spec"]["taints"]
    assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in taints


def test_replayed_recommendation_makes_no_write(k8s_replay):
    replay = k8s_replay("already_applied.json")
    assert KubernetesAdapter(replay.api).apply(_rec()) == ()
    replay.assert_all_replayed()
    assert [r["method"] for r in replay.seen] == ["GET"]


def test_conflict_is_retried_on_a_fresh_read(k8s_replay):
    replay = k8s_replay("conflict_retry.json")
    ops = KubernetesAdapter(replay.api).apply(_rec())
    replay.assert_all_replayed()
    assert len(ops) == 2
    assert replay.seen[3]["body"]["metadata"]["resourceVersion"] == "48220"


def test_unknown_node_raises_and_writes_nothing(k8s_replay):
    replay = k8s_replay("unknown_node.json")
    with pytest.raises(UnknownNode, match="n0099"):
        KubernetesAdapter(replay.api).apply(_rec(node="n0099"))
    replay.assert_all_replayed()


def test_release_removes_only_the_fleethealth_taint(k8s_replay):
    replay = k8s_replay("release.json")
    ops = KubernetesAdapter(replay.api).release("n0013", ts=1795921200.0, message="passing full self-test")
    replay.assert_all_replayed()
    assert len(ops) == 2


def test_release_uncordons_only_a_cordon_fleethealth_made(k8s_replay):
    """release.json: the node carries fleethealth's cordon annotation, so it is uncordoned and the
    annotation dropped. release_human_cordon.json: a person cordoned it (no annotation), so the patch
    leaves ``spec.unschedulable`` alone and only the taint goes (the replay fails on any other body)."""
    ours = k8s_replay("release.json")
    adapter = KubernetesAdapter(ours.api)
    assert adapter.release("n0013", ts=1795921200.0, message="passing full self-test")[0].startswith(
        "PATCH /api/v1/nodes/n0013 unschedulable=false")
    ours.assert_all_replayed()
    assert ours.seen[1]["body"]["metadata"]["annotations"] == {CORDON_ANNOTATION: None}
    human = k8s_replay("release_human_cordon.json")
    ops = KubernetesAdapter(human.api).release("n0013", ts=1795921200.0, message="passing full self-test")
    human.assert_all_replayed()
    assert "unschedulable" not in human.seen[1]["body"]["spec"] and "cordon not ours, kept" in ops[0]


def test_cordon_marks_its_own_cordon(k8s_replay):
    replay = k8s_replay("cordon_taint_condition.json")
    KubernetesAdapter(replay.api).apply(_rec())
    replay.assert_all_replayed()
    assert replay.seen[1]["body"]["metadata"]["annotations"] == {CORDON_ANNOTATION: "true"}


def test_bad_node_names_never_reach_the_api(k8s_replay):
    replay = k8s_replay("unknown_node.json")
    adapter = KubernetesAdapter(replay.api)
    for bad in ("N0013", "n0013 ", "n[0000-0999]", "-n1", "a/b"):
        with pytest.raises(SchedulerError, match="refusing node name|not a Kubernetes node name"):
            adapter.apply(_rec(node=bad))
    assert replay.seen == []


def test_actor_dry_run_and_guards_make_no_request(k8s_replay):
    replay = k8s_replay("already_applied.json")
    actor = Actor(KubernetesAdapter(replay.api), dry_run=True, clock=lambda: TS)
    planned = actor.handle(_rec())
    assert planned.outcome is Outcome.DRY_RUN and len(planned.operations) == 3
    held = Actor(KubernetesAdapter(replay.api), clock=lambda: TS).handle(_rec(guard=Guard.RATE_LIMITED))
    assert held.outcome is Outcome.SKIPPED_GUARD
    facilities = Actor(KubernetesAdapter(replay.api), clock=lambda: TS).handle(_rec(action=Action.ALERT_FACILITIES))
    assert facilities.outcome is Outcome.SKIPPED_UNSUPPORTED
    assert replay.seen == []


def test_replay_refuses_a_request_that_is_not_recorded(k8s_replay):
    """The harness itself: a write the recording does not hold fails the call and is reported."""
    replay = k8s_replay("already_applied.json")
    with pytest.raises(SchedulerError, match="HTTP 500"):
        KubernetesAdapter(replay.api).apply(_rec(action=Action.EVICT))  # different taint value: a write
    assert replay.mismatches and "unexpected request #2: PATCH" in replay.mismatches[0]
