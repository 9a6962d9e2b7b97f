"""The message bus: a producer and a consumer over Kafka, chosen from a DSN.

::

    Producer(dsn)          publish(msg) / publish_raw(topic, value) / flush() / close()
    Consumer(dsn, topics)  poll() -> list[Record] / commit() / close()
    ensure_topics(dsn)     create every schema.Topic, tolerant of topics that exist

A registry maps a DSN scheme to a backend factory (``kafka://host:port[,host:port]`` today); the
factory imports its client library lazily, and an unknown scheme raises :class:`ConfigError`
listing the known ones. kafka-python exceptions are translated at this boundary::

    kafka.errors.KafkaConnectionError, KafkaTimeoutError,
    RequestTimedOutError, NodeNotReadyError, ...        -> BusUnavailable
    any other kafka.errors.KafkaError                   -> BusError

Every value a consumer cannot decode or validate goes to ``fh.deadletter`` as a JSON object
(:class:`DeadLetter`) with the reason, is counted in ``Consumer.dead_lettered_total`` and skipped;
the consumer keeps going. A consumer given ``max_ahead_s`` / ``max_behind_s`` also dead-letters a
value whose event time (``ts``) is further ahead of, or behind, the Kafka record timestamp than
that (the reason names ``ts``): the record timestamp is the producer's clock when it sent
(``CreateTime``, kafka-python's default) or the broker's (a topic with ``LogAppendTime``), so a
forged or corrupt time cannot carry a record hours into the future. A producer replaying a
recorded or simulated timeline stamps its records with their event time instead
(``Producer(event_time_stamps=True)``), or its consumer leaves the bounds off. Commits are
manual: ``commit()`` commits everything ``poll()`` has returned (and dead-lettered) so far,
after the dead letters are flushed, so nothing accepted is lost.

Against the embedded Tansu broker a consumer-group join waits for the group's timeouts (measured
on Tansu 0.6: about half the session timeout), so consumers default to short ones: a 3 s
``max_poll_interval`` and a 6 s session, the smallest a stock Kafka broker accepts
(``group.min.session.timeout.ms``); tests against Tansu pass 2 s for a join of about 1 s.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import math
import pathlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import orjson

from fleethealth import schema
from fleethealth.errors import BusError, BusUnavailable, ConfigError, SchemaError
from fleethealth.schema import Message, Topic

__all__ = [
    "DEADLETTER_VERSION",
    "Record",
    "DeadLetter",
    "Producer",
    "Consumer",
    "ensure_topics",
    "SnapshotTopic",
    "parse_dsn",
    "dsn_options",
    "register_backend",
    "known_schemes",
]

_log = logging.getLogger("fleethealth.bus")

DEADLETTER_VERSION = 1
DEADLETTER_RAW_BYTES = 64 * 1024
"""A dead letter carries at most this much of the original value (then ``truncated`` is true, and
``raw_size`` and ``raw_sha256`` identify the whole), so a dead letter always fits in one Kafka request."""
DEADLETTER_REASON_CHARS = 2_000
_COMPRESSION_PREFERENCE = (("zstd", "zstandard"), ("lz4", "lz4"), ("gzip", "gzip"))


# ---------------------------------------------------------------- records
@dataclass(frozen=True)
class DeadLetter:
    """A value that could not be decoded or validated (topic ``fh.deadletter``).

    ``raw`` is the original value as text, or base64 when it is not UTF-8 (then ``raw_base64``
    is true); ``key`` likewise (``key_base64``). ``ts`` is the broker timestamp of the original
    record in seconds (NaN when the broker gave none). A value larger than
    :data:`DEADLETTER_RAW_BYTES` is cut to that size: ``truncated`` is then true, and ``raw_size``
    (bytes) and ``raw_sha256`` describe the whole value.
    """

    topic: str
    partition: int
    offset: int
    key: str | None
    reason: str
    raw: str
    raw_base64: bool = False
    key_base64: bool = False
    ts: float = math.nan
    raw_size: int = -1
    raw_sha256: str = ""
    truncated: bool = False
    TOPIC = Topic.DEADLETTER

    def to_obj(self) -> dict[str, Any]:
        return {"v": DEADLETTER_VERSION, "topic": self.topic, "partition": self.partition,
                "offset": self.offset, "key": self.key, "key_base64": self.key_base64,
                "reason": self.reason, "raw": self.raw, "raw_base64": self.raw_base64,
                "ts": None if math.isnan(self.ts) else self.ts, "raw_size": self.raw_size,
                "raw_sha256": self.raw_sha256, "truncated": self.truncated}

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        if obj.get("v") != DEADLETTER_VERSION:
            raise SchemaError("v", f"unknown dead-letter version {obj.get('v')!r}")
        for name, kind in (("topic", str), ("partition", int), ("offset", int), ("reason", str), ("raw", str)):
            if not isinstance(obj.get(name), kind) or isinstance(obj.get(name), bool):
                raise SchemaError(name, f"expected {kind.__name__}, got {obj.get(name)!r}")
        key, ts = obj.get("key"), obj.get("ts")
        if key is not None and not isinstance(key, str):
            raise SchemaError("key", f"expected a string or null, got {key!r}")
        if ts is not None and (isinstance(ts, bool) or not isinstance(ts, int | float)):
            raise SchemaError("ts", f"expected a number or null, got {ts!r}")
        size, digest = obj.get("raw_size", -1), obj.get("raw_sha256", "")
        if isinstance(size, bool) or not isinstance(size, int) or not isinstance(digest, str):
            raise SchemaError("raw_size", f"expected an integer and a hex digest, got {size!r}, {digest!r}")
        return cls(topic=obj["topic"], partition=obj["partition"], offset=obj["offset"], key=key,
                   reason=obj["reason"], raw=obj["raw"], raw_base64=bool(obj.get("raw_base64", False)),
                   key_base64=bool(obj.get("key_base64", False)), ts=math.nan if ts is None else float(ts),
                   raw_size=size, raw_sha256=digest, truncated=bool(obj.get("truncated", False)))

    def raw_bytes(self) -> bytes:
        """The original value as it arrived (its first :data:`DEADLETTER_RAW_BYTES` when ``truncated``)."""
        return base64.b64decode(self.raw) if self.raw_base64 else self.raw.encode()

    @classmethod
    def of(cls, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
           reason: str, ts_ms: int | None) -> DeadLetter:
        value = value or b""
        kept = value[:DEADLETTER_RAW_BYTES]
        raw, raw_b64 = _text_or_base64(kept)
        key_text, key_b64 = (None, False) if key is None else _text_or_base64(key[:1024])
        ts = ts_ms / 1000.0 if ts_ms is not None and ts_ms >= 0 else math.nan
        if len(reason) > DEADLETTER_REASON_CHARS:
            reason = reason[:DEADLETTER_REASON_CHARS] + " …"
        return cls(topic=topic, partition=partition, offset=offset, key=key_text, reason=reason, raw=raw,
                   raw_base64=raw_b64, key_base64=key_b64, ts=ts, raw_size=len(value),
                   raw_sha256=hashlib.sha256(value).hexdigest(), truncated=len(kept) < len(value))


def _text_or_base64(data: bytes) -> tuple[str, bool]:
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), True


@dataclass(frozen=True)
class Record:
    """One decoded message with where it came from. ``msg`` is a :data:`schema.Message`, or a
    :class:`DeadLetter` for a consumer of ``fh.deadletter``."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    msg: Message | DeadLetter


# ---------------------------------------------------------------- DSN and backends
def parse_dsn(dsn: str) -> tuple[str, tuple[str, ...]]:
    """Split ``scheme://host:port[,host:port]`` into the scheme and the ``host:port`` list."""
    if not isinstance(dsn, str) or "://" not in dsn:
        raise ConfigError(f"bus DSN {dsn!r} is not of the form scheme://host:port (known: {known_schemes()})")
    scheme, rest = dsn.split("://", 1)
    hosts = tuple(h.strip() for h in rest.split("?", 1)[0].split("/", 1)[0].split(",") if h.strip())
    if not hosts:
        raise ConfigError(f"bus DSN {dsn!r} names no host:port")
    for host in hosts:
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"bus DSN {dsn!r}: {host!r} is not host:port")
    return scheme.lower(), hosts


_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_DSN_OPTIONS = ("security_protocol", "sasl_mechanism", "username", "password_file", "ssl_cafile", "ssl_certfile",
                "ssl_keyfile", "ssl_check_hostname")


def dsn_options(dsn: str) -> dict[str, Any]:
    """kafka-python security settings from a DSN's query string (empty for a plain ``kafka://`` DSN).

    ``kafka://host:9093?security_protocol=SASL_SSL&sasl_mechanism=SCRAM-SHA-512&username=node-n0001&
    password_file=/etc/fleethealth/kafka-password&ssl_cafile=/etc/fleethealth/ca.pem`` — one identity per
    node, the password read from a file (never written in the DSN), TLS verified against the CA. Mutual
    TLS takes ``ssl_certfile`` and ``ssl_keyfile`` instead of a password. Unknown options, a SASL
    mechanism without a username, or an unreadable password file are a :class:`ConfigError`.
    """
    import urllib.parse

    query = dsn.split("?", 1)[1] if "?" in dsn else ""
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=False)
    given: dict[str, str] = {}
    for name, value in pairs:
        if name not in _DSN_OPTIONS:
            raise ConfigError(f"bus DSN option {name!r} is unknown (known: {', '.join(_DSN_OPTIONS)})")
        given[name] = value
    if not given:
        return {}
    protocol = given.get("security_protocol", "SASL_SSL" if "username" in given else "SSL").upper()
    if protocol not in _SECURITY_PROTOCOLS:
        raise ConfigError(f"security_protocol {protocol!r} is not one of {', '.join(_SECURITY_PROTOCOLS)}")
    out: dict[str, Any] = {"security_protocol": protocol}
    if protocol.startswith("SASL"):
        mechanism = given.get("sasl_mechanism", "SCRAM-SHA-512").upper()
        if mechanism not in _SASL_MECHANISMS:
            raise ConfigError(f"sasl_mechanism {mechanism!r} is not one of {', '.join(_SASL_MECHANISMS)}")
        if not given.get("username") or not given.get("password_file"):
            raise ConfigError(f"security_protocol {protocol} needs username= and password_file= in the bus DSN")
        try:
            password = pathlib.Path(given["password_file"]).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the bus password_file {given['password_file']}: {exc}") from exc
        out.update(sasl_mechanism=mechanism, sasl_plain_username=given["username"], sasl_plain_password=password)
    for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        if name in given:
            out[name] = given[name]
    if "ssl_check_hostname" in given:
        out["ssl_check_hostname"] = given["ssl_check_hostname"].lower() not in {"0", "false", "no"}
    return out


class _KafkaBackend:
    """kafka-python clients for one bootstrap list; ``kafka`` is imported on first use.

    ``options`` are the security settings of :func:`dsn_options`, passed to every client."""

    def __init__(self, hosts: tuple[str, ...], options: Mapping[str, Any] | None = None) -> None:
        self.hosts = list(hosts)
        self.options = dict(options or {})

    @staticmethod
    def _kafka() -> Any:
        try:
            import kafka
        except ImportError as exc:
            raise ConfigError("the kafka:// bus needs kafka-python (pip install kafka-python)") from exc
        return kafka

    def producer(self, client_id: str, compression: str, connect_timeout_ms: int, **timeouts: int) -> Any:
        """``timeouts`` override ``max_block_ms``, ``request_timeout_ms``, ``delivery_timeout_ms`` and
        ``reconnect_backoff_max_ms`` (see :class:`Producer`)."""
        kafka = self._kafka()
        settings: dict[str, Any] = {"max_block_ms": 10_000, "request_timeout_ms": 10_000,
                                    "delivery_timeout_ms": 30_000, **timeouts}
        return kafka.KafkaProducer(
            bootstrap_servers=self.hosts, client_id=client_id, acks="all", enable_idempotence=True,
            compression_type=compression, linger_ms=5, batch_size=256 * 1024,
            bootstrap_timeout_ms=connect_timeout_ms, **settings, **self.options)

    def consumer(self, topics: Sequence[str], group: str | None, client_id: str, from_beginning: bool,
                 max_poll_interval_ms: int, session_timeout_ms: int, connect_timeout_ms: int) -> Any:
        """A group member subscribed to ``topics``; with ``group`` None, a reader assigned every
        partition of them (a table: no group, no commits)."""
        kafka = self._kafka()
        if group is None:
            kc = kafka.KafkaConsumer(
                bootstrap_servers=self.hosts, group_id=None, client_id=client_id, enable_auto_commit=False,
                auto_offset_reset="earliest" if from_beginning else "latest", bootstrap_timeout_ms=connect_timeout_ms,
                request_timeout_ms=30_000, fetch_max_wait_ms=100, **self.options)
            kc.topics()  # metadata for every topic, so each one's partitions are known
            parts = []
            for topic in topics:
                known = kc.partitions_for_topic(topic)
                if not known:
                    kc.close()
                    raise ConfigError(f"topic {topic!r} does not exist on the broker (create the fh.* topics first: "
                                      "deploy/kafka/, or ensure_topics)")
                parts += [kafka.TopicPartition(topic, p) for p in sorted(known)]
            kc.assign(parts)
            return kc
        kc = kafka.KafkaConsumer(
            *topics, bootstrap_servers=self.hosts, group_id=group, client_id=client_id,
            enable_auto_commit=False, auto_offset_reset="earliest" if from_beginning else "latest",
            max_poll_interval_ms=max_poll_interval_ms, session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=max(100, session_timeout_ms // 3), request_timeout_ms=max(
                30_000, session_timeout_ms + 5_000), bootstrap_timeout_ms=connect_timeout_ms, fetch_max_wait_ms=100,
            **self.options)
        _never_leave(kc)
        return kc

    def admin(self, client_id: str, connect_timeout_ms: int) -> Any:
        kafka = self._kafka()
        return kafka.KafkaAdminClient(bootstrap_servers=self.hosts, client_id=client_id,
                                      request_timeout_ms=10_000, bootstrap_timeout_ms=connect_timeout_ms,
                                      **self.options)


def _never_leave(kc: Any) -> None:
    """Make a group member leave only by its session expiring, never by a LeaveGroup request (as a Kafka
    static member does): on close, and when ``max_poll_interval_ms`` passed without a poll, it forgets its
    membership here and the group drops it ``session_timeout_ms`` later. Tansu 0.6 loses the group's
    leader when the leader sends LeaveGroup while another member is joining: every later JoinGroup
    succeeds, no member is told to assign, every SyncGroup fails, and the partitions stay unowned for good."""
    coordinator = getattr(kc, "_coordinator", None)
    if coordinator is None or not hasattr(coordinator, "maybe_leave_group"):
        raise BusError("this kafka-python's consumer has no group coordinator where fleethealth expects one")

    def forget(*_: object, **__: object) -> None:
        coordinator.reset_generation()

    async def forget_async(*_: object, **__: object) -> None:
        coordinator.reset_generation()

    coordinator.maybe_leave_group = forget  # close() (2.x and 3.x)
    if hasattr(coordinator, "maybe_leave_group_async"):
        coordinator.maybe_leave_group_async = forget_async  # the heartbeat thread's poll timeout (3.x)


_BACKENDS: dict[str, Callable[..., _KafkaBackend]] = {"kafka": _KafkaBackend}


def register_backend(scheme: str, factory: Callable[..., Any]) -> None:
    """Map a DSN scheme to a factory taking the ``host:port`` list and the :func:`dsn_options`."""
    _BACKENDS[scheme.lower()] = factory


def known_schemes() -> str:
    return ", ".join(f"{s}://" for s in sorted(_BACKENDS))


def _backend(dsn: str) -> _KafkaBackend:
    scheme, hosts = parse_dsn(dsn)
    factory = _BACKENDS.get(scheme)
    if factory is None:
        raise ConfigError(f"unknown bus scheme {scheme + '://'!r} in {dsn!r} (known: {known_schemes()})")
    options = dsn_options(dsn)
    return factory(hosts, options) if options else factory(hosts)


def _compression() -> str:
    """zstd, else lz4, else gzip: the first codec whose Python library is importable."""
    for codec, module in _COMPRESSION_PREFERENCE:
        try:
            __import__(module)
        except ImportError:
            continue
        return codec
    return "gzip"


def _translate(exc: Exception, doing: str, where: str) -> BusError:
    """Map a kafka-python exception to BusUnavailable (cannot reach) or BusError (anything else)."""
    import kafka.errors as ke

    names = ("NoBrokersAvailable", "KafkaConnectionError", "KafkaTimeoutError", "RequestTimedOutError",
             "NodeNotReadyError", "BrokerNotAvailableError", "CoordinatorNotAvailableError")
    unreachable = tuple(getattr(ke, n) for n in names if hasattr(ke, n))  # names differ across versions
    text = f"{doing} on {where}: {type(exc).__name__}: {exc}"
    return BusUnavailable(text) if isinstance(exc, unreachable) else BusError(text)


def _is_kafka_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("kafka")


# ---------------------------------------------------------------- producer
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
        try:
            self._kp = backend.producer(client_id, self.compression, int(connect_timeout_s * 1000), **timeouts)
        except Exception as exc:
            if _is_kafka_error(exc):
                raise _translate(exc, "connecting a producer", dsn) from exc
            raise
        self._lock = threading.Lock()
        self._failures: list[str] = []
        self.published_total = 0
        self.failed_total = 0

    def publish(self, msg: Message) -> None:
        """Queue one schema message for delivery."""
        stamp = _timestamp_ms(msg.ts) if self.event_time_stamps else None
        self.publish_raw(msg.TOPIC.value, schema.encode(msg), msg.key.encode(), timestamp_ms=stamp)

    def publish_raw(self, topic: str, value: bytes, key: bytes | None = None, *,
                    timestamp_ms: int | None = None, headers: Sequence[tuple[str, bytes]] | None = None) -> None:
        """Queue raw bytes for delivery (tests and the dead-letter path use it); ``timestamp_ms`` is
        the record timestamp (default: now, by the sender's clock); ``headers`` are given as they are,
        else the producer's ``signer`` (if any) signs the record."""
        if headers is None and self.signer is not None:
            headers = self.signer.headers(str(topic), key, value)
        try:
            future = self._kp.send(str(topic), value=value, key=key, timestamp_ms=timestamp_ms,
                                   **({"headers": list(headers)} if headers else {}))
        except Exception as exc:
            if _is_kafka_error(exc):
                raise _translate(exc, f"publishing to {topic}", self.dsn) from exc
            raise
        future.add_errback(self._failed, str(topic))
        self.published_total += 1

    def _failed(self, topic: str, exc: Exception) -> None:
        with self._lock:
            self.failed_total += 1
            if len(self._failures) < 10:
                self._failures.append(f"{topic}: {type(exc).__name__}: {exc}")

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued message is delivered; raise if any delivery failed."""
        try:
            self._kp.flush(timeout=timeout_s)
        except Exception as exc:
            if _is_kafka_error(exc):
                raise _translate(exc, f"flushing within {timeout_s} s", self.dsn) from exc
            raise
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            raise BusError(f"{len(failures)} message(s) not delivered to {self.dsn}: {failures[0]}")

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


# ---------------------------------------------------------------- consumer
class Consumer:
    """Consumes schema messages from ``topics`` as member of consumer group ``group``.

    Offsets are committed only by :meth:`commit`. A value that fails to decode or validate is
    published to ``fh.deadletter`` (through ``producer`` if given, else one the consumer opens
    and closes itself) and skipped. ``from_beginning`` starts a group without committed offsets
    at the earliest record, else at the latest. ``max_ahead_s`` / ``max_behind_s`` bound a
    message's event time against its record timestamp (None: no bound; see the module docstring).
    ``verifier`` (a :class:`fleethealth.signing.Verifier`) checks each decoded record's signature
    headers; the reason it gives dead-letters the record.
    """

    def __init__(self, dsn: str, topics: Sequence[str], group: str | None, *, producer: Producer | None = None,
                 from_beginning: bool = True, client_id: str = "fleethealth",
                 max_poll_interval_s: float = 3.0, session_timeout_s: float = 6.0,
                 connect_timeout_s: float = 10.0, max_ahead_s: float | None = None,
                 max_behind_s: float | None = None, verifier: Any = None) -> None:
        self.verifier = verifier  # a fleethealth.signing.Verifier: its reason dead-letters a record
        if isinstance(topics, str):
            topics = [topics]
        if not topics:
            raise ConfigError("a consumer needs at least one topic")
        known = {t.value for t in schema.TOPIC_TYPES} | {Topic.DEADLETTER.value}
        unknown = [str(t) for t in topics if str(t) not in known]
        if unknown:
            raise ConfigError(f"topic {unknown[0]!r} carries no known message type (known: {sorted(known)})")
        for name, bound in (("max_ahead_s", max_ahead_s), ("max_behind_s", max_behind_s)):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int | float)
                                      or not bound >= 0):
                raise ConfigError(f"{name} must be a non-negative number of seconds or None, got {bound!r}")
        self.max_ahead_s = None if max_ahead_s is None else float(max_ahead_s)
        self.max_behind_s = None if max_behind_s is None else float(max_behind_s)
        self.dsn = dsn
        self.topics = tuple(str(t) for t in topics)
        self.group = group
        self._types: dict[str, Any] = {t.value: cls for t, cls in schema.TOPIC_TYPES.items()}
        self._types[Topic.DEADLETTER.value] = DeadLetter
        self._client_id = client_id
        backend = _backend(dsn)
        try:
            self._kc = backend.consumer(self.topics, group, client_id, from_beginning,
                                        int(max_poll_interval_s * 1000), int(session_timeout_s * 1000),
                                        int(connect_timeout_s * 1000))
        except Exception as exc:
            if _is_kafka_error(exc):
                raise _translate(exc, f"joining group {group!r}", dsn) from exc
            raise
        self._producer = producer
        self._own_producer = producer is None
        self._pending: dict[Any, int] = {}
        self._buffer: list[tuple[Record | None, Any, int]] = []
        self._committed: dict[Any, int] = {}
        self._dead_unflushed = False
        self.consumed_total = 0
        self.dead_lettered_total = 0
        self.commit_failed_total = 0

    split_blocks: bool = True
    """Whether a :class:`~fleethealth.schema.StepBlock` comes out as one record per step (a
    :class:`~fleethealth.schema.StepBatch` each); a reader that takes blocks whole (the runner)
    sets it False and gets one record per block."""

    admit: Callable[[str, int, int, bytes | None, bytes | None, int], bool] | None = None
    """A reader's filter before decoding: ``admit(topic, partition, offset, key, value, timestamp_ms)``;
    a record it refuses is passed over undecoded (its offset counts as read) and counted in
    ``passed_over_total``. The job stage reads only the node states it needs this way."""
    passed_over_total: int = 0

    def wait_assigned(self, timeout_s: float = 30.0) -> None:
        """Block until the group has assigned partitions and their start offsets are known.

        Records that arrive meanwhile are kept for the next :meth:`poll`. Useful with
        ``from_beginning=False``: what is published after this returns will be seen.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._buffer += self._fetch(0.1, 5000)
            try:
                assigned = self._kc.assignment()
                if assigned:
                    for tp in assigned:
                        self._kc.position(tp, timeout_ms=max(1, int((deadline - time.monotonic()) * 1000)))
                    return
            except Exception as exc:
                if _is_kafka_error(exc):
                    raise _translate(exc, f"joining group {self.group!r}", self.dsn) from exc
                raise
        raise BusUnavailable(f"group {self.group!r} got no partitions of {', '.join(self.topics)} on "
                             f"{self.dsn} within {timeout_s} s")

    def poll(self, timeout_s: float = 1.0, max_records: int = 5000) -> list[Record]:
        """Return up to ``max_records`` decoded records, waiting at most ``timeout_s`` for the first."""
        entries = self._buffer if self._buffer else self._fetch(timeout_s, max_records)
        out: list[Record] = []
        taken = 0
        for record, tp, next_offset in entries:
            if record is not None:
                if len(out) == max_records:
                    break
                out.append(record)
            self._pending[tp] = next_offset  # commit() covers what was returned or dead-lettered
            taken += 1
        self._buffer = entries[taken:]
        self.consumed_total += len(out)
        return out

    def _fetch(self, timeout_s: float, max_records: int) -> list[tuple[Record | None, Any, int]]:
        """Poll Kafka once: ``(record, partition, next offset)`` per value, ``None`` for a dead letter."""
        try:
            batches = self._kc.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except Exception as exc:
            if _is_kafka_error(exc):
                raise _translate(exc, f"polling {', '.join(self.topics)}", self.dsn) from exc
            raise
        out: list[tuple[Record | None, Any, int]] = []
        for tp, records in batches.items():
            cls = self._types.get(tp.topic)
            admit = self.admit
            skip = set() if admit is None else {
                i for i, r in enumerate(records)
                if not admit(r.topic, r.partition, r.offset, r.key, r.value, getattr(r, "timestamp", -1))}
            self.passed_over_total += len(skip)
            # one bulk decode per partition's records (columnar for step batches); each value still
            # gets its own result, so a bad one is dead-lettered with its own reason
            bulk = iter(schema.decode_many(cls, [r.value for i, r in enumerate(records)
                                                 if r.value is not None and i not in skip])
                        if cls is not DeadLetter else ())
            for i, rec in enumerate(records):
                if i in skip:
                    out.append((None, tp, rec.offset + 1))
                    continue
                try:
                    if cls is DeadLetter or rec.value is None:
                        msg = self._decode(cls, rec.value)
                    else:
                        msg = next(bulk)
                        if isinstance(msg, Exception):
                            raise msg
                except SchemaError as exc:
                    self._dead_letter(rec, f"{exc.field}: {exc.problem}")
                    out.append((None, tp, rec.offset + 1))
                except Exception as exc:  # a poison value must never stop the stream
                    self._dead_letter(rec, f"<message>: {type(exc).__name__}: {exc}")
                    out.append((None, tp, rec.offset + 1))
                else:
                    skew = None if self.verifier is None else self.verifier.check(
                        rec.topic, rec.key, rec.value, getattr(rec, "headers", None), msg)
                    skew = skew or self._skew(msg, rec)
                    if skew is None and isinstance(msg, schema.StepBlock) and self.max_behind_s is not None:
                        skew = self._skew(msg, rec, float(msg.step_ts.min()))  # its earliest step, too
                    if skew is not None:
                        self._dead_letter(rec, skew)
                        out.append((None, tp, rec.offset + 1))
                        continue
                    if isinstance(msg, schema.StepBlock) and self.split_blocks:
                        # one record per step, all at the block's offset; only the last one moves
                        # the position past it, so a poll that stops inside a block commits none of it
                        parts = msg.split()
                        out.extend((Record(rec.topic, rec.partition, rec.offset, rec.key, part), tp,
                                    rec.offset + 1 if k == len(parts) - 1 else rec.offset)
                                   for k, part in enumerate(parts))
                        continue
                    out.append((Record(rec.topic, rec.partition, rec.offset, rec.key, msg), tp, rec.offset + 1))
        return out

    def _skew(self, msg: Message | DeadLetter, rec: Any, ts: float | None = None) -> str | None:
        """Why ``msg``'s event time (or ``ts``) is out of bounds against the record timestamp, or None."""
        if (self.max_ahead_s is None and self.max_behind_s is None) or isinstance(msg, DeadLetter):
            return None
        stamp = getattr(rec, "timestamp", None)
        if not isinstance(stamp, int) or stamp < 0:
            return None  # no record timestamp to bound against
        broker = stamp / 1000.0
        event = msg.ts if ts is None else ts
        ahead = event - broker
        if self.max_ahead_s is not None and ahead > self.max_ahead_s:
            return (f"ts: event time {event:.3f} is {ahead:.0f} s ahead of the record timestamp {broker:.3f} "
                    f"(max_ahead_s={self.max_ahead_s:g})")
        if self.max_behind_s is not None and -ahead > self.max_behind_s:
            return (f"ts: event time {event:.3f} is {-ahead:.0f} s behind the record timestamp {broker:.3f} "
                    f"(max_behind_s={self.max_behind_s:g})")
        return None

    @staticmethod
    def _decode(cls: Any, value: bytes | None) -> Message | DeadLetter:
        if value is None:
            raise SchemaError("<message>", "empty value (tombstone)")
        if cls is DeadLetter:
            return DeadLetter.from_obj(schema.load_object(value))
        return schema.decode(cls, value)

    def _dead_letter(self, rec: Any, reason: str) -> None:
        if rec.topic == Topic.DEADLETTER.value:
            self.dead_lettered_total += 1  # never loop a dead letter back into its own topic
            return
        if self._producer is None:
            self._producer = Producer(self.dsn, client_id=f"{self._client_id}-deadletter")
        letter = DeadLetter.of(rec.topic, rec.partition, rec.offset, rec.key, rec.value, reason,
                               getattr(rec, "timestamp", None))
        self._producer.publish_raw(Topic.DEADLETTER.value, orjson.dumps(letter.to_obj()), rec.key)
        self._dead_unflushed = True
        self.dead_lettered_total += 1

    def commit(self, hold: Mapping[tuple[str, int], int] | None = None) -> None:
        """Commit every record returned (or dead-lettered) by :meth:`poll` so far.

        ``hold`` maps ``(topic, partition)`` to the first offset the caller has not finished
        with (records it still buffers); nothing from there on is committed for that partition,
        and the rest is committed by a later call.
        """
        if self._dead_unflushed and self._producer is not None:
            self._producer.flush()
            self._dead_unflushed = False
        if self.group is None:  # a table reader: it re-reads from its start, nothing to commit
            self._pending.clear()
            return
        hold = hold or {}
        # never for a partition the group has moved to another member: its records read here were not
        # all processed, and a coordinator takes a commit for any partition from a current member
        owned = set(self._kc.assignment())
        self._pending = {tp: off for tp, off in self._pending.items() if tp in owned}
        targets = {tp: min(off, hold.get((tp.topic, tp.partition), off)) for tp, off in self._pending.items()}
        targets = {tp: off for tp, off in targets.items() if off > self._committed.get(tp, -1)}
        if not targets:
            return
        from kafka.structs import OffsetAndMetadata

        offsets = {tp: OffsetAndMetadata(off, "", -1) for tp, off in targets.items()}
        try:
            self._kc.commit(offsets=offsets)
        except Exception as exc:
            if type(exc).__name__ in ("CommitFailedError", "RebalanceInProgressError"):
                # the group rebalanced under us (a slow poll on a loaded machine, a new member): nothing is
                # committed now. A partition that moved is dropped from what is pending at the next commit
                # (its records are redelivered to its owner, whose idempotent writes absorb them); one that
                # stayed keeps its pending offset — the group may keep its read position, and then nothing
                # would be returned again to commit past records this consumer has already finished
                self.commit_failed_total += 1
                _log.warning("commit for group %r refused after a rebalance; %d partition(s) will be re-read "
                             "from their last commit", self.group, len(offsets))
                return
            if _is_kafka_error(exc):
                raise _translate(exc, f"committing offsets of group {self.group!r}", self.dsn) from exc
            raise
        self._committed.update(targets)
        for tp, off in targets.items():
            if self._pending.get(tp) == off:
                del self._pending[tp]

    def seek(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Read the given ``(topic, partition)`` pairs from these offsets next (a restored snapshot's):
        what was fetched of them and not yet returned is dropped, and nothing is committed for them
        until records from there on are returned."""
        from kafka.structs import TopicPartition

        moved = {TopicPartition(t, p) for t, p in offsets}
        self._buffer = [entry for entry in self._buffer if entry[1] not in moved]
        try:
            for (topic, partition), offset in offsets.items():
                tp = TopicPartition(topic, partition)
                self._pending.pop(tp, None)
                self._kc.seek(tp, offset)
        except Exception as exc:
            if _is_kafka_error(exc):
                raise _translate(exc, "seeking", self.dsn) from exc
            raise

    def offset_range(self, pairs: Collection[tuple[str, int]]) -> dict[tuple[str, int], tuple[int, int]]:
        """The broker's ``(beginning, end)`` offsets of each ``(topic, partition)`` of ``pairs`` that exists
        (what a restored snapshot's offsets are checked against before a seek)."""
        from kafka.structs import TopicPartition

        try:
            known = {(t, p) for t in {t for t, _ in pairs} for p in (self._kc.partitions_for_topic(t) or ())}
            tps = [TopicPartition(t, p) for t, p in pairs if (t, p) in known]
            if not tps:
                return {}
            first, last = self._kc.beginning_offsets(tps), self._kc.end_offsets(tps)
            # Tansu 0.6 answers ListOffsets 'latest' with the last record batch's base offset + 1, short
            # of the log's end; the group's own commit, and a fetch's high watermark, are never past it
            mine = set(self._kc.assignment()) if self.group is not None else set()
            for tp in tps:
                if tp in mine:
                    seen = (self._kc.highwater(tp), self._kc.committed(tp))
                    last[tp] = max([int(last[tp]), *(int(v) for v in seen if v is not None)])
        except Exception as exc:
            if _is_kafka_error(exc):
                raise _translate(exc, "reading partition ranges", self.dsn) from exc
            raise
        return {(tp.topic, tp.partition): (int(first[tp]), int(last[tp])) for tp in tps}

    def committed(self) -> dict[tuple[str, int], int]:
        """The offsets this consumer has committed, per ``(topic, partition)`` (since it started)."""
        return {(tp.topic, tp.partition): off for tp, off in self._committed.items()}

    def assignment(self) -> set[tuple[str, int]]:
        """The ``(topic, partition)`` pairs this consumer reads now (empty between group generations)."""
        try:
            return {(tp.topic, tp.partition) for tp in self._kc.assignment()}
        except Exception as exc:
            if _is_kafka_error(exc):
                raise _translate(exc, "reading the assignment", self.dsn) from exc
            raise

    def positions(self) -> dict[tuple[str, int], int]:
        """The next offset to read per assigned ``(topic, partition)`` (after a join: where reading
        starts, the group's committed offset or the reset position)."""
        out: dict[tuple[str, int], int] = {}
        try:
            for tp in self._kc.assignment():
                out[(tp.topic, tp.partition)] = self._kc.position(tp, timeout_ms=5000)
        except Exception as exc:
            if _is_kafka_error(exc):
                raise _translate(exc, "reading consumer positions", self.dsn) from exc
            raise
        return out

    def lag(self) -> dict[tuple[str, int], int | None]:
        """Records not yet returned by :meth:`poll`, per assigned ``(topic, partition)``.

        0 means the partition is read to its end as far as the last fetch knows; None means its
        end is not known yet (no fetch has answered for it).
        """
        out: dict[tuple[str, int], int | None] = {}
        held = Counter(tp for _, tp, _ in self._buffer)  # fetched, not yet returned: still unread
        try:
            for tp in self._kc.assignment():
                end = self._kc.highwater(tp)
                position = None if end is None else self._kc.position(tp, timeout_ms=1000)
                out[(tp.topic, tp.partition)] = None if position is None else max(0, end - position) + held[tp]
        except Exception as exc:
            if _is_kafka_error(exc):
                raise _translate(exc, "reading consumer positions", self.dsn) from exc
            raise
        return out

    def close(self) -> None:
        try:
            self._kc.close(autocommit=False)
        except Exception as exc:
            if _is_kafka_error(exc):
                raise _translate(exc, "closing a consumer", self.dsn) from exc
            raise
        finally:
            if self._own_producer and self._producer is not None:
                self._producer.close()
                self._producer = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- topics
SNAPSHOT_MAX_BYTES = 64 * 1024 * 1024
"""Largest snapshot record on ``fh.snapshots`` (a 16,384-rank job's pipeline is about 3 MB)."""
TOPIC_CONFIGS: dict[str, dict[str, str]] = {
    Topic.NODESTATE.value: {"cleanup.policy": "compact"},
    Topic.SNAPSHOTS.value: {"cleanup.policy": "compact", "max.message.bytes": str(SNAPSHOT_MAX_BYTES)},
}
"""Topic settings beyond the broker's defaults: ``fh.nodestate`` is a table (each node's newest state),
``fh.snapshots`` too (each partition's newest snapshot), with records up to :data:`SNAPSHOT_MAX_BYTES`."""


class SnapshotTopic:
    """Detector snapshots on the compacted topic ``fh.snapshots``, key ``GROUP/PARTITION``, the ``seq``
    in a record header: the same two calls as the store's ``save_snapshot`` / ``load_snapshot``, for
    replicas that do not share a store (each with an embedded one) or to keep snapshots beside the
    offsets they name. :meth:`load` reads the topic to its end and takes the greatest ``seq`` of the
    key among what compaction left (compaction keeps the last written, which a replica that lost the
    partition may have written late: an older snapshot, still consistent with its own offsets)."""

    def __init__(self, dsn: str, *, client_id: str = "fleethealth-snapshots") -> None:
        self.dsn = dsn
        self._client_id = client_id
        self._producer: Any = None

    def save_snapshot(self, group: str, partition: int, seq: int, ts: float,
                      offsets: Mapping[tuple[str, int], int], blob: bytes) -> None:
        if len(blob) > SNAPSHOT_MAX_BYTES:
            raise BusError(f"a snapshot of {len(blob)} bytes is larger than fh.snapshots takes ({SNAPSHOT_MAX_BYTES})")
        try:
            if self._producer is None:
                self._producer = _backend(self.dsn).producer(self._client_id, None, 10_000,  # type: ignore[arg-type]
                                                             max_request_size=SNAPSHOT_MAX_BYTES + 65_536)
            self._producer.send(Topic.SNAPSHOTS.value, key=f"{group}/{partition}".encode(), value=bytes(blob),
                                headers=[("seq", str(int(seq)).encode())]).get(timeout=30)
        except Exception as exc:
            if _is_kafka_error(exc):
                raise _translate(exc, "publishing a snapshot", self.dsn) from exc
            raise

    def load_snapshot(self, group: str, partition: int) -> tuple[int, dict[tuple[str, int], int], bytes] | None:
        key = f"{group}/{partition}".encode()
        kafka = _KafkaBackend._kafka()
        best: tuple[int, bytes] | None = None
        backend = _backend(self.dsn)
        try:
            kc = kafka.KafkaConsumer(bootstrap_servers=backend.hosts, group_id=None, client_id=self._client_id,
                                     enable_auto_commit=False, auto_offset_reset="earliest",
                                     max_partition_fetch_bytes=SNAPSHOT_MAX_BYTES + 65_536,
                                     fetch_max_bytes=SNAPSHOT_MAX_BYTES + 65_536, **backend.options)
            try:
                parts = [kafka.TopicPartition(Topic.SNAPSHOTS.value, p)
                         for p in sorted(kc.partitions_for_topic(Topic.SNAPSHOTS.value) or ())]
                kc.assign(parts)
                ends = kc.end_offsets(parts)
                deadline = time.monotonic() + 30.0
                while any(kc.position(tp) < end for tp, end in ends.items()) and time.monotonic() < deadline:
                    for records in kc.poll(timeout_ms=500).values():
                        for rec in records:
                            if rec.key != key or rec.value is None:
                                continue
                            seq = int(dict(rec.headers or ()).get("seq", b"0") or 0)
                            if best is None or seq >= best[0]:
                                best = (seq, rec.value)
            finally:
                kc.close(autocommit=False)
        except Exception as exc:
            if _is_kafka_error(exc):
                raise _translate(exc, "reading fh.snapshots", self.dsn) from exc
            raise
        return None if best is None else (best[0], {}, best[1])

    def close(self) -> None:
        if self._producer is not None:
            self._producer.close(timeout=5)
            self._producer = None


def ensure_topics(dsn: str, partitions: int = 4, *, replication: int = 1,
                  topics: Sequence[str] | None = None, connect_timeout_s: float = 10.0) -> None:
    """Create every :class:`schema.Topic` (or ``topics``); topics that exist are left as they are."""
    if partitions < 1 or replication < 1:
        raise ConfigError(f"partitions and replication must be >= 1, got {partitions}, {replication}")
    backend = _backend(dsn)
    import kafka.errors as ke
    from kafka.admin import NewTopic

    try:
        admin = backend.admin("fleethealth-admin", int(connect_timeout_s * 1000))
    except Exception as exc:
        if _is_kafka_error(exc):
            raise _translate(exc, "connecting the admin client", dsn) from exc
        raise
    try:
        for topic in topics or [t.value for t in Topic]:
            try:
                configs = TOPIC_CONFIGS.get(str(topic), {})
                admin.create_topics([NewTopic(str(topic), partitions, replication, topic_configs=configs)])
            except ke.TopicAlreadyExistsError:
                continue
            except Exception as exc:
                if _is_kafka_error(exc):
                    raise _translate(exc, f"creating topic {topic}", dsn) from exc
                raise
    finally:
        admin.close()
