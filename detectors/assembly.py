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

from fleethealth.detectors.state import Stateful, names
from fleethealth.schema import StepBatch, StepBlock

__all__ = ["EventTimeBuffer", "StepAssembler", "AssembledStep"]

T = TypeVar("T")


class EventTimeBuffer(Stateful, Generic[T]):
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
    parts: list[StepBatch | StepBlock]  # a batch, or a block whose row ``rows[i]`` is this step
    rows: list[int]  # -1 for a batch
    nodes: set[str]
    ranks: set[int] | None  # None until a check needs it (the block path does not build it)
    first_ts: float  # event time of the first part
    epoch: int  # the assembler's rank-owner epoch when the step opened
    covered: int = 0  # how many of the job's known ranks the parts hold
    round: _Round | None = None  # while set, parts, nodes and coverage are the round's (row ``row``)
    row: int = -1


@dataclass(eq=False)
class _Round:
    """Open steps of one job that have had exactly the same parts so far: blocks of the same steps,
    one a node (the usual stream: every node sends the same interval). A block of those steps from
    another node joins all of them at once; anything else gives each step its own parts again."""

    job: str
    steps: tuple[int, ...]
    parts: list[StepBlock]
    nodes: set[str]
    covered: int
    epoch: int
    attached: int  # steps still open and sharing the round
    cols: dict[str, object] | None = None


def _part_ranks(entry: _OpenStep) -> set[int]:
    """The ranks ``entry``'s parts hold (built once, kept up to date by :meth:`StepAssembler.add`)."""
    if entry.ranks is None:
        entry.ranks = set()
        for part in entry.parts:
            entry.ranks.update(part.ranks.tolist())
    return entry.ranks


class StepAssembler(Stateful):
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
        self._epoch = 0  # counts resets of rank owners: a step opened since the last one has parts whose
        # ranks no other node owns, which lets the block path skip the rank-overlap check
        self._known_mask: dict[str, np.ndarray] = {}  # job -> whether each rank is in _ranks_known
        self._oldest: dict[str, float] = {}  # job -> first_ts of its oldest open step (absent: not known)
        self._rounds: dict[tuple[str, tuple[int, ...]], _Round] = {}
        self._gathered: tuple[tuple[int, ...], tuple[StepBatch | StepBlock, ...], dict[str, object]] | None = None
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
        if entry is not None and entry.round is not None:
            self._own(entry)
        if entry is not None and (batch.node in entry.nodes or not _part_ranks(entry).isdisjoint(ranks)):
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
            self._learn(job, batch.ranks)  # a late node still tells how many ranks the job has
            self.late_total += 1
            return []
        if entry is None:
            entry = self._open[(job, step)] = self._open_by_job.setdefault(job, {})[step] = _OpenStep(
                [], [], set(), set(), batch.ts, self._epoch)
            if batch.ts < self._oldest.get(job, -math.inf):  # kept only while known (else found when needed)
                self._oldest[job] = batch.ts
        entry.parts.append(batch)
        entry.rows.append(-1)
        entry.nodes.add(batch.node)
        if entry.ranks is not None:
            entry.ranks.update(ranks)
        entry.covered += len(known.intersection(ranks))
        out = self.flush(batch.ts, job=job)
        if (job, step) in self._open and known and entry.covered >= len(known):
            out.append(self._emit(job, step, complete=True))
        return out

    def add_block(self, block: StepBlock) -> tuple[list[AssembledStep], list[int]]:
        """Take one step block: exactly :meth:`add` of its steps in order (``block.row(k)``), without a
        step batch per step where nothing can differ. Returns the steps completed (and made overdue)
        and the rows refused (``refused_`` of each row's :meth:`add`).

        The whole-array path needs the node to report the ranks it reported last (so no other node
        owns them), no step of the job to time out within the block's event-time span, and each row's
        step to be open or new and plausible and not yet reported by the node; a row that fails one
        of these goes through :meth:`add`, which counts and refuses as for a batch."""
        job, node = block.job, block.node
        out: list[AssembledStep] = []
        refused: list[int] = []
        steps, stamps = block.steps.tolist(), block.step_ts.tolist()
        oldest = self._oldest.get(job)
        if oldest is None:
            mine = self._open_by_job.get(job)
            oldest = self._oldest[job] = min(e.first_ts for e in mine.values()) if mine else math.inf
        oldest = min(oldest, min(stamps))
        fast = (self._last_ranks.get((job, node)) == block.ranks.tobytes()
                and oldest + self.timeout_s > max(stamps))
        known = self._ranks_known.setdefault(job, set())
        opened, epoch, jump = self._open, self._epoch, self.max_step_jump
        done = self._done.get(job, -1)
        if fast and known.issuperset(block.ranks.tolist()) and max(steps) <= done + jump:
            whole = self._round(block, steps, stamps, done)
            if whole is not None:
                return whole, []
        size, count = -1, 0
        for k, step in enumerate(steps):
            entry = opened.get((job, step))
            if entry is not None and entry.round is not None:
                self._own(entry)
            if (not fast or step > done + jump or (entry is None and step <= done)
                    or (entry is not None and (entry.epoch != epoch or node in entry.nodes))):
                out += self.add(block.row(k))
                if self.refused_:
                    refused.append(k)
                done, epoch = self._done.get(job, -1), self._epoch
                continue
            if entry is None:
                entry = opened[(job, step)] = self._open_by_job.setdefault(job, {})[step] = _OpenStep(
                    [], [], set(), set(), stamps[k], epoch)
                if stamps[k] < self._oldest.get(job, -math.inf):
                    self._oldest[job] = stamps[k]
            entry.parts.append(block)
            entry.rows.append(k)
            entry.nodes.add(node)
            entry.ranks = None
            if len(known) != size:  # the job's known ranks grew (an emit, a late row): count them again
                size = len(known)
                count = len(known.intersection(block.ranks.tolist()))
            entry.covered += count
            if known and entry.covered >= size:
                out.append(self._emit(job, step, complete=True))
                done = self._done[job]
        self.refused_ = bool(refused)
        return out, refused

    def _round(self, block: StepBlock, steps: list[int], stamps: list[float], done: int) -> list[AssembledStep] | None:
        """:meth:`add_block`'s rows all at once, or None where they need one by one: the block joins the
        open round of its steps (every step still open, none from this node), or opens one (no step
        open yet, none already concluded). Its ranks are all known and no step times out within it
        (the caller checked), so each row would be added, counted and, once complete, emitted in order."""
        job, node = block.job, block.node
        key = (job, tuple(steps))
        r = self._rounds.get(key)
        if r is not None:
            if r.attached != len(steps) or node in r.nodes or r.epoch != self._epoch:
                return None
            r.parts.append(block)
            r.nodes.add(node)
        else:
            mine = self._open_by_job.get(job)
            if min(steps) <= done or len(set(steps)) != len(steps) or (mine and any(k in mine for k in steps)):
                return None
            r = self._rounds[key] = _Round(job, key[1], [block], {node}, 0, self._epoch, len(steps))
            mine = self._open_by_job.setdefault(job, {})
            for k, (step, ts) in enumerate(zip(steps, stamps, strict=True)):
                self._open[(job, step)] = mine[step] = _OpenStep([], [], set(), None, ts, self._epoch, round=r, row=k)
            if min(stamps) < self._oldest.get(job, -math.inf):
                self._oldest[job] = min(stamps)
        r.covered += block.ranks.size
        known = self._ranks_known[job]
        if known and r.covered >= len(known):
            return [self._emit(job, step, complete=True) for step in steps]
        return []

    def _own(self, entry: _OpenStep) -> None:
        """Give a step of a round its own parts, nodes and coverage (the round takes no more blocks)."""
        r = entry.round
        assert r is not None
        entry.parts, entry.rows = list(r.parts), [entry.row] * len(r.parts)
        entry.nodes, entry.covered, entry.ranks, entry.round = set(r.nodes), r.covered, None, None
        self._leave(r)

    def _leave(self, r: _Round) -> None:
        r.attached -= 1
        if r.attached <= 0 and self._rounds.get((r.job, r.steps)) is r:
            del self._rounds[(r.job, r.steps)]

    def flush(self, now: float, *, job: str | None = None) -> list[AssembledStep]:
        """Emit open steps (of ``job``, or of every job) whose first batch is older than ``now - timeout_s``."""
        if job is not None:
            mine = self._open_by_job.get(job, {})
            due = [(job, step) for step, entry in mine.items() if entry.first_ts + self.timeout_s <= now]
        else:
            due = [key for key, entry in self._open.items() if entry.first_ts + self.timeout_s <= now]
        return [self._emit(j, s, complete=False) for j, s in sorted(due, key=lambda k: k[1])]

    def overdue(self, now: float, timeout_of: Callable[[str], float]) -> list[AssembledStep]:
        """Emit open steps whose first batch is more than ``timeout_of(job)`` (at least ``timeout_s``)
        older than ``now``, a clock over all inputs: a step no later batch of its job will ever cut
        short (the job's last steps, a node's batch that never comes) is concluded, not held forever."""
        if not self._open:
            return []
        due = [key for key, entry in self._open.items()
               if entry.first_ts + max(self.timeout_s, timeout_of(key[0])) <= now]
        return [self._emit(j, s, complete=False) for j, s in sorted(due, key=lambda k: k[1])]

    def drain(self) -> list[AssembledStep]:
        """Emit everything still open (end of input)."""
        return [self._emit(job, step, complete=False) for job, step in sorted(self._open, key=lambda k: k[1])]

    def owns(self, job: str | None, node: str, rank: int | None = None) -> bool:
        """Whether ``node``'s step batches of ``job`` carry ``rank`` (any rank of the job when None): the
        job's own step stream placing a rank on a node, which supports a check result that node reports."""
        owner = self._owner.get(job or "")
        code = self._codes.get(node)
        if owner is None or code is None:
            return False
        if rank is None:
            return bool((owner == code).any())
        return 0 <= rank < owner.size and int(owner[rank]) == code

    def restart(self, job: str) -> None:
        """The job was interrupted and restarts, perhaps from an earlier step and a new placement: its step
        numbers may repeat and its ranks may move to other nodes."""
        self._done.pop(job, None)
        self._drop_owners(job)

    def forget(self, jobs: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        """Drop everything about ``jobs`` (ended: no batch for a long time) and the node codes of
        ``nodes`` (not seen for a long time: a node that comes back gets a new code, and the rank owners
        of its jobs are learned again)."""
        gone_jobs, gone_nodes = names("jobs", jobs), names("nodes", nodes)
        for job in gone_jobs:
            self._done.pop(job, None)
            self._ranks_known.pop(job, None)
            self._known_mask.pop(job, None)
            self._oldest.pop(job, None)
            self._drop_owners(job)
            for step in self._open_by_job.pop(job, {}):
                del self._open[(job, step)]
        if gone_jobs:
            self._rounds = {k: r for k, r in self._rounds.items() if k[0] not in gone_jobs}
        self._forget_nodes(gone_nodes)
        if gone_jobs or gone_nodes:
            self._gathered = None  # a cache of the last round's parts, which may name them

    def _forget_nodes(self, nodes: frozenset[str]) -> None:
        for node in nodes:
            code = self._codes.pop(node, None)
            if code is None:
                continue
            self._epoch += 1
            for owner in self._owner.values():
                owner[owner == code] = -1
        if nodes:
            self._last_ranks = {k: v for k, v in self._last_ranks.items() if k[1] not in nodes}

    def _drop_owners(self, job: str) -> None:
        self._epoch += 1
        self._owner.pop(job, None)
        for key in [k for k in self._last_ranks if k[0] == job]:
            del self._last_ranks[key]

    def open_steps(self) -> set[tuple[str, int]]:
        """(job, step) pairs still waiting for batches."""
        return set(self._open)

    def _learn(self, job: str, ranks: np.ndarray) -> None:
        """Add ranks to the job's known set; when it grows, recount the coverage of its open steps."""
        mask = self._known_mask.get(job)
        top = int(ranks.max()) + 1 if ranks.size else 0
        if mask is not None and top <= mask.size and mask[ranks].all():
            return  # the usual case: every rank already known
        if mask is None or mask.size < top:
            grown = np.zeros(max(top, 2 * (0 if mask is None else mask.size)), dtype=bool)
            if mask is not None:
                grown[:mask.size] = mask
            mask = self._known_mask[job] = grown
        mask[ranks] = True
        known = self._ranks_known.setdefault(job, set())
        before = len(known)
        known.update(ranks.tolist())
        if len(known) != before:
            for entry in self._open_by_job.get(job, {}).values():
                if entry.round is not None:
                    self._own(entry)
                entry.covered = len(known & _part_ranks(entry))

    def _gather(self, parts: list[StepBatch | StepBlock]) -> dict[str, object]:
        """The columns the parts share whatever their row: ranks, GPUs, nodes, groups, and for blocks
        of the same steps their compute times side by side (one matrix, a row per step). Kept for the
        next step, which in a stream of blocks has the same parts."""
        key = tuple(map(id, parts))
        if self._gathered is not None and self._gathered[0] == key:
            return self._gathered[2]
        groups = None
        if all(p.groups is not None for p in parts):
            groups = np.concatenate([p.groups for p in parts])
        cols: dict[str, object] = {
            "ranks": np.concatenate([p.ranks for p in parts]),
            "gpus": np.concatenate([p.gpus for p in parts]),
            "nodes": np.repeat(np.array([p.node for p in parts], dtype=object), [len(p.ranks) for p in parts]),
            "groups": groups,
        }
        if all(type(p) is StepBlock for p in parts):
            try:
                steps = np.stack([p.steps for p in parts])
            except ValueError:  # blocks of different lengths
                steps = None
            if steps is not None and bool((steps == steps[0]).all()):
                cols["matrix"] = np.concatenate([p.compute_s for p in parts], axis=1)
                cols["ts"] = np.max(np.stack([p.step_ts for p in parts]), axis=0).tolist()
        self._gathered = (key, tuple(parts), cols)
        return cols

    def _emit(self, job: str, step: int, *, complete: bool) -> AssembledStep:
        entry = self._open.pop((job, step))
        mine = self._open_by_job[job]
        del mine[step]
        if not mine:
            del self._open_by_job[job]
        if entry.first_ts <= self._oldest.get(job, -math.inf):
            del self._oldest[job]  # found again when needed
        self._done[job] = max(self._done.get(job, -1), step)
        r = entry.round
        if r is not None:  # blocks of the same steps: its row of their compute times side by side
            if r.cols is None:
                r.cols = self._gather(r.parts)
            cols, parts, rows = r.cols, r.parts, [entry.row]
            self._leave(r)
        else:
            parts, rows = entry.parts, entry.rows
            cols = self._gather(parts)
        ranks = cols["ranks"]
        self._learn(job, ranks)  # type: ignore[arg-type]
        if "matrix" in cols and rows.count(rows[0]) == len(rows):
            compute = cols["matrix"][rows[0]]  # type: ignore[index]
            ts = cols["ts"][rows[0]]  # type: ignore[index]
        else:
            pairs = list(zip(parts, rows, strict=True))
            compute = np.concatenate([p.compute_s if k < 0 else p.compute_s[k] for p, k in pairs])
            ts = max(p.ts if k < 0 else float(p.step_ts[k]) for p, k in pairs)
        return AssembledStep(
            job=job, step=step, ts=ts, ranks=ranks, gpus=cols["gpus"], nodes=cols["nodes"],  # type: ignore[arg-type]
            compute_s=compute, groups=cols["groups"], complete=complete,  # type: ignore[arg-type]
        )
