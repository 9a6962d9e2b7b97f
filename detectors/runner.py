"""The stream runner: Kafka in, detectors, ClickHouse and Kafka out — exactly once in the store.

A consumer group over the stage's input topics (all of ``fh.steps``, ``fh.telemetry`` and
``fh.events`` for the whole tier; see "Scaling out" below). Each :meth:`Runner.process_once`:

1. polls a batch (malformed values are dead-lettered by the consumer, which keeps going);
2. pushes records into the :class:`EventTimeBuffer` and releases those below the low
   watermark over the partitions that still have unread data (``lateness_s`` behind the newest
   record once all are read to their end, since nodes sharing a partition are not in step);
3. steps the stage's core (:mod:`fleethealth.detectors.cores`, chosen once by :func:`make_core`) on
   them, in event-time order: ``core.step(records, now)`` returns the
   :class:`~fleethealth.detectors.effects.Effects` to carry out (the whole tier's core feeds
   detection, :class:`Pipeline`, and then policy, :class:`PolicyStage`, composed by :func:`conclude`);
4. carries them out, the same for every stage: writes inputs (telemetry, the step batches the
   assembler accepted) to the store — with ``store_every_s``, those of several polls in one insert
   (:mod:`fleethealth.detectors.deferred`) — then what is to be published to the **outbox** (pending), then
   the events (with the ``interruption`` events detection derived), findings and recommendations,
   then eviction outcomes and the policy engine's state — idempotently: every table is a
   ReplacingMergeTree on its natural key and every insert carries a deduplication token derived from
   the offsets it covers;
5. publishes the outbox's pending rows and, once the broker has acknowledged them, marks them
   published (a failed publish leaves them pending: they go out again on the next batch);
6. commits offsets — only now, never past a record still held in the buffer or a sample row held for a
   later insert, and never past the step batches of a step the pipeline has not concluded (still
   assembling, or stragglers waiting for telemetry to diagnose them), so a restart sees them again.

A write that fails is handled by :mod:`fleethealth.detectors.retry`: the store or broker out of
reach (a connection error, a timeout) is waited out with backoff, committing nothing meanwhile;
any other failure is retried ``retry.attempts`` times and then isolated — the rows are written in
halves down to the one that fails, which is dead-lettered with the error, and the rest is stored
and committed past it. A detector that raises on a batch has it fed again one record at a time, and
the records it raises on are dead-lettered likewise: no record can stop the runner or make every
restart replay it. Records whose event time is further than ``max_ahead_s`` ahead of the broker's
timestamp, or ``max_behind_s`` behind it, are dead-lettered by the consumer naming ``ts``
(:class:`fleethealth.bus.Consumer`; ``None`` turns a bound off — replays of a recorded or simulated
timeline stamp the broker timestamp with the event time, :class:`fleethealth.bus.Producer`).

A crash anywhere replays from the last commit: rows already written are rewritten with the same
keys, so after merges (or with ``FINAL``) each (job, step, rank) is in the store exactly once.
Findings keep stable ids. A node or job stage snapshots each partition's pipeline with the offsets
it committed and restores it when the partition is assigned; the whole tier (one pipeline over every
partition) snapshots its pipeline with the offsets of every partition, under the partition number
:data:`~fleethealth.detectors.snapshot.WHOLE`, and restores it when it first gets its partitions
(see ``_snapshot`` / ``_restore``; the policy's state is saved in the store after each batch): signed explicit
state (:mod:`fleethealth.detectors.snapshot`, ``snapshots``, the ``[detect.snapshot]`` keys);
without a key none is written or restored. A snapshot refused (unsigned or wrongly signed, over a
cap, offsets outside its partition's range) is logged with its reason and counted
(``fleethealth_detect_snapshot_errors_total``), and the partition is rebuilt from the group's commit; a
state over the caps is not written (logged and counted the same), since no replica could restore it.

Nothing decided is lost between store and bus: the outbox row of a finding or recommendation is
written before its table and the policy state that remember the decision, and a runner stores
again and publishes every pending row when it starts (its replay need not conclude them again).
A crash between publishing and marking published sends a row again with the same id (derived
from the finding and the action), which consumers drop (``fleethealth act`` journals ids).
Published are findings, and of the recommendations only those asking for an action (``action``
other than ``none``); a ``none`` (already recommended, not worth it, stale) is kept in
the store for the audit trail only, so a scheduler reads decisions, not repetitions.

Scaling out (:mod:`fleethealth.detectors.stages`): ``stage="all"`` (the default) is one group over
every input, one replica per group, since steps are keyed by job and telemetry by node. The tier
also runs as stages, each a group of its own: ``node`` (telemetry and node events; publishes node
states on ``fh.nodestate``), ``job`` (steps and job events, plus ``fh.nodestate`` and the node
stage's findings read whole as tables) — both with N replicas and one pipeline per partition,
built by the ``pipeline`` factory — and ``policy`` (one replica: findings and events in,
recommendations out). What differs between them is the core (its topics, what it takes, stores,
publishes and snapshots); this shell is the same. When the group moves a partition away, the
core drops its state (:meth:`~fleethealth.detectors.cores.Core.drop`) and held records are dropped
here; its new owner reads it again from the last commit.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import orjson
from prometheus_client import REGISTRY, CollectorRegistry

from fleethealth.bus import Consumer, DeadLetter, Producer, Record, SnapshotTopic
from fleethealth.detectors.assembly import EventTimeBuffer
from fleethealth.detectors.cores import Conclusions, conclude, make_core, publishable
from fleethealth.detectors.deferred import DeferredSamples
from fleethealth.detectors.effects import Effects
from fleethealth.detectors.metrics import RunnerMetrics
from fleethealth.detectors.nodetable import HeldState, NodeTable, peek_state
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.retry import Retry, isolate
from fleethealth.detectors.snapshot import WHOLE, SnapshotError, Snapshots, check_offsets
from fleethealth.detectors.stages import Stage, group_topics, table_topics
from fleethealth.detectors.state import StateError
from fleethealth.errors import BusError, ConfigError, SchemaError
from fleethealth.ids import derived
from fleethealth.ids import token as _digest_token
from fleethealth.policy.persist import load_engine, record_outcome, save_engine
from fleethealth.policy.quarantine import book_decisions, released
from fleethealth.policy.stage import PolicyStage
from fleethealth.schema import (
    TOPIC_TYPES,
    Finding,
    Message,
    NodeState,
    Recommendation,
    StepBatch,
    StepBlock,
    Topic,
    decode,
    encode,
)
from fleethealth.schema.nodestate import encode_states
from fleethealth.store import StoreLike

__all__ = ["Runner", "Conclusions", "conclude", "publishable", "INPUT_TOPICS", "tune_gc", "Stage"]

INPUT_TOPICS = (Topic.STEPS.value, Topic.TELEMETRY.value, Topic.EVENTS.value)

log = logging.getLogger(__name__)

OutboxRow = tuple[str, str, str, float, str]
"""``(topic, id, key, ts_s, payload)``: one message stored in the outbox, as it is published."""


class Runner:
    """Feed detection (:class:`Pipeline`) and policy (:class:`PolicyStage`) from the bus and persist
    what they conclude. ``policy`` defaults to a stage around the engine saved in the store.

    ``max_held`` bounds the records held for event-time order (beyond it the oldest go early).
    ``group`` names the consumer group (replicas share it); ``publish`` turns off writing findings
    and recommendations back to Kafka (the store always gets them). ``session_timeout_s`` is how
    long a killed runner's partitions stay assigned to it (Tansu's group join also waits about half
    of it); ``max_poll_interval_s`` bounds the time one batch may take. ``registry`` receives the
    runner's metrics (``fleethealth_detect_*``); pass a fresh one when several runners share a process.
    ``max_ahead_s`` / ``max_behind_s`` bound a record's event time against its broker timestamp
    (beyond: dead-lettered naming ``ts``; None: unbounded). ``retry`` is the failure policy of the
    writes (:class:`~fleethealth.detectors.retry.Retry`; its ``stopping`` is this runner's stop).
    ``store_every_s`` holds the sample rows (telemetry, steps) of several polls for one insert per table at
    most that often (:mod:`~fleethealth.detectors.deferred`; 0: every poll), committing no offset past them.
    """

    def __init__(self, bus_dsn: str, store: StoreLike, *, group: str = "fh-detect",
                 pipeline: Pipeline | Callable[[], Pipeline] | None = None,
                 policy: PolicyStage | None = None, publish: bool = True, max_records: int = 2000,
                 lateness_s: float = 5.0, max_held: int = 200_000,
                 session_timeout_s: float = 6.0, max_poll_interval_s: float = 10.0,
                 max_ahead_s: float | None = 300.0, max_behind_s: float | None = 86_400.0,
                 retry: Retry | None = None, registry: CollectorRegistry | None = None,
                 stage: Stage | str = Stage.ALL, snapshot_every_s: float | None = 30.0,
                 snapshot_to: str = "store", snapshots: Snapshots | None = None, store_every_s: float = 0.0) -> None:
        self.store = store
        # the stage chooses its core, once: what it concludes, stores, publishes and snapshots
        self.core = make_core(stage, pipeline=pipeline,
                              policy=lambda: policy if policy is not None else PolicyStage(load_engine(store)))
        self.stage = self.core.stage
        if self.core.policy is not None and self.core.policy.book is None:  # quarantine's one home: the book
            self.core.policy.book = lambda nodes: self.retry.call("read the quarantine book",
                                                                  lambda: released(self.store, nodes))
        self.publish = publish
        self.max_records = max_records
        self.lateness_s = lateness_s
        self.max_held = max_held
        self.released_early_total = 0
        self.now_ = float("-inf")
        self._release_budget_s = max_poll_interval_s / 3
        self.snapshot_every_s = snapshot_every_s
        if snapshot_to not in ("store", "bus"):
            raise ConfigError(f"snapshot_to must be 'store' (the detector_snapshots table) or 'bus' (the "
                              f"compacted topic fh.snapshots), got {snapshot_to!r}")
        self._snapshots: Any = SnapshotTopic(bus_dsn) if snapshot_to == "bus" else store
        self.snapshot_format = snapshots if snapshots is not None else Snapshots()
        if self.core.keeps_state and snapshot_every_s is not None and not self.snapshot_format.enabled:
            log.log(self.core.without_key,
                    "no snapshot key (detect.snapshot.key_file): the %s stage writes and restores no snapshots, "
                    "its state is rebuilt from the group's commit", self.stage)
        self._snapshot_at: dict[int, float] = {}
        self._snapshot_offsets: dict[int, dict[tuple[str, int], int]] = {}
        self._seeks: set[int] = set()
        self.snapshots_total = 0
        self.restored_total = 0
        self._step_offsets: dict[tuple[str, int], dict[Hashable, int]] = {}
        self.producer = Producer(bus_dsn, client_id=f"{group}-out")
        self._group = frozenset(group_topics(self.stage))
        self.consumer = Consumer(bus_dsn, group_topics(self.stage), group, producer=self.producer,
                                 session_timeout_s=session_timeout_s, max_poll_interval_s=max_poll_interval_s,
                                 max_ahead_s=max_ahead_s, max_behind_s=max_behind_s)
        self.consumer.split_blocks = False  # a step block stays one record: assembled and stored whole
        tables = table_topics(self.stage)
        # the job stage's tables are read whole by every replica, from their start (fh.nodestate is compacted)
        self.table = Consumer(bus_dsn, tables, None, producer=self.producer, client_id=f"{group}-table") \
            if tables else None
        # of fh.nodestate, a job-stage replica decodes only its jobs' nodes and their rack peers
        self.nodes = NodeTable() if Topic.NODESTATE.value in tables else None
        self._held: list[Record] = []
        self._table_behind = False  # the table's last poll left records to read: the group's poll does not wait
        if self.table is not None and self.nodes is not None:
            self.table.admit = self._admit
        self._stop = threading.Event()
        self.retry = retry if retry is not None else Retry()
        if retry is None:
            self.retry.stopping = self._stop.is_set
        self.buffer: EventTimeBuffer[Record] = EventTimeBuffer()
        self.metrics = RunnerMetrics(registry if registry is not None else REGISTRY)
        self.findings_total = 0
        self.recommendations_total = 0
        self.states_published_total = 0
        self.pending_: list[OutboxRow] = []
        self.deferred = DeferredSamples(store_every_s, max_held)
        self.clock: Callable[[], float] = time.monotonic  # when held sample rows are due (tests may set it)
        self._recovered = not publish  # the outbox left by an earlier run is read on the first batch

    @property
    def pipeline(self) -> Pipeline:
        """The pipeline of a runner of the whole tier (``stage="all"``)."""
        if None not in self.core.pipelines:
            raise ConfigError(f"the {self.stage} stage has one pipeline per partition: see .pipelines")
        return self.core.pipelines[None]

    @property
    def pipelines(self) -> dict[int | None, Pipeline]:
        """The core's pipelines: one per partition (node, job), one under None (the whole tier), none (policy)."""
        return self.core.pipelines

    @property
    def policy(self) -> PolicyStage | None:
        """The core's policy (the whole tier and the policy stage), else None."""
        return self.core.policy

    # ------------------------------------------------------------------ loop
    def process_once(self, timeout_s: float = 1.0) -> int:
        """Poll, detect, write, publish, commit. Returns the number of records polled."""
        if not self._recovered:
            self.pending_ = self._recover_outbox() + self.pending_
            self._recovered = True
        if self.pending_:
            self._publish_pending()
        # a table still being read (a start-up, or a replica given a node's jobs) does not wait on the group's
        # topics between its polls: waiting there, it read max_records a timeout_s
        records = self.consumer.poll(0.0 if self._table_behind else timeout_s, self.max_records)
        restored = self._follow_assignment()
        if restored:  # read again from the snapshot's offsets: what this poll returned of them comes again
            records = [r for r in records if (r.topic, r.partition) not in restored]
        lag = self.consumer.lag()
        if self.table is not None:
            table = self.table.poll(0.0 if records else timeout_s, self.max_records)
            if self.nodes is not None:  # the nodes of this replica's jobs, before any node state is released
                back = self.nodes.want({r.msg.node for r in records if isinstance(r.msg, StepBatch | StepBlock)})
                for rec in table:
                    if isinstance(rec.msg, NodeState):
                        back += self.nodes.learn(rec.msg.node, rec.msg.rack)
                self._apply_kept(back)
                table = [*table, *self._held]
                self._held = []
            records = [*records, *table]
            table_lag = self.table.lag()
            self._table_behind = bool(table) and any(table_lag.values())
            lag = {**lag, **table_lag}
        for rec in records:
            self.buffer.push(rec.msg.ts, (rec.topic, rec.partition), rec)
        self._release(self._bound(self._watermark(records, lag)))
        self.metrics.lag.set(sum(v for v in lag.values() if v))
        return len(records)

    def _admit(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                ts_ms: int) -> bool:
        """The table consumer's filter: a node state this replica does not need yet is held undecoded (in
        the event-time buffer, as a :class:`HeldState`), decided on when released (:meth:`_held_states`)."""
        if topic != Topic.NODESTATE.value or value is None or self.nodes is None:
            return True
        head = peek_state(value)
        if head is None:
            return True
        node, rack, ts = head
        self._apply_kept(self.nodes.learn(node, rack))
        if self.nodes.needed(node):
            return True
        self._held.append(Record(topic, partition, offset, key, HeldState(node, rack, ts, value)))  # type: ignore[arg-type]
        return False

    def _apply_kept(self, kept: Sequence[Record]) -> None:
        """Node states dropped before and needed now (their node, or a rack peer, joined a job here) go to
        the replica's node-state table at once, as every state read went before the filter: a partition
        this replica got reads its steps again from the commit, older than the newest state."""
        states = [self._held_states([rec]) for rec in kept]
        table = self.core.shared.get("node_states")
        if table is not None:
            table.apply([r[0].msg for r in states if r])  # type: ignore[attr-defined]

    def _held_states(self, ready: list[Record]) -> list[Record]:
        """``ready`` with each held node state decoded if its node is needed now, else left out."""
        if self.nodes is None or not any(isinstance(r.msg, HeldState) for r in ready):
            return ready
        out = []
        for rec in ready:
            held = rec.msg
            if not isinstance(held, HeldState):
                out.append(rec)
            elif not self.nodes.needed(held.node):
                self.nodes.drop(held.node, held.ts, rec)
            else:
                try:
                    out.append(Record(rec.topic, rec.partition, rec.offset, rec.key, decode(NodeState, held.value)))
                    self.nodes.decoded_total_ += 1
                except SchemaError as exc:
                    self._letter(rec.topic, rec.partition, rec.offset, rec.key, held.value,
                                 f"{exc.field}: {exc.problem}")
        return out

    def _release(self, watermark: float, *, final: bool = False) -> None:
        """Conclude what the watermark releases in pieces of ``max_records`` (after a partition was slow
        to answer, a release can cover minutes of event time: the detectors' clock moves on between
        pieces as it does between polls). What is not concluded yet stays held, so no commit passes it."""
        started = time.monotonic()
        while True:
            released = self.buffer.release(watermark, limit=self.max_records)
            last = len(released) < self.max_records
            self._handle(released, final=final and last)
            if last:
                return
            if not final and time.monotonic() - started > self._release_budget_s:
                return  # the rest on the next batch: poll again in time to stay in the group

    def _follow_assignment(self) -> set[tuple[str, int]]:
        """Give the core each unit of state the group's assignment calls for (a partition's pipeline, or the
        whole tier's once it first gets partitions) — restored from its snapshot, the consumer moved back to
        the offsets the snapshot reflects — and drop the units (and held records) of partitions the group
        moved to another replica, whose new owner restores them. Returns the ``(topic, partition)`` pairs
        moved back to a snapshot's offsets."""
        assigned = {partition for _, partition in self.consumer.assignment()}
        wanted, held = self.core.wanted(assigned), self.core.held()
        restored: set[tuple[str, int]] = set()
        moved = {p for t, p in self.consumer.take_moved() if t in self._group} & held  # revoked, even if given back
        if moved:  # stale here: dropped, and restored below from its snapshot
            self._drop(sorted(moved))
            held = self.core.held()
        for unit in sorted(wanted - held):
            state, offsets = self._restore(unit)
            self.core.adopt(unit, state)
            self._snapshot_at[unit] = -math.inf  # due at the first commit: a partition never moves without one
            if offsets:
                self.buffer.discard(lambda rec, o=offsets: (rec.topic, rec.partition) in o)
                self.deferred.discard(lambda rec, o=offsets: (rec.topic, rec.partition) in o)
                self.consumer.seek(offsets)
                restored |= set(offsets)
        self._drop(sorted(held - wanted))
        return restored

    def _drop(self, gone: list[int]) -> None:
        """Forget the state units and held records of partitions the group moved away from this replica."""
        if not gone:
            return
        self.core.drop(gone)
        for p in gone:
            self._snapshot_at.pop(p, None)
            self._snapshot_offsets.pop(p, None)
        self.buffer.discard(lambda rec: rec.topic in self._group and rec.partition in gone)
        self.deferred.discard(lambda rec: rec.topic in self._group and rec.partition in gone)
        log.info("partitions %s moved to another replica of group %r: their state is dropped here", gone,
                 self.consumer.group)

    def _restore(self, unit: int) -> tuple[Pipeline, dict[tuple[str, int], int]]:
        """A unit's state from its newest snapshot and the offsets to read from; a fresh one (and no
        offsets: the group's commit) when there is none or it cannot be read (reported)."""
        if self.snapshot_every_s is None or not self.snapshot_format.enabled:
            return self.core.fresh(unit), {}
        try:
            found = self.retry.call("load a snapshot",
                                    lambda: self._snapshots.load_snapshot(self.consumer.group, unit))
            if found is None:
                return self.core.fresh(unit), {}
            _, _, blob = found
            head = self.snapshot_format.info(blob)  # signed, sizes within the caps: nothing inflated yet
            ranges = self.retry.call("read partition ranges", lambda: self.consumer.offset_range(head["offsets"]))
            check_offsets(head["offsets"], partition=None if unit == WHOLE else unit,
                          topics=group_topics(self.stage), ranges=ranges)
            explicit, offsets = self.snapshot_format.open(blob)
            try:
                state = self.core.from_state(unit, explicit)
            except StateError as exc:
                raise SnapshotError(f"snapshot state does not rebuild: {exc}") from None
        except SnapshotError as exc:
            self.metrics.snapshot_errors.inc()
            log.warning("the snapshot of group %r partition %d cannot be used (%s): rebuilding its state from "
                        "the input at the group's committed offsets", self.consumer.group, unit, exc)
            return self.core.fresh(unit), {}
        self.restored_total += 1
        log.info("group %r partition %d: state restored from its snapshot, reading from %s", self.consumer.group,
                 unit, ", ".join(f"{t}/{p}@{o}" for (t, p), o in sorted(offsets.items())))
        return state, offsets

    def _snapshot(self) -> None:
        """Snapshot each unit of the core's state whose interval is due, with the offsets this replica
        committed for its partition (every partition for the whole tier's: what a restore reads from; the
        records the state folded in past them are taken again as duplicates), and, for a partition of the
        unit it has not committed, where it began reading it (:meth:`Consumer.began_at`)."""
        if self.snapshot_every_s is None or not self.snapshot_format.enabled:
            return
        now = time.monotonic()
        committed = self.consumer.committed()
        assigned = self.consumer.assignment()
        for p in sorted(self.core.held()):
            if now - self._snapshot_at.get(p, 0.0) < self.snapshot_every_s:
                continue
            mine = {tp for tp in assigned if p == WHOLE or tp[1] == p}
            offsets = {tp: off for tp, off in committed.items() if tp in mine}
            if not offsets:
                continue  # nothing committed here yet
            # a partition of the unit not committed here: where this replica began it (its state has seen
            # nothing before), or a restore would start it at a commit made after this snapshot
            uncommitted = mine - offsets.keys()
            if uncommitted:
                offsets |= self.retry.call("read the group's commits", lambda u=uncommitted: self.consumer.began_at(u))
            if offsets == self._snapshot_offsets.get(p):
                continue  # nothing committed here since the last one
            unit = self.core.unit(p)
            try:
                try:
                    explicit = self.core.state_dict(p)
                except StateError as exc:
                    raise SnapshotError(f"state of {type(unit).__name__} cannot be snapshotted: {exc}") from exc
                blob = self.snapshot_format.seal(explicit, offsets)
            except SnapshotError as exc:  # not plain data (a defect) or over the caps: reported, the stream goes on
                self.metrics.snapshot_errors.inc()
                log.error("group %r partition %d: no snapshot written: %s", self.consumer.group, p, exc)
                self._snapshot_at[p] = now
                continue
            seq = sum(offsets.values())  # commits only move forward: the newest snapshot has the greatest
            ts = unit.now_ if math.isfinite(unit.now_) else 0.0
            self.retry.call("save a snapshot", lambda p=p, o=offsets, b=blob, s=seq, t=ts:
                            self._snapshots.save_snapshot(self.consumer.group, p, s, t, o, b))
            self._snapshot_at[p] = now
            self._snapshot_offsets[p] = offsets
            self.snapshots_total += 1
            self.metrics.snapshots.inc()
            self.metrics.snapshot_bytes.set(len(blob))

    def _bound(self, watermark: float) -> float:
        """Past ``max_held`` records held for event-time order, release the oldest anyway (counted in
        ``released_early_total``): a partition that lags far behind the others in a catch-up must not
        grow the buffer without limit; the detectors have a defined behaviour for late input."""
        excess = len(self.buffer) - self.max_held
        if excess <= 0:
            return watermark
        self.released_early_total += excess
        return max(watermark, self.buffer.nth_ts(excess))

    def _watermark(self, records: Sequence[Record], lag: dict[tuple[str, int], int | None]) -> float:
        """How far in event time it is safe to go: the low watermark over partitions with unread data;
        once every partition is read to its end, ``lateness_s`` short of the newest record (nodes sharing
        a partition are not in step with each other); after an empty poll with every partition read to
        its end, everything. An empty poll while a partition is still behind (a fetch in flight) releases no
        further: a table read ahead of the stream (the job stage's node states) must not run ahead of it.
        Nor does a poll with nothing of the group assigned while the core keeps state (a rebalance)."""
        if self.core.held() and not any(topic in self._group for topic, _ in lag):
            # the group took every partition away (a rebalance) from a core that keeps its state (the whole
            # tier): what it gives back is read again from the commit; nothing held may run ahead of it
            return float("-inf")
        live = [tp for tp, behind in lag.items() if behind != 0]
        if not records and not live:
            return float("inf")
        watermark = self.buffer.watermark(live)
        if watermark == float("inf") and self.buffer.latest_:
            watermark = max(self.buffer.latest_.values()) - self.lateness_s
        return watermark

    def caught_up(self, polled: int) -> bool:
        """Whether the last poll (which returned ``polled`` records) found every assigned partition
        read to its end: nothing returned, and every partition's end known and reached."""
        if polled:
            return False
        lag = self.consumer.lag()
        if not lag:  # no partition assigned (yet): nothing read to its end (the tables alone do not count)
            return False
        if self.table is not None:
            lag = {**lag, **self.table.lag()}
        return all(behind == 0 for behind in lag.values())

    def drain(self) -> None:
        """End of input (a finished replay or demo): release everything held and flush the detectors."""
        self._release(float("inf"), final=True)

    def run(self, stop: threading.Event, *, poll_s: float = 0.5, between: Callable[[], None] = lambda: None) -> None:
        """Process until ``stop`` is set (which also ends a wait for an unreachable store or broker);
        ``between`` runs at each batch boundary, before the next poll (a configuration reload)."""
        self._stop = stop
        self.retry.stopping = stop.is_set
        while not stop.is_set():
            between()
            self.process_once(poll_s)

    def close(self) -> None:
        self.consumer.close()
        if self.table is not None:
            self.table.close()
        if isinstance(self._snapshots, SnapshotTopic):
            self._snapshots.close()
        self.producer.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one batch
    def _handle(self, released: Sequence[tuple[Hashable, Record]], *, final: bool = False) -> None:
        try:
            self._write(released, final=final)
        except BaseException:
            # not written, not committed: hold the records again so a retry cannot commit past them
            for partition, rec in released:
                self.buffer.push(rec.msg.ts, partition, rec)
            raise

    def _insert(self, what: str, rows: Sequence[Message], insert: Callable[..., object], token: str,
                on_bad: Callable[[Message, BaseException], None]) -> list[Message]:
        """Write ``rows`` with ``insert(rows, dedup_token=…)`` under the retry policy, isolating the
        rows that fail deterministically (each goes to ``on_bad(row, error)``); returns the rows stored."""
        bad: set[int] = set()

        def write(part: Sequence[Message], path: str) -> None:
            insert(part, dedup_token=derived(what + path, _rows_token(part, token)))

        def refuse(row: Message, exc: BaseException) -> None:
            bad.add(id(row))
            on_bad(row, exc)

        if isolate(self.retry, f"insert {what}", rows, write, refuse):
            return [r for r in rows if id(r) not in bad]
        return list(rows)

    def _write(self, released: Sequence[tuple[Hashable, Record]], *, final: bool) -> None:
        """Step the core on the released records and carry out its effects, in the one order every stage
        shares: dead letters, inputs (held over polls, see ``store_every_s``), the outbox (pending), events,
        findings, recommendations and the book, eviction outcomes, the policy state; then publish, commit,
        snapshot."""
        eff = self.core.step(self._held_states([rec for _, rec in released]), self.now_, final=final)
        self.now_ = max(self.now_, eff.now)
        for rec, why in eff.poisoned:
            self.metrics.poisoned.labels("detect").inc()
            self._letter(rec.topic, rec.partition, rec.offset, rec.key, encode(rec.msg), why)  # type: ignore[arg-type]
        if eff.rejected:
            self._dead_letter(eff)
        token = eff.token

        bad_output = self._bad_output

        def bad_input(msg: Message, exc: BaseException) -> None:
            self._bad_input(eff.origin(msg), msg, exc)

        store = self.store
        self._write_samples(eff, final=final)
        # the outbox first: a decision stored anywhere is in it, and a restart stores it again and publishes it
        outgoing = [_outbox_row(m) for m in eff.outbox] if self.publish else []
        if outgoing:
            self.retry.call("write the outbox", lambda: store.write_outbox(
                outgoing, published=False, dedup_token=derived("o", token)))
        self._insert("e", eff.events, store.insert_events, token, bad_input)
        self._insert("f", eff.findings, store.insert_findings, token, bad_output)
        recs = self._insert("r", eff.recommendations, store.insert_recommendations, token, bad_output)
        if recs:  # the book, before the engine state that remembers these
            self.retry.call("write the quarantine book", lambda: book_decisions(store, recs))
        self.core.written()
        for outcome in eff.outcomes:  # before the engine state that no longer watches them
            self.retry.call("record an eviction outcome", lambda o=outcome: record_outcome(store, o))
        if eff.policy is not None:
            self.retry.call("save the policy state", lambda: save_engine(store, eff.policy, eff.now))
        self.pending_ += outgoing
        if self.pending_:
            self._publish_pending()
        if eff.states and self.publish:
            self._publish_states(eff.states)
        ready = eff.taken
        offsets = self._safe_offsets(ready)
        refused = self.consumer.commit_failed_total
        self.retry.call("commit offsets", lambda: self.consumer.commit(offsets))
        if self.consumer.commit_failed_total == refused:  # not after a refused commit: the group moved on
            self._snapshot()
        for topic, count in Tally(rec.topic for rec in ready).items():
            self.metrics.records.labels(topic).inc(count)
        for f in eff.findings:
            self.metrics.findings.labels(f.kind.value).inc()
        for r in eff.recommendations:
            self.metrics.recommendations.labels(r.action.value).inc()
        self.metrics.advance("dead_letters", self.consumer.dead_lettered_total)
        self.metrics.advance("holes", self.consumer.holes_total)
        self.metrics.advance("hole_offsets", self.consumer.hole_offsets_total)
        if self.nodes is not None:
            self.metrics.advance("passed_over", self.nodes.passed_over_total_)
        self.metrics.held.set(len(self.buffer))
        self.metrics.held_samples.set(len(self.deferred))
        if self.core.policy is not None:
            self.metrics.breaker_open.set(int(self.core.policy.engine.breaker_.open_))
        pipelines = self.core.pipelines.values()
        self.metrics.dropped.labels("late").set(sum(p.assembler.late_total for p in pipelines))
        self.metrics.dropped.labels("duplicate").set(sum(p.assembler.duplicate_total for p in pipelines))
        self.metrics.advance("early", self.released_early_total)
        for job, ranks in eff.unscored:
            log.warning("job %s is not scored for stragglers: %d comparable rank(s), fewer than "
                        "detect.straggler.min_group (hangs, SDC and node health are still watched)", job, ranks)
        self.metrics.unscored_jobs.set(sum(len(p.unscored_jobs_) for p in pipelines))
        for what in ("jobs", "nodes"):
            self.metrics.over_limit.labels(what).set(sum(p.over_limit_.get(what, 0) for p in pipelines))
        self.findings_total += len(eff.findings)
        self.recommendations_total += len(eff.recommendations)

    def _write_samples(self, eff: Effects, *, final: bool) -> None:
        """Hold this step's sample rows (telemetry, steps) with those of earlier polls, and write them all in
        one insert per table when they are due (``store_every_s``; every poll when it is 0). Held rows are
        cleared only once written: a write that raises leaves them held, and their offsets uncommitted."""
        held, now = self.deferred, self.clock()
        held.add(eff, now)
        if not held.due(now, final=final):
            return

        def bad(msg: Message, exc: BaseException) -> None:
            self._bad_input(held.origin(msg), msg, exc)

        token = held.token
        self._insert("t", held.telemetry, self.store.insert_telemetry, token, bad)
        self._insert("s", held.steps, self.store.insert_steps, token, bad)
        held.clear()

    def _bad_input(self, rec: Record | None, msg: Message, exc: BaseException) -> None:
        """Dead-letter an input record whose row the store refused (a row with no input record, such as a
        derived event, as an output)."""
        if rec is None:
            self._bad_output(msg, exc)
            return
        self.metrics.poisoned.labels("store").inc()
        self._letter(rec.topic, rec.partition, rec.offset, rec.key, encode(msg), f"store: {exc}")

    def _bad_output(self, msg: Message, exc: BaseException) -> None:
        """Dead-letter a conclusion the store refused (partition and offset -1)."""
        self.metrics.poisoned.labels("store").inc()
        self._letter(msg.TOPIC.value, -1, -1, msg.key.encode(), encode(msg), f"store: {exc}")

    def _dead_letter(self, eff: Effects) -> None:
        """Publish what the pipeline refused to take (beyond its cardinality limits) as dead letters; the
        records are committed with the rest, the dead letter is where they are kept."""
        for msg, why in eff.rejected:
            rec = eff.origin(msg)
            if rec is None:
                continue
            self._letter(rec.topic, rec.partition, rec.offset, rec.key, encode(msg), why, flush=False)
        self.retry.call("flush dead letters", self.producer.flush)

    def _letter(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes, why: str, *,
                flush: bool = True) -> None:
        """Dead-letter one value (an input record, or a conclusion the store refused: partition and
        offset -1) with the reason; with ``flush``, wait until the broker has it."""
        letter = DeadLetter.of(topic, partition, offset, key, value, why, None)
        self.retry.call("dead-letter a record", lambda: self.producer.publish_raw(
            Topic.DEADLETTER.value, orjson.dumps(letter.to_obj()), key))
        if flush:
            self.retry.call("flush dead letters", self.producer.flush)

    def _publish_states(self, states: Sequence[NodeState]) -> None:
        """Publish the node states this batch changed, before its offsets commit (a crash re-derives
        and republishes them; the job stage keeps a node's newest)."""
        values = encode_states(states)  # a poll's states encoded at once, each to schema.encode's bytes

        def send() -> None:
            for state, value in zip(states, values, strict=True):
                self.producer.publish_encoded(state, value)
            self.producer.flush()

        self.retry.call("publish node states", send)
        self.states_published_total += len(states)
        self.metrics.states.inc(len(states))

    def _recover_outbox(self) -> list[OutboxRow]:
        """The outbox rows an earlier run left pending, their findings, recommendations and events stored
        again first (a kill can fall between the outbox and those tables, which keep one row per id)."""
        rows, store = self.retry.call("read the outbox", self.store.pending_outbox), self.store
        for topic, insert in ((Topic.FINDINGS, store.insert_findings), (Topic.EVENTS, store.insert_events),
                              (Topic.RECOMMENDATIONS, store.insert_recommendations)):
            mine = [r for r in rows if r[0] == topic.value]  # (one unreadable raises: only this runner wrote it)
            token = derived("x" + topic.value, _digest_token(r[1] for r in mine))
            msgs = [decode(TOPIC_TYPES[topic], r[4]) for r in mine]
            self.retry.call("store the outbox", lambda m=msgs, i=insert, t=token: m and i(m, dedup_token=t))
        return rows

    def _publish_pending(self) -> bool:
        """Publish every pending outbox row and, once the broker acknowledged them all, mark them
        published. A failure is logged and counted and the rows stay pending (stored, so a restart
        publishes them too); returns whether the outbox is empty now."""
        rows = self.pending_
        try:
            for topic, _, key, _, payload in rows:
                self.producer.publish_raw(topic, payload.encode(), key.encode())
            self.producer.flush()
        except BusError as exc:
            self.metrics.publish_errors.inc()
            self.metrics.outbox.set(len(rows))
            log.warning("publishing %d finding(s)/recommendation(s) failed, kept in the outbox for the next "
                        "batch: %s", len(rows), exc)
            return False
        token = derived("p", _digest_token(f"{r[0]}/{r[1]};" for r in rows))
        self.retry.call("mark the outbox published",
                        lambda: self.store.write_outbox(rows, published=True, dedup_token=token))
        self.pending_ = []
        self.metrics.outbox.set(0)
        return True

    def _safe_offsets(self, ready: Sequence[Record]) -> dict[Hashable, int]:
        """Per partition, the first offset not to commit: records still held in the buffer, sample rows
        held for a later insert, and the step batches of steps the pipeline has not concluded (a restart
        must see them again)."""
        still_open = self.core.open_steps()
        open_jobs = {job for job, _ in still_open}
        for rec in ready:
            if isinstance(rec.msg, StepBatch):
                first = self._step_offsets.setdefault((rec.msg.job, rec.msg.step), {})
                tp = (rec.topic, rec.partition)
                first[tp] = min(first.get(tp, rec.offset), rec.offset)
            elif isinstance(rec.msg, StepBlock) and rec.msg.job in open_jobs:  # only its steps still open count
                tp = (rec.topic, rec.partition)
                for key in [(rec.msg.job, step) for step in rec.msg.steps.tolist()]:
                    if key in still_open:
                        first = self._step_offsets.setdefault(key, {})
                        first[tp] = min(first.get(tp, rec.offset), rec.offset)
        self._step_offsets = {k: v for k, v in self._step_offsets.items() if k in still_open}
        held = self.buffer.held(lambda rec: ((rec.topic, rec.partition), rec.offset))
        for tp, offset in self.deferred.first.items():  # sample rows held for a later insert
            held[tp] = min(held.get(tp, offset), offset)
        for offsets in self._step_offsets.values():
            for tp, offset in offsets.items():
                held[tp] = min(held.get(tp, offset), offset)
        return held


def tune_gc() -> None:
    """Garbage-collector settings for a process that runs the stream: it allocates many short-lived
    objects and few cycles, so collect the young generation less often (worth 10-25 % of throughput)
    and keep the objects made at start-up out of every collection. Process-wide: call it from a
    command's entry point, not from a library."""
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


def _outbox_row(msg: Finding | Recommendation) -> OutboxRow:
    return (msg.TOPIC.value, msg.id, msg.key, float(msg.ts), encode(msg).decode())


def _rows_token(rows: Sequence[Message], token: str) -> str:
    """One insert's deduplication token: the write's ``token`` and, for step records, the steps each
    carries. Offsets alone do not name what is written: a block's steps share its offset, a split
    block's parts are released apart, and a block partly refused once may be taken whole when read
    again — each a different set of rows under the same offsets, which the store must not drop as
    a repeat of the first."""
    steps = [f"{m.job}/{m.node}/{m.step}" if isinstance(m, StepBatch) else
             f"{m.job}/{m.node}/{','.join(map(str, m.steps.tolist()))}"
             for m in rows if isinstance(m, StepBatch | StepBlock)]
    return _digest_token([token, *steps]) if steps else token

