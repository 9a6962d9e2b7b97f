"""The ``job_start`` and ``job_exit`` records: a training run's life as its rank 0 reports it.

``job_start`` ``Event.data`` keys: ``world`` (ranks), ``first_step`` (the first step this run
trains: 0, or one past the checkpoint it resumed from), ``resumed_from`` (that checkpoint's uri, or
null) and ``placement`` (the node of each rank, when the launcher knows it; else empty).

``job_exit`` ``Event.data`` keys: ``status`` (:class:`ExitStatus`: ``completed`` — every step
trained; ``halted`` — the job stopped itself after a failed SDC check, so its launcher can roll
back; ``failed`` — an exception ended it), ``last_step`` (the last step trained, or null) and
``reason`` (free text).

The in-job library emits them (:class:`fleethealth.injob.lifecycle.JobLife`); the store keeps them
with every other event, so a query can tell a run that ended from one that went silent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Self

from fleethealth.errors import SchemaError
from fleethealth.schema import Event, EventKind

__all__ = ["ExitStatus", "JobStart", "JobExit", "job_start_event", "job_exit_event"]


class ExitStatus(StrEnum):
    """How a run ended."""

    COMPLETED = "completed"
    HALTED = "halted"
    FAILED = "failed"


def _opt_step(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaError(name, f"expected a non-negative integer or null, got {value!r}")
    return value


@dataclass(frozen=True)
class JobStart:
    """The typed view of a ``job_start`` event's ``data``."""

    world: int
    first_step: int = 0
    resumed_from: str | None = None
    placement: tuple[str, ...] = ()

    def to_data(self) -> dict[str, Any]:
        return {"world": self.world, "first_step": self.first_step, "resumed_from": self.resumed_from,
                "placement": list(self.placement)}

    @classmethod
    def from_data(cls, data: Any) -> Self:
        if not isinstance(data, dict):
            raise SchemaError("data", "expected an object")
        world = data.get("world")
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise SchemaError("world", f"expected a positive integer, got {world!r}")
        first = _opt_step("first_step", data.get("first_step", 0))
        resumed = data.get("resumed_from")
        if resumed is not None and not isinstance(resumed, str):
            raise SchemaError("resumed_from", f"expected a uri or null, got {resumed!r}")
        placement = data.get("placement", [])
        if not isinstance(placement, list | tuple) or not all(isinstance(n, str) for n in placement):
            raise SchemaError("placement", f"expected a list of node names, got {placement!r}")
        if placement and len(placement) != world:
            raise SchemaError("placement", f"expected {world} node names, got {len(placement)}")
        return cls(world=world, first_step=first or 0, resumed_from=resumed, placement=tuple(placement))

    @classmethod
    def from_event(cls, event: Event) -> Self:
        if event.kind is not EventKind.JOB_START:
            raise SchemaError("kind", f"expected a job_start event, got {event.kind.value}")
        return cls.from_data(event.data)


@dataclass(frozen=True)
class JobExit:
    """The typed view of a ``job_exit`` event's ``data``."""

    status: ExitStatus
    last_step: int | None = None
    reason: str = ""

    def to_data(self) -> dict[str, Any]:
        return {"status": self.status.value, "last_step": self.last_step, "reason": self.reason}

    @classmethod
    def from_data(cls, data: Any) -> Self:
        if not isinstance(data, dict):
            raise SchemaError("data", "expected an object")
        try:
            status = ExitStatus(data.get("status"))
        except ValueError:
            known = ", ".join(s.value for s in ExitStatus)
            raise SchemaError("status", f"unknown value {data.get('status')!r} (known: {known})") from None
        reason = data.get("reason", "")
        if not isinstance(reason, str):
            raise SchemaError("reason", f"expected a string, got {reason!r}")
        return cls(status=status, last_step=_opt_step("last_step", data.get("last_step")), reason=reason)

    @classmethod
    def from_event(cls, event: Event) -> Self:
        if event.kind is not EventKind.JOB_EXIT:
            raise SchemaError("kind", f"expected a job_exit event, got {event.kind.value}")
        return cls.from_data(event.data)


def job_start_event(*, ts: float, world: int, first_step: int = 0, resumed_from: str | None = None,
                    placement: Sequence[str] = (), node: str = "", job: str | None = None,
                    rank: int | None = None) -> Event:
    """Build a ``job_start`` event (validated: a bad value raises :class:`SchemaError`)."""
    record = JobStart.from_data({"world": world, "first_step": first_step, "resumed_from": resumed_from,
                                 "placement": list(placement)})
    how = "" if resumed_from is None else f", resumed from {resumed_from}"
    return Event(node=node, ts=float(ts), kind=EventKind.JOB_START, job=job, rank=rank, step=record.first_step,
                 message=f"job started on {world} ranks at step {record.first_step}{how}", data=record.to_data())


def job_exit_event(*, ts: float, status: ExitStatus | str, last_step: int | None = None, reason: str = "",
                   node: str = "", job: str | None = None, rank: int | None = None) -> Event:
    """Build a ``job_exit`` event (validated: a bad value raises :class:`SchemaError`)."""
    record = JobExit.from_data({"status": str(status), "last_step": last_step, "reason": reason})
    where = "" if last_step is None else f" after step {last_step}"
    return Event(node=node, ts=float(ts), kind=EventKind.JOB_EXIT, job=job, rank=rank, step=last_step,
                 message=f"job {record.status.value}{where}" + (f": {reason}" if reason else ""),
                 data=record.to_data())
