"""What the in-job SDC checks return: one rank's check result, the step's verdict, the start-up probe
(torch-free).

A :class:`CheckResult` becomes an ``sdc_check`` event (:meth:`CheckResult.to_event`, the wire record of
:mod:`fleethealth.payloads.sdc_check`); the rest stays in the training process.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from fleethealth.injob.invariants import InvariantVerdict
from fleethealth.payloads.sdc_check import CheckKind, Classification, sdc_check_event
from fleethealth.schema import Event

__all__ = ["NondeterminismWarning", "CheckResult", "StepVerdict", "StartupReport", "fingerprint_hex"]


class NondeterminismWarning(UserWarning):
    """The model's backward is not bitwise reproducible; the self-check runs at a tolerance."""


@dataclass(frozen=True)
class CheckResult:
    """One rank's result of one check. ``digests`` are hex strings (self-check: training pass then
    recomputation; replay: this rank's fingerprint then its peers'); ``mismatched`` names the
    parameters whose bits differed in a failed self-check."""

    check: CheckKind
    step: int
    rank: int
    passed: bool
    classification: Classification | None
    digests: tuple[str, ...]
    duration_s: float
    peer_ranks: tuple[int, ...] = ()
    culprit_rank: int | None = None
    tolerance: float | None = None
    mismatched: tuple[str, ...] = ()

    def to_event(self, ts: float, message: str = "") -> Event:
        """The ``sdc_check`` event reporting this result (the node probe fills the node)."""
        return sdc_check_event(
            ts=ts, check=self.check, passed=self.passed, classification=self.classification,
            digests=list(self.digests), duration_s=self.duration_s, peer_ranks=list(self.peer_ranks),
            culprit_rank=self.culprit_rank, tolerance=self.tolerance, rank=self.rank, step=self.step,
            message=message)


@dataclass(frozen=True)
class StepVerdict:
    """What :meth:`SdcGuard.after_backward` decided.

    ``skip_update``, ``check``, ``classification`` and ``culprits`` are the same on every rank (they
    are derived from the integers every rank gathered and from the replay round, identical
    everywhere). ``check`` names what failed: ``selfcheck``, ``replay``, ``invariants`` (a
    non-finite value or a spike no check explained) or ``None``; ``culprits`` are the job ranks it
    names; ``checks`` are this rank's own results. ``microbatches`` is the number of training
    forwards the guard counted in the step (more than one: gradient accumulation).
    ``rollback_to`` (same on every rank): the step of the checkpoint the loop must restore now —
    after this step's own failed check (the policy's rule) or on the policy's advice received
    through the probe — then call :meth:`SdcGuard.rolled_back`; ``rollback_reason`` says why (or,
    with ``rollback_to`` ``None``, that no clean checkpoint exists and a human must decide).
    """

    step: int
    skip_update: bool
    invariants: InvariantVerdict
    checks: tuple[CheckResult, ...] = ()
    classification: Classification | None = None
    check: str | None = None
    culprits: tuple[int, ...] = ()
    microbatches: int = 1
    rollback_to: int | None = None
    rollback_reason: str = ""

    @property
    def failed(self) -> tuple[CheckResult, ...]:
        return tuple(c for c in self.checks if not c.passed)


@dataclass(frozen=True)
class StartupReport:
    """The start-up probe: whether two healthy recomputations agree bit for bit.

    ``nondeterministic_op`` is the op torch named when deterministic algorithms were refused;
    ``mismatched`` the parameters whose gradients differed; ``selfcheck_tolerance`` is set only when
    the self-check fell back to a tolerance. ``replay_tolerance`` is the replay threshold in force.
    """

    deterministic: bool
    nondeterministic_op: str | None
    mismatched: tuple[str, ...]
    selfcheck_tolerance: float | None
    replay_tolerance: float | None


def fingerprint_hex(fp: np.ndarray) -> str:
    """A fingerprint (:func:`~fleethealth.injob.digest.fingerprint`) as the hex digest a result carries."""
    return hashlib.blake2b(np.ascontiguousarray(fp, dtype="<f8").tobytes(), digest_size=16).hexdigest()
