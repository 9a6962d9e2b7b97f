"""A broker SIGKILLed in the crash window of a produce loses nothing the probe spooled.

A Tansu broker on S3 writes a batch in two steps: the partition's watermark (next offset and the
producer's sequence numbers), then the batch object. Killed between them and started again, it answers
the producer's retry of that batch ``DUPLICATE_SEQUENCE_NUMBER``, which kafka-python completes as a
success at offset -1: the batch was acknowledged and never stored, and its offsets are a hole in the log
(``bench/broker_kill_repro.py`` measures how often random kills land there). The producer reads such
records back and fails the flush for those not found; a frozen broker's late copy is found, and not
published again (``test_broker_freeze.py``). The S3 gate
(``tests/cluster.py``) holds the batch write, so the kill falls in that window every time.
"""

from __future__ import annotations

import time

import pytest

from fleethealth.bus import Producer
from fleethealth.errors import BusError
from fleethealth.probe.delivery import Delivery
from fleethealth.probe.spool import Spool
from tests.cluster import running_cluster, until

TOPIC = "fh.events"


@pytest.fixture
def gated(tmp_path):
    with running_cluster(tmp_path / "cluster", brokers=1, gated=True) as running:
        yield running


def _served(dsn: str, last: bytes) -> list[bytes]:
    """The topic's values from its start up to ``last`` (the reader does not wait at a hole in the log's
    end: a Tansu fetch at a missing batch's offset answers nothing until a later batch exists)."""
    from kafka import KafkaConsumer, TopicPartition

    kc = KafkaConsumer(bootstrap_servers=dsn.removeprefix("kafka://").split(","), group_id=None,
                       enable_auto_commit=False, fetch_max_wait_ms=100)
    try:
        tps = [TopicPartition(TOPIC, p) for p in sorted(kc.partitions_for_topic(TOPIC) or ())]
        kc.assign(tps)
        for tp in tps:
            kc.seek(tp, 0)
        out: list[bytes] = []
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            got = kc.poll(timeout_ms=200)
            out += [r.value for rs in got.values() for r in rs]
            if last in out:
                return out
        raise AssertionError(f"{last!r} not read from the topic in 30 s (read {len(out)})")
    finally:
        kc.close(autocommit=False)


def _kill_in_the_window(cluster, send) -> None:
    """Hold the broker's next batch write, ``send()``, SIGKILL the broker once the write is held, start it
    again with writes let through."""
    cluster.gate.hold_batches()
    send()
    until(lambda: cluster.gate.held > 0, 20.0, "the broker's batch write")
    cluster.brokers[0].kill()
    cluster.gate.release()
    cluster.brokers[0].start()


def test_an_acknowledgement_without_an_offset_fails_the_flush(gated) -> None:
    from fleethealth.bus import ensure_topics

    ensure_topics(gated.dsn, partitions=1)
    with Producer(gated.dsn, request_timeout_s=2.0, delivery_timeout_s=60.0, reconnect_backoff_max_s=0.5) as p:
        p.publish_raw(TOPIC, b"before")
        p.flush()
        _kill_in_the_window(gated, lambda: p.publish_raw(TOPIC, b"in-the-window"))
        with pytest.raises(BusError, match="without an offset"):
            p.flush(timeout_s=30.0)
        assert p.unplaced_total == p.read_back_total == 1  # read back, not found
        p.publish_raw(TOPIC, b"after")
        p.flush(timeout_s=30.0)
    assert b"in-the-window" not in _served(gated.dsn, b"after")  # the broker's loss, which the flush reported


def test_the_probe_delivers_a_batch_the_killed_broker_dropped(gated, tmp_path) -> None:
    from fleethealth.bus import ensure_topics

    ensure_topics(gated.dsn, partitions=1)
    delivery = Delivery(gated.dsn, Spool(tmp_path / "spool"), node="n-kill", flush_timeout_s=1.0,
                        request_timeout_s=2.0, reconnect_backoff_max_s=0.5, backoff_s=0.1, max_backoff_s=0.5)
    delivery.start()
    try:
        values = [f"record-{k}".encode() for k in range(30)]
        for v in values[:10]:
            delivery.submit_raw(TOPIC, v, b"k")
        until(lambda: delivery.stats.delivered_total == 10, 30.0, "the first 10 records delivered")
        _kill_in_the_window(gated, lambda: [delivery.submit_raw(TOPIC, v, b"k") for v in values[10:20]])
        for v in values[20:]:
            delivery.submit_raw(TOPIC, v, b"k")
        until(lambda: len(delivery.spool) == 0, 60.0, "the spool emptied")
    finally:
        delivery.close(drain_timeout_s=5.0)
    served = _served(gated.dsn, values[-1])
    missing = [v for v in values if v not in served]
    assert not missing, f"{len(missing)} spooled records acknowledged and not on the topic: {missing[:3]}"
    # the batch published again may sit beside a copy the broker did store: at most one copy each
    assert all(served.count(v) <= 2 for v in values)
