"""What one step of a stage core asks its shell to carry out: rows to store, messages to publish, state to save.

A stage core (:mod:`fleethealth.detectors.cores`) is pure: ``step(records, now)`` returns an
:class:`Effects` and does no I/O. The runner (:mod:`fleethealth.detectors.runner`) carries it out in one
fixed order, whatever the stage: the input rows (``telemetry``, ``steps``), the ``outbox`` (pending),
``events``, ``findings``, ``recommendations`` (and the quarantine book of those stored), the eviction
``outcomes``, the policy state (``policy``), then publishes the outbox and the node ``states``, commits
offsets and snapshots. What a stage stores and publishes is decided by its core, once, when it is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fleethealth.schema import Event, Finding, Message, NodeState, Recommendation, StepBatch, StepBlock, Telemetry

if TYPE_CHECKING:
    from fleethealth.bus import Record
    from fleethealth.policy.engine import PolicyEngine
    from fleethealth.policy.eviction import EvictionOutcome

__all__ = ["Effects"]


@dataclass(frozen=True)
class Effects:
    """One step's effects. ``taken``: the records the step concluded, less those refused beyond a
    cardinality limit (what the commit and the metrics count); ``token``: the deduplication token naming
    the step's inputs (their offsets) and outputs (their ids), from which every insert's token is derived."""

    taken: tuple[Record, ...] = ()
    token: str = ""
    rejected: tuple[tuple[Message, str], ...] = ()
    """Records the pipeline refused (beyond its cardinality limits), with the reason: dead-lettered, committed."""
    poisoned: tuple[tuple[Record, str], ...] = ()
    """Records a detector raised on, with the error: dead-lettered, committed."""
    telemetry: tuple[Telemetry, ...] = ()
    """Telemetry rows to store."""
    steps: tuple[StepBatch | StepBlock, ...] = ()
    """Step rows to store: the batches the assembler accepted (of a partly refused block, the steps it took)."""
    events: tuple[Event, ...] = ()
    """Event rows to store: the stage's own input events, then those detection derived (``interruption``)."""
    findings: tuple[Finding, ...] = ()
    recommendations: tuple[Recommendation, ...] = ()
    outcomes: tuple[EvictionOutcome, ...] = ()
    """Eviction outcomes to record (before the policy state that no longer watches them)."""
    outbox: tuple[Finding | Recommendation | Event, ...] = ()
    """Messages to publish through the outbox (stored pending before any table that remembers them)."""
    states: tuple[NodeState, ...] = ()
    """Node states to publish on ``fh.nodestate`` before the offsets commit (a crash derives them again)."""
    policy: PolicyEngine | None = None
    """The policy engine, when its state is due to be saved (its memory moved in this step)."""
    now: float = float("-inf")
    """The event time the core reached in this step (the policy state is saved at it)."""
    unscored: tuple[tuple[str, int], ...] = ()
    """Jobs newly found too small to score for stragglers, with their largest group (logged once)."""
    origin_: dict[int, Record] = field(default_factory=dict, repr=False, compare=False)

    def origin(self, msg: Message) -> Record | None:
        """The input record a stored row came from (None for a row the step derived)."""
        return self.origin_.get(id(msg))
