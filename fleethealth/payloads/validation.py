"""The ``checkpoint_validated`` record: whether a checkpoint's files can be resumed from (seed 000 §4,
Failure 4), built by the in-job validator (:mod:`fleethealth.injob.ckptcheck`) and read by the policy.

A checkpoint that exists is not one a job can resume from. After each save the in-job library checks
the files it wrote — every shard its metadata names present and long enough, every file's digest
equal to the manifest written at save time, a test load on the CPU into tensors of the model's
shapes and dtypes, each tensor's norm inside the band of the job's previous valid checkpoints — and
reports the outcome once per checkpoint.

``Event.data`` keys: ``step``, ``uri`` (the checkpoint, as the ``checkpoint`` record names it),
``result`` (:class:`ValidationResult`), ``reasons`` (a list of sentences naming what is wrong; empty
when valid) and ``duration_s`` (how long the validation took in the background, or null).

``skipped`` means the checkpoint was never validated (the in-job queue was full, or the validator was
closed first): for the rollback rule it counts as *not validated*, never as valid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Self

from fleethealth.errors import SchemaError
from fleethealth.schema import Event, EventKind

__all__ = ["CheckpointValidation", "ValidationResult", "checkpoint_validated_event", "validity"]

MAX_REASONS = 16
"""Reasons one event carries; more are summarised in the last one (an event must fit one datagram)."""
MAX_REASON_CHARS = 300


class ValidationResult(StrEnum):
    VALID = "valid"
    INVALID = "invalid"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class CheckpointValidation:
    """The outcome of validating the checkpoint of ``step`` at ``uri``; ``reasons`` say what is wrong."""

    step: int
    uri: str
    result: ValidationResult
    reasons: tuple[str, ...] = ()
    duration_s: float | None = None

    @property
    def valid(self) -> bool:
        return self.result is ValidationResult.VALID

    def to_data(self) -> dict[str, Any]:
        return {"step": self.step, "uri": self.uri, "result": self.result.value, "reasons": list(self.reasons),
                "duration_s": self.duration_s}

    @classmethod
    def from_data(cls, data: Any) -> Self:
        """Read a record; raise :class:`SchemaError` naming the field when the step or result is unreadable."""
        if not isinstance(data, Mapping):
            raise SchemaError("data", f"expected an object, got {type(data).__name__}")
        step = data.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise SchemaError("step", f"expected a non-negative integer checkpoint step, got {step!r}")
        try:
            result = ValidationResult(data.get("result"))
        except ValueError:
            raise SchemaError("result", f"expected one of {[r.value for r in ValidationResult]}, "
                                        f"got {data.get('result')!r}") from None
        reasons = data.get("reasons") or ()
        if not isinstance(reasons, Sequence) or isinstance(reasons, str):
            raise SchemaError("reasons", f"expected a list of strings, got {type(reasons).__name__}")
        took = data.get("duration_s")
        return cls(step=step, uri=str(data.get("uri", "")), result=result,
                   reasons=tuple(str(r) for r in reasons),
                   duration_s=float(took) if isinstance(took, int | float) and not isinstance(took, bool) else None)

    @classmethod
    def from_event(cls, event: Event) -> Self:
        if event.kind is not EventKind.CHECKPOINT_VALIDATED:
            raise SchemaError("kind", f"expected a checkpoint_validated event, got {event.kind.value}")
        return cls.from_data({**event.data, "step": event.data.get("step", event.step)})


def _bounded(reasons: Sequence[str]) -> list[str]:
    out = [r if len(r) <= MAX_REASON_CHARS else r[:MAX_REASON_CHARS - 1] + "…" for r in reasons]
    if len(out) > MAX_REASONS:
        out = out[:MAX_REASONS - 1] + [f"and {len(out) - MAX_REASONS + 1} more problems"]
    return out


def checkpoint_validated_event(*, ts: float, step: int, uri: str, result: ValidationResult | str,
                               reasons: Sequence[str] = (), duration_s: float | None = None, node: str = "",
                               job: str | None = None, rank: int | None = None) -> Event:
    """Build a ``checkpoint_validated`` event (reasons capped at :data:`MAX_REASONS`, each at
    :data:`MAX_REASON_CHARS` characters). A valid result carries no reasons; any other carries one."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise SchemaError("step", f"expected a non-negative integer, got {step!r}")
    try:
        res = ValidationResult(result)
    except ValueError:
        raise SchemaError("result", f"expected one of {[r.value for r in ValidationResult]}, got {result!r}") from None
    if (res is ValidationResult.VALID) == bool(reasons):
        raise SchemaError("reasons", f"a {res.value} result needs {'no' if res is ValidationResult.VALID else 'a'} "
                                     f"reason, got {list(reasons)!r}")
    record = CheckpointValidation(step, uri, res, tuple(_bounded(reasons)), duration_s)
    what = "valid" if record.valid else f"{res.value}: {record.reasons[0]}"
    return Event(node=node, ts=float(ts), kind=EventKind.CHECKPOINT_VALIDATED, job=job, rank=rank, step=step,
                 message=f"checkpoint at step {step} {what}", data=record.to_data())


def validity(records: Sequence[CheckpointValidation]) -> dict[int, bool]:
    """Checkpoint step → valid, from a job's validation records (the newest record of a step wins)."""
    return {r.step: r.valid for r in records}
