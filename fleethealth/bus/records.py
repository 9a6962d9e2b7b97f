"""What a consumer returns: one decoded message with where it came from."""

from __future__ import annotations

from dataclasses import dataclass

from fleethealth.bus.deadletter import DeadLetter
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
