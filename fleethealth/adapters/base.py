"""What every scheduler adapter shares: the adapter contract, the record of an action, node names.

An adapter turns one :class:`~fleethealth.schema.Recommendation` into scheduler operations
(``scontrol update ...``, a Kubernetes node patch). It does not decide whether to act: the
:class:`~fleethealth.adapters.act.Actor` checks the guard, the rate limit, dry-run and replays
first, then calls :meth:`SchedulerAdapter.plan` (what would be done) or
:meth:`SchedulerAdapter.apply` (do it). Both return the operations as short strings, which
end up in the :class:`ActionRecord`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from fleethealth.errors import FleetHealthError
from fleethealth.schema import Action, Event, EventKind, Recommendation

__all__ = [
    "SchedulerError",
    "UnknownNode",
    "LeftAlone",
    "Outcome",
    "ActionRecord",
    "SchedulerAdapter",
    "check_node_name",
    "clean_reason",
    "is_node_name",
    "NODE_PATTERN",
]

NODE_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$"
"""The one node-name rule (adapters, API paths, sweeps): letters and digits at both ends, ``_ . -``
inside, at most 63 characters; no hostlist brackets, commas, spaces, ``=`` or leading ``-``."""

_NODE_NAME = re.compile(NODE_PATTERN)

_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


class SchedulerError(FleetHealthError):
    """A scheduler refused or failed an operation (the message names the node and the command)."""


class UnknownNode(SchedulerError):
    """The scheduler does not know the node."""


class LeftAlone(SchedulerError):
    """fleethealth must not touch the node: it opted out, or another owner (a person, another tool)
    drained it for a reason of their own. Not a failure: the recommendation is not retried."""


class Outcome(StrEnum):
    """What the actor did with one recommendation.

    ``done`` and ``dry_run`` consume the rate budget; the ``skipped_*`` outcomes and
    ``rate_limited`` leave the scheduler untouched (``skipped_not_ours``: the node opted out or
    another owner holds it, see :class:`LeftAlone`); ``failed`` means the scheduler refused.
    """

    DONE = "done"
    DRY_RUN = "dry_run"
    SKIPPED_GUARD = "skipped_guard"
    SKIPPED_UNSUPPORTED = "skipped_unsupported"
    SKIPPED_ALREADY = "skipped_already"
    SKIPPED_STALE = "skipped_stale"
    SKIPPED_NOT_OURS = "skipped_not_ours"
    RATE_LIMITED = "rate_limited"
    FAILED = "failed"


@dataclass(frozen=True)
class ActionRecord:
    """The record of one recommendation handled by one scheduler adapter.

    ``operations`` lists what was sent to the scheduler (or would have been, for ``dry_run``),
    e.g. ``("scontrol update NodeName=n0013 State=DRAIN Reason=...",)``. ``ts`` is the
    adapter's clock when it handled the recommendation; ``rec_ts`` the recommendation's time.
    """

    recommendation_id: str
    scheduler: str
    node: str
    action: Action
    outcome: Outcome
    ts: float
    rec_ts: float
    job: str | None = None
    detail: str = ""
    operations: tuple[str, ...] = field(default_factory=tuple)

    @property
    def acted(self) -> bool:
        """True when the scheduler was (or, under dry-run, would have been) changed."""
        return self.outcome in (Outcome.DONE, Outcome.DRY_RUN)

    def to_obj(self) -> dict[str, Any]:
        return {"recommendation_id": self.recommendation_id, "scheduler": self.scheduler, "node": self.node,
                "action": self.action.value, "outcome": self.outcome.value, "ts": self.ts,
                "rec_ts": self.rec_ts, "job": self.job, "detail": self.detail,
                "operations": list(self.operations)}

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> ActionRecord:
        return cls(recommendation_id=str(obj["recommendation_id"]), scheduler=str(obj["scheduler"]),
                   node=str(obj["node"]), action=Action(obj["action"]), outcome=Outcome(obj["outcome"]),
                   ts=float(obj["ts"]), rec_ts=float(obj["rec_ts"]), job=obj.get("job"),
                   detail=str(obj.get("detail", "")), operations=tuple(obj.get("operations", ())))

    def to_event(self) -> Event:
        """The ``fh.events`` record of this action (kind ``scheduler_action``, event time ``ts``)."""
        return Event(node=self.node, ts=self.ts, kind=EventKind.SCHEDULER_ACTION, job=self.job,
                     message=f"{self.scheduler} {self.action.value} {self.outcome.value}: {self.detail}"[:500],
                     data=self.to_obj())


@runtime_checkable
class SchedulerAdapter(Protocol):
    """One scheduler: the actions it supports, and how it plans and applies them."""

    name: str

    def supports(self, action: Action) -> bool:
        """True when this scheduler has an operation for ``action``."""
        ...

    def plan(self, rec: Recommendation) -> tuple[str, ...]:
        """The operations :meth:`apply` would run, without touching the scheduler."""
        ...

    def apply(self, rec: Recommendation) -> tuple[str, ...]:
        """Run the operations for ``rec``; raise :class:`SchedulerError` when the scheduler refuses."""
        ...


def is_node_name(node: object) -> bool:
    """True when ``node`` is a plain node name by :data:`NODE_PATTERN`."""
    return isinstance(node, str) and _NODE_NAME.fullmatch(node) is not None


def check_node_name(node: str) -> str:
    """Return ``node`` if it is a plain node name, else raise :class:`SchedulerError`.

    Hostlist expressions (``n[0000-0999]``), lists, spaces and ``=`` are refused: one
    recommendation names one node, and a pattern must never reach a scheduler.
    """
    if not is_node_name(node):
        raise SchedulerError(f"refusing node name {node!r}: expected letters, digits, '_', '.', '-' "
                             "(at most 63, no hostlist patterns)")
    return node


def clean_reason(text: str, *, limit: int = 200) -> str:
    """Collapse control characters and whitespace runs, and cut to ``limit`` characters."""
    flat = " ".join(_CONTROL.sub(" ", text).split())
    return flat[:limit] if flat else "fleethealth"
