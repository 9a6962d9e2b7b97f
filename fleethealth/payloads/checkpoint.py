"""The ``checkpoint`` record: a checkpoint and the verification marks when it was written
(seed 000 R6), built by the in-job watermark and read by the SDC detector and the policy.

``Event.data`` keys: ``step``, ``uri``, ``last_verified_step`` (the newest step a check of either
kind had passed when the checkpoint was written: the mark for transient faults) and
``last_replay_step`` (the newest step a cross-rank replay had passed: the mark for deterministic
faults); each null while nothing is verified. Records written before the second mark existed read
``last_replay_step`` as null, which rolls a deterministic fault back conservatively.

The builder validates strictly. The readers keep every checkpoint whose step they can read: a
missing uri reads as ``""`` and an unreadable watermark as unverified (``None``), since a rollback
would rather know of a checkpoint than lose it to a bad field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from fleethealth.errors import SchemaError
from fleethealth.payloads.rollback import Marks
from fleethealth.schema import Event, EventKind

__all__ = ["CheckpointRecord", "checkpoint_event"]


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint and the verification marks at the time it was written (``None``: nothing verified yet)."""

    step: int
    uri: str
    last_verified_step: int | None
    last_replay_step: int | None = None

    @property
    def marks(self) -> Marks:
        return Marks(transient=self.last_verified_step, deterministic=self.last_replay_step)

    @property
    def verified(self) -> bool:
        """True when a check passed at or after this checkpoint's step when it was written."""
        return self.last_verified_step is not None and self.last_verified_step >= self.step

    def to_data(self) -> dict[str, Any]:
        return {"step": self.step, "uri": self.uri, "last_verified_step": self.last_verified_step,
                "last_replay_step": self.last_replay_step}

    @classmethod
    def from_data(cls, data: Any) -> Self:
        """Read ``{"step", "uri", "last_verified_step"}``; raise :class:`SchemaError` only when the
        step is not an integer (see the module docstring)."""
        step = data.get("step") if isinstance(data, Mapping) else None
        if not isinstance(step, int):
            raise SchemaError("step", f"expected an integer checkpoint step, got {step!r}")
        lvs, lrs = data.get("last_verified_step"), data.get("last_replay_step")
        return cls(step=step, uri=str(data.get("uri", "")), last_verified_step=lvs if isinstance(lvs, int) else None,
                   last_replay_step=lrs if isinstance(lrs, int) and not isinstance(lrs, bool) else None)

    @classmethod
    def from_event(cls, event: Event) -> Self:
        """Read a ``checkpoint`` event; its ``data`` may leave the step to the event itself."""
        if event.kind is not EventKind.CHECKPOINT:
            raise SchemaError("kind", f"expected a checkpoint event, got {event.kind.value}")
        return cls.from_data({**event.data, "step": event.data.get("step", event.step)})


def checkpoint_event(*, ts: float, step: int, uri: str, last_verified_step: int | None, node: str = "",
                     job: str | None = None, rank: int | None = None, last_replay_step: int | None = None) -> Event:
    """Build a ``checkpoint`` event carrying both verification marks (seed 000 R6)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise SchemaError("step", f"expected a non-negative integer, got {step!r}")
    if last_verified_step is not None and (not isinstance(last_verified_step, int) or last_verified_step > step):
        raise SchemaError("last_verified_step", f"must be an integer <= step {step}, got {last_verified_step!r}")
    if last_replay_step is not None and (not isinstance(last_replay_step, int) or last_verified_step is None
                                         or last_replay_step > last_verified_step):
        raise SchemaError("last_replay_step", f"must be an integer <= last_verified_step {last_verified_step}, "
                                              f"got {last_replay_step!r}")
    verified = "unverified" if last_verified_step is None else f"verified through step {last_verified_step}"
    if last_replay_step is not None:
        verified += f", replay-verified through step {last_replay_step}"
    return Event(node=node, ts=float(ts), kind=EventKind.CHECKPOINT, job=job, rank=rank, step=step,
                 message=f"checkpoint at step {step}, {verified}",
                 data=CheckpointRecord(step, uri, last_verified_step, last_replay_step).to_data())
