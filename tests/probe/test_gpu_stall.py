"""One GPU whose driver calls stall costs its node that GPU's columns, not the sample.

The NVML source reads each GPU on a thread of its own (:mod:`fleethealth.probe.gpureads`); here an
8-GPU HGX H100 node (``fixtures/nvml_fabric_h100x8_healthy.json``, replayed through
:class:`NvmlReplay`) has every driver call of GPU 5 wedged. Nothing sleeps on the probe's behalf:
a wedged call waits on an event the test releases, and waits for the thread to come back are
polled with a bound.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fleethealth.errors import ConfigError
from fleethealth.probe.daemon import Probe, ProbeConfig
from fleethealth.probe.delivery import Delivery
from fleethealth.probe.gpureads import GpuReads
from fleethealth.probe.nvml import NvmlSource
from fleethealth.probe.recorded import NvmlReplay
from fleethealth.probe.spool import Spool
from fleethealth.schema import TOPIC_TYPES, Event, EventKind, Telemetry, Topic, decode

FIXTURES = Path(__file__).parent / "fixtures"
STUCK = 5


def _wait(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.01)


def _readers(before: set[threading.Thread]) -> list[threading.Thread]:
    """Reader threads started since ``before`` (other tests' sources may still hold theirs)."""
    return [t for t in threading.enumerate() if t.name.startswith("fh-gpu-read-") and t not in before]


def test_bounded_reads_one_worker_per_gpu_and_a_stale_answer_is_dropped() -> None:
    reads = GpuReads(timeout_s=0.3)
    gate = threading.Event()
    calls = {g: 0 for g in range(4)}

    def call(g: int):
        def run() -> int:
            calls[g] += 1
            if g == 2:
                gate.wait()
            return g * 10
        return run

    try:
        first = reads.read([(g, call(g)) for g in range(4)])
        assert first.results == {0: 0, 1: 10, 3: 30} and first.began == (2,) and first.stuck == (2,)
        for _ in range(5):  # GPU 2 still stuck: never asked again, never waited for
            t0 = time.monotonic()
            again = reads.read([(g, call(g)) for g in range(4)])
            assert again.began == () and again.stuck == (2,) and set(again.results) == {0, 1, 3}
            assert time.monotonic() - t0 < reads.timeout_s
        assert calls[2] == 1 and reads.threads == 4 and reads.stalls_total == {2: 1}
        gate.set()
        _wait(lambda: not reads.stalled, "the stuck read's return")
        resumed = reads.read([(g, call(g)) for g in range(4)])
        assert resumed.results == {0: 0, 1: 10, 2: 20, 3: 30} and resumed.stuck == ()
        assert reads.stalls_total == {2: 1}
    finally:
        gate.set()
        reads.close()
    with pytest.raises(ConfigError, match="timeout"):
        GpuReads(timeout_s=0)


def test_a_stalled_gpu_is_left_out_while_its_seven_siblings_report_every_sample() -> None:
    replay = NvmlReplay(FIXTURES / "nvml_fabric_h100x8_healthy.json")
    source = NvmlSource("gpu-a", "rack-1", nvml=replay, xid_events=False, gpu_timeout_s=1.0)
    threads = set(threading.enumerate())
    source.open()
    try:
        before = source.sample(1.0).telemetry
        assert np.isfinite(before.columns["temp_c"]).all() and before.gpu.size == 8
        replay.block("*", gpu=STUCK)
        samples = []
        for k in range(6):
            t0 = time.monotonic()
            samples.append(source.sample(2.0 + k))
            if k:  # only the sample where the stall began waits for it
                assert time.monotonic() - t0 < source.gpu_timeout_s
        for s in samples:
            temp = s.telemetry.columns["temp_c"]
            assert math.isnan(temp[STUCK]) and np.isfinite(np.delete(temp, STUCK)).all()
            assert np.isfinite(np.delete(s.telemetry.columns["power_w"], STUCK)).all()
        stalled = [e for s in samples for e in s.events if e.kind is EventKind.TELEMETRY_STALLED]
        assert [(e.gpu, e.ts, e.data["gpus"]) for e in stalled] == [(STUCK, 2.0, [STUCK])]
        assert "GPU 5" in stalled[0].message and stalled[0].node == "gpu-a"
        assert source.stalled_gpus == {STUCK} and source.gpu_stalls_total == 1
        assert len(_readers(threads)) == 8  # one per GPU, however many samples the stall spans
        replay.release()
        _wait(lambda: not source.stalled_gpus, "GPU 5's stuck call returning")
        after = source.sample(10.0).telemetry
        assert np.isfinite(after.columns["temp_c"]).all() and source.gpu_stalls_total == 1
    finally:
        replay.release()
        source.close()


def test_a_call_that_never_returns_holds_one_daemon_thread_and_close_does_not_wait_for_it() -> None:
    replay = NvmlReplay(FIXTURES / "nvml_fabric_h100x8_healthy.json")
    source = NvmlSource("gpu-a", "rack-1", nvml=replay, xid_events=False, gpu_timeout_s=0.5)
    threads = set(threading.enumerate())
    source.open()
    try:
        replay.block("*", gpu=STUCK)
        source.sample(1.0)
        t0 = time.monotonic()
        source.close()  # GPU 5's call is still inside the "driver"
        assert time.monotonic() - t0 < 5.0
        _wait(lambda: len(_readers(threads)) == 1, "the idle reader threads' exit")
        (stuck,) = _readers(threads)
        assert stuck.name == f"fh-gpu-read-{STUCK}" and stuck.daemon  # abandoned, never keeps the process alive
    finally:
        replay.release()


def test_the_probe_publishes_the_siblings_and_one_event_and_health_names_the_stalled_gpu(tmp_path) -> None:
    replay = NvmlReplay(FIXTURES / "nvml_fabric_h100x8_healthy.json")
    source = NvmlSource("gpu-a", "rack-1", nvml=replay, xid_events=False, gpu_timeout_s=1.0)
    config = ProbeConfig(node="gpu-a", rack="rack-1", socket_path=None, metrics_port=None, stall_timeout_s=5.0)
    probe = Probe(source, config, delivery=Delivery("kafka://127.0.0.1:9", Spool(tmp_path / "spool")))
    probe.open(background_delivery=False)
    try:
        replay.block("*", gpu=STUCK)
        assert all(probe.tick(now=100.0 + k).sampled for k in range(4))
        health = probe.health()
        assert health.gpu_stalls_total == 1 and health.gpus_stalled == 1 and health.stalls_total == 0
        assert any("1 GPU(s)" in r for r in probe.metrics.degraded())
        msgs = [decode(TOPIC_TYPES[Topic(r.topic)], r.value) for r in probe.delivery.spool.peek(1000)]
        tel = [m for m in msgs if isinstance(m, Telemetry)]
        assert [t.ts for t in tel] == [100.0, 101.0, 102.0, 103.0]
        assert all(int(np.isfinite(t.columns["temp_c"]).sum()) == 7 for t in tel)
        events = [m for m in msgs if isinstance(m, Event) and m.kind is EventKind.TELEMETRY_STALLED]
        assert [(e.gpu, e.ts) for e in events] == [(STUCK, 100.0)]
        text = probe.metrics.render().decode()
        assert "\nfleethealth_probe_gpu_stalls_total 1" in text and "\nfleethealth_probe_gpus_stalled 1" in text
    finally:
        replay.release()
        probe.close(drain_timeout_s=0.0)


def test_several_gpus_stalling_together_are_one_event_naming_them() -> None:
    replay = NvmlReplay(FIXTURES / "nvml_fabric_h100x8_healthy.json")
    source = NvmlSource("gpu-a", "rack-1", nvml=replay, xid_events=False, gpu_timeout_s=0.5)
    source.open()
    try:
        replay.block("nvmlDeviceGetPowerUsage")  # a driver wedged for every GPU
        sample = source.sample(5.0)
        assert np.isnan(sample.telemetry.columns["temp_c"]).all()
        (event,) = [e for e in sample.events if e.kind is EventKind.TELEMETRY_STALLED]
        assert event.gpu is None and event.data["gpus"] == list(range(8))
    finally:
        replay.release()
        source.close()


def test_gpu_timeout_must_be_below_the_stall_timeout(tmp_path, capsys) -> None:
    from fleethealth.commands import main

    code = main(["probe", "--source", "nvml", "--node", "n1", "--kafka", "kafka://127.0.0.1:9", "--no-socket",
                 "--spool-dir", str(tmp_path), "--gpu-timeout", "6", "--stall-timeout", "5"])
    assert code != 0 and "--gpu-timeout" in capsys.readouterr().err
