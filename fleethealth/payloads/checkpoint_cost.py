"""The ``checkpoint_cost`` record: what one checkpoint save cost the training job.

Built by the in-job library (:mod:`fleethealth.injob.ckptcost`) once a save is done, read by the
checkpoint-interval estimate (:mod:`fleethealth.policy.interval`) as the measured checkpoint cost
``C`` of seed 000 §6.

``Event.data`` keys:

* ``step`` — the checkpoint's step (the step whose update it holds, as in the ``checkpoint`` record);
* ``blocking_s`` — how long the save held training up: the whole save when it is synchronous, the
  copy to host memory (the short synchronous part) when the write runs in the background. This is
  ``C`` in the overhead C/T: the time training did not advance;
* ``write_s`` — how long the background write took after the blocking part ended (0 for a
  synchronous save). It does not stop training, but the next checkpoint cannot begin before it is
  done, so it bounds the interval from below;
* ``uri`` — where the checkpoint went (may be empty).

A record is separate from the ``checkpoint`` event (which carries the verification marks at the
time of the save): a background write ends after training has moved on, so its cost is known later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from fleethealth.errors import SchemaError
from fleethealth.schema import Event, EventKind

__all__ = ["CheckpointCost", "checkpoint_cost_event", "MAX_COST_S"]

MAX_COST_S = 7 * 86400.0
"""Longest save a record may report (a week): anything longer is a clock error, not a cost."""


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not 0.0 <= value <= MAX_COST_S:
        raise SchemaError(name, f"expected seconds in [0, {MAX_COST_S:g}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class CheckpointCost:
    """One save's cost in seconds: ``blocking_s`` held training up, ``write_s`` ran in the background after."""

    step: int
    blocking_s: float
    write_s: float = 0.0
    uri: str = ""

    def to_data(self) -> dict[str, Any]:
        return {"step": self.step, "blocking_s": self.blocking_s, "write_s": self.write_s, "uri": self.uri}

    @classmethod
    def from_data(cls, data: Any) -> Self:
        """Read ``data``; a missing or bad field is a :class:`SchemaError` naming it."""
        if not isinstance(data, Mapping):
            raise SchemaError("data", "expected an object")
        step = data.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise SchemaError("step", f"expected a non-negative integer, got {step!r}")
        uri = data.get("uri", "")
        if not isinstance(uri, str):
            raise SchemaError("uri", f"expected a string, got {uri!r}")
        return cls(step=step, blocking_s=_seconds("blocking_s", data.get("blocking_s")),
                   write_s=_seconds("write_s", data.get("write_s", 0.0)), uri=uri)

    @classmethod
    def from_event(cls, event: Event) -> Self:
        if event.kind is not EventKind.CHECKPOINT_COST:
            raise SchemaError("kind", f"expected a checkpoint_cost event, got {event.kind.value}")
        return cls.from_data({**event.data, "step": event.data.get("step", event.step)})


def checkpoint_cost_event(*, ts: float, step: int, blocking_s: float, write_s: float = 0.0, uri: str = "",
                          node: str = "", job: str | None = None, rank: int | None = None) -> Event:
    """Build a ``checkpoint_cost`` event (validated: a bad value raises :class:`SchemaError`)."""
    record = CheckpointCost.from_data({"step": step, "blocking_s": blocking_s, "write_s": write_s, "uri": uri})
    return Event(node=node, ts=float(ts), kind=EventKind.CHECKPOINT_COST, job=job, rank=rank, step=record.step,
                 message=f"checkpoint at step {record.step}: training blocked {record.blocking_s:.3g} s, "
                         f"background write {record.write_s:.3g} s", data=record.to_data())
