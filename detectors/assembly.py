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
must not stall detection on everyone else. A step that no later batch of its job cuts short (the
job's last steps) is concluded by :meth:`StepAssembler.overdue` once the caller's clock over all
inputs is past the job's step timeout, so a runner never holds its offsets forever. Late batches
of an emitted step are counted, not re-scored; duplicate batches (same job, step and node) are dropped.

Forged or broken input cannot take a job over: once a job has emitted steps, a batch more than
``max_step_jump`` steps ahead of the newest emitted step is refused (one batch claiming step 2⁶³−1
would otherwise make every later step look late), and once a rank has been seen on a node, a
batch from another node naming that rank is refused until the job restarts (a new placement).
Refused batches are counted in ``implausible_total`` and ``foreign_total`` (a batch naming ranks
another node already reported for the step is refused too, counted as a duplicate);
:meth:`StepAssembler.add` reports them through ``refused_`` and the runner stores only what the
assembler accepted, so a forged row cannot replace a real one in ``rank_steps``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Iterable
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
        self._pushed = 0  # a tie-breaker in push order (an int, not itertools.count: a snapshot pickles it)
        self.latest_: dict[Hashable, float] = {}

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, ts: float, partition: Hashable, item: T) -> None:
        if not math.isfinite(ts):
            raise ValueError(f"event time must be finite, got {ts}")
        self._pushed += 1
        heapq.heappush(self._heap, (ts, self._pushed, partition, item))
        if ts > self.latest_.get(partition, float("-inf")):
            self.latest_[partition] = ts

    def watermark(self, live: Iterable[Hashable]) -> float:
        """The newest event time every ``live`` partition (one with unread data) has reached.

        A live partition with nothing buffered yet holds everything back (-inf); with no live
        partition at all, everything may go (+inf).
        """
        return min((self.latest_.get(p, float("-inf")) for p in live), default=float("inf"))

    def nth_ts(self, n: int) -> float:
        """The event time of the ``n``-th oldest item held (1-based)."""
        return heapq.nsmallest(n, self._heap)[-1][0]

    def release(self, watermark: float, limit: int | None = None) -> list[tuple[Hashable, T]]:
        """Pop every item with ``ts <= watermark`` (at most ``limit``), oldest first, as ``(partition, item)``."""
        out: list[tuple[Hashable, T]] = []
        while self._heap and self._heap[0][0] <= watermark and (limit is None or len(out) < limit):
            _, _, partition, item = heapq.heappop(self._heap)
            out.append((partition, item))
        return out

    def discard(self, drop: Callable[[T], bool]) -> int:
        """Remove every held item ``drop`` selects (a partition moved to another reader); returns how many."""
        kept = [entry for entry in self._heap if not drop(entry[3])]
        gone = len(self._heap) - len(kept)
        if gone:
            heapq.heapify(kept)
            self._heap = kept
        return gone

    def held(self, key: Callable[[T], tuple[Hashable, int]]) -> dict[Hashable, int]:
        """Per group (e.g. partition), the smallest number ``key(item)`` gives among items still held."""
        out: dict[Hashable, int] = {}
        for _, _, _, item in self._heap:
            group, value = key(item)
            if value < out.get(group, value + 1):
                out[group] = value
        return out


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


@dataclass
class _OpenStep:
    parts: list[StepBatch]
    nodes: set[str]
    ranks: set[int]
    covered: int = 0  # how many of the job's known ranks are in ``ranks``


class StepAssembler:
    """Join per-node :class:`StepBatch` messages into whole steps (see the module docstring).

    ``timeout_s`` is in the job's own event time: a step is emitted incomplete once a batch of
    the same job ``timeout_s`` newer than the step's first batch arrives (a skewed clock on another
    job or an event cannot cut it short). Coverage is by rank identity, not count: a step is
    complete when it holds every rank the job has shown (in any earlier step, late ones included).
    A batch whose ranks another node already reported for that step is a duplicate and dropped.
    """

    def __init__(self, *, timeout_s: float = 10.0, max_step_jump: int = 100_000) -> None:
        self.timeout_s = timeout_s
        self.max_step_jump = max_step_jump
        self._open: dict[tuple[str, int], _OpenStep] = {}
        self._open_by_job: dict[str, dict[int, _OpenStep]] = {}  # the same entries, per job: work per batch
        # is bounded by the job's own open steps, not by every job's
        self._ranks_known: dict[str, set[int]] = {}
        self._done: dict[str, int] = {}
        self._owner: dict[str, np.ndarray] = {}  # job -> node code per rank (-1: not seen yet)
        self._codes: dict[str, int] = {}  # node name -> code
        self._next_code = 0  # codes are never reused, so forgetting a node cannot alias another
        self._last_ranks: dict[tuple[str, str], bytes] = {}  # (job, node) -> ranks it last reported
        self.late_total = 0
        self.duplicate_total = 0
        self.implausible_total = 0
        self.foreign_total = 0
        self.refused_ = False
        """Whether the last :meth:`add` refused its batch: implausible, foreign, or naming ranks another
        node already reported for that step."""

    def _foreign(self, batch: StepBatch) -> bool:
        """True when a rank of ``batch`` was seen on another node of the same job (columnar)."""
        same = self._last_ranks.get((batch.job, batch.node))
        signature = batch.ranks.tobytes()
        if same == signature:  # the common case: a node reports the ranks it reported last step
            return False
        code = self._codes.get(batch.node)
        if code is None:
            code = self._codes[batch.node] = self._next_code
            self._next_code += 1
        owner = self._owner.get(batch.job)
        top = int(batch.ranks.max()) + 1
        if owner is None or owner.size < top:
            grown = np.full(max(top, 2 * (0 if owner is None else owner.size)), -1, dtype=np.int32)
            if owner is not None:
                grown[:owner.size] = owner
            owner = self._owner[batch.job] = grown
        seen = owner[batch.ranks]
        if ((seen >= 0) & (seen != code)).any():
            return True
        owner[batch.ranks] = code
        self._last_ranks[(batch.job, batch.node)] = signature
        return False

    def add(self, batch: StepBatch) -> list[AssembledStep]:
        """Take one batch; return the steps it completes, and any its event time makes overdue."""
        job, step = batch.job, batch.step
        self.refused_ = False
        done = self._done.get(job)
        if done is not None and step > done + self.max_step_jump:
            self.implausible_total += 1
            self.refused_ = True
            return []
        ranks = batch.ranks.tolist()
        known = self._ranks_known.setdefault(job, set())
        entry = self._open.get((job, step))
        if entry is not None and (batch.node in entry.nodes or not entry.ranks.isdisjoint(ranks)):
            self.duplicate_total += 1
            # a node repeating itself is a replay; ranks another node already reported for this step
            # are a claim the step's owner contradicts: refused, so the store keeps the first report
            self.refused_ = batch.node not in entry.nodes
            return []
        if self._foreign(batch):
            self.foreign_total += 1
            self.refused_ = True
            return []
        if step <= self._done.get(job, -1) and entry is None:
            self._learn(job, [batch.ranks])  # a late node still tells how many ranks the job has
            self.late_total += 1
            return []
        if entry is None:
            entry = self._open[(job, step)] = self._open_by_job.setdefault(job, {})[step] = _OpenStep([], set(), set())
        entry.parts.append(batch)
        entry.nodes.add(batch.node)
        entry.ranks.update(ranks)
        entry.covered += len(known.intersection(ranks))
        out = self.flush(batch.ts, job=job)
        if (job, step) in self._open and known and entry.covered >= len(known):
            out.append(self._emit(job, step, complete=True))
        return out

    def flush(self, now: float, *, job: str | None = None) -> list[AssembledStep]:
        """Emit open steps (of ``job``, or of every job) whose first batch is older than ``now - timeout_s``."""
        if job is not None:
            mine = self._open_by_job.get(job, {})
            due = [(job, step) for step, entry in mine.items() if entry.parts[0].ts + self.timeout_s <= now]
        else:
            due = [key for key, entry in self._open.items() if entry.parts[0].ts + self.timeout_s <= now]
        return [self._emit(j, s, complete=False) for j, s in sorted(due, key=lambda k: k[1])]

    def overdue(self, now: float, timeout_of: Callable[[str], float]) -> list[AssembledStep]:
        """Emit open steps whose first batch is more than ``timeout_of(job)`` (at least ``timeout_s``)
        older than ``now``, a clock over all inputs: a step no later batch of its job will ever cut
        short (the job's last steps, a node's batch that never comes) is concluded, not held forever."""
        if not self._open:
            return []
        due = [key for key, entry in self._open.items()
               if entry.parts[0].ts + max(self.timeout_s, timeout_of(key[0])) <= now]
        return [self._emit(j, s, complete=False) for j, s in sorted(due, key=lambda k: k[1])]

    def drain(self) -> list[AssembledStep]:
        """Emit everything still open (end of input)."""
        return [self._emit(job, step, complete=False) for job, step in sorted(self._open, key=lambda k: k[1])]

    def restart(self, job: str) -> None:
        """The job was interrupted and restarts, perhaps from an earlier step and a new placement: its step
        numbers may repeat and its ranks may move to other nodes."""
        self._done.pop(job, None)
        self._drop_owners(job)

    def forget(self, job: str) -> None:
        """Drop everything about a job that ended (no batch for a long time)."""
        self._done.pop(job, None)
        self._ranks_known.pop(job, None)
        self._drop_owners(job)
        for step in self._open_by_job.pop(job, {}):
            del self._open[(job, step)]

    def forget_node(self, nodes: set[str]) -> None:
        """Drop the node codes of ``nodes`` (not seen for a long time); a node that comes back gets a new
        code, and the rank owners of its jobs are learned again."""
        for node in nodes:
            code = self._codes.pop(node, None)
            if code is None:
                continue
            for owner in self._owner.values():
                owner[owner == code] = -1
        if nodes:
            self._last_ranks = {k: v for k, v in self._last_ranks.items() if k[1] not in nodes}

    def _drop_owners(self, job: str) -> None:
        self._owner.pop(job, None)
        for key in [k for k in self._last_ranks if k[0] == job]:
            del self._last_ranks[key]

    def open_steps(self) -> set[tuple[str, int]]:
        """(job, step) pairs still waiting for batches."""
        return set(self._open)

    def _learn(self, job: str, ranks: list[np.ndarray]) -> None:
        """Add ranks to the job's known set; when it grows, recount the coverage of its open steps."""
        known = self._ranks_known.setdefault(job, set())
        before = len(known)
        for arr in ranks:
            known.update(arr.tolist())
        if len(known) != before:
            for entry in self._open_by_job.get(job, {}).values():
                entry.covered = len(known & entry.ranks)

    def _emit(self, job: str, step: int, *, complete: bool) -> AssembledStep:
        parts = self._open.pop((job, step)).parts
        mine = self._open_by_job[job]
        del mine[step]
        if not mine:
            del self._open_by_job[job]
        self._done[job] = max(self._done.get(job, -1), step)
        self._learn(job, [b.ranks for b in parts])
        groups = None
        if all(b.groups is not None for b in parts):
            groups = np.concatenate([b.groups for b in parts])
        return AssembledStep(
            job=job, step=step, ts=max(b.ts for b in parts),
            ranks=np.concatenate([b.ranks for b in parts]),
            gpus=np.concatenate([b.gpus for b in parts]),
            nodes=np.repeat(np.array([b.node for b in parts], dtype=object), [len(b.ranks) for b in parts]),
            compute_s=np.concatenate([b.compute_s for b in parts]),
            groups=groups, complete=complete,
        )
