"""What a consumer returns, and the pure steps that make it: decoding a value, bounding its event time
against the record timestamp, splitting a step block into one record per step.

None of them does I/O: the consumer (``consumer.py``) polls, calls them, and publishes the dead letters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleethealth import schema
from fleethealth.bus.deadletter import DeadLetter
from fleethealth.errors import SchemaError
from fleethealth.schema import Message


@dataclass(frozen=True)
class Record:
    """One decoded message with where it came from. ``msg`` is a :data:`schema.Message`, or a
    :class:`DeadLetter` for a consumer of ``fh.deadletter``."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    msg: Message | DeadLetter


def decode_value(cls: Any, value: bytes | None) -> Message | DeadLetter:
    """One value of a topic whose message type is ``cls``; :class:`SchemaError` for a tombstone or an
    invalid value, naming the field."""
    if value is None:
        raise SchemaError("<message>", "empty value (tombstone)")
    if cls is DeadLetter:
        return DeadLetter.from_obj(schema.load_object(value))
    return schema.decode(cls, value)


def event_time_skew(msg: Message | DeadLetter, timestamp: Any, *, max_ahead_s: float | None,
                    max_behind_s: float | None) -> str | None:
    """Why ``msg``'s event time is more than ``max_ahead_s`` ahead of, or ``max_behind_s`` behind, the
    record timestamp ``timestamp`` (milliseconds), or None (within bounds, no bound, a dead letter, or
    no record timestamp to bound against). A step block's earliest step is bounded behind, too."""
    if (max_ahead_s is None and max_behind_s is None) or isinstance(msg, DeadLetter):
        return None
    if not isinstance(timestamp, int) or timestamp < 0:
        return None  # no record timestamp to bound against
    broker = timestamp / 1000.0
    times = [msg.ts]
    if isinstance(msg, schema.StepBlock) and max_behind_s is not None:
        times.append(float(msg.step_ts.min()))  # its earliest step, too
    for event in times:
        ahead = event - broker
        if max_ahead_s is not None and ahead > max_ahead_s:
            return (f"ts: event time {event:.3f} is {ahead:.0f} s ahead of the record timestamp {broker:.3f} "
                    f"(max_ahead_s={max_ahead_s:g})")
        if max_behind_s is not None and -ahead > max_behind_s:
            return (f"ts: event time {event:.3f} is {-ahead:.0f} s behind the record timestamp {broker:.3f} "
                    f"(max_behind_s={max_behind_s:g})")
    return None


def split_block(topic: str, partition: int, offset: int, key: bytes | None,
                block: schema.StepBlock) -> list[tuple[Record, int]]:
    """One record per step of ``block``, all at the block's offset, each with the offset a consumer's
    position moves to once it is returned: only the last one moves past the block, so a poll that
    stops inside a block commits none of it."""
    parts = block.split()
    return [(Record(topic, partition, offset, key, part), offset + 1 if k == len(parts) - 1 else offset)
            for k, part in enumerate(parts)]
