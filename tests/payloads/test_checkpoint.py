"""The ``checkpoint`` record: a strict builder, readers that keep every checkpoint whose step they can
read, and an unchanged wire form."""

from __future__ import annotations

import pytest

from fleethealth.errors import SchemaError
from fleethealth.payloads.checkpoint import CheckpointRecord, checkpoint_event
from fleethealth.schema import Event, EventKind, encode


def test_the_builder_validates_and_the_wire_form_carries_both_marks() -> None:
    e = checkpoint_event(ts=5.0, step=400, uri="ckpt://train-1/400", last_verified_step=350, node="n0000",
                         job="train-1")
    assert encode(e) == (
        b'{"v":1,"node":"n0000","ts":5.0,"kind":"checkpoint","job":"train-1","gpu":null,"rank":null,"step":400,'
        b'"code":null,"message":"checkpoint at step 400, verified through step 350","data":{"step":400,'
        b'"uri":"ckpt://train-1/400","last_verified_step":350,"last_replay_step":null}}')
    assert CheckpointRecord.from_event(e) == CheckpointRecord(400, "ckpt://train-1/400", 350)
    both = checkpoint_event(ts=5.0, step=400, uri="u", last_verified_step=350, last_replay_step=200)
    assert both.data["last_replay_step"] == 200 and "replay-verified through step 200" in both.message
    assert CheckpointRecord.from_event(both).marks.deterministic == 200
    with pytest.raises(SchemaError) as err:
        checkpoint_event(ts=1.0, step=400, uri="u", last_verified_step=150, last_replay_step=200)
    assert err.value.field == "last_replay_step"
    # a record written before the replay mark existed reads it as null (conservative)
    old = Event(node="n0000", ts=1.0, kind=EventKind.CHECKPOINT, step=300,
                data={"step": 300, "last_verified_step": 250})
    assert CheckpointRecord.from_event(old).last_replay_step is None
    with pytest.raises(SchemaError) as err:
        checkpoint_event(ts=1.0, step=600, uri="u", last_verified_step=700)
    assert err.value.field == "last_verified_step"
    with pytest.raises(SchemaError):
        checkpoint_event(ts=1.0, step=-1, uri="u", last_verified_step=None)


def test_readers_keep_a_checkpoint_with_a_readable_step() -> None:
    # the step may sit on the event only; a bad watermark reads as unverified, a missing uri as ""
    e = Event(node="n0000", ts=1.0, kind=EventKind.CHECKPOINT, step=300, data={"last_verified_step": "x"})
    assert CheckpointRecord.from_event(e) == CheckpointRecord(300, "", None)
    assert CheckpointRecord.from_data({"step": 5, "uri": 7}).uri == "7"
    for bad in ({"step": "300"}, {"uri": "u"}, "step 300", None):
        with pytest.raises(SchemaError):
            CheckpointRecord.from_data(bad)
    with pytest.raises(SchemaError):
        CheckpointRecord.from_event(Event(node="n0000", ts=1.0, kind=EventKind.XID, step=3))


def test_verified_only_when_a_pass_covers_the_step() -> None:
    assert CheckpointRecord(200, "u", 200).verified
    assert not CheckpointRecord(250, "u", 200).verified
    assert not CheckpointRecord(100, "u", None).verified
