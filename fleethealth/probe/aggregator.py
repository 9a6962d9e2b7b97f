"""Turn the datagrams of a node's training ranks into one columnar step batch per (job, step).

The in-job :class:`fleethealth.injob.timer.StepTimer` of every local rank sends a compute datagram
(``"c"``: seconds of pre-collective compute) and a progress datagram (``"p"``: the step completed)
per step, and occasionally an event datagram (``"e"``: an SDC check, a hang report). The
aggregator collects them and emits

- one :class:`fleethealth.schema.StepBatch` per (job, step) when every *known* local rank of the
  job has reported the step (a rank is known once it has reported a compute time within
  ``forget_s``), or when ``timeout_s`` has passed since the step's first datagram (a hung or slow
  rank must not hold the others back: the batch goes out with the ranks that did report, and is
  counted as incomplete). A rank that sends separate progress marks (the CUDA path) counts as
  reported once both its compute time and its progress mark are in; a rank that sends only the
  combined compute datagram (the CPU path) is never held for a mark. Which ranks send marks is
  learnt per (job, rank) from the batches emitted: a rank is held while its last batched step
  carried its mark (or the mark came late for it), so a one-off mark (``step_done`` without a
  compute span) does not hold the rank's later steps. The batch's ``ts`` is the latest progress
  mark (the step's completion), else the latest compute datagram.
- one :class:`fleethealth.schema.Event` per event datagram, with this node filled in.

Garbage (not JSON, wrong fields, out-of-range ranks, GPUs or steps, a schema-invalid event) is
counted and dropped; nothing here raises on input: a datagram whose handling fails for any other
reason is counted as garbage too. Datagrams for a step already emitted are counted as ``late`` and dropped.
Memory is bounded: at most ``max_open`` steps wait at once (the oldest is emitted early).

What one sender can make the probe hold or publish is bounded too (:class:`SocketLimits`): an event
datagram must be of a kind the in-job library sends about its job (``sdc_check``, ``hang_report``,
``checkpoint``, ``job_start``, ``job_exit``: never an Xid or a lost GPU, which only the probe's own
sources report; another kind is garbage, counted), and event datagrams pass a token bucket per
job (``events_per_s``, ``event_burst``) and one for the node (``node_events_per_s``,
``node_event_burst``), so inventing job names gets no more through; a step takes at most
``max_ranks`` ranks, and so does a job on this node (the ranks it remembers as reporting within
``forget_s``): a datagram for one more is dropped. Each overflow is counted (``stats``) and
reported once per job and limit: a ``probe_error`` event on the bus (which the probe also logs as a
warning) naming the job and the limit.

:func:`pack` turns the batches of one drain (one probe interval) into as few messages as it can: one
:class:`fleethealth.schema.StepBlock` per job and rank set, at most ``max_steps`` steps and
``MAX_MESSAGE_BYTES`` each (a block over the size is split in halves); a lone step stays a batch.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fleethealth.errors import SchemaError
from fleethealth.schema import (
    MAX_BLOCK_STEPS,
    MAX_COMPUTE_S,
    MAX_MESSAGE_BYTES,
    SCHEMA_VERSION,
    Event,
    EventKind,
    StepBatch,
    StepBlock,
    decode,
    encode,
)
from fleethealth.wire import WireMessage, parse

__all__ = ["StepAggregator", "Drained", "AggregatorStats", "SocketLimits", "pack"]


@dataclass(frozen=True)
class SocketLimits:
    """What the node's training processes may send (config keys ``probe.socket_*``)."""

    events_per_s: float = 5.0
    """Event datagrams a job may send per second, sustained (``probe.socket_events_per_s``)."""
    event_burst: int = 50
    """... and at once (``probe.socket_event_burst``)."""
    node_events_per_s: float = 20.0
    """Event datagrams all jobs together may send per second (``probe.socket_node_events_per_s``)."""
    node_event_burst: int = 200
    max_ranks: int = 256
    """Ranks one step of a job, and one job, may carry on this node (``probe.socket_max_ranks``)."""
    max_jobs: int = 1024
    """Jobs whose event buckets are remembered (the least recently used is forgotten)."""
    event_kinds: frozenset[str] = frozenset({"sdc_check", "hang_report", "checkpoint", "checkpoint_validated",
                                             "checkpoint_cost", "job_start", "job_exit"})
    """Event kinds a training process may send (``probe.socket_event_kinds``): what the in-job
    library reports about its job. Node kinds (``xid``, ``gpu_lost``, ``selftest`` …) come from the
    probe's own sources, never from the socket."""

    def __post_init__(self) -> None:
        if not (self.events_per_s > 0 and self.node_events_per_s > 0 and self.event_burst >= 1
                and self.node_event_burst >= 1 and self.max_ranks >= 1 and self.max_jobs >= 1):
            raise SchemaError("probe", f"socket limits must be positive, got {self}")


class _Bucket:
    __slots__ = ("tokens", "at")

    def __init__(self, burst: float, now: float) -> None:
        self.tokens = float(burst)
        self.at = now

    def take(self, now: float, rate: float, burst: float) -> bool:
        self.tokens = min(float(burst), self.tokens + max(0.0, now - self.at) * rate)
        self.at = max(self.at, now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


def pack(batches: Sequence[StepBatch], max_steps: int = 100, *,
         max_bytes: int = MAX_MESSAGE_BYTES) -> list[StepBatch | StepBlock]:
    """The messages that carry ``batches``: per (job, node, ranks, GPUs, groups), in order of first
    appearance, blocks of at most ``max_steps`` steps (``1``: the batches unchanged) whose encoding
    fits ``max_bytes``; a block of one step is sent as its batch."""
    if not 1 <= max_steps <= MAX_BLOCK_STEPS:
        raise ValueError(f"max_steps must be within 1..{MAX_BLOCK_STEPS}, got {max_steps}")
    if max_steps == 1:
        return list(batches)
    runs: dict[tuple, list[StepBatch]] = {}
    for b in batches:
        shape = (b.job, b.node, b.ranks.tobytes(), b.gpus.tobytes(), None if b.groups is None else b.groups.tobytes())
        run = runs.setdefault(shape, [])
        if any(x.step == b.step for x in run):  # one step twice (re-emitted late): its own run
            runs.setdefault((*shape, len(runs)), []).append(b)
        else:
            run.append(b)
    out: list[StepBatch | StepBlock] = []
    for run in runs.values():
        for lo in range(0, len(run), max_steps):
            out.extend(_fit(run[lo:lo + max_steps], max_bytes))
    return out


def _fit(run: Sequence[StepBatch], max_bytes: int) -> list[StepBatch | StepBlock]:
    if len(run) == 1:
        return [run[0]]
    block = StepBlock.of(run)
    if len(encode(block)) <= max_bytes:
        return [block]
    half = len(run) // 2
    return [*_fit(run[:half], max_bytes), *_fit(run[half:], max_bytes)]


@dataclass(frozen=True)
class Drained:
    """What one :meth:`StepAggregator.drain` hands on: complete (or timed-out) batches and events."""

    batches: tuple[StepBatch, ...] = ()
    events: tuple[Event, ...] = ()


@dataclass(frozen=True, slots=True)
class AggregatorStats:
    """Counters since start: datagrams received, garbage dropped, batches emitted (and how many of
    them incomplete), datagrams that came after their step was emitted, steps emitted early to
    keep memory bounded, and events forwarded."""

    datagrams_total: int
    garbage_total: int
    batches_total: int
    incomplete_total: int
    late_total: int
    evicted_total: int
    events_total: int
    open_steps: int
    events_limited_total: int = 0
    ranks_limited_total: int = 0


@dataclass
class _Open:
    first_seen: float
    compute: dict[int, tuple[int, float, float]] = field(default_factory=dict)  # rank -> (gpu, s, ts)
    progress: dict[int, float] = field(default_factory=dict)                    # rank -> ts
    groups: dict[int, int] = field(default_factory=dict)                        # rank -> group, when sent


class StepAggregator:
    """Aggregate one node's rank datagrams. ``now`` is the probe's clock (seconds, monotonic or wall)."""

    def __init__(self, node: str, *, timeout_s: float = 5.0, forget_s: float = 300.0, max_open: int = 4096,
                 remember_emitted: int = 65536, limits: SocketLimits | None = None) -> None:
        self.node = node
        self.limits = limits if limits is not None else SocketLimits()
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._node_bucket: _Bucket | None = None
        self._events_limited = self._ranks_limited = 0
        self._reported: set[tuple[str, str]] = set()  # (job, limit) already reported
        self.timeout_s = timeout_s
        self.forget_s = forget_s
        self.max_open = max_open
        self._open: OrderedDict[tuple[str, int], _Open] = OrderedDict()
        self._known: dict[str, dict[int, float]] = {}   # job -> rank -> last seen (now)
        self._marks: dict[str, set[int]] = {}           # job -> ranks held for progress marks
        self._batched: dict[str, dict[int, int]] = {}   # job -> rank -> last step batched with its compute
        self._job_since: dict[str, float] = {}          # job -> when its first rank reported (now)
        self._emitted: set[tuple[str, int]] = set()
        self._emitted_order: deque[tuple[str, int]] = deque()
        self._remember = remember_emitted
        self._ready: list[StepBatch] = []
        self._events: list[Event] = []
        self._datagrams = self._garbage = self._batches = self._incomplete = 0
        self._late = self._evicted = self._events_total = 0
        self.last_garbage: str | None = None

    # ------------------------------------------------------------ input
    def feed(self, datagram: bytes, now: float, wall: float | None = None) -> None:
        """Take one raw datagram; garbage is counted (``last_garbage`` keeps the reason) and dropped.

        ``wall`` (the wall clock, seconds since the epoch) stamps an event datagram that carries no
        ``ts`` of its own; without it the event gets ``now``. Never raises.
        """
        self._datagrams += 1
        try:
            msg = parse(datagram)
        except (ValueError, TypeError, OverflowError) as exc:
            self._drop(str(exc))
            return
        try:
            self.add(msg, now, wall)
        except Exception as exc:  # noqa: BLE001 - one bad datagram must not stop the rest
            self.reject(f"{type(exc).__name__}: {exc}")

    def reject(self, reason: str) -> None:
        """Count one datagram as garbage for ``reason`` (a caller whose own handling of it failed)."""
        self._drop(reason[:500])

    def add(self, msg: WireMessage, now: float, wall: float | None = None) -> None:
        """Take one parsed datagram (``wall``: as in :meth:`feed`)."""
        if msg.kind == "e":
            kind = (msg.event or {}).get("kind")
            if kind not in self.limits.event_kinds:
                self._drop(f"event kind {str(kind)[:40]!r} is not one a training process may send "
                           f"(probe.socket_event_kinds: {', '.join(sorted(self.limits.event_kinds))})")
                return
            if self._event_allowed(msg.job, now, wall):
                self._add_event(msg, now if wall is None else wall)
            return
        if msg.kind == "c" and msg.value > MAX_COMPUTE_S:
            self._drop(f"compute time {msg.value} s is not a measurement")
            return
        key = (msg.job, msg.step)
        if key in self._emitted:
            self._late += 1
            if msg.kind == "p" and self._batched.get(msg.job, {}).get(msg.rank) == msg.step:
                self._marks.setdefault(msg.job, set()).add(msg.rank)  # its mark came after the batch
            return
        entry = self._open.get(key)
        if entry is None:
            entry = self._open[key] = _Open(first_seen=now)
            if len(self._open) > self.max_open:
                old_key, old = self._open.popitem(last=False)
                self._evicted += 1
                self._emit(old_key, old, complete=False)
        known = self._known.get(msg.job, {})
        cap = self.limits.max_ranks
        if (msg.rank not in entry.compute and msg.rank not in entry.progress
                and (max(len(entry.compute), len(entry.progress)) >= cap or (msg.rank not in known
                                                                             and len(known) >= cap))):
            self._ranks_limited += 1
            self._report(msg.job, "max_ranks", wall if wall is not None else now,
                         f"job {msg.job!r} already has {cap} ranks on this node (in step {msg.step}, or "
                         f"reporting within {self.forget_s:g} s; probe.socket_max_ranks): further ranks' "
                         "datagrams are dropped")
            if not entry.compute and not entry.progress:
                del self._open[key]
            return
        if msg.kind == "c":
            entry.compute[msg.rank] = (msg.gpu, msg.value, msg.ts)
            if msg.group is not None:
                entry.groups[msg.rank] = msg.group
            self._known.setdefault(msg.job, {})[msg.rank] = now
            self._job_since.setdefault(msg.job, now)
        else:
            entry.progress[msg.rank] = msg.ts
        if self._complete(msg.job, entry, now):
            del self._open[key]
            self._emit(key, entry, complete=True)

    def _add_event(self, msg: WireMessage, now: float) -> None:
        obj = dict(msg.event or {})
        obj["node"] = self.node
        obj.setdefault("v", SCHEMA_VERSION)
        if not obj.get("ts"):
            obj["ts"] = now
        try:
            event = decode(Event, obj)
        except SchemaError as exc:
            self._drop(f"event: {exc}")
            return
        self._events.append(event)
        self._events_total += 1

    def _event_allowed(self, job: str, now: float, wall: float | None) -> bool:
        lim = self.limits
        if self._node_bucket is None:
            self._node_bucket = _Bucket(lim.node_event_burst, now)
        bucket = self._buckets.get(job)
        if bucket is None:
            bucket = self._buckets[job] = _Bucket(lim.event_burst, now)
            if len(self._buckets) > lim.max_jobs:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(job)
        if not bucket.take(now, lim.events_per_s, lim.event_burst):
            which, detail = job, f"job {job!r} sent events faster than {lim.events_per_s:g}/s (burst {lim.event_burst})"
        elif not self._node_bucket.take(now, lim.node_events_per_s, lim.node_event_burst):
            which, detail = "", (f"this node's jobs sent events faster than {lim.node_events_per_s:g}/s "
                                 f"(burst {lim.node_event_burst})")
        else:
            return True
        self._events_limited += 1
        self._report(which, "events_per_s", wall if wall is not None else now,
                     f"{detail}: further events are dropped (probe.socket_events_per_s)")
        return False

    def _report(self, job: str, limit: str, ts: float, message: str) -> None:
        """One ``probe_error`` event per job and limit (the node's, ``job`` empty), ever."""
        if (job, limit) in self._reported:
            return
        if len(self._reported) >= 4 * self.limits.max_jobs:
            return  # reported enough: the counters keep counting
        self._reported.add((job, limit))
        self._events.append(Event(node=self.node, ts=ts, kind=EventKind.PROBE_ERROR, job=job or None,
                                  message=message[:2000], data={"source": "socket", "limit": limit}))
        self._events_total += 1

    def _drop(self, reason: str) -> None:
        self._garbage += 1
        self.last_garbage = reason

    # ------------------------------------------------------------ output
    def drain(self, now: float) -> Drained:
        """Emit timed-out steps, forget ranks silent for ``forget_s``, and hand over what is ready."""
        for key in [k for k, e in self._open.items() if now - e.first_seen >= self.timeout_s]:
            entry = self._open.pop(key)
            known = self._known.get(key[0], {})
            self._emit(key, entry, complete=all(r in entry.compute for r in known))
        for job, ranks in list(self._known.items()):
            for rank in [r for r, seen in ranks.items() if now - seen > self.forget_s]:
                del ranks[rank]
                self._marks.get(job, set()).discard(rank)
                self._batched.get(job, {}).pop(rank, None)
            if not ranks:
                del self._known[job]
                self._marks.pop(job, None)
                self._batched.pop(job, None)
                self._job_since.pop(job, None)
        out = Drained(tuple(self._ready), tuple(self._events))
        self._ready, self._events = [], []
        return out

    @property
    def stats(self) -> AggregatorStats:
        return AggregatorStats(self._datagrams, self._garbage, self._batches, self._incomplete, self._late,
                               self._evicted, self._events_total, len(self._open), self._events_limited,
                               self._ranks_limited)

    # ------------------------------------------------------------ internals
    def _complete(self, job: str, entry: _Open, now: float) -> bool:
        if now - self._job_since.get(job, now) < self.timeout_s:
            return False  # still learning which ranks run here: early steps go out at the timeout
        known = self._known.get(job, {})
        if len(entry.compute) < len(known) or any(r not in entry.compute for r in known):
            return False
        marks = self._marks.get(job)
        if marks and any(r not in entry.progress for r in marks if r in known):
            return False
        return True

    def _emit(self, key: tuple[str, int], entry: _Open, *, complete: bool) -> None:
        self._remember_emitted(key)
        if not entry.compute:  # only progress marks (compute lost or not yet read): nothing to batch
            return
        self._learn_marks(key, entry)
        try:
            ranks = np.fromiter(entry.compute, dtype=np.int32, count=len(entry.compute))
            order = np.argsort(ranks, kind="stable")
            values = list(entry.compute.values())
            gpus = np.fromiter((v[0] for v in values), dtype=np.int16, count=len(values))[order]
            secs = np.fromiter((v[1] for v in values), dtype=np.float64, count=len(values))[order]
            ts = max(entry.progress.values()) if entry.progress else max(v[2] for v in values)
            groups = None  # a rank that sent no group (while others did) is a group of its own, -1
            if entry.groups:
                groups = np.fromiter((entry.groups.get(r, -1) for r in entry.compute), dtype=np.int32,
                                     count=len(entry.compute))[order]
            batch = StepBatch(job=key[0], step=key[1], node=self.node, ts=float(ts), ranks=ranks[order],
                              gpus=gpus, compute_s=secs, groups=groups)
        except (OverflowError, ValueError, TypeError, SchemaError) as exc:  # values parse() would refuse
            self._drop(f"step {key[1]} of job {key[0]!r} cannot be batched: {exc}")
            return
        self._ready.append(batch)
        self._batches += 1
        if not complete:
            self._incomplete += 1

    def _learn_marks(self, key: tuple[str, int], entry: _Open) -> None:
        """Hold each rank batched here for marks next time iff its mark for this step is in."""
        job, step = key
        marks = self._marks.setdefault(job, set())
        batched = self._batched.setdefault(job, {})
        for rank in entry.compute:
            if batched.get(rank, -1) > step:
                continue  # an older step emitted late (timeout or eviction) says nothing new
            batched[rank] = step
            if rank in entry.progress:
                marks.add(rank)
            else:
                marks.discard(rank)

    def _remember_emitted(self, key: tuple[str, int]) -> None:
        self._emitted.add(key)
        self._emitted_order.append(key)
        if len(self._emitted_order) > self._remember:
            self._emitted.discard(self._emitted_order.popleft())
