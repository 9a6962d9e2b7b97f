"""The in-job validator: the training thread never waits for a validation; results reach the probe."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

from fleethealth.injob.ckptcheck.background import CheckpointValidator
from fleethealth.injob.ckptcheck.rules import Verdict
from fleethealth.injob.reporter import Reporter
from fleethealth.payloads.validation import CheckpointValidation, ValidationResult
from fleethealth.probe.aggregator import StepAggregator
from fleethealth.schema import EventKind

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(scale: float = 1.0) -> dict:
    torch.manual_seed(3)
    model = torch.nn.Linear(5, 4)
    return {"model": {k: v * scale for k, v in model.state_dict().items()}, "step": 1}


class _Gate:
    """A check that holds the worker until the test opens it, then reports valid."""

    def __init__(self) -> None:
        self.started, self.open = threading.Event(), threading.Event()

    def __call__(self, path, expected, band, rules, step) -> Verdict:
        self.started.set()
        if not self.open.wait(30):
            raise TimeoutError("the test never opened the gate")
        return Verdict(valid=True)


def test_saved_returns_while_the_validation_runs_and_far_faster_than_it():
    gate, seen = _Gate(), []
    v = CheckpointValidator(Reporter(job="j", rank=0, sink=seen.append), check=gate)
    state = _state()
    began = time.perf_counter()
    assert v.saved(10, "/ck/10", state) is True
    call_s = time.perf_counter() - began
    assert gate.started.wait(10)
    assert not v.results and not seen            # the step went on while the validation had not finished
    time.sleep(0.5)                              # the validation's own length, set here
    gate.open.set()
    assert v.wait(10)
    [record] = v.results
    assert record.valid and record.duration_s >= 0.5
    assert call_s < record.duration_s / 10, (call_s, record.duration_s)
    v.close()


def test_a_full_queue_skips_and_reports_instead_of_waiting():
    gate, seen = _Gate(), []
    v = CheckpointValidator(Reporter(job="j", rank=0, sink=seen.append), check=gate, queue_size=1)
    assert v.saved(1, "/ck/1")
    assert gate.started.wait(10)                 # the worker holds checkpoint 1
    assert v.saved(2, "/ck/2")                   # waits in the queue
    assert v.saved(3, "/ck/3") is False          # no room: skipped, not waited for
    [skipped] = [CheckpointValidation.from_event(e) for e in seen]
    assert skipped.step == 3 and skipped.result is ValidationResult.SKIPPED and "queue was full" in skipped.reasons[0]
    gate.open.set()
    assert v.wait(10)
    assert v.validity() == {1: True, 2: True, 3: False} and v.dropped_total == 1
    v.close()


def test_a_crashing_check_is_an_invalid_checkpoint_not_a_crash():
    def broken(path, expected, band, rules, step):
        raise OSError("stale file handle")

    seen = []
    v = CheckpointValidator(Reporter(job="j", rank=0, sink=seen.append), check=broken)
    v.saved(5, "/ck/5")
    assert v.wait(10)
    [record] = v.results
    assert not record.valid and record.reasons == ("validation could not run: OSError: stale file handle",)
    assert v.failed_total == 1
    v.close()


def test_the_band_comes_from_the_checkpoints_it_found_valid(tmp_path):
    seen = []
    v = CheckpointValidator(Reporter(job="j", rank=0, sink=seen.append))
    for step, scale in ((1, 1.0), (2, 1.01), (3, 100.0), (4, 1.02)):
        path = tmp_path / f"ckpt-{step}.pt"
        state = _state(scale)
        torch.save(state, path)
        v.saved(step, path, state)
        assert v.wait(30)
    v.close()
    assert v.validity() == {1: True, 2: True, 3: False, 4: True}   # 3's norms never entered the band
    bad = CheckpointValidation.from_event(seen[2])
    assert [r.split(" norm ")[0] for r in bad.reasons] == ["tensor model.bias", "tensor model.weight"]
    assert all("x the largest of the last 2 valid checkpoints" in r for r in bad.reasons)


def test_the_event_goes_through_the_probe_socket_and_the_probe_takes_it(tmp_path, probe_socket):
    path, sock = probe_socket
    v = CheckpointValidator(Reporter(job="llm-run", rank=0, gpu=0, socket_path=path))
    ckpt = tmp_path / "ckpt.pt"
    state = _state()
    with warnings.catch_warnings():
        torch.save(state, ckpt)
    v.saved(7, ckpt, state)
    assert v.wait(30)
    v.close()
    agg = StepAggregator("gpu-a17")
    agg.feed(sock.recv(65536), now=0.0)
    [event] = agg.drain(0.0).events
    assert event.kind is EventKind.CHECKPOINT_VALIDATED and event.job == "llm-run" and event.node == "gpu-a17"
    assert CheckpointValidation.from_event(event).valid and event.step == 7


def test_a_restarted_validator_judges_its_first_checkpoint_against_the_history_it_is_given(tmp_path):
    from fleethealth.injob.ckptcheck.files import spec_of, write_manifest

    paths = []
    for step, scale in ((1, 1.0), (2, 1.01)):
        paths.append(tmp_path / f"ckpt-{step}.pt")
        torch.save(_state(scale), paths[-1])
        write_manifest(paths[-1], spec_of(_state(scale)), step=step)
    broken = tmp_path / "not-a-checkpoint.pt"
    broken.write_bytes(b"garbage")
    boom = tmp_path / "ckpt-3.pt"
    torch.save(_state(100.0), boom)
    seen = []
    v = CheckpointValidator(Reporter(job="j", rank=0, sink=seen.append), history=[broken, *paths])
    v.saved(3, boom, _state(100.0))
    assert v.wait(30)
    v.close()
    [record] = [CheckpointValidation.from_event(e) for e in seen]
    assert not record.valid and "the last 2 valid checkpoints" in record.reasons[0]   # the garbage one left out


def test_a_verdict_the_socket_did_not_take_is_sent_again_from_the_worker():
    answers, naps = [False, False, True], []
    seen = []

    def flaky(event):
        seen.append(event)
        return answers.pop(0)

    v = CheckpointValidator(Reporter(job="j", rank=0, sink=flaky), check=lambda *a: Verdict(valid=True),
                            retry_s=0.05, sleep=naps.append)
    v.saved(4, "/ck/4")
    assert v.wait(10)
    v.close()
    assert len(seen) == 3 and naps == [0.05, 0.1] and v.results[0].valid
