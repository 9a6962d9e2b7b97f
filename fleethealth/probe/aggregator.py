"""Turn the datagrams of a node's training ranks into one columnar step batch per (job, step).

The in-job :class:`fleethealth.injob.timer.StepTimer` of every local rank sends a compute datagram
(``"c"``: seconds of pre-collective compute) and a progress datagram (``"p"``: the step completed)
per step, and occasionally an event datagram (``"e"``: an SDC check, a hang report). The
aggregator collects them and emits

- one :class:`fleethealth.schema.StepBatch` per (job, step) when every *known* local rank of the
  job has reported the step (a rank is known once it has reported a compute time within
  ``forget_s``), or when ``timeout_s`` has passed since the step's first datagram (a hung or slow
  rank must not hold the others back: the batch goes out with the ranks that did report, and is
  counted as incomplete). When a job sends progress marks, a rank counts as reported once both its
  compute time and its progress mark are in; the batch's ``ts`` is the latest progress mark (the
  step's completion), else the latest compute datagram.
- one :class:`fleethealth.schema.Event` per event datagram, with this node filled in.

Garbage (not JSON, wrong fields, a schema-invalid event) is counted and dropped; nothing here
raises on input. Datagrams for a step already emitted are counted as ``late`` and dropped.
Memory is bounded: at most ``max_open`` steps wait at once (the oldest is emitted early).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from fleethealth.errors import SchemaError
from fleethealth.schema import MAX_COMPUTE_S, SCHEMA_VERSION, Event, StepBatch, decode
from fleethealth.wire import WireMessage, parse

__all__ = ["StepAggregator", "Drained", "AggregatorStats"]


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


@dataclass
class _Open:
    first_seen: float
    compute: dict[int, tuple[int, float, float]] = field(default_factory=dict)  # rank -> (gpu, s, ts)
    progress: dict[int, float] = field(default_factory=dict)                    # rank -> ts


class StepAggregator:
    """Aggregate one node's rank datagrams. ``now`` is the probe's clock (seconds, monotonic or wall)."""

    def __init__(self, node: str, *, timeout_s: float = 5.0, forget_s: float = 300.0, max_open: int = 4096,
                 remember_emitted: int = 65536) -> None:
        self.node = node
        self.timeout_s = timeout_s
        self.forget_s = forget_s
        self.max_open = max_open
        self._open: OrderedDict[tuple[str, int], _Open] = OrderedDict()
        self._known: dict[str, dict[int, float]] = {}   # job -> rank -> last seen (now)
        self._uses_progress: set[str] = set()
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
    def feed(self, datagram: bytes, now: float) -> None:
        """Take one raw datagram; garbage is counted (``last_garbage`` keeps the reason) and dropped."""
        self._datagrams += 1
        try:
            msg = parse(datagram)
        except (ValueError, TypeError, OverflowError) as exc:
            self._drop(str(exc))
            return
        self.add(msg, now)

    def add(self, msg: WireMessage, now: float) -> None:
        """Take one parsed datagram."""
        if msg.kind == "e":
            self._add_event(msg, now)
            return
        if msg.kind == "c" and msg.value > MAX_COMPUTE_S:
            self._drop(f"compute time {msg.value} s is not a measurement")
            return
        key = (msg.job, msg.step)
        if key in self._emitted:
            self._late += 1
            return
        entry = self._open.get(key)
        if entry is None:
            entry = self._open[key] = _Open(first_seen=now)
            if len(self._open) > self.max_open:
                old_key, old = self._open.popitem(last=False)
                self._evicted += 1
                self._emit(old_key, old, complete=False)
        if msg.kind == "c":
            entry.compute[msg.rank] = (msg.gpu, msg.value, msg.ts)
            self._known.setdefault(msg.job, {})[msg.rank] = now
            self._job_since.setdefault(msg.job, now)
        else:
            entry.progress[msg.rank] = msg.ts
            self._uses_progress.add(msg.job)
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
            if not ranks:
                del self._known[job]
                self._uses_progress.discard(job)
                self._job_since.pop(job, None)
        out = Drained(tuple(self._ready), tuple(self._events))
        self._ready, self._events = [], []
        return out

    @property
    def stats(self) -> AggregatorStats:
        return AggregatorStats(self._datagrams, self._garbage, self._batches, self._incomplete, self._late,
                               self._evicted, self._events_total, len(self._open))

    # ------------------------------------------------------------ internals
    def _complete(self, job: str, entry: _Open, now: float) -> bool:
        if now - self._job_since.get(job, now) < self.timeout_s:
            return False  # still learning which ranks run here: early steps go out at the timeout
        known = self._known.get(job, {})
        if len(entry.compute) < len(known) or any(r not in entry.compute for r in known):
            return False
        if job in self._uses_progress and any(r not in entry.progress for r in known):
            return False
        return True

    def _emit(self, key: tuple[str, int], entry: _Open, *, complete: bool) -> None:
        self._remember_emitted(key)
        if not entry.compute:  # only progress marks (compute lost or not yet read): nothing to batch
            return
        ranks = np.fromiter(entry.compute, dtype=np.int32, count=len(entry.compute))
        order = np.argsort(ranks, kind="stable")
        values = list(entry.compute.values())
        gpus = np.fromiter((v[0] for v in values), dtype=np.int16, count=len(values))[order]
        secs = np.fromiter((v[1] for v in values), dtype=np.float64, count=len(values))[order]
        ts = max(entry.progress.values()) if entry.progress else max(v[2] for v in values)
        self._ready.append(StepBatch(job=key[0], step=key[1], node=self.node, ts=float(ts), ranks=ranks[order],
                                     gpus=gpus, compute_s=secs))
        self._batches += 1
        if not complete:
            self._incomplete += 1

    def _remember_emitted(self, key: tuple[str, int]) -> None:
        self._emitted.add(key)
        self._emitted_order.append(key)
        if len(self._emitted_order) > self._remember:
            self._emitted.discard(self._emitted_order.popleft())
