"""Two 8-GPU nodes, each a real :class:`Probe` over replayed NVML answers, through a broker of the
test's own and :class:`Runner` into chDB: one GPU whose driver calls stall again and again, and one
GPU whose NVSwitch fabric registration failed.

- ``gpu-a`` (``fixtures/nvml_fabric_h100x8_healthy.json``): GPU 5's every driver call wedges three
  times; each time the probe leaves GPU 5 out (one ``telemetry_stalled`` event naming it) while the
  other seven GPUs' samples go on, then the call returns and GPU 5 is read again.
- ``gpu-b`` (``fixtures/nvml_fabric_h100x8_gpu5_failed.json``): GPU 5's registration COMPLETED with
  NVML_ERROR_TIMEOUT; every other GPU of both nodes registered cleanly.

Expected: exactly one ``telemetry_stall`` finding (gpu-a, GPU 5) and exactly one ``fabric`` finding
(gpu-b, GPU 5), both reported, not acted on; gpu-a's seven siblings stored for every sample.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from fleethealth.detectors.runner import Runner
from fleethealth.probe.daemon import Probe, ProbeConfig
from fleethealth.probe.nvml import NvmlSource
from fleethealth.probe.recorded import NvmlReplay
from fleethealth.schema import Action
from fleethealth.store import open_store

FIXTURES = Path(__file__).parents[1] / "probe" / "fixtures"
STUCK = 5
TICKS = 12
STALL_TICKS = (2, 5, 8)


@pytest.fixture
def chdb(tmp_path: Path):
    with open_store(f"chdb://{tmp_path}/store") as store:
        store.migrate()
        yield store


def _probe(tmp_path: Path, dsn: str, node: str, fixture: str) -> tuple[Probe, NvmlReplay]:
    replay = NvmlReplay(FIXTURES / fixture)
    source = NvmlSource(node, "rack-1", nvml=replay, xid_events=False, gpu_timeout_s=1.0)
    config = ProbeConfig(node=node, rack="rack-1", socket_path=None, metrics_port=None,
                         spool_dir=str(tmp_path / node), stall_timeout_s=10.0)
    return Probe(source, config, dsn=dsn).open(background_delivery=False), replay


def _deliver(probe: Probe) -> int:
    deadline = time.monotonic() + 60
    while probe.delivery.stats.spool.records:
        if time.monotonic() > deadline:
            raise AssertionError(f"{probe.config.node}: {probe.delivery.stats.spool.records} records not "
                                 f"delivered in 60 s ({probe.delivery.stats.last_error})")
        probe.delivery.step(force=True)
    return probe.delivery.stats.delivered_total


def test_a_stalling_gpu_and_a_fabric_failure_are_each_one_finding_end_to_end(own_broker, chdb, tmp_path) -> None:
    t0 = time.time() - 1200.0  # event time within the runner's default bounds of the broker's clock
    a, replay_a = _probe(tmp_path, own_broker.dsn, "gpu-a", "nvml_fabric_h100x8_healthy.json")
    b, _ = _probe(tmp_path, own_broker.dsn, "gpu-b", "nvml_fabric_h100x8_gpu5_failed.json")
    try:
        for k in range(TICKS):
            ts = t0 + 10.0 * k
            if k in STALL_TICKS:
                replay_a.block("*", gpu=STUCK)
            assert a.tick(now=ts).sampled and b.tick(now=ts).sampled
            if k in STALL_TICKS:
                assert a.source.stalled_gpus == {STUCK}
                replay_a.release()
                deadline = time.monotonic() + 10
                while a.source.stalled_gpus:  # the wedged call returns; GPU 5 is read from the next tick
                    assert time.monotonic() < deadline, "GPU 5's released call did not return within 10 s"
                    time.sleep(0.01)
        total = _deliver(a) + _deliver(b)
        assert a.health().gpu_stalls_total == 3 and a.health().stalls_total == 0
    finally:
        replay_a.release()
        a.close(drain_timeout_s=0.0)
        b.close(drain_timeout_s=0.0)
    with Runner(own_broker.dsn, chdb, group=f"gpu-faults-{uuid.uuid4().hex[:6]}", publish=False,
                registry=CollectorRegistry(), session_timeout_s=2.0, max_poll_interval_s=30.0) as runner:
        deadline = time.monotonic() + 90
        while runner.consumer.consumed_total < total and time.monotonic() < deadline:
            runner.process_once(0.5)
        assert runner.consumer.consumed_total == total
        runner.process_once(0.2)
        runner.drain()
    rows = chdb.query("SELECT toFloat64(ts) - {t0:Float64}, countIf(isFinite(temp_c)), count() FROM gpu_samples "
                      "FINAL WHERE node = 'gpu-a' GROUP BY ts ORDER BY ts", {"t0": t0}).rows
    assert [round(r[0]) for r in rows] == [10 * k for k in range(TICKS)]
    assert [r[1] for r in rows] == [7 if k in STALL_TICKS else 8 for k in range(TICKS)]  # the siblings, every tick
    (stall,) = chdb.findings(kind="telemetry_stall")
    assert (stall.node, stall.gpu, len(stall.evidence["stall_ts"])) == ("gpu-a", STUCK, 3)
    (fabric,) = chdb.findings(kind="fabric")
    assert (fabric.node, fabric.gpu, fabric.evidence["reason"]) == ("gpu-b", STUCK, "registration_failed")
    assert fabric.evidence["fabric"][0]["status"] == 10
    recs = {r.finding_id: r for r in chdb.recommendations()}
    assert recs[stall.id].action is Action.NONE and recs[fabric.id].action is Action.NONE
