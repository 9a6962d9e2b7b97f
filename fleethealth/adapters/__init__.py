"""Scheduler adapters: Slurm and Kubernetes consumers of recommendations.

``fleethealth act --scheduler slurm|kubernetes`` feeds ``fh.recommendations`` to an
:class:`Actor`, which checks guard, replay, rate limit and dry-run before a
:class:`SlurmAdapter` drains a node or a :class:`KubernetesAdapter` cordons or drains it
(cordon + Eviction API). Both mark what they did and undo only their own work.
The ``kubernetes`` client is imported only when a Kubernetes adapter is built.
"""

from fleethealth.adapters.act import Actor, Journal, run_act
from fleethealth.adapters.base import (
    ActionRecord,
    LeftAlone,
    Outcome,
    SchedulerAdapter,
    SchedulerError,
    UnknownNode,
    check_node_name,
)
from fleethealth.adapters.kubernetes import KubernetesAdapter
from fleethealth.adapters.slurm import SlurmAdapter

__all__ = [
    "ActionRecord",
    "Actor",
    "Journal",
    "KubernetesAdapter",
    "LeftAlone",
    "Outcome",
    "SchedulerAdapter",
    "SchedulerError",
    "SlurmAdapter",
    "UnknownNode",
    "check_node_name",
    "run_act",
]
