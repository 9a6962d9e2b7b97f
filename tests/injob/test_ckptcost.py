"""Checkpoint save costs from inside the training job: what blocked, what ran in the background (torch-free)."""

from __future__ import annotations

from concurrent.futures import Future

import orjson
import pytest

from fleethealth.errors import ConfigError
from fleethealth.injob.ckptcost import SaveTimer, report_checkpoint_cost
from fleethealth.injob.reporter import Reporter
from fleethealth.payloads.checkpoint_cost import CheckpointCost
from fleethealth.schema import EventKind


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _timer(rank: int = 0):
    seen: list = []
    clock = _Clock()
    reporter = Reporter(job="llm", rank=rank, gpu=0, sink=seen.append, clock=lambda: 1_796_000_000.0)
    return SaveTimer(reporter, clock=clock), clock, seen


def test_a_synchronous_save_reports_all_of_it_as_blocking():
    saves, clock, seen = _timer()
    with saves.timed(40, "s3://ckpt/40"):
        clock.t += 12.5
    (ev,) = seen
    assert ev.kind is EventKind.CHECKPOINT_COST and (ev.job, ev.rank, ev.step) == ("llm", 0, 40)
    assert CheckpointCost.from_event(ev) == CheckpointCost(40, 12.5, 0.0, "s3://ckpt/40")


def test_a_background_write_is_reported_when_its_future_completes():
    saves, clock, seen = _timer()
    future: Future = Future()
    with saves.timed(80) as save:
        clock.t += 0.5                      # the copy to host memory
        assert save.background(future) is future
    assert seen == [] and save.blocking_s == 0.5   # training goes on; nothing waits for the write
    clock.t += 9.0
    future.set_result(None)                 # the writer's thread completes it
    (ev,) = seen
    assert (ev.data["blocking_s"], ev.data["write_s"]) == (0.5, 9.0)
    future2: Future = Future()              # a write done before the block ends: reported at its end
    with saves.timed(120) as save:
        save.background(future2)
        clock.t += 1.0
        future2.set_result(None)
        assert len(seen) == 1
    assert (seen[-1].step, seen[-1].data["blocking_s"], seen[-1].data["write_s"]) == (120, 1.0, 0.0)


def test_only_the_emitting_rank_reports_and_a_failed_save_is_not_reported():
    saves, clock, seen = _timer(rank=3)
    with saves.timed(40):
        clock.t += 2.0
    assert seen == []
    saves, clock, seen = _timer()
    with pytest.raises(OSError), saves.timed(40):
        raise OSError("disk full")
    assert seen == []
    with pytest.raises(ConfigError, match="add_done_callback"), saves.timed(41) as save:
        save.background(object())


def test_bad_values_are_logged_not_raised_and_the_record_reaches_the_probe_socket(probe_socket, caplog):
    path, sock = probe_socket
    reporter = Reporter(job="llm", rank=0, socket_path=path)
    assert not report_checkpoint_cost(reporter, step=5, blocking_s=float("nan"))
    assert "not reported" in caplog.text
    assert report_checkpoint_cost(reporter, step=5, blocking_s=0.25, write_s=3.0, uri="file:///c/5")
    datagram = orjson.loads(sock.recv(65536))
    assert datagram["event"]["kind"] == "checkpoint_cost" and datagram["event"]["data"]["write_s"] == 3.0
    reporter.close()


def test_the_probe_relays_checkpoint_cost_from_training_processes():
    """The datagram the reporter sends passes the probe's aggregator (a kind a training process may send)."""
    from fleethealth.probe.aggregator import StepAggregator
    from fleethealth.wire import event_datagram

    sent: list = []
    reporter = Reporter(job="llm", rank=0, gpu=0, sink=sent.append, clock=lambda: 50.0)
    assert report_checkpoint_cost(reporter, step=7, blocking_s=1.5, write_s=20.0)
    agg = StepAggregator("gpu-a1")
    agg.feed(orjson.dumps(event_datagram(sent[0])), 50.0)
    (ev,) = agg.drain(50.0).events
    assert (ev.kind, ev.node, ev.job, ev.step) == (EventKind.CHECKPOINT_COST, "gpu-a1", "llm", 7)
    assert CheckpointCost.from_event(ev) == CheckpointCost(7, 1.5, 20.0, "")
