"""``job_start`` / ``job_exit`` records: built validated, read back the same, bad values named."""

from __future__ import annotations

import orjson
import pytest

from fleethealth.errors import SchemaError
from fleethealth.payloads.job import ExitStatus, JobExit, JobStart, job_exit_event, job_start_event
from fleethealth.schema import Event, EventKind, decode, encode


def test_job_start_round_trips_through_the_wire_format() -> None:
    ev = job_start_event(ts=10.0, world=4, first_step=41, resumed_from="file:///c/ckpt-000040.pt",
                         placement=["n0000", "n0004", "n0002", "n0003"], node="n0000", job="j", rank=0)
    back = decode(Event, orjson.loads(encode(ev)))
    assert back.kind is EventKind.JOB_START and back.step == 41
    assert JobStart.from_event(back) == JobStart(world=4, first_step=41, resumed_from="file:///c/ckpt-000040.pt",
                                                 placement=("n0000", "n0004", "n0002", "n0003"))


def test_job_exit_reads_each_status() -> None:
    for status in ExitStatus:
        ev = job_exit_event(ts=1.0, status=status, last_step=70, reason="why")
        assert JobExit.from_event(ev) == JobExit(status=status, last_step=70, reason="why")
        assert status.value in ev.message


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"world": 0}, "world"), ({"world": True}, "world"), ({"world": 2, "first_step": -1}, "first_step"),
    ({"world": 2, "placement": ["n0000"]}, "placement"), ({"world": 2, "resumed_from": 3}, "resumed_from"),
])
def test_bad_job_start_values_name_their_key(kwargs: dict, key: str) -> None:
    with pytest.raises(SchemaError, match=key):
        job_start_event(ts=0.0, **kwargs)


def test_bad_job_exit_values_name_their_key() -> None:
    with pytest.raises(SchemaError, match="status"):
        job_exit_event(ts=0.0, status="exploded")
    with pytest.raises(SchemaError, match="last_step"):
        job_exit_event(ts=0.0, status="completed", last_step=-2)
    with pytest.raises(SchemaError, match="kind"):
        JobExit.from_event(job_start_event(ts=0.0, world=1))
