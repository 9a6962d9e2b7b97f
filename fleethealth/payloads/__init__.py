"""Wire payloads both sides share: what the in-job library sends and the streaming tier reads.

Imports only :mod:`fleethealth.schema`, :mod:`fleethealth.errors` and the standard library, so the
training process and the detectors meet here and nowhere else.

- :mod:`~fleethealth.payloads.sdc_check` — ``sdc_check`` events: :class:`SdcCheck`, :func:`classify`.
- :mod:`~fleethealth.payloads.hang_report` — ``hang_report`` events: :class:`HangReport`, and
  :class:`RankStacks` as a ``hang`` finding lists them.
- :mod:`~fleethealth.payloads.checkpoint` — ``checkpoint`` events: :class:`CheckpointRecord`.
- :mod:`~fleethealth.payloads.checkpoint_cost` — ``checkpoint_cost`` events: :class:`CheckpointCost`.
- :mod:`~fleethealth.payloads.validation` — ``checkpoint_validated`` events: :class:`CheckpointValidation`.
- :mod:`~fleethealth.payloads.sdc_evidence` — an ``sdc`` finding's evidence: :class:`SdcEvidence`.
- :mod:`~fleethealth.payloads.rollback` — the rollback rule: :func:`rollback_target`.
- :mod:`~fleethealth.payloads.job` — ``job_start`` / ``job_exit`` events: :class:`JobStart`, :class:`JobExit`.
"""

from __future__ import annotations

from fleethealth.payloads.checkpoint import CheckpointRecord, checkpoint_event
from fleethealth.payloads.checkpoint_cost import CheckpointCost, checkpoint_cost_event
from fleethealth.payloads.hang_report import HangReport, RankStacks, hang_report_event
from fleethealth.payloads.job import ExitStatus, JobExit, JobStart, job_exit_event, job_start_event
from fleethealth.payloads.rollback import rollback_target
from fleethealth.payloads.sdc_check import CheckKind, Classification, SdcCheck, classify, sdc_check_event
from fleethealth.payloads.sdc_evidence import SdcEvidence
from fleethealth.payloads.validation import CheckpointValidation, ValidationResult, checkpoint_validated_event

__all__ = [
    "CheckKind",
    "CheckpointCost",
    "CheckpointRecord",
    "CheckpointValidation",
    "Classification",
    "ExitStatus",
    "HangReport",
    "JobExit",
    "JobStart",
    "RankStacks",
    "SdcCheck",
    "SdcEvidence",
    "ValidationResult",
    "checkpoint_cost_event",
    "checkpoint_event",
    "checkpoint_validated_event",
    "classify",
    "hang_report_event",
    "job_exit_event",
    "job_start_event",
    "rollback_target",
    "sdc_check_event",
]
