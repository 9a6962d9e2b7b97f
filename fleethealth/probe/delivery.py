"""Delivery of the probe's records to Kafka through the spool: nothing accepted within the bound is lost.

Every record is appended to the :class:`fleethealth.probe.spool.Spool` first (write-ahead).
:meth:`Delivery.step` takes the oldest batch, publishes it through
:class:`fleethealth.bus.Producer` (idempotent, ``acks=all``, compressed, batched), waits for the
broker's acknowledgement with ``flush`` and only then removes the batch from the spool. A thread
(:meth:`start`) runs ``step`` continuously so a slow or absent broker never delays sampling.

A broker that is away — stopped, partitioned, or frozen (its sockets open, every request left
unanswered) — is waited out by **one** producer:

- A batch handed to the producer stays *in flight* until the broker acknowledges it; it is never
  published a second time while its first copy may still arrive. The producer's batches do not
  expire (``delivery_timeout_s`` is infinite by default): a request that got no answer within
  ``request_timeout_s`` is retried on a new connection with the same producer id and sequence
  numbers, so the broker drops the copy it may already hold (the idempotent producer; Tansu and
  Kafka both keep the sequences). Only when the producer reports the records *failed* (a broker
  that lost its state, a fatal producer error) is the batch published anew through a fresh
  producer; the consumers' natural keys absorb what may then repeat (see docs/architecture.md).
- While a batch is in flight the delivery thread waits in ``flush`` — no back-off sleep on top —
  and the producer reconnects at most ``reconnect_backoff_max_s`` apart, so delivery resumes within
  about ``reconnect_backoff_max_s`` + ``request_timeout_s`` of the broker answering again.
  Only connecting (building the producer), or a call that failed at once, backs off, from
  ``backoff_s`` to ``max_backoff_s``.

Records the spool dropped beyond its bound are reported on the bus as a ``spool_dropped`` event
(counts, bytes, per topic, time range) ahead of the first batch delivered after the outage. Records
the bound drops while they are in flight and that the broker then acknowledges arrived: they are taken
out of the drop counts (:meth:`Spool.ack_delivered`), so the report counts exactly what never arrived.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleethealth import schema
from fleethealth.errors import BusError, BusUnavailable, ConfigError
from fleethealth.probe.spool import Spool, SpoolDrops, SpoolRecord, SpoolStats
from fleethealth.schema import Event, EventKind, Message

__all__ = ["Delivery", "DeliveryStats", "drop_report"]


@dataclass(frozen=True, slots=True)
class DeliveryStats:
    """Delivery counters and the spool's state; ``connected`` is true while the last attempt succeeded.
    ``drop_reports_total`` counts ``spool_dropped`` events the broker acknowledged; ``inflight_records``
    is how many records are handed to the producer and not yet acknowledged."""

    delivered_total: int
    failures_total: int
    connected: bool
    last_error: str | None
    spool: SpoolStats
    drop_reports_total: int = 0
    inflight_records: int = 0


@dataclass(frozen=True, slots=True)
class _InFlight:
    start: int                 # spool indices [start, end) handed to the producer
    end: int
    drops: SpoolDrops | None   # the drop report handed to it ahead of them, if any
    records: tuple[SpoolRecord, ...] = ()  # the records [start, end): the bound may drop them meanwhile


def drop_report(node: str, drops: SpoolDrops) -> Event:
    """The ``spool_dropped`` event for ``drops``. Its time is the newest dropped record's (now when
    unknown), so the same report published twice has the same id."""
    ts = drops.last_ts if math.isfinite(drops.last_ts) else time.time()
    span = ("" if not (math.isfinite(drops.first_ts) and math.isfinite(drops.last_ts))
            else f" spanning {drops.last_ts - drops.first_ts:.0f} s")
    return Event(node=node, ts=ts, kind=EventKind.SPOOL_DROPPED,
                 message=f"probe spool full: dropped the oldest {drops.records} record(s), {drops.bytes} bytes{span}",
                 data=drops.to_obj())


class Delivery:
    """Spool-backed delivery of records to the bus at ``dsn``.

    ``producer_factory(dsn)`` builds the producer (default :class:`fleethealth.bus.Producer` with
    the timeouts given here); ``on_connect(dsn)`` runs after every (re)connect, e.g.
    :func:`fleethealth.bus.ensure_topics` against a broker that forgets its topics on restart.
    ``node`` names the node in the ``spool_dropped`` reports (default: this host's node name).
    ``signer`` (a :class:`fleethealth.signing.Signer` holding this node's key) signs every record as
    it is handed to the producer: the spool keeps the bodies, the signature goes in the record's headers.
    """

    def __init__(self, dsn: str, spool: Spool, *, client_id: str = "fleethealth-probe",
                 producer_factory: Callable[[str], Any] | None = None,
                 on_connect: Callable[[str], None] | None = None, batch_records: int = 1000,
                 flush_timeout_s: float = 5.0, backoff_s: float = 0.5, max_backoff_s: float = 5.0,
                 request_timeout_s: float = 5.0, reconnect_backoff_max_s: float = 1.0,
                 delivery_timeout_s: float = math.inf, node: str | None = None,
                 clock: Callable[[], float] = time.monotonic, signer: Any = None) -> None:
        if batch_records < 1:
            raise ConfigError("delivery batch must hold at least one record")
        for name, value in (("request_timeout_s", request_timeout_s),
                            ("reconnect_backoff_max_s", reconnect_backoff_max_s),
                            ("delivery_timeout_s", delivery_timeout_s), ("flush_timeout_s", flush_timeout_s)):
            if not value > 0:
                raise ConfigError(f"delivery {name} must be positive, got {value!r}")
        self.dsn = dsn
        self.spool = spool
        self.client_id = client_id
        self._factory = producer_factory
        self._on_connect = on_connect
        self.batch_records = batch_records
        self.flush_timeout_s = flush_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.request_timeout_s = request_timeout_s
        self.reconnect_backoff_max_s = reconnect_backoff_max_s
        self.delivery_timeout_s = delivery_timeout_s
        if node is None:
            from fleethealth.nodename import node_name

            node = node_name()
        self.node = node
        self.signer = signer
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._producer: Any = None
        self._healthy = False
        self._inflight: _InFlight | None = None  # handed to the producer, not yet acknowledged
        self._retry_at = 0.0
        self._delay = backoff_s
        self._delivered = 0
        self._failures = 0
        self._drop_reports = 0
        self._last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ input (any thread)
    def submit(self, msg: Message) -> None:
        """Accept one schema message (spooled at once; delivered by :meth:`step`)."""
        self.submit_raw(msg.TOPIC.value, schema.encode(msg), msg.key.encode(), ts=msg.ts)

    def submit_raw(self, topic: str, value: bytes, key: bytes | None = None, *, ts: float | None = None) -> None:
        """Accept raw bytes; ``ts`` is their time for a drop report (default: now)."""
        with self._wake:
            self.spool.append(topic, value, key, ts=ts)
            self._wake.notify()

    # ------------------------------------------------------------ delivery
    def step(self, *, force: bool = False) -> int:
        """Try to deliver one batch; return how many spooled records the broker acknowledged (0 on
        failure, when nothing is queued, or while backing off unless ``force``). Never raises on
        bus errors.

        A batch not acknowledged within ``flush_timeout_s`` stays *in flight*: the producer keeps
        it (and retries it itself) and later steps only flush again, so it is never published
        twice while the first copy may still arrive. Only when the producer reports the records
        failed is the batch published anew (through a fresh producer).
        """
        if not force and self._clock() < self._retry_at:
            return 0
        if self._inflight is None:
            with self._lock:
                drops = self.spool.drops_to_report()
                start = self.spool.head_seq
                batch = self.spool.peek(self.batch_records)
            if not batch and drops is None:
                return 0
        if self._producer is None and not self._connect():
            return 0
        waited_from = time.monotonic()
        try:
            if self._inflight is None:
                self._publish(start, batch, drops)
            self._producer.flush(self.flush_timeout_s)
        except BusUnavailable as exc:  # not acknowledged (or not accepted) yet: same producer, flush again
            waited = time.monotonic() - waited_from >= min(self.flush_timeout_s, self.request_timeout_s) / 2
            self._fail(exc, drop_producer=False, pause=not waited)
            return 0
        except Exception as exc:  # the records failed (or the client broke): publish them again later
            self._inflight = None
            self._fail(exc, drop_producer=True)
            return 0
        done, self._inflight = self._inflight, None
        self._healthy = True
        self._delay = self.backoff_s
        if done is None:
            return 0
        with self._lock:  # in flight since, some may have been dropped by the bound: they arrived all the same
            self.spool.ack_delivered(done.start, done.records)
            if done.drops is not None:
                self.spool.drops_reported()
                self._drop_reports += 1
        self._delivered += done.end - done.start
        return done.end - done.start

    def _publish(self, start: int, batch: list[Any], drops: SpoolDrops | None) -> None:
        """Hand the drop report (if any) and ``batch`` to the producer; whatever it accepted is in flight,
        also when a later record raises."""
        reported = False
        sent = 0
        try:
            if drops is not None:
                report = drop_report(self.node, drops)
                if self.signer is None:
                    self._producer.publish(report)
                else:
                    self._send(report.TOPIC.value, schema.encode(report), report.key.encode())
                reported = True
            for record in batch:
                self._send(record.topic, record.value, record.key)
                sent += 1
        finally:
            if reported or sent:
                self._inflight = _InFlight(start, start + sent, drops if reported else None, tuple(batch[:sent]))

    def _send(self, topic: str, value: bytes, key: bytes | None) -> None:
        if self.signer is None:
            self._producer.publish_raw(topic, value, key)
        else:
            self._producer.publish_raw(topic, value, key, headers=self.signer.headers(topic, key, value))

    def _connect(self) -> bool:
        try:
            factory = self._factory
            if factory is None:
                from fleethealth.bus import Producer

                self._producer = Producer(self.dsn, client_id=self.client_id, max_block_s=self.request_timeout_s,
                                          request_timeout_s=self.request_timeout_s,
                                          delivery_timeout_s=self.delivery_timeout_s,
                                          reconnect_backoff_max_s=self.reconnect_backoff_max_s)
            else:
                self._producer = factory(self.dsn)
            if self._on_connect is not None:
                self._on_connect(self.dsn)
        except Exception as exc:  # BusError, ConfigError from a bad DSN, or a client failure
            self._fail(exc, drop_producer=True)
            return False
        return True

    def _fail(self, exc: BaseException, *, drop_producer: bool, pause: bool = True) -> None:
        """Count a failure; ``drop_producer`` closes the producer (a fresh one is built next time);
        ``pause`` backs off (exponentially) before the next attempt — not when the call has just
        waited its full time (a flush for the batch in flight, a publish for metadata), which is the
        wait already."""
        self._failures += 1
        self._healthy = False
        self._last_error = f"{type(exc).__name__}: {exc}"
        if drop_producer:
            producer, self._producer = self._producer, None
            if producer is not None:
                try:
                    producer.close(timeout_s=0.0)  # nothing of ours is buffered in it any more
                except Exception:  # closing a broken client may fail too; it is dropped either way
                    pass
        if not pause:
            self._retry_at = self._clock()
            return
        self._retry_at = self._clock() + self._delay
        self._delay = min(self._delay * 2, self.max_backoff_s)

    # ------------------------------------------------------------ background thread
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fh-probe-delivery", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.step() == 0:
                with self._wake:
                    if self._stop.is_set():
                        return
                    wait = max(self._retry_at - self._clock(), 0.0)
                    self._wake.wait(timeout=min(max(wait, 0.05), 1.0) if len(self.spool) else 1.0)

    def close(self, drain_timeout_s: float = 5.0) -> None:
        """Stop the thread, try to deliver what is queued within ``drain_timeout_s``, close the producer."""
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.flush_timeout_s + 5)
        deadline = time.monotonic() + drain_timeout_s
        while (len(self.spool) or self._inflight is not None) and time.monotonic() < deadline \
                and self.step(force=True):
            pass
        if self._producer is not None:
            try:
                self._producer.close()
            except BusError:
                pass
            self._producer = None
        self.spool.close()

    @property
    def stats(self) -> DeliveryStats:
        with self._lock:
            spool = self.spool.stats
        return DeliveryStats(self._delivered, self._failures, self._healthy and self._producer is not None,
                             self._last_error, spool, self._drop_reports,
                             0 if self._inflight is None else self._inflight.end - self._inflight.start)
