"""Delivery of the probe's records to Kafka through the spool: nothing accepted within the bound is lost.

Every record is appended to the :class:`fleethealth.probe.spool.Spool` first (write-ahead).
:meth:`Delivery.step` takes the oldest batch, publishes it through
:class:`fleethealth.bus.Producer` (idempotent, ``acks=all``, compressed, batched), waits for the
broker's acknowledgement with ``flush`` and only then removes the batch from the spool. When the
broker is unreachable the batch stays spooled *and* in flight in the producer (it is flushed again,
never published twice while a first copy may still arrive), and retries back off exponentially
(``backoff_s`` up to ``max_backoff_s``); when the broker is back the spool replays in order, then
new records follow. A thread (:meth:`start`) runs ``step`` continuously so a slow or absent broker
never delays sampling.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleethealth import schema
from fleethealth.errors import BusError, BusUnavailable, ConfigError
from fleethealth.probe.spool import Spool, SpoolStats
from fleethealth.schema import Message

__all__ = ["Delivery", "DeliveryStats"]


@dataclass(frozen=True, slots=True)
class DeliveryStats:
    """Delivery counters and the spool's state; ``connected`` is true while the last attempt succeeded."""

    delivered_total: int
    failures_total: int
    connected: bool
    last_error: str | None
    spool: SpoolStats


class Delivery:
    """Spool-backed delivery of records to the bus at ``dsn``.

    ``producer_factory(dsn)`` builds the producer (default :class:`fleethealth.bus.Producer`);
    ``on_connect(dsn)`` runs after every (re)connect, e.g. :func:`fleethealth.bus.ensure_topics`
    against a broker that forgets its topics on restart.
    """

    def __init__(self, dsn: str, spool: Spool, *, client_id: str = "fleethealth-probe",
                 producer_factory: Callable[[str], Any] | None = None,
                 on_connect: Callable[[str], None] | None = None, batch_records: int = 1000,
                 flush_timeout_s: float = 5.0, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if batch_records < 1:
            raise ConfigError("delivery batch must hold at least one record")
        self.dsn = dsn
        self.spool = spool
        self.client_id = client_id
        self._factory = producer_factory
        self._on_connect = on_connect
        self.batch_records = batch_records
        self.flush_timeout_s = flush_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._producer: Any = None
        self._healthy = False
        self._inflight: tuple[int, int] | None = None  # spool indices [start, end) published, not yet acked
        self._retry_at = 0.0
        self._delay = backoff_s
        self._delivered = 0
        self._failures = 0
        self._last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ input (any thread)
    def submit(self, msg: Message) -> None:
        """Accept one schema message (spooled at once; delivered by :meth:`step`)."""
        self.submit_raw(msg.TOPIC.value, schema.encode(msg), msg.key.encode())

    def submit_raw(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        with self._wake:
            self.spool.append(topic, value, key)
            self._wake.notify()

    # ------------------------------------------------------------ delivery
    def step(self, *, force: bool = False) -> int:
        """Try to deliver one batch; return how many records the broker acknowledged (0 on failure,
        when nothing is queued, or while backing off unless ``force``). Never raises on bus errors.

        A batch whose flush timed out stays *in flight*: the producer keeps it and later steps only
        flush again, so it is never published twice while the first copy may still arrive. Only
        when the producer reports the records failed is the batch published anew (through a fresh
        producer) — a batch split over partitions could then repeat the part that did arrive.
        """
        if not force and self._clock() < self._retry_at:
            return 0
        if self._inflight is None:
            with self._lock:
                start = self.spool.head_seq
                batch = self.spool.peek(self.batch_records)
            if not batch:
                return 0
        if self._producer is None and not self._connect():
            return 0
        try:
            if self._inflight is None:
                for record in batch:
                    self._producer.publish_raw(record.topic, record.value, record.key)
                self._inflight = (start, start + len(batch))
            self._producer.flush(self.flush_timeout_s)
        except BusUnavailable as exc:  # not acknowledged yet: keep the batch in flight, retry the flush
            self._fail(exc, drop_producer=self._inflight is None)
            return 0
        except Exception as exc:  # the records failed (or the client broke): publish them again later
            self._inflight = None
            self._fail(exc, drop_producer=True)
            return 0
        first, end = self._inflight
        self._inflight = None
        self._healthy = True
        with self._lock:
            self.spool.ack_until(end)
        self._delivered += end - first
        self._delay = self.backoff_s
        return end - first

    def _connect(self) -> bool:
        try:
            factory = self._factory
            if factory is None:
                from fleethealth.bus import Producer

                self._producer = Producer(self.dsn, client_id=self.client_id)
            else:
                self._producer = factory(self.dsn)
            if self._on_connect is not None:
                self._on_connect(self.dsn)
        except Exception as exc:  # BusError, ConfigError from a bad DSN, or a client failure
            self._fail(exc, drop_producer=True)
            return False
        return True

    def _fail(self, exc: BaseException, *, drop_producer: bool) -> None:
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
        while len(self.spool) and time.monotonic() < deadline and self.step(force=True):
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
                             self._last_error, spool)
