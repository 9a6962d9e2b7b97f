"""The hang watchdog: fires on missing progress with every thread's stack; driven by a fake clock."""

from __future__ import annotations

import threading

import pytest

from fleethealth.errors import ConfigError
from fleethealth.injob.reporter import Reporter
from fleethealth.injob.watchdog import HangWatchdog, dump_all_stacks
from fleethealth.payloads.hang_report import HangReport
from fleethealth.schema import Event


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _watchdog(**kw) -> tuple[HangWatchdog, _Clock, list[Event]]:
    clock, seen = _Clock(), []
    wd = HangWatchdog(90.0, reporter=Reporter(job="j", rank=5, gpu=5, sink=seen.append), clock=clock, **kw)
    return wd, clock, seen


def test_fires_once_after_the_timeout_and_rearms_on_progress() -> None:
    wd, clock, seen = _watchdog()
    wd.beat(448)
    wd.collective("all_reduce")
    clock.t += 89.0
    assert wd.poll(clock()) is None
    clock.t += 2.0
    event = wd.poll(clock())
    assert event is not None and seen == [event]
    assert event.rank == 5 and event.step == 448 and event.job == "j"
    rep = HangReport.from_event(event)
    assert rep.last_collective == "all_reduce" and rep.timeout_s == 90.0
    assert "test_fires_once_after_the_timeout_and_rearms_on_progress" in rep.stacks  # this thread's frame
    clock.t += 500.0
    assert wd.poll(clock()) is None and wd.fired_total == 1  # one report per stall
    wd.beat(449)
    clock.t += 91.0
    assert wd.poll(clock()) is not None and wd.fired_total == 2


def test_abort_and_hook_run_after_the_report() -> None:
    order: list[str] = []
    wd, clock, seen = _watchdog(abort=True, abort_fn=lambda: order.append("abort"),
                                on_hang=lambda e: order.append(f"hook {e.step}"))
    wd.beat(10)
    clock.t += 100
    wd.poll(clock())
    assert len(seen) == 1 and order == ["hook 10", "abort"]


def test_stack_dump_covers_other_threads() -> None:
    gate, started = threading.Event(), threading.Event()

    def parked_in_collective() -> None:
        started.set()
        gate.wait(10)

    t = threading.Thread(target=parked_in_collective, name="worker")
    t.start()
    started.wait(5)
    try:
        assert "parked_in_collective" in dump_all_stacks()
    finally:
        gate.set()
        t.join()


def test_thread_fires_without_any_beat() -> None:
    fired = threading.Event()
    wd = HangWatchdog(0.05, reporter=Reporter(rank=0, sink=lambda e: None), poll_s=0.01,
                      on_hang=lambda e: fired.set())
    with wd:
        assert fired.wait(5.0)
    assert wd.fired_total == 1 and wd.last_report.step is None


def test_bad_timeout() -> None:
    with pytest.raises(ConfigError):
        HangWatchdog(0.0)


def test_a_check_runs_under_the_wider_limit_and_restarts_the_step_clock() -> None:
    wd, clock, seen = _watchdog(check_timeout_s=600.0)
    wd.beat(7)
    clock.t += 80.0
    with wd.checking("replay"):
        clock.t += 500.0  # a slow replay: far past the step timeout, within the check limit
        assert wd.poll(clock()) is None and wd.limit_s == 600.0
    clock.t += 89.0  # the rest of the step gets a full step timeout after the check
    assert wd.poll(clock()) is None and wd.limit_s == 90.0
    clock.t += 2.0
    assert wd.poll(clock()) is not None
    wd.beat(8)
    with wd.checking("replay"):  # a check that truly stalls is still reported, at its own limit
        clock.t += 601.0
        event = wd.poll(clock())
    assert event is not None and HangReport.from_event(event).timeout_s == 600.0 and len(seen) == 2
    assert HangWatchdog(2.0).check_timeout_s == 20.0
    with pytest.raises(ConfigError):
        HangWatchdog(2.0, check_timeout_s=1.0)
