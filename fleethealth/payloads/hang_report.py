"""The ``hang_report`` record: every thread's stack when an in-job watchdog timed out, read by the
hang detector.

``Event.data`` keys: ``stacks`` (a faulthandler dump of every thread), ``last_collective``,
``timeout_s``; the rank and step are set on the event itself.

A ``hang`` finding lists the reports it attaches in ``evidence["stacks"]``, one :class:`RankStacks`
each: ``rank``, ``node``, ``gpu``, ``step``, ``ts``, ``last_collective``, ``stacks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

from fleethealth.errors import SchemaError
from fleethealth.payloads._fields import opt_float
from fleethealth.schema import Event, EventKind

__all__ = ["HangReport", "RankStacks", "hang_report_event"]


@dataclass(frozen=True)
class HangReport:
    """The typed view of a ``hang_report`` event's ``data``: every thread's stack at the timeout."""

    stacks: str
    last_collective: str | None
    timeout_s: float

    def to_data(self) -> dict[str, Any]:
        return {"stacks": self.stacks, "last_collective": self.last_collective, "timeout_s": self.timeout_s}

    @classmethod
    def from_event(cls, event: Event) -> Self:
        if event.kind is not EventKind.HANG_REPORT:
            raise SchemaError("kind", f"expected a hang_report event, got {event.kind.value}")
        stacks = event.data.get("stacks")
        if not isinstance(stacks, str):
            raise SchemaError("stacks", "expected a string")
        last = event.data.get("last_collective")
        if last is not None and not isinstance(last, str):
            raise SchemaError("last_collective", "expected a string or null")
        timeout = opt_float("timeout_s", event.data.get("timeout_s"))
        if timeout is None:
            raise SchemaError("timeout_s", "missing")
        return cls(stacks=stacks, last_collective=last, timeout_s=timeout)


@dataclass(frozen=True)
class RankStacks:
    """One rank's hang report with where and when it came from, as a ``hang`` finding lists it."""

    rank: int
    node: str
    gpu: int | None
    step: int | None
    ts: float
    report: HangReport

    def to_evidence(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "gpu": self.gpu, "step": self.step, "ts": self.ts,
                "last_collective": self.report.last_collective, "stacks": self.report.stacks}


def hang_report_event(*, ts: float, stacks: str, timeout_s: float, last_collective: str | None = None,
                      node: str = "", job: str | None = None, rank: int | None = None,
                      gpu: int | None = None, step: int | None = None, max_stack_chars: int = 150_000) -> Event:
    """Build a ``hang_report`` event. Stack dumps longer than ``max_stack_chars`` keep their tail
    (the innermost frames, where the waiting happens) so the datagram fits the wire limit."""
    if len(stacks) > max_stack_chars:
        stacks = "...(truncated)\n" + stacks[-max_stack_chars:]
    report = HangReport(stacks=stacks, last_collective=last_collective, timeout_s=float(timeout_s))
    message = f"no step completed within {timeout_s:g} s" + (
        "" if last_collective is None else f"; last collective {last_collective}")
    return Event(node=node, ts=float(ts), kind=EventKind.HANG_REPORT, job=job, gpu=gpu, rank=rank, step=step,
                 message=message, data=report.to_data())
