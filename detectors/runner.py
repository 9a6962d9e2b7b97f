"""The stream runner: Kafka in, detectors, ClickHouse and Kafka out — exactly once in the store.

One consumer group over ``fh.steps`` (keyed by job), ``fh.telemetry`` and ``fh.events`` (keyed
by node), so replicas split the partitions between them. Each :meth:`Runner.process_once`:

1. polls a batch (malformed values are dead-lettered by the consumer, which keeps going);
2. pushes records into the :class:`EventTimeBuffer` and releases those below the low
   watermark over the partitions that still have unread data;
3. feeds them, in event-time order, to the pure :class:`Pipeline`;
4. writes inputs, findings and recommendations to the store — idempotently: every table is a
   ReplacingMergeTree on its natural key and every insert carries a deduplication token derived
   from the offsets it covers;
5. publishes findings and recommendations;
6. commits offsets — only now, and never past a record still held in the buffer.

A crash anywhere replays from the last commit: rows already written are rewritten with the same
keys, so after merges (or with ``FINAL``) each (job, step, rank) is in the store exactly once.
Detector state lives in memory and restarts empty; findings keep stable ids.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Hashable, Sequence

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from fleethealth.bus import Consumer, Producer, Record
from fleethealth.detectors.assembly import EventTimeBuffer
from fleethealth.detectors.pipeline import Output, Pipeline
from fleethealth.policy.persist import load_engine, save_engine
from fleethealth.schema import Event, StepBatch, Telemetry, Topic
from fleethealth.store import Store

__all__ = ["Runner", "INPUT_TOPICS"]

INPUT_TOPICS = (Topic.STEPS.value, Topic.TELEMETRY.value, Topic.EVENTS.value)


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


class Runner:
    """Feed the detection :class:`Pipeline` from the bus and persist what it concludes.

    ``group`` names the consumer group (replicas share it); ``publish`` turns off writing findings
    and recommendations back to Kafka (the store always gets them). ``registry`` receives the
    runner's metrics (``fleethealth_detect_*``); pass a fresh one when several runners share a process.
    """

    def __init__(self, bus_dsn: str, store: Store, *, group: str = "fh-detect", pipeline: Pipeline | None = None,
                 publish: bool = True, max_records: int = 2000, registry: CollectorRegistry | None = None) -> None:
        self.store = store
        self.pipeline = pipeline if pipeline is not None else Pipeline(policy=load_engine(store))
        self.publish = publish
        self.max_records = max_records
        self.producer = Producer(bus_dsn, client_id=f"{group}-out")
        self.consumer = Consumer(bus_dsn, INPUT_TOPICS, group, producer=self.producer, max_poll_interval_s=10.0)
        self.buffer: EventTimeBuffer[Record] = EventTimeBuffer()
        self.metrics = _Metrics(registry if registry is not None else REGISTRY)
        self.findings_total = 0
        self.recommendations_total = 0

    # ------------------------------------------------------------------ loop
    def process_once(self, timeout_s: float = 1.0) -> int:
        """Poll, detect, write, publish, commit. Returns the number of records polled."""
        records = self.consumer.poll(timeout_s, self.max_records)
        for rec in records:
            self.buffer.push(rec.msg.ts, (rec.topic, rec.partition), rec)
        lag = self.consumer.lag()
        live = [tp for tp, behind in lag.items() if behind != 0]
        ready = [rec for _, rec in self.buffer.release(self.buffer.watermark(live))]
        self._handle(ready, self.pipeline.feed([r.msg for r in ready]))
        self.metrics.lag.set(sum(v for v in lag.values() if v))
        return len(records)

    def drain(self) -> None:
        """End of input (a finished replay or demo): release everything held and flush the detectors."""
        ready = [rec for _, rec in self.buffer.release(float("inf"))]
        out = self.pipeline.feed([r.msg for r in ready])
        out.extend(self.pipeline.drain())
        self._handle(ready, out)

    def run(self, stop: threading.Event, *, poll_s: float = 0.5) -> None:
        """Process until ``stop`` is set."""
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
    def _handle(self, ready: Sequence[Record], out: Output) -> None:
        token = _token(ready)
        telemetry = [r.msg for r in ready if isinstance(r.msg, Telemetry)]
        batches = [r.msg for r in ready if isinstance(r.msg, StepBatch)]
        events = [r.msg for r in ready if isinstance(r.msg, Event)]
        if telemetry:
            self.store.insert_telemetry(telemetry, dedup_token=f"t:{token}")
        if batches:
            self.store.insert_steps(batches, dedup_token=f"s:{token}")
        if events:
            self.store.insert_events(events, dedup_token=f"e:{token}")
        if out.findings:
            self.store.insert_findings(out.findings, dedup_token=f"f:{token}")
        if out.recommendations:
            self.store.insert_recommendations(out.recommendations, dedup_token=f"r:{token}")
        if out.findings and self.pipeline.policy is not None:
            save_engine(self.store, self.pipeline.policy, self.pipeline.now_)
        if self.publish:
            for msg in (*out.findings, *out.recommendations):
                self.producer.publish(msg)
            if out.findings or out.recommendations:
                self.producer.flush()
        self.consumer.commit(self._safe_offsets())
        for rec in ready:
            self.metrics.records.labels(rec.topic).inc()
        for f in out.findings:
            self.metrics.findings.labels(f.kind.value).inc()
        for r in out.recommendations:
            self.metrics.recommendations.labels(r.action.value).inc()
        self.metrics.dead_letters.set(self.consumer.dead_lettered_total)
        self.metrics.held.set(len(self.buffer))
        self.findings_total += len(out.findings)
        self.recommendations_total += len(out.recommendations)

    def _safe_offsets(self) -> dict[Hashable, int]:
        """Per partition, the first offset still held in the buffer (nothing from there on is committed)."""
        held: dict[Hashable, int] = {}
        for partition, rec in self.buffer.pending():
            held[partition] = min(held.get(partition, rec.offset), rec.offset)
        return held


def _token(records: Sequence[Record]) -> str:
    """A deduplication token naming exactly the offsets a write covers."""
    digest = hashlib.blake2b(digest_size=12)
    for rec in sorted(records, key=lambda r: (r.topic, r.partition, r.offset)):
        digest.update(f"{rec.topic}/{rec.partition}/{rec.offset};".encode())
    return digest.hexdigest()
