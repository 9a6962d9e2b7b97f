"""The in-job step timer: datagrams to the probe's socket, never blocking, lazily-read CUDA spans."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from fleethealth.errors import ConfigError
from fleethealth.injob.timer import StepTimer
from fleethealth.wire import parse


def test_cpu_span_and_progress_reach_the_socket_in_one_datagram(probe_socket) -> None:
    path, sock = probe_socket
    with StepTimer("train-1", 13, gpu=5, socket_path=path, cuda=False) as timer:
        with timer.compute(7):
            time.sleep(0.02)
        before_done = time.time()
        time.sleep(0.01)  # the collective
        timer.step_done(7)
        assert not timer.cuda and timer.stats.sent_total == 1  # one send per step
        timer.step_done(8)  # a mark without a span
        with timer.compute(9):
            pass
        with timer.compute(10):  # 9 was never marked done: it goes out when 10 starts
            pass
    msgs = [parse(sock.recv(65536)) for _ in range(4)]  # 10 goes out at close
    c = msgs[0]
    assert (c.kind, c.job, c.rank, c.gpu, c.step) == ("c", "train-1", 13, 5, 7)
    assert 0.015 < c.value < 1.0 and c.ts >= before_done + 0.005  # ts is the step's completion
    assert [(m.kind, m.step) for m in msgs[1:]] == [("p", 8), ("c", 9), ("c", 10)]


def test_never_blocks_without_a_probe_and_counts_drops(tmp_path) -> None:
    timer = StepTimer("j", 0, gpu=0, socket_path=str(tmp_path / "absent.sock"), cuda=False)
    t0 = time.perf_counter()
    for step in range(200):
        with timer.compute(step):
            pass
        timer.step_done(step)
    assert time.perf_counter() - t0 < 1.0
    assert timer.stats.dropped_total == 200 and timer.stats.sent_total == 0
    timer.close()


def test_a_full_probe_queue_drops_instead_of_blocking(probe_socket) -> None:
    path, sock = probe_socket
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    timer = StepTimer("j", 1, gpu=1, socket_path=path, cuda=False)
    t0 = time.perf_counter()
    for step in range(5000):  # nobody reads: the receive queue fills
        with timer.compute(step):
            pass
        timer.step_done(step)
    assert time.perf_counter() - t0 < 5.0
    stats = timer.stats  # the queue takes a few, the bounded backlog holds 4,096 for later, the rest drop
    assert stats.dropped_total > 0 and stats.waiting > 0
    assert stats.sent_total + stats.dropped_total + stats.waiting == 5000
    timer._sender.close_timeout_s = 0.05
    timer.close()  # still nobody reads: what waited is lost after the bounded flush, and counted
    assert timer.stats.sent_total + timer.stats.dropped_total == 5000


class _FakeEvent:
    """A CUDA event stand-in for the lazy-reading logic where no device exists: ``query()`` is
    false until the test marks the device done; ``synchronize`` must never be called."""

    device_done_until = -1  # records with a sequence number up to this have completed
    synchronize_calls = 0
    made = 0
    records = 0

    def __init__(self) -> None:
        _FakeEvent.made += 1
        self.seq = -1

    def record(self) -> None:
        self.seq = _FakeEvent.records
        _FakeEvent.records += 1

    def query(self) -> bool:
        return self.seq <= _FakeEvent.device_done_until

    def elapsed_time(self, end: _FakeEvent) -> float:
        return 250.0  # ms

    def synchronize(self) -> None:
        _FakeEvent.synchronize_calls += 1


def test_cuda_spans_are_read_lazily_in_order_without_synchronising(probe_socket) -> None:
    path, sock = probe_socket
    _FakeEvent.device_done_until, _FakeEvent.synchronize_calls, _FakeEvent.made, _FakeEvent.records = -1, 0, 0, 0
    timer = StepTimer("j", 2, gpu=2, socket_path=path, event_factory=_FakeEvent, max_pending=4)
    assert timer.cuda
    for step in range(3):
        with timer.compute(step):
            pass
    assert timer.stats.sent_total == 0 and timer.stats.pending == 3  # nothing read yet: the device is busy
    _FakeEvent.device_done_until = 3  # steps 0 and 1 finished (events 0..3)
    timer.step_done(2)
    msgs = [parse(sock.recv(65536)) for _ in range(3)]
    assert [(m.kind, m.step) for m in msgs] == [("c", 0), ("c", 1), ("p", 2)]
    assert msgs[0].value == 0.25 and timer.stats.pending == 1
    for step in range(3, 10):  # the device stalls: the oldest spans are dropped, memory stays bounded
        with timer.compute(step):
            pass
    assert timer.stats.pending == 4 and timer.stats.spans_dropped_total == 4
    assert _FakeEvent.made <= 2 * 6 and _FakeEvent.synchronize_calls == 0  # events are reused
    timer.close()


def test_bad_arguments_are_config_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="rank"):
        StepTimer("j", -1, socket_path=str(tmp_path / "s"))
    with pytest.raises(ConfigError, match="job"):
        StepTimer("", 0, socket_path=str(tmp_path / "s"))


def test_importing_the_timer_does_not_import_torch() -> None:
    code = "import sys, fleethealth.injob.timer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "False"


@pytest.mark.gpu
def test_real_cuda_events_on_a_device(probe_socket) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    path, sock = probe_socket
    timer = StepTimer("j", 0, gpu=0, socket_path=path, cuda=True)
    x = torch.randn(2048, 2048, device="cuda")
    for step in range(3):
        with timer.compute(step):
            x = x @ x
            x = x / x.norm()
    torch.cuda.synchronize()  # the test waits; the timer itself never does
    assert timer.flush() == 3
    values = [parse(sock.recv(65536)).value for _ in range(3)]
    assert all(0.0 < v < 5.0 for v in values)
    timer.close()
