"""The ``checkpoint_validated`` record: whether a checkpoint's files can be resumed from (seed 000 §4,
Failure 4), built by the in-job validator (:mod:`fleethealth.injob.ckptcheck`) and read by the policy.

A checkpoint that exists is not one a job can resume from. After each save the in-job library checks
the files it wrote — every shard its metadata names present and long enough, every file's digest
equal to the manifest written at save time, a test load on the CPU into tensors of the model's
shapes and dtypes, each tensor's norm inside the band of the job's previous valid checkpoints — and
reports the outcome once per checkpoint.

``Event.data`` keys: ``step``, ``uri`` (the checkpoint, as the ``checkpoint`` record names it),
``result`` (:class:`ValidationResult`), ``reasons`` (a list of sentences naming what is wrong; empty
when valid), ``duration_s`` (how long the validation took in the background, or null) and, on a valid
result, ``norms`` (tensor name → L2 norm, at most :data:`MAX_NORMS` names of at most
:data:`MAX_NORM_NAME_CHARS` characters and :data:`MAX_NORMS_BYTES` in all, the first by name: the norm
band ``fleethealth checkpoint validate --job`` reads back from the store).

``skipped`` means the checkpoint was never validated (the in-job queue was full, or the validator was
closed first): for the rollback rule it counts as *not validated*, never as valid.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Self

from fleethealth.errors import SchemaError
from fleethealth.schema import Event, EventKind

__all__ = ["CheckpointValidation", "ValidationResult", "checkpoint_validated_event", "validity", "bounded_norms",
           "MAX_NORMS"]

MAX_REASONS = 16
"""Reasons one event carries; more are summarised in the last one (an event must fit one datagram)."""
MAX_REASON_CHARS = 300
MAX_NORMS = 512
"""Tensor norms one valid record carries (the band of the tensors beyond it is not kept in the store)."""
MAX_NORM_NAME_CHARS = 200
MAX_NORMS_BYTES = 24 * 1024
"""The norms' share of a record: with the reasons it must fit one datagram of the probe's socket (64 KiB)."""


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
    norms: Mapping[str, float] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return self.result is ValidationResult.VALID

    def to_data(self) -> dict[str, Any]:
        out = {"step": self.step, "uri": self.uri, "result": self.result.value, "reasons": list(self.reasons),
               "duration_s": self.duration_s}
        if self.norms:
            out["norms"] = dict(self.norms)
        return out

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
                   duration_s=float(took) if isinstance(took, int | float) and not isinstance(took, bool) else None,
                   norms=_read_norms(data.get("norms")))

    @classmethod
    def from_event(cls, event: Event) -> Self:
        if event.kind is not EventKind.CHECKPOINT_VALIDATED:
            raise SchemaError("kind", f"expected a checkpoint_validated event, got {event.kind.value}")
        return cls.from_data({**event.data, "step": event.data.get("step", event.step)})


def _read_norms(norms: Any) -> dict[str, float]:
    """A record's ``norms``, default-deny: an object of at most :data:`MAX_NORMS` names (strings of at most
    :data:`MAX_NORM_NAME_CHARS` characters) to finite numbers >= 0; anything else a :class:`SchemaError`."""
    if norms is None:
        return {}
    if not isinstance(norms, Mapping):
        raise SchemaError("norms", f"expected an object of tensor name to norm, got {type(norms).__name__}")
    if len(norms) > MAX_NORMS:
        raise SchemaError("norms", f"at most {MAX_NORMS} tensors, got {len(norms)}")
    out: dict[str, float] = {}
    for name, value in norms.items():
        if not isinstance(name, str) or not name or len(name) > MAX_NORM_NAME_CHARS:
            raise SchemaError("norms", f"a tensor name must be 1 to {MAX_NORM_NAME_CHARS} characters, got {name!r:.60}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise SchemaError("norms", f"the norm of {name!r:.60} must be a finite number >= 0, got {value!r:.40}")
        out[name] = float(value)
    return out


def bounded_norms(norms: Mapping[str, float]) -> dict[str, float]:
    """The norms a record can carry: finite ones, names within bounds, the first by name up to
    :data:`MAX_NORMS` entries and :data:`MAX_NORMS_BYTES` of JSON."""
    out: dict[str, float] = {}
    size = 2
    for name in sorted(norms):
        value = float(norms[name])
        if not (0 < len(name) <= MAX_NORM_NAME_CHARS and math.isfinite(value) and value >= 0):
            continue
        size += len(name) + 28  # quotes, colon, comma, a float's repr and JSON escapes of a plain name
        if len(out) >= MAX_NORMS or size > MAX_NORMS_BYTES:
            break
        out[name] = value
    return out


def _bounded(reasons: Sequence[str]) -> list[str]:
    out = [r if len(r) <= MAX_REASON_CHARS else r[:MAX_REASON_CHARS - 1] + "…" for r in reasons]
    if len(out) > MAX_REASONS:
        out = out[:MAX_REASONS - 1] + [f"and {len(out) - MAX_REASONS + 1} more problems"]
    return out


def checkpoint_validated_event(*, ts: float, step: int, uri: str, result: ValidationResult | str,
                               reasons: Sequence[str] = (), duration_s: float | None = None, node: str = "",
                               job: str | None = None, rank: int | None = None,
                               norms: Mapping[str, float] | None = None) -> Event:
    """Build a ``checkpoint_validated`` event (reasons capped at :data:`MAX_REASONS`, each at
    :data:`MAX_REASON_CHARS` characters). A valid result carries no reasons; any other carries one.
    A valid result's ``norms`` are kept within bounds (:func:`bounded_norms`); another's are dropped."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise SchemaError("step", f"expected a non-negative integer, got {step!r}")
    try:
        res = ValidationResult(result)
    except ValueError:
        raise SchemaError("result", f"expected one of {[r.value for r in ValidationResult]}, got {result!r}") from None
    if (res is ValidationResult.VALID) == bool(reasons):
        raise SchemaError("reasons", f"a {res.value} result needs {'no' if res is ValidationResult.VALID else 'a'} "
                                     f"reason, got {list(reasons)!r}")
    kept = bounded_norms(norms) if norms and res is ValidationResult.VALID else {}
    record = CheckpointValidation(step, uri, res, tuple(_bounded(reasons)), duration_s, kept)
    what = "valid" if record.valid else f"{res.value}: {record.reasons[0]}"
    return Event(node=node, ts=float(ts), kind=EventKind.CHECKPOINT_VALIDATED, job=job, rank=rank, step=step,
                 message=f"checkpoint at step {step} {what}", data=record.to_data())


def validity(records: Sequence[CheckpointValidation]) -> dict[int, bool]:
    """Checkpoint step → valid, from a job's validation records (the newest record of a step wins)."""
    return {r.step: r.valid for r in records}
