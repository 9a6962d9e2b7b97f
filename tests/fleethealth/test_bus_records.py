"""The consumer's pure steps (``fleethealth/bus/records.py``) and the kafka-python boundary
(``fleethealth/bus/kafka_client.py``), without a broker."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.bus.kafka_client import translated
from fleethealth.bus.records import Record, decode_value, event_time_skew, split_block
from fleethealth.errors import BusError, BusUnavailable, SchemaError
from fleethealth.schema import Event, EventKind, StepBatch, StepBlock, encode

T0 = 1_700_000_000.0


def _block() -> StepBlock:
    return StepBlock(job="j", node="host-a", steps=np.array([7, 8, 9]), step_ts=np.array([T0, T0 + 60, T0 + 120]),
                     ranks=np.array([0, 1], dtype=np.int32), gpus=np.array([0, 1], dtype=np.int16),
                     compute_s=np.ones((3, 2)))


def test_event_time_skew_names_ts_and_the_bound() -> None:
    event = Event(node="host-a", ts=T0, kind=EventKind.XID)
    stamp = int((T0 - 100) * 1000)  # the event is 100 s ahead of its record timestamp
    assert event_time_skew(event, stamp, max_ahead_s=None, max_behind_s=None) is None
    assert event_time_skew(event, stamp, max_ahead_s=200, max_behind_s=0) is None
    reason = event_time_skew(event, stamp, max_ahead_s=50, max_behind_s=None)
    assert reason is not None and reason.startswith("ts:") and "ahead" in reason and "max_ahead_s=50" in reason
    behind = event_time_skew(event, int((T0 + 100) * 1000), max_ahead_s=None, max_behind_s=50)
    assert behind is not None and "behind" in behind and "max_behind_s=50" in behind
    for no_stamp in (None, -1, 1.5):
        assert event_time_skew(event, no_stamp, max_ahead_s=0, max_behind_s=0) is None


def test_a_step_blocks_earliest_step_is_bounded_behind_too() -> None:
    block = _block()
    stamp = int((T0 + 120) * 1000)  # the latest step is on time, the earliest 120 s behind
    assert event_time_skew(block, stamp, max_ahead_s=10, max_behind_s=None) is None
    reason = event_time_skew(block, stamp, max_ahead_s=None, max_behind_s=60)
    assert reason is not None and f"{T0:.3f}" in reason and "behind" in reason


def test_split_block_moves_the_position_past_the_block_only_at_its_last_step() -> None:
    parts = split_block("fh.steps", 2, 41, b"j", _block())
    assert [next_offset for _, next_offset in parts] == [41, 41, 42]
    assert all(type(r) is Record and (r.topic, r.partition, r.offset, r.key) == ("fh.steps", 2, 41, b"j")
               for r, _ in parts)
    assert [r.msg.step for r, _ in parts] == [7, 8, 9] and all(type(r.msg) is StepBatch for r, _ in parts)


def test_decode_value_refuses_a_tombstone_and_decodes_the_rest() -> None:
    with pytest.raises(SchemaError, match="tombstone"):
        decode_value(Event, None)
    event = Event(node="host-a", ts=T0, kind=EventKind.XID, code=79)
    assert decode_value(Event, encode(event)).id == event.id


def test_translated_maps_kafka_errors_and_passes_the_rest() -> None:
    ke = pytest.importorskip("kafka.errors")
    with pytest.raises(BusUnavailable, match="polling fh.steps on kafka://k:9092") as caught:
        with translated("polling fh.steps", "kafka://k:9092"):
            raise ke.KafkaTimeoutError()
    assert isinstance(caught.value.__cause__, ke.KafkaTimeoutError)
    with pytest.raises(BusError) as other:
        with translated("committing", "kafka://k:9092"):
            raise ke.UnknownTopicOrPartitionError()
    assert type(other.value) is BusError
    with pytest.raises(ValueError), translated("seeking", "kafka://k:9092"):
        raise ValueError("not kafka's")
