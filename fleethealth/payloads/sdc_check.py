"""The ``sdc_check`` record: one rank's result of an in-job SDC check, built in the training process
and read by the SDC detector.

``Event.data`` keys: ``check`` (``selfcheck`` | ``replay``), ``passed``, ``classification``
(``transient`` | ``persistent`` | ``data_or_code`` | null), ``digests`` (hex strings),
``duration_s``, ``peer_ranks``, ``culprit_rank``, ``tolerance``.

An ``sdc_check`` event describes the *emitting rank's own* result: ``passed=False`` means this rank's
GPU is suspect. In a replay the rank the vote names emits ``passed=False`` with ``culprit_rank`` set
to itself, its honest peers emit ``passed=True`` naming the same culprit; when no majority exists
both ranks of the pair emit ``passed=False`` with ``culprit_rank`` null.

Classification follows the rerun logic of Megatron-LM's rerun state machine: a result that differs
when recomputed on the same device is ``transient``; one that reproduces on the same device but
differs on another device is ``persistent``; one that reproduces on every device is data or code,
not hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Self

from fleethealth.errors import SchemaError
from fleethealth.payloads._fields import hex_list, opt_float, rank_list
from fleethealth.schema import Event, EventKind

__all__ = ["CheckKind", "Classification", "classify", "SdcCheck", "sdc_check_event"]


class CheckKind(StrEnum):
    """Which mechanism produced a result: the bitwise self-check or the cross-rank replay."""

    SELFCHECK = "selfcheck"
    REPLAY = "replay"


class Classification(StrEnum):
    """What a failed check says about its cause (seed 000 R3; Megatron's rerun logic)."""

    TRANSIENT = "transient"
    PERSISTENT = "persistent"
    DATA_OR_CODE = "data_or_code"


def classify(same_device_reproduces: bool, other_device_agrees: bool | None) -> Classification | None:
    """Classify an anomalous result from two reruns.

    ``same_device_reproduces``: the same device computed the same answer again.
    ``other_device_agrees``: another device computed the same answer (within tolerance); ``None``
    when no other device took part. Returns ``None`` when the evidence cannot tell hardware from
    data (the answer reproduces here and nobody else was asked).
    """
    if not same_device_reproduces:
        return Classification.TRANSIENT
    if other_device_agrees is None:
        return None
    return Classification.DATA_OR_CODE if other_device_agrees else Classification.PERSISTENT


@dataclass(frozen=True)
class SdcCheck:
    """One SDC check result, the typed view of an ``sdc_check`` event's ``data``.

    ``digests`` holds the compared values as hex strings (for a self-check the two bitwise digests,
    for a replay one fingerprint digest per rank in ``peer_ranks`` order after the emitter's own);
    ``tolerance`` is the replay's distance threshold (null for the bitwise self-check).
    """

    check: CheckKind
    passed: bool
    classification: Classification | None = None
    digests: tuple[str, ...] = ()
    duration_s: float = 0.0
    peer_ranks: tuple[int, ...] = ()
    culprit_rank: int | None = None
    tolerance: float | None = None

    def to_data(self) -> dict[str, Any]:
        return {"check": self.check.value, "passed": self.passed,
                "classification": None if self.classification is None else self.classification.value,
                "digests": list(self.digests), "duration_s": self.duration_s,
                "peer_ranks": list(self.peer_ranks), "culprit_rank": self.culprit_rank,
                "tolerance": self.tolerance}

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Self:
        """Validate ``Event.data`` of an ``sdc_check`` event; raise :class:`SchemaError` naming the key."""
        try:
            check = CheckKind(data.get("check"))
        except ValueError:
            raise SchemaError("check", f"expected selfcheck or replay, got {data.get('check')!r}") from None
        passed = data.get("passed")
        if not isinstance(passed, bool):
            raise SchemaError("passed", f"expected true or false, got {passed!r}")
        cls_value = data.get("classification")
        try:
            classification = None if cls_value is None else Classification(cls_value)
        except ValueError:
            known = ", ".join(c.value for c in Classification)
            raise SchemaError("classification", f"unknown value {cls_value!r} (known: {known})") from None
        culprit = data.get("culprit_rank")
        if culprit is not None and (isinstance(culprit, bool) or not isinstance(culprit, int) or culprit < 0):
            raise SchemaError("culprit_rank", f"expected a rank or null, got {culprit!r}")
        return cls(check=check, passed=passed, classification=classification,
                   digests=tuple(hex_list(data.get("digests", []))),
                   duration_s=opt_float("duration_s", data.get("duration_s", 0.0)) or 0.0,
                   peer_ranks=tuple(rank_list(data.get("peer_ranks", []))), culprit_rank=culprit,
                   tolerance=opt_float("tolerance", data.get("tolerance")))

    @classmethod
    def from_event(cls, event: Event) -> Self:
        if event.kind is not EventKind.SDC_CHECK:
            raise SchemaError("kind", f"expected an sdc_check event, got {event.kind.value}")
        return cls.from_data(event.data)


def sdc_check_event(*, ts: float, check: CheckKind | str, passed: bool,
                    classification: Classification | str | None = None, digests: list[str] | tuple[str, ...] = (),
                    duration_s: float = 0.0, peer_ranks: list[int] | tuple[int, ...] = (),
                    culprit_rank: int | None = None, tolerance: float | None = None, node: str = "",
                    job: str | None = None, rank: int | None = None, gpu: int | None = None,
                    step: int | None = None, message: str = "") -> Event:
    """Build an ``sdc_check`` event; every value is validated (a bad one raises :class:`SchemaError`).

    ``node`` may be empty inside a training process: the node probe fills it in on receipt.
    """
    record = SdcCheck.from_data({
        "check": str(check), "passed": passed,
        "classification": None if classification is None else str(classification),
        "digests": digests if isinstance(digests, str) else list(digests), "duration_s": duration_s,
        "peer_ranks": peer_ranks if isinstance(peer_ranks, str) else list(peer_ranks),
        "culprit_rank": culprit_rank, "tolerance": tolerance})
    if not message:
        message = (f"{record.check.value} {'passed' if passed else 'FAILED'}"
                   + ("" if record.classification is None else f" ({record.classification.value})")
                   + ("" if culprit_rank is None else f", culprit rank {culprit_rank}"))
    return Event(node=node, ts=float(ts), kind=EventKind.SDC_CHECK, job=job, gpu=gpu, rank=rank, step=step,
                 message=message, data=record.to_data())
