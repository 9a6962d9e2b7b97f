"""Slurm adapter against a real single-node Slurm (``slurmctld`` + ``slurmd`` + ``munged`` on 127.0.0.1).

The ``slurm_cluster`` fixture (tests/adapters/conftest.py) starts the daemons from Debian's
``slurm-wlm`` and ``munge`` packages; every drain below is checked with ``sinfo -R`` on that
cluster. Without the packages these tests are skipped with the reason printed.
"""

from __future__ import annotations

import pytest

from fleethealth.adapters import Actor, Outcome, SchedulerError, SlurmAdapter, UnknownNode
from fleethealth.adapters.slurm import drain_argv, resume_argv
from fleethealth.schema import Action, Guard, Recommendation


def _reasons(cluster) -> dict[str, str]:
    out = cluster.sinfo("--list-reasons", "--noheader", "--Node", "--format=%N|%E")
    return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)


def _state(cluster) -> str:
    """The node's state without the transient ``*`` (not responding yet) flag."""
    return cluster.sinfo("--noheader", "--Node", f"--nodes={cluster.node}", "--format=%T").strip().rstrip("*")


@pytest.fixture
def slurm(slurm_cluster):
    adapter = SlurmAdapter(env=slurm_cluster.env)
    yield adapter
    adapter.resume(slurm_cluster.node)


def _rec(node: str, action: Action = Action.EVICT, guard: Guard = Guard.ALLOWED, ts: float = 1000.0,
         **kw) -> Recommendation:
    return Recommendation(action=action, node=node, ts=ts, reason="thermal straggler, payback 41 min",
                          guard=guard, job="train-1", finding_id=f"f-{node}-{action.value}-{ts}", **kw)


def test_argv_is_a_list_with_validated_node():
    argv = drain_argv("n0013", "hot; rm -rf /\nnext line", scontrol="scontrol")
    assert argv == ["scontrol", "update", "NodeName=n0013", "State=DRAIN", "Reason=hot; rm -rf / next line"]
    assert resume_argv("n0013") == ["scontrol", "update", "NodeName=n0013", "State=RESUME"]
    for bad in ("n[0000-0999]", "n0001,n0002", "n0001 State=DOWN", "", "-n1", "n0001=x", "a" * 64):
        with pytest.raises(SchedulerError, match="refusing node name"):
            drain_argv(bad, "x")


def test_drain_shows_in_sinfo_reasons_and_resume_clears_it(slurm, slurm_cluster):
    node = slurm_cluster.node
    assert node not in _reasons(slurm_cluster)
    command = slurm.drain(node, "fleethealth evict: thermal straggler z=4.2 (GPU 3)")
    assert command.startswith(f"scontrol update NodeName={node} State=DRAIN")
    assert _reasons(slurm_cluster)[node] == "fleethealth evict: thermal straggler z=4.2 (GPU 3)"
    assert slurm.drain_reasons() == {node: "fleethealth evict: thermal straggler z=4.2 (GPU 3)"}
    assert _state(slurm_cluster) in {"drained", "draining"}
    assert slurm.resume(node) == f"scontrol update NodeName={node} State=RESUME"
    assert node not in _reasons(slurm_cluster)
    assert _state(slurm_cluster) == "idle"
    assert slurm.resume(node) is None  # already in service: nothing to do


def test_unknown_node_is_refused_and_nothing_is_drained(slurm, slurm_cluster):
    # slurmctld of a one-node cluster maps any unknown NodeName to its only node; the adapter
    # must check the name with sinfo first, or a typo would drain n0000.
    with pytest.raises(UnknownNode, match="n0999"):
        slurm.drain("n0999", "should not happen")
    assert _reasons(slurm_cluster) == {}
    assert _state(slurm_cluster) == "idle"


def test_actor_drains_allowed_recommendations_once(slurm, slurm_cluster):
    node = slurm_cluster.node
    actor = Actor(slurm, max_actions=5, window_s=3600.0, clock=lambda: 5000.0)
    held = actor.handle(_rec(node, guard=Guard.NEEDS_HUMAN))
    assert held.outcome is Outcome.SKIPPED_GUARD and _reasons(slurm_cluster) == {}
    page = actor.handle(_rec(node, action=Action.PAGE))
    assert page.outcome is Outcome.SKIPPED_UNSUPPORTED and _reasons(slurm_cluster) == {}
    rec = _rec(node, action=Action.QUARANTINE)
    done = actor.handle(rec)
    assert done.outcome is Outcome.DONE, done.detail
    assert done.operations[0].startswith(f"scontrol update NodeName={node} State=DRAIN Reason=fleethealth")
    assert _reasons(slurm_cluster)[node].startswith(f"fleethealth quarantine {rec.id}: thermal straggler")
    slurm.resume(node)
    assert actor.handle(rec) is None  # a replay changes nothing
    assert _reasons(slurm_cluster) == {} and actor.replays_ == 1


def test_dry_run_records_the_command_and_leaves_slurm_alone(slurm, slurm_cluster):
    actor = Actor(slurm, dry_run=True, clock=lambda: 10.0)
    record = actor.handle(_rec(slurm_cluster.node, action=Action.DRAIN))
    assert record.outcome is Outcome.DRY_RUN
    assert "State=DRAIN" in record.operations[0]
    assert _reasons(slurm_cluster) == {}
    wet = Actor(slurm, clock=lambda: 10.0).handle(_rec(slurm_cluster.node, dry_run=True, ts=2.0))
    assert wet.outcome is Outcome.DRY_RUN and _reasons(slurm_cluster) == {}
