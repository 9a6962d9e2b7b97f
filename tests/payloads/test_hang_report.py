"""The ``hang_report`` record: long stack dumps keep their innermost frames; the wire form is fixed."""

from __future__ import annotations

import pytest

from fleethealth.errors import SchemaError
from fleethealth.payloads.hang_report import HangReport, RankStacks, hang_report_event
from fleethealth.schema import Event, EventKind, encode


def test_hang_report_keeps_the_innermost_frames_when_truncated() -> None:
    stacks = "Thread 0x1 (most recent call first):\n" + "".join(f'  File "f{i}.py", line {i}\n'
                                                                  for i in range(20_000))
    e = hang_report_event(ts=3.0, stacks=stacks, timeout_s=90.0, last_collective="all_reduce", rank=7, step=449,
                          max_stack_chars=1000)
    rep = HangReport.from_event(e)
    assert len(rep.stacks) < 1100 and rep.stacks.endswith(stacks[-200:]) and rep.stacks.startswith("...")
    assert rep.last_collective == "all_reduce" and rep.timeout_s == 90.0 and e.rank == 7 and e.step == 449


def test_the_wire_form_is_unchanged() -> None:
    e = hang_report_event(ts=3.0, stacks='Thread 0x1:\n  File "a.py", line 1', timeout_s=90.0,
                          last_collective="all_reduce", node="n0002", job="train-1", rank=16, gpu=0, step=449)
    assert encode(e) == (
        b'{"v":1,"node":"n0002","ts":3.0,"kind":"hang_report","job":"train-1","gpu":0,"rank":16,"step":449,'
        b'"code":null,"message":"no step completed within 90 s; last collective all_reduce","data":{"stacks":'
        b'"Thread 0x1:\\n  File \\"a.py\\", line 1","last_collective":"all_reduce","timeout_s":90.0}}')


@pytest.mark.parametrize(("data", "field"), [
    ({"last_collective": None, "timeout_s": 1.0}, "stacks"),
    ({"stacks": "s", "last_collective": 3, "timeout_s": 1.0}, "last_collective"),
    ({"stacks": "s", "last_collective": None}, "timeout_s"),
])
def test_bad_reports_raise_naming_the_key(data: dict, field: str) -> None:
    e = Event(node="n0001", ts=1.0, kind=EventKind.HANG_REPORT, data=data)
    with pytest.raises(SchemaError) as err:
        HangReport.from_event(e)
    assert err.value.field == field


def test_reading_the_wrong_kind_is_an_error() -> None:
    with pytest.raises(SchemaError):
        HangReport.from_event(Event(node="n0001", ts=1.0, kind=EventKind.CHECKPOINT, data={"step": 1}))


def test_a_hang_finding_lists_each_rank_report_with_its_origin() -> None:
    report = HangReport(stacks="Thread 0x1", last_collective=None, timeout_s=90.0)
    listed = RankStacks(rank=16, node="n0002", gpu=0, step=450, ts=704.5, report=report).to_evidence()
    assert list(listed.items()) == [("rank", 16), ("node", "n0002"), ("gpu", 0), ("step", 450), ("ts", 704.5),
                                    ("last_collective", None), ("stacks", "Thread 0x1")]
