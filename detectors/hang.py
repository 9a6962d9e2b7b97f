"""Hang detection: a progress check in event time, never a liveness check (seed 000 §7).

A hung rank is alive; what stops is progress. Per job, :class:`HangDetector` keeps every rank's
last completed step and the event time it arrived (from :class:`~fleethealth.schema.StepBatch`),
the time the job last made progress, and a window of step durations. When progress has stopped
for longer than the step timeout — ``timeout_factor`` × the ``quantile`` step time, floored at
``min_timeout_s`` (seed: 3 × p99, ~90 s at scale) — the job is hung, and it yields **one**
``hang`` finding naming the ranks and nodes that are behind (the lowest last step, which
includes ranks that stopped reporting) with the stack dumps the in-job watchdogs sent as
``hang_report`` events.

Timeline of one hang::

    last progress ──timeout──▶ deadline ──(wait for the behind ranks' stacks, ≤ stack_grace_s)──▶ finding

The finding is emitted at the deadline if every behind rank's stack is already in, else as soon
as they are, or at ``deadline + stack_grace_s`` with what arrived, or earlier when the job
resumes or is reported interrupted. Its ``ts`` is that moment in event time (not the caller's
clock), so a replay yields the same finding; its ``episode_ts`` (and so its id) is the job's last
progress, which does not depend on the timeout a detector estimated from the history it saw — a
restarted detector that knows fewer step durations concludes at another time with the same id.

A whole-job hang (a network or storage hang: every rank stops at the same step, none behind, no
watchdog report) is told from a finished or idle job by the job's nodes: while most of them still
report telemetry at ``deadline + stack_grace_s``, the job is hung and yields a finding with no
culprit (``rank`` null, ``evidence["culprit"]`` false, ``evidence["level"]`` true, the last step
and the stacks if any); the policy pages a human instead of draining a node. Without that
telemetry, ranks all level with no watchdog report is a job that finished or is idle (counted in
``idle_total_``). Not a hang either: a job that stopped for a known cause before the deadline (its
``job_exit`` record — a lost GPU, a planned restart — or an ``interruption`` record). After a
``job_exit``, a ``job_start`` or an ``interruption`` the job's rank state starts afresh with its next
batch, since a restarted job may resume from an earlier step — except, after a ``job_exit``, a batch
of a step no newer than the exit's ``last_step``: the exited run's own last steps, which the ranks
deliver in any order around rank 0's exit, reopen nothing (``late_after_exit_total_``; a restart the
job lifecycle sees from such a step comes with its own ``job_start`` marker first).

The clock never outruns the step input: ``now`` comes from all inputs, so a stalled steps
partition lets it pass a job's deadline while the job is in fact progressing. A batch that
arrives after the deadline was passed but carries an event time before it shows progress in
time: the deadline is withdrawn (counted in ``clock_ahead_total_``), not reported as a resumed
hang. Level ranks wait the ``stack_grace_s`` before being reported, which is what lets a
stalled partition deliver its backlog first.

``update(Batch(steps=…, events=…, alive=…), now)`` (or ``check(batches, events, now, alive=...)``):
``now`` is the newest event time the caller has seen
(the runner passes its watermark); it must be finite. ``alive`` maps a node to the event time of
its newest telemetry sample.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fleethealth.detectors.batch import Batch, expect
from fleethealth.detectors.state import Stateful, names
from fleethealth.errors import SchemaError
from fleethealth.params import check_int, check_number
from fleethealth.payloads.hang_report import HangReport, RankStacks
from fleethealth.schema import Event, EventKind, Finding, FindingKind, StepBatch, StepBlock

__all__ = ["HangDetector", "StepTimeout"]

_STOPS = (EventKind.INTERRUPTION, EventKind.JOB_EXIT, EventKind.JOB_START)
"""Events that end a job's current run: after one its rank state starts afresh with the next batch."""


@dataclass(frozen=True)
class StepTimeout:
    """The step timeout of a job, the one rule both the hang detector and the job lifecycle use:
    ``factor`` × the ``quantile`` of the job's last ``window`` step durations, at least ``floor_s``
    (seed: 3 × p99, floored at 30 s). Its settings are the hang detector's keys
    (``detect.hang.timeout_factor``, ``quantile``, ``min_timeout_s``, ``window``);
    :meth:`HangDetector.step_timeout` builds it and the pipeline hands it to the lifecycle."""

    factor: float = 3.0
    quantile: float = 0.99
    floor_s: float = 30.0
    window: int = 512

    def of(self, durations: np.ndarray) -> float:
        """The timeout for step durations ``durations`` (shape ``(n,)``, the newest ``window``); the floor
        when there are none."""
        if durations.size == 0:
            return float(self.floor_s)
        return max(float(self.floor_s), self.factor * float(np.quantile(durations, self.quantile)))


@dataclass
class _Job:
    """Running state of one job (mutable; private to the detector)."""

    last_step: np.ndarray = field(default_factory=lambda: np.full(0, -1, dtype=np.int64))
    last_ts: np.ndarray = field(default_factory=lambda: np.zeros(0))
    node_of: np.ndarray = field(default_factory=lambda: np.full(0, -1, dtype=np.int64))
    gpu_of: np.ndarray = field(default_factory=lambda: np.full(0, -1, dtype=np.int64))
    nodes: list[str] = field(default_factory=list)
    node_index: dict[str, int] = field(default_factory=dict)
    max_step: int = -1
    max_step_ts: float = math.nan
    progress_ts: float = math.nan
    durations: deque[float] = field(default_factory=deque)
    timeout: float = math.nan  # cached step timeout; NaN when the durations changed since
    stacks: dict[int, RankStacks] = field(default_factory=dict)
    interrupted: bool = False
    exit_step: int | None = None  # after a job_exit: the exited run's last step (its steps reopen nothing)
    reported: bool = False
    deadline: float = math.nan

    def grow(self, top: int) -> None:
        if top < self.last_step.size:
            return
        new = max(top + 1, 2 * self.last_step.size, 64)
        for name, fill in (("last_step", -1), ("last_ts", 0.0), ("node_of", -1), ("gpu_of", -1)):
            old = getattr(self, name)
            arr = np.full(new, fill, dtype=old.dtype)
            arr[: old.size] = old
            setattr(self, name, arr)


class HangDetector(Stateful):
    """One ``hang`` finding per stalled job, naming the ranks behind and attaching their stacks.

    Parameters are keyword-only and checked on the first ``update`` (``ConfigError``):
    ``timeout_factor`` × the ``quantile`` of the last ``window`` step durations, floored at
    ``min_timeout_s``; ``stack_grace_s`` how long past the deadline to wait for watchdog stacks;
    ``max_listed`` caps the ranks and stacks listed in the evidence.
    """

    name = "hang"

    def __init__(self, *, timeout_factor: float = 3.0, quantile: float = 0.99, min_timeout_s: float = 30.0,
                 window: int = 512, stack_grace_s: float = 90.0, max_listed: int = 64) -> None:
        self.timeout_factor = timeout_factor
        self.quantile = quantile
        self.min_timeout_s = min_timeout_s
        self.window = window
        self.stack_grace_s = stack_grace_s
        self.max_listed = max_listed

    # ------------------------------------------------------------ state
    def _start(self) -> None:
        check_number("timeout_factor", self.timeout_factor, above=0, owner=self)
        check_number("quantile", self.quantile, above=0, at_most=1.0, owner=self)
        check_number("min_timeout_s", self.min_timeout_s, above=0, owner=self)
        check_int("window", self.window, at_least=1, owner=self)
        check_number("stack_grace_s", self.stack_grace_s, at_least=0, owner=self)
        check_int("max_listed", self.max_listed, at_least=1, owner=self)
        self.rule_ = StepTimeout(factor=float(self.timeout_factor), quantile=float(self.quantile),
                                 floor_s=float(self.min_timeout_s), window=int(self.window))
        self.jobs_: dict[str, _Job] = {}
        self.idle_total_ = 0
        self.clock_ahead_total_ = 0
        self.ignored_events_total_ = 0
        self.late_after_exit_total_ = 0
        self.alive_: Mapping[str, float] = {}

    def timeout_s(self, job: str) -> float:
        """The current step timeout of ``job`` (the floor until step durations are known)."""
        state = self.jobs_.get(job) if hasattr(self, "jobs_") else None
        if state is None or not state.durations:
            return float(self.min_timeout_s)
        if math.isnan(state.timeout):
            state.timeout = self.rule_.of(np.fromiter(state.durations, dtype=np.float64))
        return state.timeout

    def step_timeout(self) -> StepTimeout:
        """The step-timeout rule of this detector's parameters (checked), for the job lifecycle to share."""
        if not hasattr(self, "jobs_"):
            self._start()
        return self.rule_

    def forget(self, jobs: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        """Drop ``jobs`` (ended: they will not be reported as hung) and the newest telemetry times of
        ``nodes``. Where a live job's ranks ran is that job's state, dropped with it."""
        gone_jobs, gone_nodes = names("jobs", jobs), names("nodes", nodes)
        if not hasattr(self, "jobs_"):
            return
        for job in gone_jobs:
            self.jobs_.pop(job, None)
        if gone_nodes and any(n in self.alive_ for n in gone_nodes):
            self.alive_ = {n: ts for n, ts in self.alive_.items() if n not in gone_nodes}

    # ------------------------------------------------------------ input
    def _batch(self, b: StepBatch) -> None:
        job = self.jobs_.get(b.job)
        if job is None:
            job = self.jobs_[b.job] = _Job()
        if job.interrupted:
            if job.exit_step is not None and b.step <= job.exit_step:
                self.late_after_exit_total_ += 1  # the exited run's own last steps, delivered after its exit
                return
            self.jobs_[b.job] = job = _Job(durations=job.durations)
        ranks = np.asarray(b.ranks, dtype=np.int64)
        if ranks.size == 0:
            return
        job.grow(int(ranks.max()))
        node = job.node_index.setdefault(b.node, len(job.nodes))
        if node == len(job.nodes):
            job.nodes.append(b.node)
        job.node_of[ranks] = node
        job.gpu_of[ranks] = np.asarray(b.gpus, dtype=np.int64)
        newer = job.last_step[ranks] < b.step
        if newer.any():
            job.last_step[ranks[newer]] = b.step
            job.last_ts[ranks[newer]] = b.ts
            job.progress_ts = b.ts if math.isnan(job.progress_ts) else max(job.progress_ts, b.ts)
            job.reported = False
            job.deadline = math.nan
            job.stacks.clear()
        if b.step > job.max_step:
            if job.max_step >= 0 and b.ts > job.max_step_ts:
                job.durations.append((b.ts - job.max_step_ts) / (b.step - job.max_step))
                job.timeout = math.nan
                while len(job.durations) > self.window:
                    job.durations.popleft()
            job.max_step, job.max_step_ts = b.step, b.ts

    def _quiet(self, job: _Job | None) -> bool:
        """Whether a job is in the state where a block of its steps can wait for :meth:`_blocks`: known,
        not interrupted, no deadline armed, progress seen (none of which its own steps can change)."""
        return job is not None and not job.interrupted and not self._pending(job) and not math.isnan(job.progress_ts)

    def _blocks(self, name: str, blocks: list[StepBlock]) -> list[Finding]:
        """Fold in ``blocks`` of job ``name`` (consecutive in its input, taken while :meth:`_quiet`), as
        :meth:`_one` of each step in order would: one pass over all their ranks for each run of blocks
        whose steps and times increase and neither pass the job's newest step nor its step timeout
        (then no check can report and the step times do not change), step by step for a block that
        does not (a job's newest steps), and for every block after one that left the job not quiet."""
        job = self.jobs_[name]
        out: list[Finding] = []
        while blocks:
            cut = self._foldable(name, job, blocks) if self._quiet(job) else 0
            if cut:
                self._fold(job, blocks[:cut])
            for batch in blocks[cut].split() if cut < len(blocks) else ():
                out += self._one(batch.ts, batch)
            blocks = blocks[cut + 1:]
        return out

    def _foldable(self, name: str, job: _Job, blocks: list[StepBlock]) -> int:
        """How many leading ``blocks`` :meth:`_fold` may take at once (see :meth:`_blocks`)."""
        steps = np.concatenate([b.steps for b in blocks])
        stamps = np.concatenate([b.step_ts for b in blocks])
        sizes = np.fromiter((b.steps.size for b in blocks), dtype=np.int64, count=len(blocks))
        ends = np.cumsum(sizes) - 1
        bad = np.zeros(steps.size, dtype=bool)
        bad[1:] = (steps[1:] <= steps[:-1]) | (stamps[1:] < stamps[:-1])
        bad[ends[:-1] + 1] = False  # a block's first step follows another block's last: no order between them
        wrong = np.add.reduceat(bad, ends - sizes + 1) > 0
        wrong |= (steps[ends] > job.max_step) | (stamps[ends] > job.progress_ts + self.timeout_s(name))
        return int(np.argmax(wrong)) if wrong.any() else len(blocks)

    def _fold(self, job: _Job, blocks: list[StepBlock]) -> None:
        """:meth:`_batch` of every step of ``blocks`` in order, for blocks :meth:`_foldable` accepted: each
        rank ends at the newest step a block brought it past, a block that moved any rank moves
        progress to its last step's time."""
        last = np.fromiter((b.steps[-1] for b in blocks), dtype=np.int64, count=len(blocks))
        last_ts = np.fromiter((b.step_ts[-1] for b in blocks), dtype=np.float64, count=len(blocks))
        counts = np.fromiter((b.ranks.size for b in blocks), dtype=np.int64, count=len(blocks))
        ranks = np.concatenate([b.ranks for b in blocks]).astype(np.int64)
        if ranks.size == 0:
            return
        job.grow(int(ranks.max()))
        codes = []
        for b in blocks:
            node = job.node_index.setdefault(b.node, len(job.nodes))
            if node == len(job.nodes):
                job.nodes.append(b.node)
            codes.append(node)
        which = np.repeat(np.arange(len(blocks)), counts)
        steps, stamps = last[which], last_ts[which]
        gpus = np.concatenate([b.gpus for b in blocks]).astype(np.int64)
        order = np.lexsort((np.arange(ranks.size), ranks))  # by rank, then input order
        r, s = ranks[order], steps[order]
        head = np.ones(r.size, dtype=bool)
        head[1:] = r[1:] != r[:-1]
        tail = np.ones(r.size, dtype=bool)
        tail[:-1] = head[1:]
        # the running newest step of each rank before each of its reports: its state, then the
        # maximum over its earlier reports in this call (dense ranks of the steps keep the offsets small)
        values, dense = np.unique(np.concatenate([s, job.last_step[r]]), return_inverse=True)
        mine, before = dense[:s.size], dense[s.size:]
        group = np.cumsum(head) - 1
        offset = group * (values.size + 1)
        running = np.maximum.accumulate(mine + offset) - offset  # inclusive, per rank
        prior = np.empty_like(running)
        prior[1:] = running[:-1]
        prior[head] = -1
        newer = mine > np.maximum(prior, before)
        last_newer = np.maximum.accumulate(np.where(newer, np.arange(r.size), -1))  # per position, global
        final = order[last_newer[tail]]  # the report that left each rank at its newest step
        moved_rank = last_newer[tail] >= np.flatnonzero(head)  # the rank moved at all in this call
        if moved_rank.any():
            idx = final[moved_rank]
            job.last_step[ranks[idx]] = steps[idx]
            job.last_ts[ranks[idx]] = stamps[idx]
            moved = np.zeros(len(blocks), dtype=bool)
            moved[which[order[newer]]] = True
            job.progress_ts = max(job.progress_ts, float(last_ts[moved].max()))
            job.reported = False
            job.deadline = math.nan
            job.stacks.clear()
        at = order[tail]  # the last report of each rank names its node and GPU
        job.node_of[ranks[at]] = np.asarray(codes, dtype=np.int64)[which[at]]
        job.gpu_of[ranks[at]] = gpus[at]

    def _event(self, e: Event) -> list[Finding]:
        if e.kind not in _STOPS and e.kind is not EventKind.HANG_REPORT:
            return []
        job = self.jobs_.get(e.job) if e.job is not None else None
        if job is None and e.kind is EventKind.JOB_EXIT and e.job is not None:
            job = self.jobs_[e.job] = _Job()  # an exit before any of its run's steps: they end nothing later
        if job is None:
            self.ignored_events_total_ += 1
            return []
        if e.kind is EventKind.HANG_REPORT:
            try:
                report = HangReport.from_event(e)
            except SchemaError:
                self.ignored_events_total_ += 1
                return []
            if e.rank is not None and len(job.stacks) < 4 * self.max_listed:
                job.stacks[e.rank] = RankStacks(rank=e.rank, node=e.node, gpu=e.gpu, step=e.step, ts=e.ts,
                                                report=report)
            return []
        out = self._report(e.job, job, e.ts, "interrupted") if self._pending(job) else []
        job.interrupted = True
        job.exit_step = _exit_step(e, job.max_step) if e.kind is EventKind.JOB_EXIT else None
        return out

    # ------------------------------------------------------------ decision
    def _behind(self, job: _Job) -> np.ndarray:
        known = np.flatnonzero(job.node_of >= 0)
        if known.size == 0:
            return known
        steps = job.last_step[known]
        low = int(steps.min())
        return known[steps == low] if low < job.max_step else np.empty(0, dtype=np.int64)

    def _report(self, name: str, job: _Job, ts: float, why: str) -> list[Finding]:
        job.reported = True
        behind = self._behind(job)
        listed = behind[: self.max_listed]
        culprits = behind.tolist()
        if behind.size == 0:
            # Every rank is level: the watchdogs' reports are the only pointer (the odd stack out).
            by_stack: dict[str, list[int]] = {}
            for rank, rec in job.stacks.items():
                by_stack.setdefault(rec.report.stacks, []).append(rank)
            if len(by_stack) > 1:
                culprits = sorted(min(by_stack.values(), key=len))
            listed = np.asarray(culprits[: self.max_listed], dtype=np.int64)
        nodes = sorted({job.nodes[i] for i in job.node_of[listed].tolist() if i >= 0})
        stacks = sorted(job.stacks.values(), key=lambda r: (r.rank not in set(culprits), r.rank))
        first = int(listed[0]) if listed.size else None
        node = (job.nodes[job.node_of[first]] if first is not None and job.node_of[first] >= 0
                else stacks[0].node if stacks else job.nodes[0])
        stuck_step = int(job.last_step[listed].min()) + 1 if listed.size else job.max_step + 1
        evidence = {
            "why": why, "timeout_s": round(self.timeout_s(name), 3), "last_progress_ts": job.progress_ts,
            "stalled_s": round(ts - job.progress_ts, 3), "max_step": job.max_step,
            "behind_ranks": [int(r) for r in listed], "behind_count": int(len(culprits)),
            "behind_nodes": nodes, "last_steps": sorted({int(s) for s in job.last_step[listed]}),
            "stacks": [r.to_evidence() for r in stacks[: self.max_listed]],
        }
        evidence["culprit"] = bool(culprits)
        evidence["level"] = behind.size == 0
        if not culprits:
            evidence["last_step"] = job.max_step
            evidence["nodes_reporting"] = self._reporting(job, ts)
            evidence["node_count"] = len(job.nodes)
        one = len(culprits) == 1 and first is not None
        return [Finding(kind=FindingKind.HANG, node=node, ts=float(ts), job=name,
                        gpu=int(job.gpu_of[first]) if one and job.gpu_of[first] >= 0 else None,
                        rank=first if one else None, step=stuck_step, detector=self.name, evidence=evidence,
                        episode_ts=None if math.isnan(job.progress_ts) else float(job.progress_ts))]

    def _check(self, name: str, job: _Job, now: float) -> list[Finding]:
        if job.reported or job.interrupted or math.isnan(job.progress_ts):
            return []
        if math.isnan(job.deadline):
            deadline = job.progress_ts + self.timeout_s(name)
            if now <= deadline:
                return []
            job.deadline = deadline
        behind = self._behind(job)
        if behind.size == 0 and not job.stacks:
            at = job.deadline + self.stack_grace_s
            if now > at:
                if 2 * self._reporting(job, at) > len(job.nodes):  # its nodes live on: the whole job hangs
                    return self._report(name, job, at, "timeout")
                job.reported = True  # level and silent: finished or idle, not hung
                self.idle_total_ += 1
            return []
        have = set(job.stacks)
        if behind.size and all(int(r) in have for r in behind[: self.max_listed]):
            last = max(job.stacks[int(r)].ts for r in behind[: self.max_listed])
            return self._report(name, job, max(job.deadline, last), "timeout")
        if behind.size == 0 and job.stacks:
            return self._report(name, job, max(job.deadline, max(r.ts for r in job.stacks.values())), "timeout")
        if now >= job.deadline + self.stack_grace_s:
            return self._report(name, job, job.deadline + self.stack_grace_s, "timeout")
        return []

    def _reporting(self, job: _Job, at: float) -> int:
        """How many of the job's nodes sent telemetry at or after event time ``at``."""
        alive = self.alive_
        return sum(1 for n in job.nodes if alive.get(n, -math.inf) >= at)

    def _advances(self, job: _Job, b: StepBatch) -> bool:
        ranks = np.asarray(b.ranks, dtype=np.int64)
        if ranks.size == 0:
            return False
        if int(ranks.max()) >= job.last_step.size:
            return True
        return bool((job.last_step[ranks] < b.step).any())

    def update(self, batch: Batch, now: float) -> list[Finding]:
        """:meth:`check` of ``batch.steps`` and ``batch.events`` at ``now``, with ``batch.alive``."""
        batch = expect(batch, self)
        return self.check(batch.steps, batch.events, now, alive=batch.alive)

    def check(self, batches: Sequence[StepBatch], events: Sequence[Event], now: float, *,
              alive: Mapping[str, float] | None = None) -> list[Finding]:
        """Fold in step batches and events in event-time order; return new ``hang`` findings.

        Before each input the job is checked at that input's time, so a stall is seen even when
        the caller hands over a long stretch at once; finally every job is checked at ``now``.
        ``alive`` (node -> newest telemetry event time) tells a whole-job hang from an idle job.
        """
        if not hasattr(self, "jobs_"):
            self._start()
        if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
            raise SchemaError("now", f"expected a finite event time, got {now!r}")
        if alive is not None:
            self.alive_ = alive
        items: list[tuple[float, int, int, StepBatch | StepBlock | Event]] = [
            (b.ts if type(b) is not StepBlock else min(b.step_ts.tolist()), 0, i, b) for i, b in enumerate(batches)]
        items += [(e.ts, 1, i, e) for i, e in enumerate(events)]
        out: list[Finding] = []
        waiting: dict[str, list[StepBlock]] = {}  # per job, blocks taken while it is quiet, folded in at once
        jobs = self.jobs_
        for ts, _, _, item in sorted(items, key=lambda x: x[:3]):
            block = type(item) is StepBlock
            quiet = block and self._quiet(jobs.get(item.job))
            if not quiet and item.job is not None and item.job in waiting:
                out += self._blocks(item.job, waiting.pop(item.job))
            if block:  # a block is its steps in order, at their own times
                if quiet:
                    waiting.setdefault(item.job, []).append(item)
                else:
                    for batch in item.split():
                        out += self._one(batch.ts, batch)
                continue
            out += self._one(ts, item)
        for name, blocks in waiting.items():
            out += self._blocks(name, blocks)
        for name, job in self.jobs_.items():
            out += self._check(name, job, float(now))
        return out

    def _one(self, ts: float, item: StepBatch | Event) -> list[Finding]:
        """One input of :meth:`check`, at its event time ``ts``."""
        out: list[Finding] = []
        job = self.jobs_.get(item.job) if item.job is not None else None
        if (job is not None and isinstance(item, StepBatch) and self._pending(job) and ts <= job.deadline
                and self._advances(job, item)):
            job.deadline = math.nan  # progress made in time, delivered late: the clock ran ahead of it
            self.clock_ahead_total_ += 1
        if job is not None and not _unseen_behind(job, item):
            out += self._check(item.job, job, ts)
        if isinstance(item, StepBatch):
            if job is not None and self._pending(job) and self._advances(job, item):
                if self._behind(job).size or job.stacks:
                    out += self._report(item.job, job, max(ts, job.deadline), "resumed")
                # else a level pause that ended before its grace: nobody to name, nothing to report
            self._batch(item)
        else:
            out += self._event(item)
        return out

    @staticmethod
    def _pending(job: _Job) -> bool:
        return not (job.reported or job.interrupted or math.isnan(job.deadline))


def _unseen_behind(job: _Job, item: StepBatch | Event) -> bool:
    """Whether ``item`` comes from a part of ``job`` never seen here — a step batch of ranks it has never
    seen, or a ``job_start`` (the pipeline's restart marker ahead of such a batch) from a node it has never
    seen — at a step its known ranks have passed. Then what it knew was part of the job, and the time
    since their progress is no stall of the job: the check at the item's time is skipped. A node whose
    clock stepped back (an NTP correction within ``max_behind_s``) puts its stretch of steps an hour
    ahead of the other nodes' in event time; the others, arriving an hour later in event time at lower
    steps, are that case. A run resuming after a real hang is ranks (and nodes) the job knows; a hang
    that a run restarted on only new nodes ends is reported by the checks at ``now`` before it."""
    if isinstance(item, Event):
        return (item.kind is EventKind.JOB_START and item.step is not None and item.step <= job.max_step
                and item.node not in job.node_index)
    if item.step > job.max_step or not len(item.ranks):
        return False
    first = int(item.ranks[0])
    if first < job.node_of.size and job.node_of[first] >= 0:
        return False  # a rank it has seen (a step stream's every batch but a new part's first): no array pass
    ranks = np.asarray(item.ranks, dtype=np.int64)
    known = ranks[ranks < job.node_of.size]
    return bool(known.size == 0 or (job.node_of[known] < 0).all())


def _exit_step(e: Event, max_step: int) -> int:
    """The last step of the run a ``job_exit`` ended: its ``last_step``, else the newest step seen."""
    last = e.data.get("last_step") if isinstance(e.data, dict) else None
    if isinstance(last, int) and not isinstance(last, bool) and last >= 0:
        return last
    return max_step
