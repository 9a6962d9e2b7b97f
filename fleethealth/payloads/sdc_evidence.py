"""The evidence of an ``sdc`` finding: the failing check record plus what a rollback needs.

Keys of ``Finding.evidence``: the check record's ``check``, ``classification``, ``digests``,
``duration_s``, ``peer_ranks``, ``culprit_rank``, ``tolerance``; ``reporting_rank`` (the rank that
emitted the check); ``hardware`` (false only for ``data_or_code``); ``last_verified_step`` (the
newest step of the job whose check of either kind passed before the failing one, or null: the mark
for transient faults), ``last_replay_step`` (the newest such step of a cross-rank replay: the mark
for deterministic faults) and ``checkpoints`` (the job's recent checkpoint records, oldest first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from fleethealth.errors import SchemaError
from fleethealth.payloads.checkpoint import CheckpointRecord
from fleethealth.payloads.sdc_check import Classification, SdcCheck

__all__ = ["SdcEvidence"]


@dataclass(frozen=True)
class SdcEvidence:
    """The typed view of an ``sdc`` finding's ``evidence``; ``record.passed`` is always False."""

    record: SdcCheck
    reporting_rank: int | None
    last_verified_step: int | None
    checkpoints: tuple[CheckpointRecord, ...] = ()
    last_replay_step: int | None = None

    @property
    def hardware(self) -> bool:
        """False when the check says data or code, not this GPU, is to blame."""
        return self.record.classification is not Classification.DATA_OR_CODE

    def to_evidence(self) -> dict[str, Any]:
        r = self.record
        return {
            "check": r.check.value,
            "classification": None if r.classification is None else r.classification.value,
            "digests": list(r.digests), "duration_s": r.duration_s, "peer_ranks": list(r.peer_ranks),
            "culprit_rank": r.culprit_rank, "tolerance": r.tolerance, "reporting_rank": self.reporting_rank,
            "hardware": self.hardware, "last_verified_step": self.last_verified_step,
            "last_replay_step": self.last_replay_step,
            "checkpoints": [c.to_data() for c in self.checkpoints],
        }

    @classmethod
    def from_evidence(cls, evidence: Mapping[str, Any]) -> Self:
        """Validate a finding's evidence; raise :class:`SchemaError` naming the key."""
        record = SdcCheck.from_data({**evidence, "passed": False})
        reporting = evidence.get("reporting_rank")
        if reporting is not None and (isinstance(reporting, bool) or not isinstance(reporting, int)):
            raise SchemaError("reporting_rank", f"expected a rank or null, got {reporting!r}")
        lvs, lrs = evidence.get("last_verified_step"), evidence.get("last_replay_step")
        for name, value in (("last_verified_step", lvs), ("last_replay_step", lrs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise SchemaError(name, f"expected a step or null, got {value!r}")
        books = evidence.get("checkpoints", [])
        if not isinstance(books, list | tuple):
            raise SchemaError("checkpoints", "expected a list of checkpoint records")
        return cls(record=record, reporting_rank=reporting, last_verified_step=lvs, last_replay_step=lrs,
                   checkpoints=tuple(CheckpointRecord.from_data(c) for c in books))
