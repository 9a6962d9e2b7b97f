"""``instrument`` in one process: which span it measures, micro-step sums, what it leaves out, the
lazily read CUDA path (with stand-in events), DDP beside the SDC guard's comm hook (in a gloo process
of its own), and bad input."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from fleethealth.errors import ConfigError
from fleethealth.injob.instrument import instrument
from fleethealth.injob.timer import StepTimer
from fleethealth.wire import parse

sys.path.insert(0, str(Path(__file__).parent))
import _ddp_hook_worker as DW  # noqa: E402
from _ranks import run_ranks  # noqa: E402

DDP_WORKER = Path(__file__).with_name("_ddp_hook_worker.py")

FWD_S = 0.05
SLOP_S = 0.1
"""Bounds leave this much for scheduling delays; every excluded interval is longer."""


class _Sleep(torch.nn.Module):
    def __init__(self, seconds: float = FWD_S) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.lin(x)


def _micro(model: torch.nn.Module, n: int = 1) -> None:
    for _ in range(n):
        model(torch.randn(3, 4)).sum().backward()


def test_plain_span_sums_micro_steps_and_leaves_out_what_is_not_local_compute(probe_socket) -> None:
    path, sock = probe_socket
    model = _Sleep()
    with instrument(model, job="j", rank=3, gpu=1, socket_path=path, log=False) as timed:
        assert timed.method == "plain" and timed.clock == "perf_counter" and "plain" in timed.describe()
        _micro(model)
        time.sleep(0.25)  # the optimizer step, a collective: not in the span
        timed.step_done(0)
        for _ in range(3):  # gradient accumulation: three micro-steps, data loading between them
            _micro(model)
            time.sleep(0.15)
            with torch.no_grad():
                model(torch.randn(3, 4))  # an evaluation forward: not counted
        loss = model(torch.randn(3, 4)).sum()  # a recomputation as the SDC guard makes it: no .grad written
        torch.autograd.grad(loss, list(model.parameters()))
        timed.step_done(1)
        assert timed.last_micro_steps == 3
        timed.step_done(2)  # no micro-step: a progress mark
        (model(torch.randn(3, 4)) - model(torch.randn(3, 4))).sum().backward()  # two forwards, one backward
        timed.step_done(3)
    msgs = [parse(sock.recv(65536)) for _ in range(4)]
    assert [(m.kind, m.job, m.rank, m.gpu, m.step) for m in msgs] == [
        ("c", "j", 3, 1, 0), ("c", "j", 3, 1, 1), ("p", "j", 3, 1, 2), ("c", "j", 3, 1, 3)]
    assert FWD_S <= msgs[0].value < FWD_S + SLOP_S
    assert 3 * FWD_S <= msgs[1].value < 3 * FWD_S + SLOP_S  # not the gaps, the evaluations or the recomputation
    assert 2 * FWD_S <= msgs[3].value < 2 * FWD_S + SLOP_S


def test_hooks_are_removed_at_close(probe_socket) -> None:
    path, _ = probe_socket
    model = _Sleep()
    timed = instrument(model, job="j", rank=0, socket_path=path, log=False)
    timed.close()
    assert not model._forward_pre_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


class _FakeEvent:
    """A CUDA event stand-in: complete only once the test says the device got there."""

    done_until = -1
    records = 0
    synchronize_calls = 0

    def __init__(self) -> None:
        self.seq = -1
        self.t = 0.0

    def record(self) -> None:
        self.seq = _FakeEvent.records
        _FakeEvent.records += 1
        self.t = time.perf_counter()

    def query(self) -> bool:
        return self.seq <= _FakeEvent.done_until

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.t - self.t) * 1000.0

    def synchronize(self) -> None:
        _FakeEvent.synchronize_calls += 1


def test_cuda_path_reads_event_spans_lazily_and_never_waits(probe_socket) -> None:
    path, sock = probe_socket
    _FakeEvent.done_until, _FakeEvent.records, _FakeEvent.synchronize_calls = -1, 0, 0
    model = _Sleep()
    timed = instrument(model, job="j", rank=0, socket_path=path, cuda=True, event_factory=_FakeEvent, log=False)
    assert timed.clock == "cuda_events" and not timed.includes_waits
    _micro(model, 2)
    timed.step_done(0)  # two event pairs queued; the device has not reached them
    assert timed.stats.pending == 1 and timed.stats.sent_total == 0
    _micro(model)
    _FakeEvent.done_until = 3  # step 0's four events are complete
    timed.step_done(1)
    msg = parse(sock.recv(65536))
    assert (msg.kind, msg.step) == ("c", 0) and 2 * FWD_S <= msg.value < 2 * FWD_S + SLOP_S
    assert timed.stats.pending == 1
    _FakeEvent.done_until = 10**9
    assert timed.flush() == 1 and parse(sock.recv(65536)).step == 1
    timed.close()
    assert _FakeEvent.synchronize_calls == 0


def test_ddp_is_timed_with_gradient_hooks_beside_the_sdc_guard_comm_hook(probe_socket, tmp_path) -> None:
    """DDP on gloo runs in a process of its own (``_ddp_hook_worker.py``, one rank): a collective
    that never completes blocks in C++, where no test timeout reaches, so it must not be the suite's
    own process that waits."""
    path, sock = probe_socket
    assert path == str(tmp_path / "probe.sock")  # where the worker sends its spans
    (out,) = run_ranks(DDP_WORKER, 1, tmp_path, timeout_s=180)
    assert out["method"] == "ddp"
    msgs = [parse(sock.recv(65536)) for _ in range(DW.STEPS)]
    assert [(m.kind, m.step) for m in msgs] == [("c", s) for s in range(DW.STEPS)]
    # the guard's self-check recomputation at step 2 adds nothing to the span (step 0 holds first-use setup)
    assert all(DW.FWD_S <= m.value < DW.FWD_S + SLOP_S for m in msgs[1:]), [m.value for m in msgs]
    assert out["checks"] and all(c["passed"] for c in out["checks"])


def test_step_timer_and_instrument_take_job_rank_and_socket_from_the_environment(probe_socket, monkeypatch) -> None:
    path, sock = probe_socket
    monkeypatch.setenv("FLEETHEALTH_JOB", "env-job")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("FLEETHEALTH_SOCKET", path)  # read when the timer is built, not at import
    timer = StepTimer(cuda=False)
    assert (timer.job, timer.rank, timer.gpu) == ("env-job", 5, 1)
    timer.step_done(0)
    timer.close()
    model = _Sleep()
    with instrument(model, group=2, log=False) as timed:
        _micro(model)
        timed.step_done(1)
    p, c = parse(sock.recv(65536)), orjson_loads(sock.recv(65536))
    assert (p.kind, p.job, p.rank, p.gpu, p.step) == ("p", "env-job", 5, 1, 0)
    assert (c["t"], c["job"], c["rank"], c["g"]) == ("c", "env-job", 5, 2)
    monkeypatch.delenv("FLEETHEALTH_JOB")
    with pytest.raises(ConfigError, match="FLEETHEALTH_JOB"):
        StepTimer()


def orjson_loads(data: bytes) -> dict:
    import orjson

    return orjson.loads(data)


def test_reporting_never_blocks_without_a_probe_and_warns_once(tmp_path, caplog) -> None:
    caplog.set_level("WARNING", logger="fleethealth.injob")
    model = torch.nn.Linear(4, 2)
    timed = instrument(model, job="j", rank=0, socket_path=str(tmp_path / "absent.sock"), log=False)
    t0 = time.perf_counter()
    for step in range(100):
        _micro(model)
        timed.step_done(step)
    assert time.perf_counter() - t0 < 5.0
    assert timed.stats.dropped_total == 100 and timed.stats.sent_total == 0
    warned = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(warned) == 1 and "job j rank 0" in warned[0], warned  # once a minute, not once a step
    timed.close()


def test_bad_input_is_a_config_error(tmp_path) -> None:
    sock = str(tmp_path / "s")
    with pytest.raises(ConfigError, match="torch.nn.Module"):
        instrument(object(), job="j", rank=0, socket_path=sock)  # type: ignore[arg-type]
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match="requires a gradient"):
        instrument(frozen, job="j", rank=0, socket_path=sock)
    with pytest.raises(ConfigError, match="group"):
        StepTimer("j", 0, group=-1, socket_path=sock)
