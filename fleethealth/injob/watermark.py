"""The verification watermark and checkpoint retention of seed 000, revision R6 (torch-free).

"Clean" becomes a recorded property rather than a judgement call at 3 am:

- ``last_verified_step`` is the most recent step at which an SDC check passed; every checkpoint
  records it (:meth:`Watermark.checkpoint`).
- the rollback target is the newest checkpoint whose step is <= the last passing check
  (:func:`fleethealth.payloads.rollback.rollback_target`, the rule the policy applies too); anything
  written after it is in the suspect window.
- retention is derived from the check cadence: ``ceil(3 x sdc_interval / checkpoint_interval + 2)``
  rolling checkpoints, plus a milestone every 6 hours kept for the whole run (:func:`retention`).
  The seed's worked numbers: checks every 33 min and checkpoints every 13.6 min give 9.28, keep 10.

Once a check fails the watermark freezes: a later check can pass on weights that already hold the
corruption (both recomputations start from the same bad weights), so only :meth:`Watermark.reset`
after a rollback lets it move again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from fleethealth.errors import ConfigError
from fleethealth.payloads.checkpoint import CheckpointRecord
from fleethealth.payloads.rollback import rollback_target

__all__ = ["Retention", "Watermark", "retention", "MILESTONE_EVERY_S"]

MILESTONE_EVERY_S = 6 * 3600.0
"""Seed 000 R6: a milestone checkpoint every 6 hours, retained for the whole run."""

_C = TypeVar("_C")


@dataclass(frozen=True)
class Retention:
    """How many checkpoints to keep. ``rolling`` = ``ceil(ratio)``; ``ratio`` is the unrounded
    ``3 x sdc_interval / checkpoint_interval + 2``; ``milestones`` are kept for the whole run."""

    ratio: float
    rolling: int
    milestones: int

    @property
    def total(self) -> int:
        return self.rolling + self.milestones

    def __int__(self) -> int:
        return self.total


def retention(sdc_interval: float, checkpoint_interval: float, *, run_length: float | None = None,
              milestone_every: float = MILESTONE_EVERY_S) -> Retention:
    """Checkpoints to retain so a clean ancestor survives SDC detection latency (seed 000 R6).

    ``sdc_interval`` and ``checkpoint_interval`` (and ``run_length``, ``milestone_every``) share one
    unit. ``milestones`` is ``floor(run_length / milestone_every)`` (0 when the run length is unknown).
    """
    for name, value in (("sdc_interval", sdc_interval), ("checkpoint_interval", checkpoint_interval),
                        ("milestone_every", milestone_every)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
    ratio = 3.0 * sdc_interval / checkpoint_interval + 2.0
    rolling = math.ceil(ratio - 1e-12)
    milestones = 0
    if run_length is not None:
        if not (math.isfinite(run_length) and run_length >= 0):
            raise ConfigError(f"run_length must be a non-negative finite number, got {run_length!r}")
        milestones = int(run_length // milestone_every)
    return Retention(ratio=ratio, rolling=rolling, milestones=milestones)


class Watermark:
    """Tracks ``last_verified_step`` from check results, freezing it at the first failure.

    ``failed_step`` is the step of the first failing check since the last :meth:`reset` (``None``
    while everything passes); ``suspect`` is True while it is set.
    """

    def __init__(self, last_verified_step: int | None = None) -> None:
        self.last_verified_step = last_verified_step
        self.failed_step: int | None = None

    @property
    def suspect(self) -> bool:
        return self.failed_step is not None

    def record(self, step: int, passed: bool) -> int | None:
        """Record one check result (all ranks' verdict at ``step``); return the watermark."""
        if passed:
            if self.failed_step is None and (self.last_verified_step is None or step > self.last_verified_step):
                self.last_verified_step = step
        elif self.failed_step is None:
            self.failed_step = step
        return self.last_verified_step

    def checkpoint(self, step: int, uri: str) -> CheckpointRecord:
        """The record to store with a checkpoint written at ``step``."""
        return CheckpointRecord(step=step, uri=uri, last_verified_step=self.last_verified_step)

    def rollback_target(self, checkpoints: Sequence[_C]) -> _C | None:
        """The newest checkpoint at or before the last passing check."""
        return rollback_target(checkpoints, self.last_verified_step)

    def reset(self, step: int) -> None:
        """Resume tracking after rolling back to the checkpoint at ``step`` (which is verified)."""
        self.failed_step = None
        self.last_verified_step = step
