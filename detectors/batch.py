"""What one ``update(batch, now)`` of a detector takes: :class:`Batch`.

Every detector has one entry point, ``update(batch, now) -> list`` (findings; the node-state table
the states it published; the job lifecycle its events), and reads only the kinds of record it uses
from the batch: each kind may be empty, and a detector given none of its kinds concludes only what
``now`` (event time) concludes. The records of one kind are in event-time order, as the runner's
reorder buffer hands them over. Besides the records, a batch carries what the caller knows that a
detector asks about (``alive``, ``owns``, ``rack_of``): read-only views, never state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from fleethealth.schema import Event, Finding, NodeState, StepBatch, StepBlock, Telemetry

if TYPE_CHECKING:
    from fleethealth.detectors.assembly import AssembledStep

__all__ = ["Batch", "EMPTY", "expect"]


class Batch(NamedTuple):
    """One update's input, each kind possibly empty (immutable; a named tuple, as one is made per record on
    the pipeline's hot path: a frozen dataclass takes five times as long to build).

    ``steps``: step batches and blocks (the hang detector, the job lifecycle); ``assembled``: one
    job's assembled steps, in step order (that job's straggler detector); ``telemetry``: samples
    (health rules, failure predictor, node-state table); ``states``: published node states (the
    node-state table of a job stage); ``events``: events (hang, SDC, health, predictor, lifecycle);
    ``findings``: findings concluded upstream (the rack episodes fold stragglers; the lifecycle
    reads hang, Xid and SDC findings as stop causes).

    ``alive``: node -> its newest telemetry event time (the hang detector tells a hung job from an
    idle one); ``owns(job, node, rank)``: whether the job's step stream places the rank on the node
    (the SDC detector); ``rack_of(node)``: the rack a node reports, None when unknown (the rack
    episodes). ``conclude``: False when the caller feeds records one at a time and concludes once
    for the whole feed (the lifecycle then only folds them in: its stops are concluded, at ``now``,
    by an update with ``conclude``); ``final``: the end of the input (open stops conclude with what
    is known).
    """

    steps: Sequence[StepBatch | StepBlock] = ()
    assembled: Sequence[AssembledStep] = ()
    telemetry: Sequence[Telemetry] = ()
    states: Sequence[NodeState] = ()
    events: Sequence[Event] = ()
    findings: Sequence[Finding] = ()
    alive: Mapping[str, float] | None = None
    owns: Callable[[str | None, str, int | None], bool] | None = None
    rack_of: Callable[[str], str | None] | None = None
    conclude: bool = True
    final: bool = False


EMPTY = Batch()
"""No records: an update with it concludes only what ``now`` concludes."""


def expect(batch: object, owner: object) -> Batch:
    """``batch`` if it is a :class:`Batch`; else a ``TypeError`` naming the detector and the per-kind
    call (``check``) that takes separate arguments."""
    if type(batch) is not Batch:
        raise TypeError(f"{type(owner).__name__}.update takes a Batch and an event time, got "
                        f"{type(batch).__name__}; {type(owner).__name__}.check takes the per-kind arguments")
    return batch
