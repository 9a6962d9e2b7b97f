"""A consumer positioned at a hole in a Tansu log on S3.

A Tansu broker on S3 writes a batch in two steps: the partition's watermark (next offset, producer
sequence numbers), then the batch object. SIGKILLed between the two and started again, it leaves a hole:
offsets the watermark counts and no batch holds (``tests/probe/test_broker_kill.py``). Tansu's fetch at an
offset answers the stored batches at or after it, so a hole followed by a batch is passed over; one at
the log's end answers nothing while the high watermark stays beyond it, and its consumer's lag stays
above 0 for as long as nothing new is written: a drain (``detect --until-caught-up``, the demo's) waits
forever. The consumer reports both and skips the second after ``hole_skip_after_s``
(``fleethealth/bus/consumer.py``). The S3 gate (``tests/cluster.py``) holds the batch write, so the kill
lands in that window every time.
"""

from __future__ import annotations

import time
from collections import Counter

import orjson
import pytest

from fleethealth.bus import Consumer, DeadLetter, Producer, ensure_topics
from fleethealth.errors import BusError
from fleethealth.schema import Event, EventKind, Topic
from tests.cluster import running_cluster, until

SKIP_AFTER_S = 1.0
TOPIC = Topic.EVENTS.value


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("holes"), brokers=1, gated=True) as running:
        ensure_topics(running.dsn, partitions=1)
        yield running


def _event(label: str) -> Event:
    return Event(node="n-hole", ts=1_700_000_000.0, kind=EventKind.XID, message=label)


def _hole(cluster, producer: Producer, labels: list[str]) -> None:
    """Publish ``labels`` with the broker SIGKILLed between its watermark and batch writes: their offsets
    become a hole (the producer's flush says so; nothing publishes them again here)."""
    held = cluster.gate.held
    cluster.gate.hold_batches()
    for label in labels:
        producer.publish(_event(label))
    until(lambda: cluster.gate.held > held, 20.0, "the broker's batch write")
    cluster.brokers[0].kill()
    cluster.gate.release()
    cluster.brokers[0].start()
    with pytest.raises(BusError, match="without an offset"):
        producer.flush(timeout_s=30.0)


def _publish(producer: Producer, labels: list[str]) -> None:
    for label in labels:
        producer.publish(_event(label))
    producer.flush(timeout_s=30.0)


def _holes_reported(cluster, group: str, expected: int) -> list[DeadLetter]:
    """The hole dead letters of ``group`` on ``fh.deadletter``, read from its start until ``expected`` of
    them are there (and 1 s more for any beyond; Tansu's ListOffsets can answer short of the log's end)."""
    from kafka import KafkaConsumer, TopicPartition

    kc = KafkaConsumer(bootstrap_servers=cluster.dsn.removeprefix("kafka://").split(","), group_id=None,
                       enable_auto_commit=False, fetch_max_wait_ms=100)
    try:
        tp = TopicPartition(Topic.DEADLETTER.value, 0)
        kc.assign([tp])
        kc.seek(tp, 0)
        out: list[DeadLetter] = []
        deadline, extra = time.monotonic() + 20.0, None
        while time.monotonic() < (deadline if extra is None else extra):
            for rs in kc.poll(timeout_ms=200).values():
                out += [d for d in (DeadLetter.from_obj(orjson.loads(r.value)) for r in rs)
                        if d.topic == TOPIC and d.reason.startswith("hole") and repr(group) in d.reason]
            if extra is None and len(out) >= expected:
                extra = time.monotonic() + 1.0
        return out
    finally:
        kc.close(autocommit=False)


def _read(consumer: Consumer, seen: Counter[str], until, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s} s: read {sorted(seen)}, lag {consumer.lag()}, "
                                 f"holes {getattr(consumer, 'holes_total', None)}")
        seen.update(r.msg.message for r in consumer.poll(0.2))
        consumer.commit()


def test_a_hole_at_the_log_end_is_skipped_and_reported(gated) -> None:
    """Before: lag 3 for ever at the hole (nothing new is written). After: the consumer skips it once its
    position has stood still with the high watermark beyond it for ``hole_skip_after_s``, counts it and
    dead-letters a record naming the range; what is written after it is read exactly once."""
    group = "fh-hole-end"
    with Producer(gated.dsn, request_timeout_s=2.0, delivery_timeout_s=60.0, reconnect_backoff_max_s=0.5) as p:
        _publish(p, [f"end-before-{k}" for k in range(5)])
        _hole(gated, p, [f"end-lost-{k}" for k in range(3)])
        consumer = Consumer(gated.dsn, [TOPIC], group, session_timeout_s=3.0, max_poll_interval_s=6.0)
        consumer.hole_skip_after_s = SKIP_AFTER_S
        seen: Counter[str] = Counter()
        try:
            _read(consumer, seen, lambda: seen["end-before-4"] and consumer.lag() == {(TOPIC, 0): 0},
                  30.0, "read to the end past the hole")
            assert consumer.holes_total == 1 and consumer.hole_offsets_total == 3
            end = consumer.positions()[(TOPIC, 0)]
            assert consumer.committed()[(TOPIC, 0)] == end  # a restarted member does not stand at the hole again
            _publish(p, [f"end-after-{k}" for k in range(5)])
            _read(consumer, seen, lambda: seen["end-after-4"], 30.0, "the records after the hole")
        finally:
            consumer.close()
    kept = {f"end-before-{k}" for k in range(5)} | {f"end-after-{k}" for k in range(5)}
    assert {m: n for m, n in seen.items() if m.startswith("end-")} == dict.fromkeys(kept, 1)
    letters = _holes_reported(gated, group, 1)
    assert len(letters) == 1, letters
    assert letters[0].partition == 0
    assert letters[0].reason.startswith(f"hole: offsets {letters[0].offset}-{letters[0].offset + 2} ")


def test_records_past_a_hole_are_read_once_and_the_hole_reported(gated) -> None:
    """A hole followed by records: the fetch at the hole answers the next batch, so nothing stalls; every
    record stored is read exactly once, and the hole, passed over silently before, is counted and
    dead-lettered with its offsets."""
    group = "fh-hole-inside"
    with Producer(gated.dsn, request_timeout_s=2.0, delivery_timeout_s=60.0, reconnect_backoff_max_s=0.5) as p:
        _publish(p, [f"in-before-{k}" for k in range(5)])
        _hole(gated, p, [f"in-lost-{k}" for k in range(4)])
        _publish(p, [f"in-after-{k}" for k in range(5)])
    consumer = Consumer(gated.dsn, [TOPIC], group, session_timeout_s=3.0, max_poll_interval_s=6.0)
    consumer.hole_skip_after_s = 0.0  # never skipped: only passed over
    seen: Counter[str] = Counter()
    try:
        _read(consumer, seen, lambda: seen["in-after-4"] and consumer.lag() == {(TOPIC, 0): 0}, 30.0,
              "read to the end past the hole")
        consumer.commit()
    finally:
        consumer.close()
    kept = {f"in-before-{k}" for k in range(5)} | {f"in-after-{k}" for k in range(5)}
    assert {m: n for m, n in seen.items() if m.startswith("in-")} == dict.fromkeys(kept, 1)
    letters = _holes_reported(gated, group, 2)
    # the earlier test's hole, now inside the log, is passed over too (this group reads from the start)
    sizes = sorted(d.reason.split("(")[1].split(")")[0] for d in letters)
    assert sizes == ["3", "4"], [d.reason for d in letters]
    assert consumer.holes_total == 2 and consumer.hole_offsets_total == 7
    assert all("passed over" in d.reason for d in letters)


def test_a_batch_being_written_is_not_skipped(gated) -> None:
    """The two writes of one batch are apart for as long as the broker's S3 write takes; a position that
    stands still for less than ``hole_skip_after_s`` is left where it is, and the batch is read when its
    write lands."""
    group = "fh-hole-slow"
    consumer = Consumer(gated.dsn, [TOPIC], group, from_beginning=False, session_timeout_s=3.0,
                        max_poll_interval_s=6.0)
    consumer.hole_skip_after_s = 30.0
    consumer.wait_assigned()
    seen: Counter[str] = Counter()
    with Producer(gated.dsn, request_timeout_s=10.0, delivery_timeout_s=60.0, reconnect_backoff_max_s=0.5) as p:
        try:
            held = gated.gate.held
            gated.gate.hold_batches()
            p.publish(_event("slow-0"))
            until(lambda: gated.gate.held > held, 20.0, "the broker's batch write")
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:  # the watermark counts the batch, its object is not there
                seen.update(r.msg.message for r in consumer.poll(0.2))
            assert consumer.lag() == {(TOPIC, 0): 1} and "slow-0" not in seen
            gated.gate.release()  # the held write is dropped; the broker's S3 client writes it again
            p.flush(timeout_s=30.0)
            _read(consumer, seen, lambda: seen["slow-0"], 30.0, "the slow batch")
        finally:
            gated.gate.release()
            consumer.close()
    assert seen["slow-0"] == 1 and consumer.holes_total == 0
