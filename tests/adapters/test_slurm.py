"""Slurm adapter against a real single-node Slurm (``slurmctld`` + ``slurmd`` + ``munged`` on 127.0.0.1).

The ``slurm_cluster`` fixture (tests/adapters/conftest.py) starts the daemons from Debian's
``slurm-wlm`` and ``munge`` packages; every drain below is checked with ``sinfo -R`` on that
cluster. Without the packages these tests are skipped with the reason printed. Ownership follows
LBNL NHC: fleethealth's reasons start with ``fleethealth:``; any other reason is another owner's.
"""

from __future__ import annotations

import subprocess

import pytest

from fleethealth.adapters import Actor, LeftAlone, Outcome, SchedulerError, SlurmAdapter, UnknownNode
from fleethealth.adapters.slurm import REASON_PREFIX, drain_argv, reservation_name, resume_argv
from fleethealth.schema import Action, Guard, Recommendation


def _reasons(cluster) -> dict[str, str]:
    out = cluster.sinfo("--list-reasons", "--noheader", "--Node", "--format=%N|%E")
    return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)


def _state(cluster) -> str:
    """The node's state without the transient ``*`` (not responding yet) flag."""
    return cluster.sinfo("--noheader", "--Node", f"--nodes={cluster.node}", "--format=%T").strip().rstrip("*")


def _scontrol(cluster, *args: str) -> None:
    subprocess.run(["scontrol", *args], env=cluster.env, check=True, capture_output=True, timeout=15)


@pytest.fixture
def slurm(slurm_cluster):
    adapter = SlurmAdapter(env=slurm_cluster.env)
    yield adapter
    adapter.unreserve(slurm_cluster.node)
    if adapter.info(slurm_cluster.node).held:  # whoever drained it, the next test starts idle
        _scontrol(slurm_cluster, "update", f"NodeName={slurm_cluster.node}", "State=RESUME")


def _rec(node: str, action: Action = Action.EVICT, guard: Guard = Guard.ALLOWED, ts: float = 1000.0,
         **kw) -> Recommendation:
    return Recommendation(action=action, node=node, ts=ts, reason="thermal straggler, payback 41 min",
                          guard=guard, job="train-1", finding_id=f"f-{node}-{action.value}-{ts}", **kw)


def test_argv_is_a_list_with_validated_node():
    argv = drain_argv("n0013", "hot; rm -rf /\nnext line", scontrol="scontrol")
    assert argv == ["scontrol", "update", "NodeName=n0013", "State=DRAIN",
                    "Reason=fleethealth: hot; rm -rf / next line"]
    assert drain_argv("n0013", "fleethealth: x")[-1] == "Reason=fleethealth: x"  # never prefixed twice
    assert resume_argv("n0013") == ["scontrol", "update", "NodeName=n0013", "State=RESUME"]
    for bad in ("n[0000-0999]", "n0001,n0002", "n0001 State=DOWN", "", "-n1", "n0001=x", "a" * 64):
        with pytest.raises(SchedulerError, match="refusing node name"):
            drain_argv(bad, "x")


def test_drain_shows_in_sinfo_reasons_and_resume_clears_it(slurm, slurm_cluster):
    node = slurm_cluster.node
    assert node not in _reasons(slurm_cluster)
    command = slurm.drain(node, "evict: thermal straggler z=4.2 (GPU 3)")
    assert command.startswith(f"scontrol update NodeName={node} State=DRAIN")
    assert _reasons(slurm_cluster)[node] == "fleethealth: evict: thermal straggler z=4.2 (GPU 3)"
    assert slurm.drain_reasons() == {node: "fleethealth: evict: thermal straggler z=4.2 (GPU 3)"}
    assert _state(slurm_cluster) in {"drained", "draining"}
    assert slurm.resume(node) == f"scontrol update NodeName={node} State=RESUME"
    assert node not in _reasons(slurm_cluster)
    assert _state(slurm_cluster) == "idle"
    assert slurm.resume(node) is None  # already in service: nothing to do


def test_unknown_node_is_refused_and_nothing_is_drained(slurm, slurm_cluster):
    with pytest.raises(UnknownNode, match="n0999"):
        slurm.drain("n0999", "should not happen")
    assert _reasons(slurm_cluster) == {}
    assert _state(slurm_cluster) == "idle"
    # slurmctld itself refuses an unknown name (22.05: "Invalid node name specified"); the adapter
    # translates that too, for a node removed between its read and its write
    with pytest.raises(UnknownNode, match="Invalid node name specified"):
        slurm._run(drain_argv("n0999", "x", scontrol="scontrol"))


def test_an_admins_reason_is_never_overwritten_nor_resumed(slurm, slurm_cluster):
    node = slurm_cluster.node
    _scontrol(slurm_cluster, "update", f"NodeName={node}", "State=DRAIN", "Reason=disk replacement, ticket 4711")
    with pytest.raises(LeftAlone, match="another owner .reason 'disk replacement, ticket 4711'"):
        slurm.drain(node, "evict: thermal straggler")
    with pytest.raises(LeftAlone, match="only they resume it"):
        slurm.resume(node)
    assert _reasons(slurm_cluster)[node] == "disk replacement, ticket 4711"
    record = Actor(slurm, clock=lambda: 5000.0).handle(_rec(node, action=Action.QUARANTINE))
    assert record.outcome is Outcome.SKIPPED_NOT_OURS and not record.acted
    assert _reasons(slurm_cluster)[node] == "disk replacement, ticket 4711"
    assert _state(slurm_cluster) in {"drained", "draining"}


def test_fleethealth_drains_with_its_prefix_and_resumes_only_its_own(slurm, slurm_cluster):
    node = slurm_cluster.node
    slurm.drain(node, "hang attributed to n0000")
    assert _reasons(slurm_cluster)[node] == f"{REASON_PREFIX} hang attributed to n0000"
    assert slurm.info(node).ours and slurm.info(node).held
    slurm.drain(node, "a later finding")  # its own reason may be replaced by its own
    assert _reasons(slurm_cluster)[node] == f"{REASON_PREFIX} a later finding"
    assert slurm.resume(node) is not None and _state(slurm_cluster) == "idle"


def test_maintenance_reservation_reaches_a_drained_node(slurm, slurm_cluster):
    """A drained node runs no job step; resumed inside a MAINT,IGNORE_JOBS reservation it runs
    fleethealth's step (``srun --reservation``) and nobody else's."""
    node = slurm_cluster.node
    slurm.drain(node, "sdc: quarantined")
    name = slurm.reserve(node, minutes=10)
    assert name == reservation_name(node) == f"fleethealth-{node}"
    shown = subprocess.run(["scontrol", "show", "reservation", name], env=slurm_cluster.env, capture_output=True,
                           text=True, timeout=15, check=True).stdout
    assert "MAINT" in shown and "IGNORE_JOBS" in shown and f"Nodes={node}" in shown
    slurm.resume(node)
    out = subprocess.run(["srun", f"--reservation={name}", "-w", node, "-N", "1", "-n", "1", "echo", "reached"],
                         env=slurm_cluster.env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "reached", out.stderr
    assert slurm.unreserve(node) and not slurm.unreserve(node)


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
    assert done.operations[0].startswith(f"scontrol update NodeName={node} State=DRAIN Reason=fleethealth: ")
    assert _reasons(slurm_cluster)[node].startswith(f"fleethealth: quarantine {rec.id}: thermal straggler")
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
