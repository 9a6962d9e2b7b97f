"""Delivery through the spool against a real broker: an outage loses nothing within the bound.

Each test runs its own :class:`EmbeddedBroker` on a fixed port (not the session broker), so it
can stop it mid-stream and start it again on the same port. Tansu keeps topics and data in
memory only: what was delivered before the outage is read before stopping it, and the topics are
created again after the restart.
"""

from __future__ import annotations

import time

import pytest

from fleethealth.broker import EmbeddedBroker, free_port
from fleethealth.bus import Consumer, ensure_topics
from fleethealth.probe.daemon import Probe, ProbeConfig
from fleethealth.probe.delivery import Delivery
from fleethealth.probe.simsource import SimSource
from fleethealth.probe.spool import Spool
from fleethealth.schema import Telemetry
from fleethealth.sim import FleetSim, Scenario

pytestmark = pytest.mark.slow

_SCENARIO = {"seed": 3, "fleet": {"racks": 1, "nodes_per_rack": 1, "gpus_per_node": 8},
             "job": {"id": "spool-job", "steps": 400, "step_time_s": 1.0, "jitter": 0.02}}


def _source() -> SimSource:
    return SimSource("n0000", sim=FleetSim(Scenario.from_obj(_SCENARIO)))


def _read_telemetry(dsn: str, expected: int, group: str, timeout_s: float = 30.0) -> list[float]:
    seen: list[float] = []
    with Consumer(dsn, ["fh.telemetry"], group) as consumer:
        deadline = time.monotonic() + timeout_s
        while len(seen) < expected and time.monotonic() < deadline:
            seen += [r.msg.ts for r in consumer.poll(timeout_s=0.5) if isinstance(r.msg, Telemetry)]
        # anything beyond the expected count would be a duplicate: give it a moment to show up
        seen += [r.msg.ts for r in consumer.poll(timeout_s=0.5) if isinstance(r.msg, Telemetry)]
    return seen


def test_broker_outage_every_sample_arrives_once_and_in_order(tmp_path) -> None:
    port = free_port()
    expected_source = _source()
    expected_source.open()
    expected = [expected_source.sample(0.0).telemetry.ts for _ in range(13)]
    broker = EmbeddedBroker(port=port).start()
    try:
        ensure_topics(broker.dsn)
        delivery = Delivery(broker.dsn, Spool(tmp_path / "spool"), flush_timeout_s=2.0, backoff_s=0.2)
        config = ProbeConfig(node="n0000", rack="r00", socket_path=None, metrics_port=None)
        probe = Probe(_source(), config, delivery=delivery).open(background_delivery=False)
        for _ in range(5):
            assert probe.tick().sampled
            assert delivery.step() > 0
        before = _read_telemetry(broker.dsn, 5, "outage-before")
        broker.stop()
        for _ in range(5):  # the broker is gone: sampling goes on, records stay spooled
            assert probe.tick().sampled
            delivery.step()
        stats = delivery.stats
        assert stats.failures_total >= 1 and not stats.connected and stats.spool.records >= 5
        broker = EmbeddedBroker(port=port).start()
        ensure_topics(broker.dsn)  # memory-only broker: the topics went with it
        for _ in range(3):
            probe.tick()
        deadline = time.monotonic() + 60
        while len(delivery.spool) and time.monotonic() < deadline:
            delivery.step(force=True)
        assert len(delivery.spool) == 0
        after = _read_telemetry(broker.dsn, 8, "outage-after")
        probe.close(drain_timeout_s=1.0)
        assert before + after == expected
        assert probe.health().spool_dropped_total == 0
    finally:
        broker.stop()


def test_beyond_the_bound_the_oldest_are_dropped_counted_and_the_rest_delivered_in_order(tmp_path) -> None:
    port = free_port()
    source = _source()
    source.open()
    samples = [source.sample(0.0).telemetry for _ in range(60)]
    one = len(__import__("fleethealth.schema", fromlist=["encode"]).encode(samples[0]))
    spool = Spool(tmp_path / "spool", max_bytes=one * 16, segment_bytes=one * 2)
    delivery = Delivery(f"kafka://127.0.0.1:{port}", spool, flush_timeout_s=2.0)
    for tel in samples:  # no broker yet: everything is spooled, the bound overflows
        delivery.submit(tel)
    stats = delivery.stats.spool
    assert stats.dropped_total > 0 and stats.records + stats.dropped_total == 60
    assert stats.bytes <= one * 16
    with EmbeddedBroker(port=port) as broker:
        ensure_topics(broker.dsn)
        while len(spool):
            assert delivery.step(force=True) > 0
        got = _read_telemetry(broker.dsn, stats.records, "overflow")
        delivery.close(drain_timeout_s=0.5)
    assert got == [t.ts for t in samples[-stats.records:]]
