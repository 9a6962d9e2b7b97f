"""The kafka-python boundary: the clients for one bootstrap list, and its exceptions translated::

    kafka.errors.KafkaConnectionError, KafkaTimeoutError,
    RequestTimedOutError, NodeNotReadyError, ...        -> BusUnavailable
    any other kafka.errors.KafkaError                   -> BusError

``kafka`` is imported on first use, so ``import fleethealth.bus`` works without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from fleethealth.errors import BusError, BusUnavailable, ConfigError


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
                 max_poll_interval_ms: int, session_timeout_ms: int, connect_timeout_ms: int,
                 on_revoked: Callable[[tuple[str, set[Any], int | None]], object] | None = None) -> Any:
        """A group member subscribed to ``topics``; with ``group`` None, a reader assigned every
        partition of them (a table: no group, no commits). ``on_revoked`` gets ``("revoked", set,
        generation)`` for each set of partitions the group revokes from the member, ``("lost", set,
        generation)`` for each it loses with its membership and ``("assigned", set, generation)`` for each
        it assigns, in order (:func:`_revocations`); the client calls it inside a poll, on its own network
        thread, so it should only record them."""
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
            bootstrap_servers=self.hosts, group_id=group, client_id=client_id,
            enable_auto_commit=False, auto_offset_reset="earliest" if from_beginning else "latest",
            max_poll_interval_ms=max_poll_interval_ms, session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=max(100, session_timeout_ms // 3), request_timeout_ms=max(
                30_000, session_timeout_ms + 5_000), bootstrap_timeout_ms=connect_timeout_ms, fetch_max_wait_ms=100,
            **self.options)
        listener = None if on_revoked is None else _revocations(kafka, on_revoked)
        kc.subscribe(list(topics), listener=listener)
        if listener is not None:
            listener.kc = kc  # whose generation each call names
        _never_leave(kc)
        return kc

    def reader(self, client_id: str, connect_timeout_ms: int) -> Any:
        """A consumer in no group, assigned nothing yet (the caller assigns and seeks)."""
        kafka = self._kafka()
        return kafka.KafkaConsumer(bootstrap_servers=self.hosts, group_id=None, client_id=client_id,
                                   enable_auto_commit=False, bootstrap_timeout_ms=connect_timeout_ms,
                                   fetch_max_wait_ms=100, **self.options)

    def admin(self, client_id: str, connect_timeout_ms: int) -> Any:
        kafka = self._kafka()
        return kafka.KafkaAdminClient(bootstrap_servers=self.hosts, client_id=client_id,
                                      request_timeout_ms=10_000, bootstrap_timeout_ms=connect_timeout_ms,
                                      **self.options)


def reaches_a_broker(kc: Any) -> bool | None:
    """Whether a kafka-python client holds a connection to any broker it knows (its metadata's brokers
    and its group coordinator); None where this kafka-python does not say."""
    client = getattr(kc, "_client", None)
    cluster = getattr(client, "cluster", None)
    if client is None or cluster is None or not hasattr(client, "connected"):
        return None
    try:
        nodes = [b.node_id if hasattr(b, "node_id") else b.nodeId for b in cluster.brokers()]  # 3.x, 2.x
        coordinator = getattr(getattr(kc, "_coordinator", None), "coordinator_id", None)
        if coordinator is not None:
            nodes.append(coordinator)
        return any(client.connected(node) for node in nodes)
    except Exception:  # noqa: BLE001 — introspection of a client's internals: unknown, never an error
        return None


def _revocations(kafka: Any, call: Callable[[tuple[str, set[Any], int | None]], object]) -> Any:
    """A kafka-python rebalance listener passing ``("revoked", partitions, generation)`` for each set revoked,
    ``("lost", partitions, generation)`` for each set lost with the membership (the member was dropped
    from the group, which went on without it) and ``("assigned", partitions, generation)`` for each set
    assigned to ``call``, in order; ``generation`` is the group generation the member is in at the call
    (the one it held the partitions in, for a revocation; None where this kafka-python does not say)."""
    class _Revoked(kafka.ConsumerRebalanceListener):  # type: ignore[misc, name-defined]
        kc: Any = None

        def on_partitions_revoked(self, revoked: Any) -> None:
            call(("revoked", set(revoked), generation(self.kc)))

        def on_partitions_assigned(self, assigned: Any) -> None:
            call(("assigned", set(assigned), generation(self.kc)))

        def on_partitions_lost(self, lost: Any) -> None:
            call(("lost", set(lost), generation(self.kc)))

    return _Revoked()


def generation(kc: Any) -> int | None:
    """The group generation a kafka-python group member is in (-1 when it has none), or None where this
    kafka-python does not say."""
    try:
        value = kc._coordinator._generation.generation_id
    except AttributeError:
        return None
    return value if isinstance(value, int) else None


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


@contextlib.contextmanager
def translated(doing: str, where: str) -> Iterator[None]:
    """Run a block of kafka-python calls: a kafka-python exception leaves it as :class:`BusUnavailable`
    or :class:`BusError` (``raise … from`` the original) saying what was being done on which DSN;
    any other exception passes through as it is."""
    try:
        yield
    except Exception as exc:
        if _is_kafka_error(exc):
            raise _translate(exc, doing, where) from exc
        raise
