"""Offline idle-node sweeps, the Slurm health check entry, return-to-pool decisions."""

from fleethealth.sweeps.launch import LocalLauncher, NodeRun, NodeStatus, SrunLauncher, run_node, slurm_idle_nodes
from fleethealth.sweeps.plan import NodeRisk, rank_nodes, risk_from_store, validate_node
from fleethealth.sweeps.release import ReleaseDecision, apply_release, release_decision
from fleethealth.sweeps.runner import NodeOutcome, SweepReport, run_sweep

__all__ = [
    "LocalLauncher",
    "NodeOutcome",
    "NodeRisk",
    "NodeRun",
    "NodeStatus",
    "ReleaseDecision",
    "SrunLauncher",
    "SweepReport",
    "apply_release",
    "rank_nodes",
    "release_decision",
    "risk_from_store",
    "run_node",
    "run_sweep",
    "slurm_idle_nodes",
    "validate_node",
]
