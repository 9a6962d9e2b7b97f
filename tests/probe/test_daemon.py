"""The probe loop: one telemetry message per tick, events, stalls, the in-job socket, the CLI.

The NVML source replays recorded answers (these machines have no GPU); nothing here needs a
broker: records are read back from the probe's spool, which is where every record goes first.
"""

from __future__ import annotations

import socket
import time

import orjson
import pytest

from fleethealth.commands import main
from fleethealth.injob.timer import StepTimer
from fleethealth.probe.daemon import Probe, ProbeConfig
from fleethealth.probe.delivery import Delivery
from fleethealth.probe.nvml import NvmlSource
from fleethealth.probe.recorded import NvmlReplay
from fleethealth.probe.spool import Spool
from fleethealth.schema import TOPIC_TYPES, Event, EventKind, StepBatch, StepBlock, Telemetry, Topic, decode


def _probe(tmp_path, source, *, socket_path=None, stall_timeout_s=5.0, step_timeout_s=5.0, **kwargs) -> Probe:
    config = ProbeConfig(node="n0003", rack="r00", socket_path=socket_path, metrics_port=None,
                         stall_timeout_s=stall_timeout_s, step_timeout_s=step_timeout_s)
    delivery = Delivery("kafka://127.0.0.1:9", Spool(tmp_path / "spool"))
    return Probe(source, config, delivery=delivery, **kwargs).open(background_delivery=False)


def _messages(probe: Probe) -> list[object]:
    return [decode(TOPIC_TYPES[Topic(r.topic)], r.value) for r in probe.delivery.spool.peek(100_000)]


def _spooled(probe: Probe) -> list[object]:
    """The spooled messages, each step block as its step batches."""
    return [part for m in _messages(probe) for part in (m.split() if isinstance(m, StepBlock) else [m])]


@pytest.fixture
def replay(recording) -> NvmlReplay:
    return NvmlReplay(recording("nvml_h100_faults.json"))


def test_one_telemetry_message_per_tick_and_xid_events(tmp_path, replay) -> None:
    probe = _probe(tmp_path, NvmlSource("n0003", "r00", nvml=replay, xid_wait_ms=10))
    try:
        deadline = time.monotonic() + 5
        ticks = 0
        while time.monotonic() < deadline:
            probe.tick(now=1000.0 + ticks)
            ticks += 1
            if any(isinstance(m, Event) and m.kind is EventKind.XID for m in _spooled(probe)):
                break
            time.sleep(0.02)
        msgs = _spooled(probe)
        tel = [m for m in msgs if isinstance(m, Telemetry)]
        assert [t.ts for t in tel] == [1000.0 + i for i in range(ticks)]
        assert {(t.node, t.rack) for t in tel} == {("n0003", "r00")}
        xid = [m for m in msgs if isinstance(m, Event) and m.kind is EventKind.XID]
        assert [(e.gpu, e.code) for e in xid] == [(3, 48)]
        health = probe.health()
        assert health.samples_total == ticks and health.events_total == 1 and health.spool_records == len(msgs)
    finally:
        probe.close(drain_timeout_s=0.0)


def test_a_stalled_source_is_an_event_and_the_probe_keeps_ticking(tmp_path, replay) -> None:
    probe = _probe(tmp_path, NvmlSource("n0003", "r00", nvml=replay, xid_events=False), stall_timeout_s=0.2)
    try:
        assert probe.tick(now=1.0).sampled
        replay.block("nvmlDeviceGetFieldValues")
        report = probe.tick(now=2.0)
        assert not report.sampled and report.events == 1
        assert not probe.tick(now=3.0).sampled
        replay.release()
        deadline = time.monotonic() + 5
        while not probe.tick(now=4.0).sampled and time.monotonic() < deadline:
            time.sleep(0.01)
        kinds = [(type(m).__name__, getattr(m, "kind", None)) for m in _spooled(probe)]
        assert kinds.count(("Event", EventKind.TELEMETRY_STALLED)) == 1
        assert kinds.count(("Telemetry", None)) == 2
        health = probe.health()
        assert health.stalls_total == 1 and health.stalled == 0
    finally:
        replay.release()
        probe.close(drain_timeout_s=0.0)


class _Broken:
    name = "broken"
    rack = "r00"

    def open(self) -> None:
        return None

    def sample(self, ts: float):
        raise RuntimeError("driver returned garbage")

    def close(self) -> None:
        return None


def test_a_failing_source_is_reported_once_not_a_crash(tmp_path) -> None:
    probe = _probe(tmp_path, _Broken())
    try:
        for t in range(3):
            assert not probe.tick(now=float(t)).sampled
        errors = [m for m in _spooled(probe) if isinstance(m, Event) and m.kind is EventKind.PROBE_ERROR]
        assert len(errors) == 1 and "driver returned garbage" in errors[0].message
        assert probe.health().sample_errors_total == 3
    finally:
        probe.close(drain_timeout_s=0.0)


def test_rank_datagrams_become_one_batch_per_step_and_garbage_is_counted(tmp_path, replay) -> None:
    sock_path = str(tmp_path / "run" / "probe.sock")
    probe = _probe(tmp_path, NvmlSource("n0003", "r00", nvml=replay, xid_events=False), socket_path=sock_path,
                   step_timeout_s=0.5)
    timers = [StepTimer("job-a", 24 + r, gpu=r, socket_path=sock_path, cuda=False) for r in range(4)]
    rogue = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rogue.setblocking(False)
    try:
        for step in range(3):
            for timer in timers:
                with timer.compute(step):
                    pass
                timer.step_done(step)
                _wait_for(probe, datagrams=5 * step + timer.rank - 23)
            rogue.sendto(b"\x00garbage" if step else orjson.dumps({"t": "c", "job": "job-a"}), sock_path)
            _wait_for(probe, datagrams=5 * (step + 1))
        probe.pump(time.monotonic() + 1.0)
        probe.tick(now=5.0)
        blocks = [m for m in _messages(probe) if isinstance(m, StepBlock | StepBatch)]
        assert len(blocks) == 1 and blocks[0].steps.tolist() == [0, 1, 2]  # one interval: one message
        batches = [m for m in _spooled(probe) if isinstance(m, StepBatch)]
        assert [b.step for b in batches] == [0, 1, 2]
        assert all(b.ranks.tolist() == [24, 25, 26, 27] and b.node == "n0003" for b in batches)
        health = probe.health()
        assert health.datagrams_garbage_total == 3 and health.datagrams_total == 15
    finally:
        rogue.close()
        for timer in timers:
            timer.close()
        probe.close(drain_timeout_s=0.0)


def test_out_of_range_datagrams_and_a_failing_datagram_do_not_stop_the_socket(tmp_path, replay, monkeypatch) -> None:
    """A GPU index past int16 is garbage (not a crash of the batch), and a fault injected into the
    handling of one datagram is counted while the socket thread keeps serving the ranks."""
    sock_path = str(tmp_path / "run" / "probe.sock")
    probe = _probe(tmp_path, NvmlSource("n0003", "r00", nvml=replay, xid_events=False), socket_path=sock_path,
                   step_timeout_s=0.2)
    real_add = probe.aggregator.add

    def add(msg, now, wall=None):
        if msg.job == "boom":
            raise RuntimeError("injected fault")
        real_add(msg, now, wall)

    monkeypatch.setattr(probe.aggregator, "add", add)
    rank = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        def send(job: str, step: int, gpu: int) -> None:
            rank.sendto(orjson.dumps({"t": "c", "job": job, "rank": 0, "gpu": gpu, "step": step, "s": 0.1,
                                      "ts": 1.0}), sock_path)

        send("job-a", 0, 40000)
        send("boom", 0, 0)
        _wait_for(probe, datagrams=2)
        send("job-a", 1, 0)
        _wait_for(probe, datagrams=3)
        probe.pump(time.monotonic() + 0.5)
        probe.tick(now=5.0)
        assert probe._receiver is not None and probe._receiver.is_alive()
        batches = [m for m in _spooled(probe) if isinstance(m, StepBatch)]
        assert [(b.job, b.step, b.gpus.tolist()) for b in batches] == [("job-a", 1, [0])]
        health = probe.health()
        assert health.datagrams_total == 3 and health.datagrams_garbage_total == 2
    finally:
        rank.close()
        probe.close(drain_timeout_s=0.0)


def test_an_event_datagram_without_ts_is_stamped_with_the_wall_clock(tmp_path, replay) -> None:
    sock_path = str(tmp_path / "run" / "probe.sock")
    probe = _probe(tmp_path, NvmlSource("n0003", "r00", nvml=replay, xid_events=False), socket_path=sock_path,
                   clock=lambda: 1_700_000_000.5)  # the monotonic clock stays time.monotonic
    rank = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        rank.sendto(orjson.dumps({"t": "e", "event": {"kind": "hang_report", "job": "job-a", "rank": 3, "step": 9,
                                                       "data": {"stacks": "Thread 0x1", "last_collective": None,
                                                                "timeout_s": 90.0}}}), sock_path)
        _wait_for(probe, datagrams=1)
        probe.tick(now=1_700_000_001.0)
        (hang,) = [m for m in _spooled(probe) if isinstance(m, Event) and m.kind is EventKind.HANG_REPORT]
        assert hang.ts == 1_700_000_000.5 and hang.node == "n0003"
    finally:
        rank.close()
        probe.close(drain_timeout_s=0.0)


def _wait_for(probe: Probe, datagrams: int) -> None:
    """Pace the sender as a training step would: the kernel queues only a few datagrams."""
    deadline = time.monotonic() + 5
    while probe.health().datagrams_total < datagrams and time.monotonic() < deadline:
        time.sleep(0.001)


def test_cli_missing_nvml_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    rc = main(["probe", "--source", "nvml", "--kafka", "kafka://127.0.0.1:9", "--spool-dir", str(tmp_path),
               "--no-socket", "--metrics-port", "0"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert err.startswith("fleethealth probe: error: NVML source") and "--source sim" in err


def test_cli_requires_a_bus(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("FLEETHEALTH_KAFKA", raising=False)
    assert main(["probe", "--source", "sim", "--spool-dir", str(tmp_path)]) == 2
    assert "--kafka DSN is required" in capsys.readouterr().err
