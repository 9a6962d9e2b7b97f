"""The probe's delivery across a frozen broker, and the report of what a full spool dropped.

A frozen broker (SIGSTOP) is the outage that fails nothing fast: its sockets stay open, the kernel
still accepts connections, every request just waits. The test runs its own
:class:`EmbeddedBroker` (freezing the session broker would stall every other test), freezes it
for longer than the producer's request timeout — so the record sent meanwhile is retried on a new
connection while its first copy sits in the frozen broker's socket — thaws it, and reads the topic
back raw: delivery must resume within seconds and every record must be there exactly once. The same
runs on the durable cluster (``tests/cluster.py``: two brokers on one S3 bucket), every broker frozen:
nothing lost, in order, but a record retried through the other broker may arrive twice.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from fleethealth import schema
from fleethealth.broker import EmbeddedBroker, free_port
from fleethealth.bus import Consumer, ensure_topics
from fleethealth.probe.delivery import Delivery
from fleethealth.probe.simsource import SimSource
from fleethealth.probe.spool import Spool
from fleethealth.schema import Event, EventKind, Telemetry, Topic
from fleethealth.sim import FleetSim, Scenario

pytestmark = pytest.mark.slow

_FREEZE_S = 8.0
_REQUEST_TIMEOUT_S = 2.0


def _read_topic(dsn: str, topic: str, expected: int, timeout_s: float = 20.0) -> list[bytes]:
    """Every value on ``topic`` from the start (no group), waiting for ``expected`` and a little more."""
    import kafka

    consumer = kafka.KafkaConsumer(topic, bootstrap_servers=dsn.removeprefix("kafka://").split(","), group_id=None,
                                   auto_offset_reset="earliest", enable_auto_commit=False)
    values: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        quiet = 0
        while time.monotonic() < deadline and quiet < 2:
            got = [r.value for recs in consumer.poll(timeout_ms=500).values() for r in recs]
            values += got
            quiet = quiet + 1 if not got and len(values) >= expected else 0
    finally:
        consumer.close()
    return values


def test_a_frozen_broker_resumes_within_seconds_of_thaw_and_no_record_is_duplicated(tmp_path) -> None:
    broker = EmbeddedBroker().start()
    try:
        _freeze_and_thaw(broker.dsn, tmp_path, freeze=lambda: os.kill(broker.pid, signal.SIGSTOP),
                         thaw=lambda: os.kill(broker.pid, signal.SIGCONT))
    finally:
        if broker.running:
            os.kill(broker.pid, signal.SIGCONT)
        broker.stop()


def test_the_durable_cluster_frozen_the_probe_spools_and_replays_in_order(cluster, tmp_path) -> None:
    """The same on the durable cluster (two brokers on one S3 bucket, the DSN naming both): with every
    broker frozen the probe spools, and after the thaw it delivers everything once, in order."""
    def each(action: object) -> None:
        for k in range(len(cluster.brokers)):
            action(k)  # type: ignore[operator]

    _freeze_and_thaw(cluster.dsn, tmp_path, freeze=lambda: each(cluster.freeze), thaw=lambda: each(cluster.thaw),
                     noticed=False, max_twice=_FREEZE_S / 0.05)


def _freeze_and_thaw(dsn: str, tmp_path, *, freeze, thaw, noticed: bool = True,  # noqa: ANN001
                     max_twice: float = 0) -> None:
    """``noticed``: also require that the delivery had marked itself disconnected and counted a failed
    request by the thaw (on the cluster its reconnect may still be waiting on a frozen bootstrap then).
    ``max_twice``: how many records may reach the topic twice. On the durable cluster a batch retried
    through the other broker can be stored twice (one run: 2 of 174; Tansu's brokers do not share the
    idempotent producer's sequence numbers, it seems): every record is there, in order of first
    arrival, and the detectors' natural keys absorb the copy; bounded by what the freeze spooled."""
    stop = threading.Event()
    submitted = 0
    delivery = None
    try:
        ensure_topics(dsn, partitions=1, topics=[Topic.EVENTS.value])
        delivery = Delivery(dsn, Spool(tmp_path / "spool"), node="n0000", flush_timeout_s=1.0,
                            request_timeout_s=_REQUEST_TIMEOUT_S, reconnect_backoff_max_s=0.5)
        delivery.start()

        def feed() -> None:
            nonlocal submitted
            while not stop.is_set():
                delivery.submit(Event(node="n0000", ts=time.time(), kind=EventKind.PROBE_ERROR,
                                      message=f"record {submitted}", data={"seq": submitted}))
                submitted += 1
                stop.wait(0.05)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        deadline = time.monotonic() + 15
        while delivery.stats.delivered_total < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert delivery.stats.delivered_total >= 10, delivery.stats

        freeze()
        time.sleep(_FREEZE_S)
        at_thaw = delivery.stats
        assert at_thaw.spool.records > 0  # it kept everything
        assert not noticed or not at_thaw.connected  # and noticed
        thaw()
        thawed = time.monotonic()
        while delivery.stats.delivered_total == at_thaw.delivered_total and time.monotonic() - thawed < 20:
            time.sleep(0.02)
        resumed_s = time.monotonic() - thawed
        while len(delivery.spool) > 2 and time.monotonic() - thawed < 20:
            time.sleep(0.02)
        drained_s = time.monotonic() - thawed
        stop.set()
        feeder.join()
        delivery.close(drain_timeout_s=10.0)
        assert len(delivery.spool) == 0

        # the freeze outlasted the request timeout, so requests were retried on new connections
        assert not noticed or at_thaw.failures_total >= 1
        assert resumed_s < 5.0, f"first delivery {resumed_s:.1f} s after the broker answered again"
        assert drained_s < 8.0, f"backlog delivered {drained_s:.1f} s after the broker answered again"
        seqs = [schema.decode(Event, v).data["seq"] for v in _read_topic(dsn, Topic.EVENTS.value, submitted)]
        twice = len(seqs) - len(set(seqs))
        print(f"froze for {_FREEZE_S} s: {at_thaw.spool.records} records spooled, {submitted} sent, "
              f"{len(seqs)} on the topic ({twice} twice); resumed {resumed_s:.1f} s after the thaw")
        first = list(dict.fromkeys(seqs))
        assert first == list(range(submitted))  # all of them, in the order they were accepted
        assert twice <= max_twice, f"{twice} record(s) on the topic twice"
    finally:
        stop.set()


_SCENARIO = {"seed": 3, "fleet": {"racks": 1, "nodes_per_rack": 1, "gpus_per_node": 8},
             "job": {"id": "spool-job", "steps": 400, "step_time_s": 1.0, "jitter": 0.02}}


def test_what_a_full_spool_dropped_is_reported_on_the_bus_when_it_returns(tmp_path) -> None:
    port = free_port()
    source = SimSource("n0000", sim=FleetSim(Scenario.from_obj(_SCENARIO)))
    source.open()
    samples = [source.sample(0.0).telemetry for _ in range(60)]
    one = len(schema.encode(samples[0]))
    spool = Spool(tmp_path / "spool", max_bytes=one * 16, segment_bytes=one * 2)
    delivery = Delivery(f"kafka://127.0.0.1:{port}", spool, node="n0000", flush_timeout_s=2.0)
    for tel in samples:  # no broker yet: everything is spooled, the bound overflows
        delivery.submit(tel)
    stats = delivery.stats.spool
    dropped = stats.dropped_total
    assert dropped > 0
    spool.close()  # the probe restarts during the outage: the report survives it

    spool = Spool(tmp_path / "spool", max_bytes=one * 16, segment_bytes=one * 2)
    delivery = Delivery(f"kafka://127.0.0.1:{port}", spool, node="n0000", flush_timeout_s=2.0)
    with EmbeddedBroker(port=port) as broker:
        ensure_topics(broker.dsn)
        while len(spool):
            assert delivery.step(force=True) > 0
        assert delivery.stats.drop_reports_total == 1 and spool.drops_to_report() is None
        with Consumer(broker.dsn, [Topic.EVENTS.value], "drop-report") as consumer:
            events: list[Event] = []
            deadline = time.monotonic() + 20
            while not events and time.monotonic() < deadline:
                events += [r.msg for r in consumer.poll(timeout_s=0.5) if isinstance(r.msg, Event)]
            events += [r.msg for r in consumer.poll(timeout_s=0.5) if isinstance(r.msg, Event)]
        telemetry = [schema.decode(Telemetry, v) for v in _read_topic(broker.dsn, Topic.TELEMETRY.value,
                                                                           60 - dropped)]
        delivery.close(drain_timeout_s=0.5)
    (report,) = events
    assert report.kind is EventKind.SPOOL_DROPPED and report.node == "n0000"
    assert report.data["records"] == dropped and report.data["topics"] == {Topic.TELEMETRY.value: dropped}
    assert report.data["bytes"] == stats.dropped_bytes_total
    lost = samples[:dropped]  # the oldest went; their event times are the range reported
    assert report.data["first_ts"] == lost[0].ts and report.data["last_ts"] == lost[-1].ts
    assert [t.ts for t in telemetry] == [t.ts for t in samples[dropped:]]


_FAULTY = {"seed": 5, "fleet": {"racks": 2, "nodes_per_rack": 4, "gpus_per_node": 4},
           "job": {"id": "dup-job", "steps": 160, "step_time_s": 2.0, "jitter": 0.02},
           "checks": {"selfcheck_every": 40, "replay_every": 80, "checkpoint_every": 20},
           "faults": [{"kind": "thermal_straggler", "node": "n0005", "gpu": 1, "start_step": 40, "slowdown": 0.25},
                      {"kind": "xid", "node": "n0002", "gpu": 3, "step": 90, "code": 79}]}


def _node_streams() -> list[list[object]]:
    """What each sim step puts on the bus, node by node (a probe's delivery order)."""
    out: list[list[object]] = []
    for step in FleetSim(Scenario.from_obj(_FAULTY)).run():
        out.append([*step.telemetry, *step.batches, *step.events])
    return out


def _detect(chunks: list[list[object]]) -> tuple[set[str], set[str]]:
    from fleethealth.detectors.pipeline import Pipeline
    from fleethealth.detectors.runner import conclude
    from fleethealth.policy.stage import PolicyStage

    pipe, stage = Pipeline(), PolicyStage()
    findings: set[str] = set()
    recs: set[str] = set()
    for chunk in chunks:
        out = conclude(pipe, stage, chunk)
        findings |= {f.id for f in out.findings}
        recs |= {r.id for r in out.recommendations}
    out = conclude(pipe, stage, [], final=True)
    findings |= {f.id for f in out.findings}
    recs |= {r.id for r in out.recommendations}
    return findings, recs


def test_a_batch_published_twice_by_a_new_producer_changes_no_finding_and_no_stored_row(store) -> None:
    """The repeat the idempotent producer cannot prevent (a producer that failed, a probe killed with a
    batch in flight) is absorbed by the consumers' natural keys: same findings, same rows."""
    chunks = _node_streams()
    once = [m for chunk in chunks for m in chunk]
    # one node's in-flight batch — its sample, step batch and events of a few steps — arrives twice
    node = "n0005"
    repeated: list[list[object]] = []
    for k, chunk in enumerate(chunks):
        repeated.append(chunk)
        if k % 25 == 10:
            repeated.append([m for m in chunk if getattr(m, "node", None) == node or isinstance(m, Event)])
    assert sum(map(len, repeated)) > len(once)
    clean = _detect(chunks)
    assert clean[0], "the scenario's faults must be found for the comparison to mean anything"
    assert _detect(repeated) == clean

    for chunk in repeated:  # separate inserts, as the runner's batches would be
        store.insert_telemetry([m for m in chunk if isinstance(m, Telemetry)])
        store.insert_steps([m for m in chunk if type(m).__name__ == "StepBatch"])
        store.insert_events([m for m in chunk if isinstance(m, Event)])
    counts = {t: store.query(f"SELECT count() FROM {t} FINAL").rows[0][0]
              for t in ("gpu_samples", "rank_steps", "events")}
    tel = [m for m in once if isinstance(m, Telemetry)]
    assert counts["gpu_samples"] == sum(len(t.gpu) for t in tel)
    assert counts["rank_steps"] == sum(len(m.ranks) for m in once if type(m).__name__ == "StepBatch")
    assert counts["events"] == len({m.id for m in once if isinstance(m, Event)})


@pytest.mark.parametrize("name", ["request_timeout_s", "reconnect_backoff_max_s", "delivery_timeout_s"])
def test_a_timeout_that_is_not_positive_is_a_config_error(tmp_path, name) -> None:
    from fleethealth.bus import Producer
    from fleethealth.errors import ConfigError

    with pytest.raises(ConfigError, match=name):
        Delivery("kafka://127.0.0.1:9", Spool(tmp_path / "spool"), node="n0000", **{name: 0.0})
    with pytest.raises(ConfigError, match=name):  # refused before any connection is tried
        Producer("kafka://127.0.0.1:9", **{name: float("nan")})
