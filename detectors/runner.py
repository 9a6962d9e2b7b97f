"""The stream runner: Kafka in, detectors, ClickHouse and Kafka out — exactly once in the store.

One consumer group over ``fh.steps`` (keyed by job), ``fh.telemetry`` and ``fh.events`` (keyed
by node), so replicas split the partitions between them. Each :meth:`Runner.process_once`:

1. polls a batch (malformed values are dead-lettered by the consumer, which keeps going);
2. pushes records into the :class:`EventTimeBuffer` and releases those below the low
   watermark over the partitions that still have unread data (``lateness_s`` behind the newest
   record once all are read to their end, since nodes sharing a partition are not in step);
3. feeds them, in event-time order, to the two pure stages, composed by :func:`conclude`:
   detection (:class:`Pipeline`: findings) and then policy (:class:`PolicyStage`:
   recommendations, pages, and the outcomes of executed evictions);
4. writes inputs (the step batches the assembler accepted, the events, and with them the
   ``interruption`` events detection derived), findings and recommendations to the store —
   idempotently: every table is a ReplacingMergeTree on its natural key and every insert
   carries a deduplication token derived from the offsets it covers — then what is to be
   published to the **outbox** (pending), then eviction outcomes and the policy engine's state;
5. publishes the outbox's pending rows and, once the broker has acknowledged them, marks them
   published (a failed publish leaves them pending: they go out again on the next batch);
6. commits offsets — only now, never past a record still held in the buffer, and never past
   the step batches of a step the pipeline has not concluded (still assembling, or stragglers
   waiting for telemetry to diagnose them), so a restart sees them again.

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
Detector state lives in memory and restarts empty; findings keep stable ids.

Nothing decided is lost between store and bus: the outbox row of a finding or recommendation is
written before the policy state that remembers the decision, and a runner publishes every pending
row when it starts. A crash between publishing and marking published sends a row again with the
same id (derived from the finding and the action), which consumers drop (``fleethealth act``
journals ids). Published are findings, and of the recommendations only those asking for an action
(``action`` other than ``none``); a ``none`` (already recommended, not worth it, stale) is kept in
the store for the audit trail only, so a scheduler reads decisions, not repetitions.

Scaling out: replicas in one group split the partitions of every topic, but a straggler's
diagnosis needs the telemetry of its node's rack and steps are keyed by job while telemetry is
keyed by node — so run one replica per group and scale by giving independent sets of jobs and
nodes their own topics (or groups). A rebalance is not handled beyond Kafka's redelivery: held
records of a revoked partition are processed again by its new owner, which the idempotent
store writes absorb.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections import Counter as Tally
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import orjson
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from fleethealth.bus import Consumer, DeadLetter, Producer, Record
from fleethealth.detectors.assembly import EventTimeBuffer
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.retry import Retry, isolate
from fleethealth.errors import BusError
from fleethealth.ids import derived
from fleethealth.ids import token as _digest_token
from fleethealth.policy.eviction import EvictionOutcome
from fleethealth.policy.persist import load_engine, record_outcome, save_engine
from fleethealth.policy.stage import PolicyStage
from fleethealth.schema import (
    Action,
    Event,
    Finding,
    Message,
    Recommendation,
    StepBatch,
    StepBlock,
    Telemetry,
    Topic,
    encode,
)
from fleethealth.store import StoreLike

__all__ = ["Runner", "Conclusions", "conclude", "publishable", "INPUT_TOPICS", "tune_gc"]

INPUT_TOPICS = (Topic.STEPS.value, Topic.TELEMETRY.value, Topic.EVENTS.value)

log = logging.getLogger(__name__)

OutboxRow = tuple[str, str, str, float, str]
"""``(topic, id, key, ts_s, payload)``: one message stored in the outbox, as it is published."""


@dataclass
class Conclusions:
    """What one batch of input concluded: detection's findings, then the policy's decisions."""

    findings: list[Finding] = field(default_factory=list)
    recommendations: list[Recommendation] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    """Events detection derived (``interruption``), stored with the input events."""
    outcomes: list[EvictionOutcome] = field(default_factory=list)
    policy_changed: bool = False
    refused: list[StepBatch | StepBlock] = field(default_factory=list)
    kept: list[tuple[StepBlock, StepBlock]] = field(default_factory=list)
    rejected: list[tuple[Message, str]] = field(default_factory=list)

    def extend(self, other: Conclusions) -> None:
        """Add what ``other`` (a later part of the same batch) concluded."""
        self.findings += other.findings
        self.recommendations += other.recommendations
        self.outcomes += other.outcomes
        self.policy_changed = self.policy_changed or other.policy_changed
        self.refused += other.refused
        self.kept += other.kept
        self.rejected += other.rejected


def publishable(msg: Finding | Recommendation) -> bool:
    """Whether ``msg`` goes to the bus: every finding, and the recommendations that ask a scheduler for
    an action (a ``none`` — already recommended, not worth it, stale — stays in the store only)."""
    return not isinstance(msg, Recommendation) or msg.action is not Action.NONE


def conclude(pipeline: Pipeline, policy: PolicyStage, messages: Sequence[Message], *,
             final: bool = False) -> Conclusions:
    """Detection, then policy, on ``messages`` (in event-time order); pure. With ``final`` (end of
    input), the pipeline's drain is decided too. The one place the two stages are composed."""
    out = pipeline.feed(messages)
    events = [m for m in messages if isinstance(m, Event)]
    decided = policy.update(out.findings, [*events, *out.events], out.now, steps=out.steps, ended=out.ended)
    findings, derived_events = list(out.findings), list(out.events)
    if final:
        tail = pipeline.drain()
        decided.extend(policy.update(tail.findings, tail.events, tail.now, steps=tail.steps, ended=tail.ended))
        findings += tail.findings
        derived_events += tail.events
    return Conclusions(findings=findings, recommendations=decided.recommendations, events=derived_events,
                       outcomes=decided.outcomes, policy_changed=decided.changed, refused=list(out.refused),
                       kept=list(out.kept), rejected=list(out.rejected))


class _Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.records = Counter("fleethealth_detect_records_total", "Input records processed", ["topic"],
                               registry=registry)
        self.findings = Counter("fleethealth_detect_findings_total", "Findings written", ["kind"], registry=registry)
        self.recommendations = Counter("fleethealth_detect_recommendations_total", "Recommendations written",
                                       ["action"], registry=registry)
        self.dead_letters = Gauge("fleethealth_detect_dead_letters", "Records dead-lettered by this runner",
                                  registry=registry)
        self.lag = Gauge("fleethealth_detect_lag_records", "Records not yet read, over assigned partitions",
                         registry=registry)
        self.held = Gauge("fleethealth_detect_buffered_records", "Records held for event-time order",
                          registry=registry)
        self.dropped = Gauge("fleethealth_detect_unscored_batches", "Step batches stored but not scored, by reason",
                             ["reason"], registry=registry)
        self.early = Gauge("fleethealth_detect_released_early_records",
                           "Records released before the watermark because the reorder buffer was full",
                           registry=registry)
        self.outbox = Gauge("fleethealth_detect_outbox_pending", "Stored findings and recommendations not yet "
                            "acknowledged by the broker", registry=registry)
        self.over_limit = Gauge("fleethealth_detect_over_limit_records",
                                "Records dead-lettered for naming a new job or node beyond the cardinality limits",
                                ["what"], registry=registry)
        self.publish_errors = Counter("fleethealth_detect_publish_errors_total",
                                      "Publishes of the outbox that failed (retried on the next batch)",
                                      registry=registry)
        self.poisoned = Counter("fleethealth_detect_poisoned_records_total",
                                "Records and conclusions dead-lettered because a detector or a store write "
                                "failed on them deterministically", ["stage"], registry=registry)


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
    """

    def __init__(self, bus_dsn: str, store: StoreLike, *, group: str = "fh-detect", pipeline: Pipeline | None = None,
                 policy: PolicyStage | None = None, publish: bool = True, max_records: int = 2000,
                 lateness_s: float = 5.0, max_held: int = 200_000,
                 session_timeout_s: float = 6.0, max_poll_interval_s: float = 10.0,
                 max_ahead_s: float | None = 300.0, max_behind_s: float | None = 86_400.0,
                 retry: Retry | None = None, registry: CollectorRegistry | None = None) -> None:
        self.store = store
        self.pipeline = pipeline if pipeline is not None else Pipeline()
        self.policy = policy if policy is not None else PolicyStage(load_engine(store))
        self.publish = publish
        self.max_records = max_records
        self.lateness_s = lateness_s
        self.max_held = max_held
        self.released_early_total = 0
        self._step_offsets: dict[tuple[str, int], dict[Hashable, int]] = {}
        self.producer = Producer(bus_dsn, client_id=f"{group}-out")
        self.consumer = Consumer(bus_dsn, INPUT_TOPICS, group, producer=self.producer,
                                 session_timeout_s=session_timeout_s, max_poll_interval_s=max_poll_interval_s,
                                 max_ahead_s=max_ahead_s, max_behind_s=max_behind_s)
        self.consumer.split_blocks = False  # a step block stays one record: assembled and stored whole
        self._stop = threading.Event()
        self.retry = retry if retry is not None else Retry()
        if retry is None:
            self.retry.stopping = self._stop.is_set
        self.buffer: EventTimeBuffer[Record] = EventTimeBuffer()
        self.metrics = _Metrics(registry if registry is not None else REGISTRY)
        self.findings_total = 0
        self.recommendations_total = 0
        self.pending_: list[OutboxRow] = []
        self._recovered = not publish  # the outbox left by an earlier run is read on the first batch

    # ------------------------------------------------------------------ loop
    def process_once(self, timeout_s: float = 1.0) -> int:
        """Poll, detect, write, publish, commit. Returns the number of records polled."""
        if not self._recovered:
            self.pending_ = self.store.pending_outbox() + self.pending_
            self._recovered = True
        if self.pending_:
            self._publish_pending()
        records = self.consumer.poll(timeout_s, self.max_records)
        for rec in records:
            self.buffer.push(rec.msg.ts, (rec.topic, rec.partition), rec)
        lag = self.consumer.lag()
        self._handle(self.buffer.release(self._bound(self._watermark(records, lag))))
        self.metrics.lag.set(sum(v for v in lag.values() if v))
        return len(records)

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
        a partition are not in step with each other); after an empty poll, everything."""
        if not records:
            return float("inf")
        watermark = self.buffer.watermark([tp for tp, behind in lag.items() if behind != 0])
        if watermark == float("inf") and self.buffer.latest_:
            watermark = max(self.buffer.latest_.values()) - self.lateness_s
        return watermark

    def caught_up(self, polled: int) -> bool:
        """Whether the last poll (which returned ``polled`` records) found every assigned partition
        read to its end: nothing returned, and every partition's end known and reached."""
        if polled:
            return False
        lag = self.consumer.lag()
        return bool(lag) and all(behind == 0 for behind in lag.values())

    def drain(self) -> None:
        """End of input (a finished replay or demo): release everything held and flush the detectors."""
        self._handle(self.buffer.release(float("inf")), final=True)

    def run(self, stop: threading.Event, *, poll_s: float = 0.5) -> None:
        """Process until ``stop`` is set (which also ends a wait for an unreachable store or broker)."""
        self._stop = stop
        self.retry.stopping = stop.is_set
        while not stop.is_set():
            self.process_once(poll_s)

    def close(self) -> None:
        self.consumer.close()
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

    def _conclude(self, ready: list[Record], final: bool) -> tuple[Conclusions, list[Record]]:
        """:func:`conclude` on the batch; if a detector raises, the batch again one record at a time
        (the detectors take what they had folded in before as duplicates), dead-lettering each record
        it raises on. Returns the conclusions and the records that were concluded."""
        try:
            return conclude(self.pipeline, self.policy, [r.msg for r in ready], final=final), ready
        except Exception as exc:
            log.warning("a detector raised on a batch of %d record(s), isolating: %s: %s", len(ready),
                        type(exc).__name__, exc)
        out, kept = Conclusions(), []
        for rec in ready:
            try:
                out.extend(conclude(self.pipeline, self.policy, [rec.msg]))
            except Exception as exc:
                self.metrics.poisoned.labels("detect").inc()
                self._letter(rec.topic, rec.partition, rec.offset, rec.key, encode(rec.msg),
                             f"detector: {type(exc).__name__}: {exc}")
                continue
            kept.append(rec)
        if final:
            out.extend(conclude(self.pipeline, self.policy, [], final=True))
        return out, kept

    def _insert(self, what: str, rows: Sequence[Message], insert: Callable[..., object], token: str,
                on_bad: Callable[[Message, BaseException], None]) -> list[Message]:
        """Write ``rows`` with ``insert(rows, dedup_token=…)`` under the retry policy, isolating the
        rows that fail deterministically (each goes to ``on_bad(row, error)``); returns the rows stored."""
        bad: set[int] = set()

        def write(part: Sequence[Message], path: str) -> None:
            insert(part, dedup_token=derived(what + path, token))

        def refuse(row: Message, exc: BaseException) -> None:
            bad.add(id(row))
            on_bad(row, exc)

        if isolate(self.retry, f"insert {what}", rows, write, refuse):
            return [r for r in rows if id(r) not in bad]
        return list(rows)

    def _write(self, released: Sequence[tuple[Hashable, Record]], *, final: bool) -> None:
        ready = [rec for _, rec in released]
        out, ready = self._conclude(ready, final)
        token = _token(ready, out)
        telemetry = [r.msg for r in ready if isinstance(r.msg, Telemetry)]
        if out.rejected:
            self._dead_letter(ready, out.rejected)
            rejected = {id(m) for m, _ in out.rejected}
            ready = [r for r in ready if id(r.msg) not in rejected]
        refused = {id(b) for b in out.refused}
        batches = [r.msg for r in ready if isinstance(r.msg, StepBatch | StepBlock) and id(r.msg) not in refused]
        events = [*(r.msg for r in ready if isinstance(r.msg, Event)), *out.events]
        where = {id(r.msg): r for r in ready}
        for block, accepted in out.kept:  # the steps of a partly refused block the assembler took
            batches.append(accepted)
            if id(block) in where:
                where[id(accepted)] = where[id(block)]

        def bad_output(msg: Message, exc: BaseException) -> None:
            self.metrics.poisoned.labels("store").inc()
            self._letter(msg.TOPIC.value, -1, -1, msg.key.encode(), encode(msg), f"store: {exc}")

        def bad_input(msg: Message, exc: BaseException) -> None:
            rec = where.get(id(msg))
            if rec is None:  # a derived event (an interruption): output, not input
                bad_output(msg, exc)
                return
            self.metrics.poisoned.labels("store").inc()
            self._letter(rec.topic, rec.partition, rec.offset, rec.key, encode(msg), f"store: {exc}")

        store = self.store
        self._insert("t", telemetry, store.insert_telemetry, token, bad_input)
        self._insert("s", batches, store.insert_steps, token, bad_input)
        self._insert("e", events, store.insert_events, token, bad_input)
        findings = self._insert("f", out.findings, store.insert_findings, token, bad_output)
        recs = self._insert("r", out.recommendations, store.insert_recommendations, token, bad_output)
        outgoing = [_outbox_row(m) for m in (*findings, *recs) if publishable(m)] if self.publish else []
        if outgoing:  # before the engine state that remembers these decisions: none is lost
            self.retry.call("write the outbox", lambda: store.write_outbox(
                outgoing, published=False, dedup_token=derived("o", token)))
        for outcome in out.outcomes:  # before the engine state that no longer watches them
            self.retry.call("record an eviction outcome", lambda o=outcome: record_outcome(store, o))
        if out.policy_changed:
            self.retry.call("save the policy state",
                            lambda: save_engine(store, self.policy.engine, self.pipeline.now_))
        self.pending_ += outgoing
        if self.pending_:
            self._publish_pending()
        offsets = self._safe_offsets(ready)
        self.retry.call("commit offsets", lambda: self.consumer.commit(offsets))
        for topic, count in Tally(rec.topic for rec in ready).items():
            self.metrics.records.labels(topic).inc(count)
        for f in out.findings:
            self.metrics.findings.labels(f.kind.value).inc()
        for r in out.recommendations:
            self.metrics.recommendations.labels(r.action.value).inc()
        self.metrics.dead_letters.set(self.consumer.dead_lettered_total)
        self.metrics.held.set(len(self.buffer))
        assembler = self.pipeline.assembler
        self.metrics.dropped.labels("late").set(assembler.late_total)
        self.metrics.dropped.labels("duplicate").set(assembler.duplicate_total)
        self.metrics.early.set(self.released_early_total)
        for what, count in self.pipeline.over_limit_.items():
            self.metrics.over_limit.labels(what).set(count)
        self.findings_total += len(out.findings)
        self.recommendations_total += len(out.recommendations)

    def _dead_letter(self, ready: Sequence[Record], rejected: Sequence[tuple[Message, str]]) -> None:
        """Publish what the pipeline refused to take (beyond its cardinality limits) as dead letters; the
        records are committed with the rest, the dead letter is where they are kept."""
        where = {id(r.msg): r for r in ready}
        for msg, why in rejected:
            rec = where.get(id(msg))
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
        """Per partition, the first offset not to commit: records still held in the buffer, and the
        step batches of steps the pipeline has not concluded (a restart must see them again)."""
        still_open = self.pipeline.open_steps()
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


def _token(records: Sequence[Record], out: Conclusions) -> str:
    """A deduplication token naming exactly what a write covers: the input offsets and the output ids."""
    offsets = (f"{r.topic}/{r.partition}/{r.offset};"
               for r in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)))
    return _digest_token([*offsets, *(msg.id for msg in (*out.findings, *out.recommendations, *out.events))])
