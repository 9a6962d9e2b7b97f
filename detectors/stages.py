"""The detector tier's stages: which topics each reads, which records it takes, what it writes.

One process can run the whole tier (``all``, one consumer group over steps, telemetry and events:
one replica per group), or the tier runs as three stages that scale apart:

* ``node`` — a consumer group over ``fh.telemetry`` and ``fh.events`` (both keyed by node, so a
  node's samples and its node events are on the same partition number, which Kafka's range
  assignor gives to one replica): the health rules, the failure predictor and each node's state
  for diagnosis, published to ``fh.nodestate`` (compacted, key node) when it changes and as a
  heartbeat. N replicas; one pipeline per partition.
* ``job`` — a consumer group over ``fh.steps`` and ``fh.events`` (steps keyed by job, and the
  events a training job sends — checks, checkpoints, hang reports, start and exit — keyed by job
  too, :data:`fleethealth.schema.JOB_EVENT_KINDS`): step assembly, stragglers, hangs, SDC results,
  the job lifecycle and diagnosis; it publishes the derived interruptions and each job's progress
  and end (``job_progress``, ``job_end``: :mod:`fleethealth.payloads.progress`) for the policy
  stage. Each replica also reads ``fh.nodestate`` (decoding only its jobs' nodes and their rack
  peers: :mod:`fleethealth.detectors.nodetable`) and the node stage's findings on ``fh.findings``
  (the Xid findings the lifecycle names a stop's cause by) as tables, outside the group. N replicas;
  one pipeline per partition, all sharing the replica's node-state table.
* ``policy`` — one replica (a single writer: the fleet-wide guards — the breaker, one eviction per
  job per hour, the same-rack rule — are decided in one place, and its state is saved in the
  store after each batch): a consumer group over ``fh.findings`` and ``fh.events`` (the job events
  the engine reads, the derived ``interruption`` events the job stage publishes, the scheduler's
  outcomes), deciding and publishing recommendations.

Each stage stores what it owns, so nothing is written twice: the node stage the telemetry, the
node events and its findings; the job stage the step batches, the job events, the derived
interruption events and its findings; the policy stage the recommendations and the engine state.
"""

from __future__ import annotations

from enum import StrEnum

from fleethealth.schema import Event, EventKind, Finding, FindingKind, Topic, is_job_event

__all__ = ["Stage", "NODE_FINDING_KINDS", "group_topics", "table_topics", "takes_event", "takes_finding"]


class Stage(StrEnum):
    ALL = "all"
    NODE = "node"
    JOB = "job"
    POLICY = "policy"


NODE_FINDING_KINDS = frozenset({FindingKind.XID, FindingKind.ECC, FindingKind.THERMAL, FindingKind.POWER_BRAKE,
                                FindingKind.LINK, FindingKind.FAILURE_RISK,
                                FindingKind.TELEMETRY_STALL, FindingKind.FABRIC})
"""What the node stage concludes (from telemetry and node events); the job stage the rest."""

_GROUP = {
    Stage.ALL: (Topic.STEPS, Topic.TELEMETRY, Topic.EVENTS),
    Stage.NODE: (Topic.TELEMETRY, Topic.EVENTS),
    Stage.JOB: (Topic.STEPS, Topic.EVENTS),
    Stage.POLICY: (Topic.FINDINGS, Topic.EVENTS),
}
_TABLES = {Stage.JOB: (Topic.NODESTATE, Topic.FINDINGS)}
_DERIVED = frozenset({EventKind.JOB_PROGRESS, EventKind.JOB_END})
"""What the job stage publishes for the policy stage about a job's steps and end (never stored)."""


def group_topics(stage: Stage) -> tuple[str, ...]:
    """The topics the stage's consumer group splits between its replicas."""
    return tuple(t.value for t in _GROUP[stage])


def table_topics(stage: Stage) -> tuple[str, ...]:
    """The topics every replica of the stage reads whole, outside the group."""
    return tuple(t.value for t in _TABLES.get(stage, ()))


def takes_event(stage: Stage, event: Event) -> bool:
    """Whether the stage processes (and stores, unless it is the policy) this input event."""
    if stage is Stage.NODE:
        return not is_job_event(event)
    if stage is Stage.JOB:  # not the stops, progress and ends it derived itself and published for the policy stage
        return is_job_event(event) and event.kind not in _DERIVED and not (
            event.kind is EventKind.INTERRUPTION and "interruption_id" in event.data)
    return True


def takes_finding(stage: Stage, finding: Finding) -> bool:
    """Whether a finding read from ``fh.findings`` is input to the stage: the policy takes every
    finding; the job stage the node stage's (its lifecycle names a stop's cause by an Xid)."""
    if stage is Stage.JOB:
        return finding.kind in NODE_FINDING_KINDS
    return stage is Stage.POLICY
