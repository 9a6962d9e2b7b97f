"""The Reporter: in-job events reach the node probe's socket without a node (the probe fills it), and a
broken sink never stops training."""

from __future__ import annotations

import socket
import subprocess
import sys

from fleethealth.injob.reporter import Reporter
from fleethealth.payloads.sdc_check import SdcCheck, sdc_check_event
from fleethealth.schema import Event
from fleethealth.wire import Sender, event_datagram, parse


def test_event_reaches_a_real_probe_socket_without_node(tmp_path) -> None:
    """A Reporter over a real Unix datagram socket: the probe side parses it with wire.parse."""
    path = str(tmp_path / "probe.sock")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    probe.bind(path)
    try:
        reporter = Reporter(job="train-1", rank=4, gpu=4, socket_path=path)
        assert reporter.emit(sdc_check_event(ts=5.0, check="selfcheck", passed=True, step=100,
                                             digests=["ab", "ab"]))
        msg = parse(probe.recv(65536))
        assert msg.kind == "e" and msg.job == "train-1" and msg.rank == 4 and msg.step == 100
        assert "node" not in msg.event and msg.event["data"]["passed"] is True
        received = Event.from_obj({**msg.event, "node": "n0001"})
        assert SdcCheck.from_event(received).digests == ("ab", "ab")
        reporter.close()
    finally:
        probe.close()


def test_reporter_never_raises_and_counts() -> None:
    seen: list[Event] = []

    def broken(event: Event) -> None:
        raise OSError("probe gone")

    ok = Reporter(job="j", rank=2, gpu=0, sink=seen.append)
    bad = Reporter(job="j", rank=2, gpu=0, sink=broken)
    e = sdc_check_event(ts=1.0, check="selfcheck", passed=True)
    assert ok.emit(e) and seen[0].rank == 2 and seen[0].job == "j"
    assert not bad.emit(e) and bad.failed_total == 1
    absent = Reporter(job="j", rank=0, socket_path="/nonexistent/probe.sock")
    assert not absent.emit(e) and absent.sender.dropped_total == 1
    assert event_datagram(e)["t"] == "e" and "node" not in event_datagram(e)["event"]


def test_torch_free_modules_import_without_torch() -> None:
    code = ("import sys, fleethealth.injob as j\n"
            "from fleethealth.injob import Reporter, Watermark, HangWatchdog, ReplayCalibration, Invariants, "
            "sdc_check_event, retention\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "assert set(j.__all__) >= {'SdcGuard', 'HangWatchdog', 'Watermark', 'sdc_check_event'}\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_full_probe_queue_delays_datagrams_in_order_and_loses_none(tmp_path) -> None:
    """Ranks finishing a step together on a loaded node fill the probe's socket queue (the kernel's
    ``net.unix.max_dgram_qlen``, 10 by default). The sender keeps what the queue cannot take in its
    bounded backlog, never blocking, and delivers it in order once the probe reads; a datagram is
    dropped only when the backlog is full, or still waiting when the sender closes."""
    path = str(tmp_path / "probe.sock")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    probe.bind(path)
    probe.settimeout(5.0)
    try:
        sender = Sender(path, backlog=500)
        for step in range(400):  # the probe reads nothing meanwhile
            assert sender.send({"t": "p", "job": "j", "rank": 0, "gpu": 0, "step": step, "ts": 1.0})
        assert sender.waiting > 0 and sender.dropped_total == 0, (sender.waiting, sender.dropped_total)
        got: list[int] = []
        while len(got) < 400:  # the probe catches up; each send and flush moves the backlog on
            got.append(parse(probe.recv(65536)).step)
            sender.flush()
        assert got == list(range(400)) and sender.waiting == 0 and sender.sent_total == 400

        small = Sender(path, backlog=5, close_timeout_s=0.05)
        taken = [small.send({"t": "p", "job": "j", "rank": 1, "gpu": 0, "step": s, "ts": 1.0}) for s in range(100)]
        assert taken.count(False) == small.dropped_total > 0  # the backlog full: refused, counted
        assert small.waiting == 5
        small.close()  # the probe still reads nothing: what waits is lost after the bounded flush
        assert small.lost_after_accept == 5 and small.dropped_total == taken.count(False) + 5
    finally:
        probe.close()


def test_a_reporter_counts_what_its_backlog_never_delivered(tmp_path) -> None:
    path = str(tmp_path / "probe.sock")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    probe.bind(path)
    try:
        reporter = Reporter(job="j", rank=0, gpu=0, socket_path=path)
        reporter.sender.close_timeout_s = 0.05
        e = sdc_check_event(ts=1.0, check="selfcheck", passed=True)
        assert all(reporter.emit(e) for _ in range(50))  # queued, not refused: emit says True
        assert reporter.failed_total == 0 and reporter.sender.waiting > 0
        reporter.close()
        assert reporter.dropped_total == reporter.sender.lost_after_accept > 0
    finally:
        probe.close()
