"""The producer: schema messages (or raw bytes) to their topics, idempotent and compressed."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Sequence
from typing import Any, Self

from fleethealth import schema
from fleethealth.bus.dsn import _backend, parse_dsn
from fleethealth.bus.kafka_client import _is_kafka_error, translated
from fleethealth.errors import BusError, ConfigError
from fleethealth.schema import Message

log = logging.getLogger(__name__)

_COMPRESSION_PREFERENCE = (("zstd", "zstandard"), ("lz4", "lz4"), ("gzip", "gzip"))


def _compression() -> str:
    """zstd, else lz4, else gzip: the first codec whose Python library is importable."""
    for codec, module in _COMPRESSION_PREFERENCE:
        try:
            __import__(module)
        except ImportError:
            continue
        return codec
    return "gzip"


_READ_BACK_S = 10.0
"""The longest a flush reads back records acknowledged without an offset (see :meth:`Producer._verify`)."""
_READ_BACK_MAX = 100_000
"""How many of a partition's last records are read back when nothing of it was placed before."""

_RESEND_MAX_BYTES = 64 * 1024 * 1024
"""The most bytes of records a producer keeps between two flushes to publish again itself after a fail-over
(see :meth:`Producer.flush`); past it, a failed flush is the caller's to publish again."""

_NEVER_MS = 2**31 - 1
"""A delivery timeout of ``math.inf``: about 24.8 days, the largest a Kafka client takes."""


def _producer_timeouts(**seconds: float | None) -> dict[str, int]:
    """kafka-python's ``*_ms`` settings for the timeouts given (``None`` left out), checked."""
    out: dict[str, int] = {}
    for name, value in seconds.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value <= 0:
            raise ConfigError(f"producer {name} must be a positive number of seconds, got {value!r}")
        out[name.removesuffix("_s") + "_ms"] = _NEVER_MS if math.isinf(value) else max(1, int(value * 1000))
    if "delivery_timeout_ms" in out:  # kafka-python requires delivery >= linger + request timeout
        out["delivery_timeout_ms"] = max(out["delivery_timeout_ms"], out.get("request_timeout_ms", 10_000) + 5)
    return out


class Producer:
    """Publishes schema messages: topic ``msg.TOPIC``, key ``msg.key``, value ``schema.encode(msg)``.

    Idempotent, ``acks=all``, compressed (zstd, else lz4, else gzip), small linger. Delivery is
    asynchronous: ``flush()`` waits for it and raises :class:`BusError` if any message failed.
    Records carry the sender's clock as their timestamp, unless ``event_time_stamps``: then
    :meth:`publish` stamps each with the message's event time (simulators, replays, tests that
    publish a timeline other than now — what a consumer's event-time bound then accepts).

    The idempotent producer retries a request that timed out with the same producer id and
    sequence numbers, so the broker drops a second copy of a batch whose first copy arrived after
    all; that holds only within one producer's life and while its batches have not expired.
    Timeouts (``None`` keeps the default): ``max_block_s`` (10 s) bounds a ``publish`` waiting for
    metadata or buffer space; ``request_timeout_s`` (10 s) closes a connection whose request got no
    answer, the batch then retried on a new one; ``delivery_timeout_s`` (30 s) fails a batch not
    acknowledged in that time (``math.inf``: never — retried until the broker answers);
    ``reconnect_backoff_max_s`` (kafka-python's 30 s) caps the wait between reconnect attempts.

    With several brokers in the DSN, a publish or flush that fails (a broker lost for good: the client
    knows only its address) fails over once, logged: a new client bootstrapped from every broker, the
    records not yet flushed published again on it, then flushed (see :meth:`flush`).
    """

    def __init__(self, dsn: str, *, client_id: str = "fleethealth", compression: str | None = None,
                 connect_timeout_s: float = 10.0, max_block_s: float | None = None,
                 request_timeout_s: float | None = None, delivery_timeout_s: float | None = None,
                 reconnect_backoff_max_s: float | None = None,
                 event_time_stamps: bool = False, signer: Any = None) -> None:
        self.dsn = dsn
        self.event_time_stamps = bool(event_time_stamps)
        self.signer = signer  # a fleethealth.signing.Signer: every record it publishes carries fh-kid / fh-sig
        backend = _backend(dsn)
        if compression is not None and compression not in {c for c, _ in _COMPRESSION_PREFERENCE}:
            raise ConfigError(f"unknown compression {compression!r} (known: zstd, lz4, gzip)")
        self.compression = compression or _compression()
        timeouts = _producer_timeouts(max_block_s=max_block_s, request_timeout_s=request_timeout_s,
                                      delivery_timeout_s=delivery_timeout_s,
                                      reconnect_backoff_max_s=reconnect_backoff_max_s)
        self._backend = backend
        self._client_id = client_id
        self._connect = lambda: backend.producer(client_id, self.compression, int(connect_timeout_s * 1000),
                                                 **timeouts)
        with translated("connecting a producer", dsn):
            self._kp = self._connect()
        self.failovers_total = 0
        self._lock = threading.Lock()
        self._failures: list[str] = []
        self.published_total = 0
        self.failed_total = 0
        self.unplaced_total = 0
        """Records acknowledged without an offset and not found when read back (see :meth:`_verify`), also
        counted in ``failed_total``; ``read_back_total`` counts every record read back."""
        self.read_back_total = 0
        self._unplaced: list[tuple[tuple[str, int], bytes | None, bytes]] = []
        self._acked: dict[tuple[str, int], int] = {}
        self._flushed: dict[tuple[str, int], int] = {}
        self._several = len(parse_dsn(dsn)[1]) >= 2
        self._generation = 0  # the client's: callbacks of a client failed over from are not this one's
        self._sent: list[tuple[str, bytes, bytes | None, int | None, list[tuple[str, bytes]] | None]] = []
        self._sent_bytes = 0
        self._sent_whole = True  # whether _sent holds every record since the last flush
        self.resent_total = 0

    def publish(self, msg: Message) -> None:
        """Queue one schema message for delivery."""
        self.publish_encoded(msg, schema.encode(msg))

    def publish_encoded(self, msg: Message, value: bytes) -> None:
        """Queue one schema message whose wire bytes ``value`` (``schema.encode(msg)``'s) were encoded
        already, e.g. a poll's node states at once (``schema.nodestate.encode_states``)."""
        stamp = _timestamp_ms(msg.ts) if self.event_time_stamps else None
        self.publish_raw(msg.TOPIC.value, value, msg.key.encode(), timestamp_ms=stamp)

    def publish_raw(self, topic: str, value: bytes, key: bytes | None = None, *,
                    timestamp_ms: int | None = None, headers: Sequence[tuple[str, bytes]] | None = None) -> None:
        """Queue raw bytes for delivery (tests and the dead-letter path use it); ``timestamp_ms`` is
        the record timestamp (default: now, by the sender's clock); ``headers`` are given as they are,
        else the producer's ``signer`` (if any) signs the record."""
        if headers is None and self.signer is not None:
            headers = self.signer.headers(str(topic), key, value)
        record = (str(topic), value, key, timestamp_ms, list(headers) if headers else None)
        if self._several and self._sent_whole:
            if self._sent_bytes + len(value) <= _RESEND_MAX_BYTES:
                self._sent.append(record)
                self._sent_bytes += len(value)
            else:
                self._sent_whole, self._sent, self._sent_bytes = False, [], 0
        try:
            self._send(record)
        except BusError as exc:  # no metadata nor buffer space within max_block_s: a broker lost for good?
            if not self._sent_whole or not self._fail_over():
                raise
            log.warning("publishing to %s failed (%s): failed over to a client bootstrapped from every broker of "
                        "%s; publishing again the %d record(s) not flushed", topic, exc, self.dsn, len(self._sent))
            self._resend()
        self.published_total += 1

    def _send(self, record: tuple[str, bytes, bytes | None, int | None, list[tuple[str, bytes]] | None]) -> None:
        topic, value, key, timestamp_ms, headers = record
        with translated(f"publishing to {topic}", self.dsn):
            future = self._kp.send(topic, value=value, key=key, timestamp_ms=timestamp_ms,
                                   **({"headers": headers} if headers else {}))
        future.add_callback(self._placed, self._generation, topic, key, value)
        future.add_errback(self._failed_on, self._generation, topic)

    def _resend(self) -> None:
        """Publish again, on the client failed over to, every record since the last flush."""
        for record in self._sent:
            self._send(record)
        self.resent_total += len(self._sent)

    def _placed(self, generation: int, topic: str, key: bytes | None, value: bytes, metadata: Any) -> None:
        """An acknowledgement without an offset is not yet a delivery. kafka-python completes a batch the
        broker answered ``DUPLICATE_SEQUENCE_NUMBER`` as a success at offset -1. A broker that took the
        first copy (a frozen one, answering late) did store it; a Tansu broker on S3 SIGKILLed between
        taking a batch's sequence numbers and writing the batch answers the same to the retry of a batch
        it never stored (``bench/broker_kill_repro.py``). :meth:`flush` reads such records back."""
        offset = getattr(metadata, "offset", None)
        tp = (topic, int(getattr(metadata, "partition", -1)))
        with self._lock:
            if generation != self._generation:
                return
            if isinstance(offset, int) and offset >= 0:
                if offset > self._acked.get(tp, -1):
                    self._acked[tp] = offset
            else:
                self._unplaced.append((tp, key, value))

    def _verify(self, timeout_s: float) -> None:
        """Read back the records acknowledged without an offset (see :meth:`_placed`): each one found on
        its partition, after what the previous flush had placed there, is delivered; each one not found
        is counted failed (``unplaced_total``), so the flush raises and the caller publishes it again
        (a new producer id: no broker calls it a duplicate)."""
        with self._lock:
            unplaced, self._unplaced = self._unplaced, []
            since = dict(self._flushed)
        if not unplaced:
            return
        found = self._read_back(set(unplaced), since, min(timeout_s, _READ_BACK_S))
        missing = [(tp, k, v) for tp, k, v in unplaced if (tp, k, v) not in found]
        with self._lock:
            self.read_back_total += len(unplaced)
            self.unplaced_total += len(missing)
        for (topic, partition), _, _ in missing:
            self._failed(topic, BusError(f"acknowledged without an offset and not found on partition {partition} "
                                         "when read back: a retried batch the broker called a duplicate and "
                                         "never stored"))

    def _read_back(self, wanted: set[tuple[tuple[str, int], bytes | None, bytes]], since: dict[tuple[str, int], int],
                   timeout_s: float) -> set[tuple[tuple[str, int], bytes | None, bytes]]:
        """Which of ``wanted`` (``(partition, key, value)``) are on their partitions after ``since`` (the last
        offset placed there as of the previous flush; else among the last :data:`_READ_BACK_MAX`
        records), read until all are found, the partitions' ends are reached, five polls in a row answer
        nothing (a Tansu fetch inside a hole in the log answers nothing), or ``timeout_s``."""
        tps = {tp for tp, _, _ in wanted}
        import time

        from kafka.structs import TopicPartition

        out: set[tuple[tuple[str, int], bytes | None, bytes]] = set()
        try:
            reader = self._backend.reader(f"{self._client_id}-readback", 10_000)
        except Exception as exc:
            if _is_kafka_error(exc):
                return out
            raise
        try:
            parts = [TopicPartition(t, p) for t, p in sorted(tps) if p >= 0]
            reader.assign(parts)
            ends = reader.end_offsets(parts)
            for tp in parts:
                start = since.get((tp.topic, tp.partition))
                reader.seek(tp, start + 1 if start is not None else max(0, int(ends[tp]) - _READ_BACK_MAX))
            deadline, quiet = time.monotonic() + timeout_s, 0
            while time.monotonic() < deadline and quiet < 5 and not wanted <= out:
                got = reader.poll(timeout_ms=200)
                for tp, records in got.items():
                    out.update(((tp.topic, tp.partition), r.key, r.value) for r in records)
                known = all(reader.highwater(tp) is not None for tp in parts)
                if not got and known and all(reader.position(tp) >= reader.highwater(tp) for tp in parts):
                    break
                quiet = quiet + 1 if not got and known else 0
        except Exception as exc:
            if not _is_kafka_error(exc):
                raise
        finally:
            with contextlib.suppress(Exception):
                reader.close()
        return out

    def _failed_on(self, generation: int, topic: str, exc: Exception) -> None:
        if generation == self._generation:  # (the dropped client's batches fail as it closes: published again)
            self._failed(topic, exc)

    def _failed(self, topic: str, exc: Exception) -> None:
        with self._lock:
            self.failed_total += 1
            if len(self._failures) < 10:
                self._failures.append(f"{topic}: {type(exc).__name__}: {exc}")

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued message is delivered; raise if any delivery failed. With several brokers
        in the DSN, a flush that fails (timed out, or a record not delivered) fails over once, logged: the
        records since the last flush are published again on a client bootstrapped from every broker and
        flushed within another ``timeout_s``; only if that fails too does it raise (a record that had
        reached the broker may then be on its topic twice, with the same id)."""
        try:
            self._flush(timeout_s)
        except BusError as exc:
            if not self._sent_whole or not self._fail_over():
                self._forget_sent()
                raise
            log.warning("flushing to %s failed (%s): failed over to a client bootstrapped from every broker; "
                        "publishing again the %d record(s) not flushed", self.dsn, exc, len(self._sent))
            try:
                self._resend()
                self._flush(timeout_s)
            except BusError:
                self._forget_sent()
                raise
        self._forget_sent()

    def _forget_sent(self) -> None:
        self._sent, self._sent_bytes, self._sent_whole = [], 0, True

    def _flush(self, timeout_s: float) -> None:
        with translated(f"flushing within {timeout_s} s", self.dsn):
            self._kp.flush(timeout=timeout_s)
        self._verify(timeout_s)
        with self._lock:
            self._flushed.update(self._acked)
            failures, self._failures = self._failures, []
        if failures:
            raise BusError(f"{len(failures)} message(s) not delivered to {self.dsn}: {failures[0]}")

    def _fail_over(self) -> bool:
        """After a failed flush, with several brokers in the DSN: replace the client by a new one
        bootstrapped from all of them. kafka-python forgets its bootstrap list once it has metadata, and
        brokers that share one node id (Tansu's, on one storage) leave it one address, so a client whose
        broker died for good would retry that address forever. What the old client still held is
        dropped, its failures and placements with it; :meth:`flush` publishes it again on the new client (a
        record that had reached the broker then arrives twice, with the same id). With one broker in the
        DSN, or none answering, the client is kept. Returns whether it was replaced."""
        if not self._several:
            return False
        try:
            fresh = self._connect()
        except Exception as exc:
            if _is_kafka_error(exc):
                return False
            raise
        old, self._kp = self._kp, fresh
        with self._lock:  # what the old client failed or placed without an offset is published again
            self._generation += 1
            self._failures, self._unplaced = [], []
        self.failovers_total += 1
        sender = getattr(old, "_sender", None)
        if sender is not None:
            sender.force_close()
            sender.join(1.0)
        with contextlib.suppress(Exception):
            old.close(timeout=0)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is queued within ``timeout_s``, then close; undelivered messages are dropped
        (call :meth:`flush` first to learn about them). Never raises for an unreachable broker."""
        try:
            self._kp.close(timeout=timeout_s)
        except Exception as exc:
            if not _is_kafka_error(exc):
                raise
            # kafka-python's close() flushes first and, when that times out, never stops its sender
            # thread, which would deliver the dropped messages later: stop it, then close.
            sender = getattr(self._kp, "_sender", None)
            if sender is not None:
                sender.force_close()
                sender.join(timeout_s)
            with contextlib.suppress(Exception):
                self._kp.close(timeout=0)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _timestamp_ms(ts: float) -> int | None:
    """An event time as a Kafka record timestamp (None, i.e. now, for one Kafka cannot carry)."""
    if not math.isfinite(ts) or ts < 0 or ts >= 2**62 / 1000:
        return None
    return int(round(ts * 1000.0))
