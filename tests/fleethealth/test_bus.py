"""The bus against a real Tansu broker over TCP (the session ``broker`` fixture): publish, poll,
commit, dead-lettering, compression, topic creation and the errors callers see.

Topics are shared by every test of the session, so each test marks its messages with a unique
job or node name and only looks at those.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import numpy as np
import orjson
import pytest

from fleethealth import bus, schema
from fleethealth.broker import EmbeddedBroker, free_port
from fleethealth.bus import Consumer, DeadLetter, Producer, Record, ensure_topics
from fleethealth.errors import BusError, BusUnavailable, ConfigError
from fleethealth.schema import (
    Action,
    Diagnosis,
    Event,
    EventKind,
    Finding,
    FindingKind,
    Recommendation,
    StepBatch,
    Telemetry,
    Topic,
)

FAST = {"session_timeout_s": 2.0, "max_poll_interval_s": 2.0}
"""Short group timeouts: on Tansu a group join waits about half the session timeout."""


def _uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _steps(job: str, step: int, compute: list[float] | None = None, node: str = "n0000") -> StepBatch:
    compute = compute if compute is not None else [1.0 + 0.01 * i for i in range(8)]
    n = len(compute)
    return StepBatch(job=job, step=step, node=node, ts=100.0 + step, ranks=np.arange(n, dtype=np.int32),
                     gpus=np.arange(n, dtype=np.int16), compute_s=np.asarray(compute, dtype=np.float64))


def _drain(consumer: Consumer, done: Callable[[list[Record]], bool], keep: Callable[[Record], bool],
           timeout_s: float = 20.0) -> list[Record]:
    """Poll until ``done(kept records)`` or the timeout; keep only this test's records."""
    kept: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        kept += [r for r in consumer.poll(timeout_s=0.2) if keep(r)]
        if done(kept):
            return kept
    raise AssertionError(f"timed out with {len(kept)} records: {kept[:3]}")


# ---------------------------------------------------------------- DSN and configuration errors
@pytest.mark.parametrize("make", [
    lambda: Producer("nats://127.0.0.1:4222"),
    lambda: Consumer("nats://127.0.0.1:4222", [Topic.STEPS], "g"),
    lambda: ensure_topics("nats://127.0.0.1:4222"),
])
def test_unknown_scheme_lists_the_known_ones(make: Callable[[], object]) -> None:
    with pytest.raises(ConfigError, match=r"unknown bus scheme 'nats://'.*known: kafka://"):
        make()


@pytest.mark.parametrize("dsn", ["127.0.0.1:9092", "kafka://", "kafka://localhost", "kafka://host:notaport",
                                 "kafka://host:0", "kafka://a:1,b"])
def test_malformed_dsn_is_a_config_error(dsn: str) -> None:
    with pytest.raises(ConfigError):
        bus.parse_dsn(dsn)


def test_dsn_with_several_brokers() -> None:
    assert bus.parse_dsn("KAFKA://k1:9092,k2:9093") == ("kafka", ("k1:9092", "k2:9093"))


def test_unknown_topic_and_codec_are_config_errors(broker: EmbeddedBroker) -> None:
    with pytest.raises(ConfigError, match="carries no known message type"):
        Consumer(broker.dsn, ["fh.nonsense"], "g")
    with pytest.raises(ConfigError, match="unknown compression 'snappy'"):
        Producer(broker.dsn, compression="snappy")


def test_unreachable_broker_is_bus_unavailable() -> None:
    dead = f"kafka://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(BusUnavailable, match=r"connecting a producer on kafka://127\.0\.0\.1"):
        Producer(dead, connect_timeout_s=1.0)
    with pytest.raises(BusUnavailable):
        Consumer(dead, [Topic.STEPS], "g", connect_timeout_s=1.0)
    assert time.monotonic() - started < 15


# ---------------------------------------------------------------- publish, poll, commit
def test_every_message_type_round_trips_and_commit_hides_it_from_the_group(broker: EmbeddedBroker) -> None:
    ensure_topics(broker.dsn)
    job, node, group = _uid("job"), _uid("node"), _uid("group")
    finding = Finding(kind=FindingKind.STRAGGLER, node=node, ts=5.0, job=job, rank=3, step=9,
                      diagnosis=Diagnosis.NODE_THERMAL, z=5.1, slowdown=0.2, evidence={"temp_c": 90.0})
    sent = [
        Telemetry.from_columns(node, "r00", 5.0, [0, 1], temp_c=[60.0, 90.0]),
        _steps(job, 9, node=node),
        Event(node=node, ts=5.0, kind=EventKind.XID, job=job, gpu=1, code=79),
        finding,
        Recommendation(action=Action.EVICT, node=node, ts=6.0, reason="hot", job=job, finding_id=finding.id),
    ]
    mine = lambda r: getattr(r.msg, "node", None) == node  # noqa: E731
    with Producer(broker.dsn) as producer:
        for msg in sent:
            producer.publish(msg)
        producer.flush()
        assert producer.published_total == 5 and producer.failed_total == 0

        topics = [t for t in schema.TOPIC_TYPES]
        with Consumer(broker.dsn, topics, group, **FAST) as consumer:
            got = _drain(consumer, lambda k: len(k) >= 5, mine)
            consumer.commit()
        by_type = {type(r.msg): r for r in got}
        assert len(got) == 5 and set(by_type) == {type(m) for m in sent}
        for msg in sent[2:]:
            assert by_type[type(msg)].msg == msg
            assert by_type[type(msg)].topic == msg.TOPIC.value and by_type[type(msg)].key == msg.key.encode()
        np.testing.assert_array_equal(by_type[Telemetry].msg.columns["temp_c"], [60.0, 90.0])
        np.testing.assert_array_equal(by_type[StepBatch].msg.compute_s, sent[1].compute_s)

        # the same group after the commit sees only what was published after it
        with Consumer(broker.dsn, topics, group, **FAST) as again:
            sentinel = _steps(job, 10, node=node)
            producer.publish(sentinel)
            producer.flush()
            later = _drain(again, lambda k: any(getattr(r.msg, "step", None) == 10 for r in k), mine)
        assert [r.msg.step for r in later] == [10]


def test_uncommitted_records_are_delivered_again(broker: EmbeddedBroker) -> None:
    job, group = _uid("job"), _uid("group")
    mine = lambda r: r.msg.job == job  # noqa: E731
    with Producer(broker.dsn) as producer:
        for step in range(3):
            producer.publish(_steps(job, step))
        producer.flush()
    with Consumer(broker.dsn, [Topic.STEPS], group, **FAST) as first:
        assert len(_drain(first, lambda k: len(k) >= 3, mine)) == 3  # no commit
    with Consumer(broker.dsn, [Topic.STEPS], group, **FAST) as second:
        assert sorted(r.msg.step for r in _drain(second, lambda k: len(k) >= 3, mine)) == [0, 1, 2]


def test_a_member_closing_while_another_joins_leaves_the_group_its_partitions(broker: EmbeddedBroker) -> None:
    """The group's only member (its leader) closes just as a second one is joining. On Tansu 0.6 a
    LeaveGroup from the leader then loses the group's leader for good: the second member's joins
    succeed, no one assigns, every SyncGroup fails and no partition is ever read again. Members leave
    by their session expiring instead, so the second one gets every partition within a bound."""
    import threading

    ensure_topics(broker.dsn)
    group = _uid("group")
    first = Consumer(broker.dsn, [Topic.STEPS], group, **FAST)
    first.wait_assigned(timeout_s=30)
    joined: list[BaseException | None] = []
    with Consumer(broker.dsn, [Topic.STEPS], group, **FAST) as second:
        joining = threading.Thread(target=lambda: joined.append(_assigned(second)), daemon=True)
        joining.start()  # its JoinGroup starts a rebalance the first member's leader must answer
        first.poll(0.5)  # (the first member sees the rebalance begin)
        first.close()
        joining.join(60)
        assert joined == [None], joined
        assert second.assignment() == second.partitions()  # every partition of fh.steps


def _assigned(consumer: Consumer) -> BaseException | None:
    try:
        consumer.wait_assigned(timeout_s=30)
    except BaseException as exc:  # reported by the test's thread
        return exc
    return None


def test_commit_covers_only_what_poll_returned(broker: EmbeddedBroker) -> None:
    job, group = _uid("job"), _uid("group")
    mine = lambda r: r.msg.job == job  # noqa: E731
    with Producer(broker.dsn) as producer:
        for step in range(5):
            producer.publish(_steps(job, step))  # one key: one partition, in order
        producer.flush()
    with Consumer(broker.dsn, [Topic.STEPS], group, **FAST) as first:
        first.wait_assigned(timeout_s=15)  # may already hold fetched records in its buffer
        taken: list[Record] = []
        deadline = time.monotonic() + 15
        while not taken and time.monotonic() < deadline:
            batch = first.poll(timeout_s=0.2, max_records=2)
            assert len(batch) <= 2
            taken = [r for r in batch if mine(r)]
        first.commit()
    with Consumer(broker.dsn, [Topic.STEPS], group, **FAST) as second:
        rest = _drain(second, lambda k: len(k) >= 5 - len(taken), mine)
    assert [r.msg.step for r in taken] + [r.msg.step for r in rest] == [0, 1, 2, 3, 4]


def test_from_latest_skips_what_is_already_there(broker: EmbeddedBroker) -> None:
    job = _uid("job")
    mine = lambda r: r.msg.job == job  # noqa: E731
    with Producer(broker.dsn) as producer:
        producer.publish(_steps(job, 0))
        producer.flush()
        with Consumer(broker.dsn, [Topic.STEPS], _uid("group"), from_beginning=False, **FAST) as consumer:
            consumer.wait_assigned(timeout_s=15)  # joined, and the latest offsets are taken
            producer.publish(_steps(job, 1))
            producer.flush()
            got = _drain(consumer, lambda k: any(r.msg.step == 1 for r in k), mine)
    assert [r.msg.step for r in got] == [1]


# ---------------------------------------------------------------- dead letters
def test_malformed_values_are_dead_lettered_and_the_consumer_keeps_going(broker: EmbeddedBroker) -> None:
    job = _uid("job")
    key = job.encode()
    bad_schema = orjson.dumps({**_steps(job, 1).to_obj(), "compute_s": [1.0, -2.0] + [1.0] * 6})
    not_json = b'{"v": 1, "job": '
    not_utf8 = b"\xff\xfe binary \x00"
    with Producer(broker.dsn) as producer:
        producer.publish(_steps(job, 0))
        for raw in (not_json, bad_schema, not_utf8):
            producer.publish_raw(Topic.STEPS.value, raw, key)  # same key: same partition, in order
        producer.publish(_steps(job, 2))
        producer.flush()

        with Consumer(broker.dsn, [Topic.STEPS], _uid("group"), producer=producer, **FAST) as consumer:
            got = _drain(consumer, lambda k: len(k) >= 2, lambda r: r.msg.job == job)
            consumer.commit()  # flushes the dead letters first
            assert [r.msg.step for r in got] == [0, 2]
            assert consumer.dead_lettered_total == 3
            offsets = [r.offset for r in got]

    with Consumer(broker.dsn, [Topic.DEADLETTER], _uid("group"), **FAST) as dl:
        letters = [r.msg for r in _drain(dl, lambda k: len(k) >= 3, lambda r: r.msg.key == job)]
    assert all(isinstance(d, DeadLetter) for d in letters)
    letters.sort(key=lambda d: d.offset)
    assert [d.offset for d in letters] == list(range(offsets[0] + 1, offsets[1]))
    assert {d.topic for d in letters} == {Topic.STEPS.value}
    assert [d.raw_bytes() for d in letters] == [not_json, bad_schema, not_utf8]
    assert [d.raw_base64 for d in letters] == [False, False, True]
    assert "not valid JSON" in letters[0].reason
    assert letters[1].reason.startswith("compute_s: ")
    assert letters[0].ts > 1e9  # the broker's timestamp of the rejected record, in seconds
    assert DeadLetter.from_obj(orjson.loads(orjson.dumps(letters[1].to_obj()))) == letters[1]


def test_a_bad_dead_letter_is_counted_not_looped(broker: EmbeddedBroker) -> None:
    marker = _uid("dl").encode()
    with Producer(broker.dsn) as producer:
        producer.publish_raw(Topic.DEADLETTER.value, b"garbage", marker)
        good = DeadLetter.of("fh.steps", 0, 1, marker, b"x", "reason", 1000)
        producer.publish_raw(Topic.DEADLETTER.value, orjson.dumps(good.to_obj()), marker)
        producer.flush()
    with Consumer(broker.dsn, [Topic.DEADLETTER], _uid("group"), **FAST) as dl:
        got = _drain(dl, lambda k: len(k) >= 1, lambda r: r.key == marker)
        assert [r.msg for r in got] == [good]
        assert dl.dead_lettered_total >= 1 and dl._producer is None  # nothing was republished


# ---------------------------------------------------------------- compression and topics
def test_every_codec_round_trips_through_tansu(broker: EmbeddedBroker) -> None:
    job = _uid("job")
    assert Producer(broker.dsn).compression == "zstd"  # zstandard is installed with [embedded]
    for i, codec in enumerate(("zstd", "lz4", "gzip")):
        with Producer(broker.dsn, compression=codec) as producer:
            producer.publish(_steps(job, i, compute=[0.5 + i] * 64))
            producer.flush()
    with Consumer(broker.dsn, [Topic.STEPS], _uid("group"), **FAST) as consumer:
        got = _drain(consumer, lambda k: len(k) >= 3, lambda r: r.msg.job == job)
    assert sorted((r.msg.step, float(r.msg.compute_s[0])) for r in got) == [(0, 0.5), (1, 1.5), (2, 2.5)]


def test_ensure_topics_creates_all_and_tolerates_existing(broker: EmbeddedBroker) -> None:
    from kafka import KafkaAdminClient

    extra, default = _uid("topic"), _uid("topic")
    ensure_topics(broker.dsn)
    ensure_topics(broker.dsn)
    ensure_topics(broker.dsn, partitions=3, topics=[extra])
    ensure_topics(broker.dsn, partitions=3, topics=[extra])
    ensure_topics(broker.dsn, topics=[default])
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    try:
        assert {t.value for t in Topic} | {extra, default} <= set(admin.list_topics())
        described = {t["name"]: len(t["partitions"]) for t in admin.describe_topics([extra, default])}
    finally:
        admin.close()
    # a topic made here has the partitions asked for, four by default (the fh.* topics of the session's
    # broker may have been made earlier by another test, with its own count)
    assert described == {extra: 3, default: 4}
    with pytest.raises(ConfigError):
        ensure_topics(broker.dsn, partitions=0)


# ---------------------------------------------------------------- outage
def test_publishing_to_a_stopped_broker_fails_then_works_after_restart() -> None:
    """A broker restarted on the same port serves again (memory storage: it starts empty)."""
    port = free_port()
    job = _uid("job")
    with EmbeddedBroker(port=port) as first:
        producer = Producer(first.dsn)
        producer.publish(_steps(job, 0))
        producer.flush()
    with pytest.raises(BusError):
        producer.publish(_steps(job, 1))
        producer.flush(timeout_s=1.0)
    producer.close(timeout_s=1.0)
    with EmbeddedBroker(port=port) as second:
        with Producer(second.dsn) as again:
            again.publish(_steps(job, 2))
            again.flush()
        with Consumer(second.dsn, [Topic.STEPS], _uid("group"), **FAST) as consumer:
            got = _drain(consumer, lambda k: len(k) >= 1, lambda r: r.msg.job == job, timeout_s=15)
    assert [r.msg.step for r in got] == [2]  # step 0 was lost with the first broker's memory


def test_dsn_security_options(tmp_path):
    """Producer identity through the DSN: SASL/SCRAM with the password from a file, TLS with a CA."""
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    opts = bus.dsn_options(f"kafka://k1:9093?username=node-n0001&password_file={secret}&ssl_cafile=/etc/ca.pem")
    assert opts == {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                    "sasl_plain_username": "node-n0001", "sasl_plain_password": "s3cret", "ssl_cafile": "/etc/ca.pem"}
    assert bus.dsn_options("kafka://k1:9093?security_protocol=SSL&ssl_certfile=c.pem&ssl_keyfile=k.pem") == {
        "security_protocol": "SSL", "ssl_certfile": "c.pem", "ssl_keyfile": "k.pem"}
    assert bus.dsn_options("kafka://k1:9092") == {}
    assert bus.parse_dsn("kafka://k1:9093?security_protocol=SSL") == ("kafka", ("k1:9093",))
    with pytest.raises(ConfigError, match="unknown"):
        bus.dsn_options("kafka://k1:9093?pasword_file=x")
    with pytest.raises(ConfigError, match="needs username"):
        bus.dsn_options("kafka://k1:9093?security_protocol=SASL_SSL")
    with pytest.raises(ConfigError, match="cannot read"):
        bus.dsn_options(f"kafka://k1:9093?username=a&password_file={tmp_path / 'missing'}")
    with pytest.raises(ConfigError, match="sasl_mechanism"):
        bus.dsn_options(f"kafka://k1:9093?username=a&password_file={secret}&sasl_mechanism=GSSAPI")


def test_explicit_plaintext_dsn_talks_to_the_real_broker(broker):
    dsn = f"{broker.dsn}?security_protocol=PLAINTEXT"
    topic_msg = Event(node="n0001", ts=1.0, kind=EventKind.XID, code=31, message="dsn-options")
    with bus.Producer(dsn) as producer:
        producer.publish(topic_msg)
        producer.flush()


def test_a_commit_refused_after_a_rebalance_is_not_fatal(broker):
    """A consumer that missed its poll deadline is out of the group; its commit is refused. The records
    since the last commit are re-read (idempotent downstream) instead of the runner dying."""
    topic_msg = Event(node="n0001", ts=1.0, kind=EventKind.XID, code=31, message=f"rebalance-{uuid.uuid4().hex}")
    group = f"g-{uuid.uuid4().hex[:8]}"
    with bus.Producer(broker.dsn) as producer:
        producer.publish(topic_msg)
        producer.flush()
    with bus.Consumer(broker.dsn, [Topic.EVENTS], group, max_poll_interval_s=1.0, session_timeout_s=1.0) as c:
        deadline = time.monotonic() + 30
        while not any(getattr(r.msg, "message", "") == topic_msg.message for r in c.poll(0.2)):
            assert time.monotonic() < deadline
        time.sleep(3.0)  # past max_poll_interval: the coordinator drops this member
        c.commit()  # refused by the broker, and survived
        again = []
        deadline = time.monotonic() + 30
        while not again and time.monotonic() < deadline:
            again = [r for r in c.poll(0.2) if getattr(r.msg, "message", "") == topic_msg.message]
        c.commit()
    assert c.commit_failed_total == 1
    assert again, "a refused commit re-reads the records since the last commit"
