"""Putting the stream back together in event time: a reorder buffer and the step assembler.

Kafka orders messages within a partition only. Telemetry (keyed by node), step batches (keyed by
job) and events arrive interleaved in whatever order the fetches return them, so a detector that
read them as they come would compare a straggler with telemetry from minutes earlier, or see a
hang where the steps partition merely lags. :class:`EventTimeBuffer` holds records until every
input partition that still has unread data has moved past their event time (a low watermark
over partitions; a partition read to its end does not hold the others back), then releases them
in event-time order.

:class:`StepAssembler` joins one (job, step) across nodes: it emits the step when every rank the
job has shown in earlier steps reported (the first step of a job waits for the timeout, since
nothing says yet how many ranks it has), or when the completeness timeout (event time) has passed — a hung node
must not stall detection on everyone else. Late batches of an emitted step are counted, not
re-scored; duplicate batches (same job, step and node) are dropped.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from fleethealth.schema import StepBatch

__all__ = ["EventTimeBuffer", "StepAssembler", "AssembledStep"]

T = TypeVar("T")


class EventTimeBuffer(Generic[T]):
    """Hold items until the low watermark over live input partitions passes their event time."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Hashable, T]] = []
        self._seq = itertools.count()
        self.latest_: dict[Hashable, float] = {}

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, ts: float, partition: Hashable, item: T) -> None:
        heapq.heappush(self._heap, (ts, next(self._seq), partition, item))
        if ts > self.latest_.get(partition, float("-inf")):
            self.latest_[partition] = ts

    def watermark(self, live: Iterable[Hashable]) -> float:
        """The newest event time every ``live`` partition (one with unread data) has reached.

        A live partition with nothing buffered yet holds everything back (-inf); with no live
        partition at all, everything may go (+inf).
        """
        return min((self.latest_.get(p, float("-inf")) for p in live), default=float("inf"))

    def release(self, watermark: float) -> list[tuple[Hashable, T]]:
        """Pop every item with ``ts <= watermark``, oldest first, as ``(partition, item)``."""
        out = []
        while self._heap and self._heap[0][0] <= watermark:
            _, _, partition, item = heapq.heappop(self._heap)
            out.append((partition, item))
        return out

    def pending(self) -> list[tuple[Hashable, T]]:
        """Items still held, in event-time order (for working out which offsets are safe to commit)."""
        return [(p, item) for _, _, p, item in sorted(self._heap)]


@dataclass(frozen=True, eq=False)
class AssembledStep:
    """One (job, step) across every node that reported it, columnar over ranks (shape ``(r,)``)."""

    job: str
    step: int
    ts: float
    ranks: np.ndarray
    gpus: np.ndarray
    nodes: np.ndarray
    compute_s: np.ndarray
    groups: np.ndarray | None
    complete: bool


class StepAssembler:
    """Join per-node :class:`StepBatch` messages into whole steps (see the module docstring).

    ``timeout_s`` is in event time: a step is emitted incomplete once a message ``timeout_s``
    newer than its first batch has been seen.
    """

    def __init__(self, *, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self._open: dict[tuple[str, int], list[StepBatch]] = {}
        self._ranks_known: dict[str, set[int]] = {}
        self._done: dict[str, int] = {}
        self.late_total = 0
        self.duplicate_total = 0

    def add(self, batch: StepBatch) -> list[AssembledStep]:
        """Take one batch; return the steps it completes, and any its event time makes overdue."""
        job, step = batch.job, batch.step
        if step <= self._done.get(job, -1) and (job, step) not in self._open:
            self.late_total += 1
            return []
        parts = self._open.setdefault((job, step), [])
        if any(b.node == batch.node for b in parts):
            self.duplicate_total += 1
            return []
        parts.append(batch)
        out = self.flush(batch.ts)
        known = self._ranks_known.get(job)
        if (job, step) in self._open and known and sum(len(b.ranks) for b in parts) >= len(known):
            out.append(self._emit(job, step, complete=True))
        return out

    def flush(self, now: float) -> list[AssembledStep]:
        """Emit open steps whose first batch is older than ``now - timeout_s``."""
        due = [key for key, parts in self._open.items() if parts[0].ts + self.timeout_s <= now]
        return [self._emit(job, step, complete=False) for job, step in sorted(due, key=lambda k: k[1])]

    def drain(self) -> list[AssembledStep]:
        """Emit everything still open (end of input)."""
        return [self._emit(job, step, complete=False) for job, step in sorted(self._open, key=lambda k: k[1])]

    def _emit(self, job: str, step: int, *, complete: bool) -> AssembledStep:
        parts = self._open.pop((job, step))
        self._done[job] = max(self._done.get(job, -1), step)
        known = self._ranks_known.setdefault(job, set())
        for b in parts:
            known.update(b.ranks.tolist())
        groups = None
        if all(b.groups is not None for b in parts):
            groups = np.concatenate([b.groups for b in parts])
        return AssembledStep(
            job=job, step=step, ts=max(b.ts for b in parts),
            ranks=np.concatenate([b.ranks for b in parts]),
            gpus=np.concatenate([b.gpus for b in parts]),
            nodes=np.concatenate([np.full(len(b.ranks), b.node, dtype=object) for b in parts]),
            compute_s=np.concatenate([b.compute_s for b in parts]),
            groups=groups, complete=complete,
        )
