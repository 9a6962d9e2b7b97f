"""The sdc_check / hang_report / checkpoint records: builders validate, and they survive the wire and
the schema codec unchanged (the probe fills the node)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from fleethealth.errors import SchemaError
from fleethealth.injob.records import (
    CheckKind,
    Classification,
    HangReport,
    SdcCheck,
    checkpoint_event,
    classify,
    event_datagram,
    hang_report_event,
    sdc_check_event,
)
from fleethealth.injob.report import Reporter
from fleethealth.schema import Event, EventKind, decode, encode
from fleethealth.wire import parse


def _replay_failure() -> Event:
    return sdc_check_event(ts=12.5, check="replay", passed=False, classification="persistent",
                           digests=["0a1b", "ffee"], duration_s=0.4, peer_ranks=[3, 5], culprit_rank=1,
                           tolerance=1e-6, job="train-1", rank=1, gpu=1, step=10_000)


def test_sdc_check_event_has_the_contract_keys_and_round_trips() -> None:
    e = _replay_failure()
    assert e.kind is EventKind.SDC_CHECK and e.rank == 1 and e.step == 10_000
    assert set(e.data) == {"check", "passed", "classification", "digests", "duration_s", "peer_ranks",
                           "culprit_rank", "tolerance"}
    assert "culprit rank 1" in e.message and "persistent" in e.message
    filled = Event(**{**e.__dict__, "node": "n0007"})
    back = decode(Event, encode(filled))
    rec = SdcCheck.from_event(back)
    assert rec == SdcCheck(check=CheckKind.REPLAY, passed=False, classification=Classification.PERSISTENT,
                           digests=("0a1b", "ffee"), duration_s=0.4, peer_ranks=(3, 5), culprit_rank=1,
                           tolerance=1e-6)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"check": "bisect"}, "check"),
    ({"passed": "yes"}, "passed"),
    ({"classification": "cosmic"}, "classification"),
    ({"digests": ["xyz"]}, "digests"),
    ({"digests": "abcd"}, "digests"),
    ({"peer_ranks": [-1]}, "peer_ranks"),
    ({"culprit_rank": True}, "culprit_rank"),
    ({"tolerance": float("nan")}, "tolerance"),
    ({"duration_s": -1.0}, "duration_s"),
])
def test_bad_record_values_raise_naming_the_key(kwargs: dict, field: str) -> None:
    base = {"ts": 1.0, "check": "selfcheck", "passed": True}
    with pytest.raises(SchemaError) as err:
        sdc_check_event(**{**base, **kwargs})
    assert err.value.field == field


def test_reading_the_wrong_kind_is_an_error() -> None:
    e = checkpoint_event(ts=1.0, step=600, uri="s3://ckpt/600", last_verified_step=500)
    with pytest.raises(SchemaError):
        SdcCheck.from_event(e)
    with pytest.raises(SchemaError):
        HangReport.from_event(e)
    with pytest.raises(SchemaError):
        checkpoint_event(ts=1.0, step=600, uri="u", last_verified_step=700)


def test_classification_follows_the_rerun_logic() -> None:
    assert classify(False, None) is Classification.TRANSIENT
    assert classify(False, True) is Classification.TRANSIENT
    assert classify(True, False) is Classification.PERSISTENT
    assert classify(True, True) is Classification.DATA_OR_CODE
    assert classify(True, None) is None


def test_hang_report_keeps_the_innermost_frames_when_truncated() -> None:
    stacks = "Thread 0x1 (most recent call first):\n" + "".join(f'  File "f{i}.py", line {i}\n'
                                                                  for i in range(20_000))
    e = hang_report_event(ts=3.0, stacks=stacks, timeout_s=90.0, last_collective="all_reduce", rank=7, step=449,
                          max_stack_chars=1000)
    rep = HangReport.from_event(e)
    assert len(rep.stacks) < 1100 and rep.stacks.endswith(stacks[-200:]) and rep.stacks.startswith("...")
    assert rep.last_collective == "all_reduce" and rep.timeout_s == 90.0 and e.rank == 7 and e.step == 449


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
    assert event_datagram(e)["t"] == "e"


def test_torch_free_modules_import_without_torch() -> None:
    code = ("import sys, fleethealth.injob as j\n"
            "from fleethealth.injob import Reporter, Watermark, HangWatchdog, ReplayCalibration, Invariants, "
            "sdc_check_event, retention\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "assert set(j.__all__) >= {'SdcGuard', 'HangWatchdog', 'Watermark', 'sdc_check_event'}\n")
    subprocess.run([sys.executable, "-c", code], check=True)
