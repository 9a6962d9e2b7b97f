"""The probe cut off from every broker of the durable cluster for longer than its spool holds.

Both Tansu brokers (S3 storage, ``tests/cluster.py``) are SIGKILLed while the probe keeps sampling into a
small spool, which drops its oldest records; started again on the same storage, they serve what they
had. What the probe kept then arrives once each and in order, and one ``spool_dropped`` event says how
many were dropped: exactly what was published and never arrived.
"""

from __future__ import annotations

import time

import pytest

from fleethealth import schema
from fleethealth.bus import Consumer, ensure_topics
from fleethealth.probe.delivery import Delivery
from fleethealth.probe.simsource import SimSource
from fleethealth.probe.spool import Spool
from fleethealth.schema import Event, EventKind, Telemetry, Topic
from fleethealth.sim import FleetSim, Scenario
from tests.cluster import running_cluster, until

NODE = "n0000"
_SCENARIO = {"seed": 5, "fleet": {"racks": 1, "nodes_per_rack": 1, "gpus_per_node": 8},
             "job": {"id": "cut-job", "steps": 400, "step_time_s": 1.0, "jitter": 0.02}}


@pytest.fixture(scope="module")
def durable(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("cut"), brokers=2) as running:
        yield running


def _samples(n: int) -> list[Telemetry]:
    source = SimSource(NODE, sim=FleetSim(Scenario.from_obj(_SCENARIO)))
    source.open()
    return [source.sample(0.0).telemetry for _ in range(n)]


def _read_all(dsn: str, timeout_s: float = 30.0) -> tuple[list[Telemetry], list[Event]]:
    """Every telemetry record and event of ``NODE`` on the cluster, read from the start to the end."""
    telemetry: list[Telemetry] = []
    events: list[Event] = []
    with Consumer(dsn, [Topic.TELEMETRY.value, Topic.EVENTS.value], None) as consumer:
        deadline = time.monotonic() + timeout_s
        while True:
            got = consumer.poll(0.3)
            telemetry += [r.msg for r in got if isinstance(r.msg, Telemetry) and r.msg.node == NODE]
            events += [r.msg for r in got if isinstance(r.msg, Event) and r.msg.node == NODE]
            lag = consumer.lag()
            if not got and lag and all(v == 0 for v in lag.values()):
                return telemetry, events
            if time.monotonic() > deadline:
                raise AssertionError(f"the topics not read to their end in {timeout_s} s (lag {lag})")


def test_the_drop_beyond_the_spool_is_reported_and_the_rest_arrives_once_in_order(durable, tmp_path) -> None:
    ensure_topics(durable.dsn, partitions=2)
    samples = _samples(80)
    one = len(schema.encode(samples[0]))
    spool = Spool(tmp_path / "spool", max_bytes=one * 16, segment_bytes=one * 2)
    delivery = Delivery(durable.dsn, spool, node=NODE, flush_timeout_s=1.0, request_timeout_s=2.0,
                        reconnect_backoff_max_s=0.5, backoff_s=0.1, max_backoff_s=0.5)
    delivery.start()
    try:
        for tel in samples[:10]:
            delivery.submit(tel)
        until(lambda: delivery.stats.delivered_total == 10, 30.0, "the first 10 records delivered")
        for broker in durable.brokers:  # the probe reaches no broker
            broker.kill()
        delivery.submit(samples[10])  # handed to the producer, which waits for a broker
        until(lambda: delivery.stats.inflight_records == 1, 30.0, "the first record of the outage in flight")
        for tel in samples[11:70]:  # 60 records into a spool that holds 16: the one in flight is dropped too
            delivery.submit(tel)
        assert delivery.stats.spool.dropped_total >= 40 and delivery.stats.delivered_total == 10
        for broker in durable.brokers:  # healed: the same storage, the same ports
            broker.start()
        for tel in samples[70:]:
            delivery.submit(tel)
        until(lambda: len(delivery.spool) == 0 and delivery.stats.drop_reports_total == 1, 60.0,
               "the spool emptied and the drop reported")
        stats = delivery.stats
    finally:
        delivery.close(drain_timeout_s=5.0)
    arrived, events = _read_all(durable.dsn)
    reports = [e for e in events if e.kind is EventKind.SPOOL_DROPPED]
    assert len(reports) == 1, [e.message for e in reports]
    dropped = reports[0].data["records"]
    ts = [t.ts for t in arrived]
    assert len(ts) == len(set(ts)), "a record arrived twice"
    assert ts == sorted(ts), "records arrived out of order"
    assert dropped == stats.spool.dropped_total and dropped >= 40
    assert dropped + len(arrived) == len(samples), (
        f"{len(samples)} published, {len(arrived)} arrived, {dropped} reported dropped")
    # one run of the outage's oldest was dropped: before it, the first 10 and the batch in flight when the
    # brokers went (delivered, so not counted as dropped although the bound dropped it from the spool)
    published = [t.ts for t in samples]
    cut = next(k for k, (a, b) in enumerate(zip(ts, published, strict=False)) if a != b)
    assert cut >= 10 and ts == published[:cut] + published[cut + dropped:]
    assert reports[0].data["topics"] == {Topic.TELEMETRY.value: dropped}
