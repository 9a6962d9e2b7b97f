"""The message bus: a producer and a consumer over Kafka, chosen from a DSN.

::

    Producer(dsn)          publish(msg) / publish_raw(topic, value) / flush() / close()
    Consumer(dsn, topics)  poll() -> list[Record] / commit() / close()
    ensure_topics(dsn)     create every schema.Topic, tolerant of topics that exist

A registry maps a DSN scheme to a backend factory (``kafka://host:port[,host:port]`` today); the
factory imports its client library lazily, and an unknown scheme raises :class:`ConfigError`
listing the known ones. kafka-python exceptions are translated in one place (``kafka_client.translated``)::

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

Where each part lives::

    dsn.py           parse_dsn, dsn_options, the scheme registry (register_backend, known_schemes)
    kafka_client.py  the kafka-python clients, and translated(): the one translation of its exceptions
    producer.py      Producer
    consumer.py      Consumer
    records.py       Record, and the pure steps a consumer takes: decode, event-time bound, block split
    deadletter.py    DeadLetter and its size limits
    topics.py        ensure_topics, TOPIC_CONFIGS (the admin side)
    snapshots.py     SnapshotTopic, detector snapshots on fh.snapshots
"""

# the names outside __all__ (``X as X``) are module constants importers read, kept where they were
from fleethealth.bus.consumer import Consumer
from fleethealth.bus.deadletter import DEADLETTER_RAW_BYTES as DEADLETTER_RAW_BYTES
from fleethealth.bus.deadletter import DEADLETTER_REASON_CHARS as DEADLETTER_REASON_CHARS
from fleethealth.bus.deadletter import DEADLETTER_VERSION, DeadLetter
from fleethealth.bus.dsn import dsn_options, known_schemes, parse_dsn, register_backend
from fleethealth.bus.producer import Producer
from fleethealth.bus.records import Record
from fleethealth.bus.snapshots import SNAPSHOT_MAX_BYTES as SNAPSHOT_MAX_BYTES
from fleethealth.bus.snapshots import SnapshotTopic
from fleethealth.bus.topics import TOPIC_CONFIGS as TOPIC_CONFIGS
from fleethealth.bus.topics import ensure_topics

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
