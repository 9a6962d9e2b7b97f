"""The verification marks and checkpoint retention of seed 000, revision R6 (torch-free).

"Clean" becomes a recorded property rather than a judgement call at 3 am — and "clean" depends
on which check vouched for it (:mod:`fleethealth.payloads.rollback`):

- ``last_verified_step`` is the newest step a check of either kind passed (it vouches against
  *transient* faults); ``last_replay_step`` the newest step a cross-rank replay passed (it vouches
  against *deterministic* faults, which a self-check cannot see). Every checkpoint records both
  (:meth:`Watermark.checkpoint`).
- the rollback target is the newest checkpoint at or before the mark that matches the failure's
  class: the last passing check for a transient fault, the last passing replay otherwise.
- retention (:func:`retention`) keeps enough rolling checkpoints to reach back past the last
  passing replay, :meth:`Watermark.keep` names the clean ancestors that must survive whatever
  the count is, and :meth:`Watermark.deletable` the rest (what ``SdcGuard.prune`` hands the loop).

Once a check fails both marks freeze: a later check can pass on weights that already hold the
corruption (both recomputations start from the same bad weights), so only :meth:`Watermark.reset`
after a rollback lets them move again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from fleethealth.errors import ConfigError
from fleethealth.payloads.checkpoint import CheckpointRecord
from fleethealth.payloads.rollback import Marks, bound_for, deletable, retained, rollback_target

__all__ = ["Retention", "Watermark", "retention", "MILESTONE_EVERY_S"]

MILESTONE_EVERY_S = 6 * 3600.0
"""Seed 000 R6: a milestone checkpoint every 6 hours, retained for the whole run."""

_C = TypeVar("_C")


@dataclass(frozen=True)
class Retention:
    """How many checkpoints to keep. ``rolling`` = ``ceil(ratio)``; ``ratio`` is the unrounded
    ``3 x max(selfcheck_interval, replay_interval) / checkpoint_interval + 2``; ``milestones`` are kept
    for the whole run. ``transient_ratio`` is the seed's original term (self-checks only): what a
    job that trusted its self-checks alone would keep."""

    ratio: float
    rolling: int
    milestones: int
    transient_ratio: float = math.nan

    @property
    def total(self) -> int:
        return self.rolling + self.milestones

    def __int__(self) -> int:
        return self.total


def retention(sdc_interval: float, checkpoint_interval: float, *, replay_interval: float | None = None,
              run_length: float | None = None, milestone_every: float = MILESTONE_EVERY_S) -> Retention:
    """Checkpoints to retain so a clean ancestor survives SDC detection latency (seed 000 R6).

    The seed's rule is ``3 x check_interval / checkpoint_interval + 2``: a fault is found by the
    check after it starts, and the checkpoint to return to is the newest one at or before the last
    *passing* check, so the window must span about one check interval (with the seed's factor of
    3 for a late or skipped check) plus the checkpoint before it. A deterministic fault is found
    only by a replay, and its rollback goes back to the last passing *replay*, so the check interval
    that governs the window is the longer of the two cadences::

        rolling = ceil(3 x max(sdc_interval, replay_interval) / checkpoint_interval + 2)

    Seed 000: self-checks every 1,000 steps (33 min) and checkpoints every 13.6 min give 9.28 →
    keep 10 for transient faults; with R3's replay every ~10,000 steps (333 min) the window becomes
    3 x 333.3 / 13.6 + 2 = 75.5 → keep 76. :meth:`Watermark.keep` shows which few of those must
    survive (the clean ancestors); the count is what a store that retains by count needs.

    ``sdc_interval`` is the self-check interval; ``replay_interval`` the replay's (``None``: no
    replay, the seed's original rule). All intervals (and ``run_length``, ``milestone_every``) share
    one unit. ``milestones`` is ``floor(run_length / milestone_every)`` (0 when the run length is unknown).
    """
    for name, value in (("sdc_interval", sdc_interval), ("checkpoint_interval", checkpoint_interval),
                        ("milestone_every", milestone_every)) + ((("replay_interval", replay_interval),)
                                                                 if replay_interval is not None else ()):
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
    transient = 3.0 * sdc_interval / checkpoint_interval + 2.0
    governing = max(sdc_interval, replay_interval or 0.0)
    ratio = 3.0 * governing / checkpoint_interval + 2.0
    rolling = math.ceil(ratio - 1e-12)
    milestones = 0
    if run_length is not None:
        if not (math.isfinite(run_length) and run_length >= 0):
            raise ConfigError(f"run_length must be a non-negative finite number, got {run_length!r}")
        milestones = int(run_length // milestone_every)
    return Retention(ratio=ratio, rolling=rolling, milestones=milestones, transient_ratio=transient)


class Watermark:
    """Tracks both verification marks from check results, freezing them at the first failure.

    ``last_verified_step``: newest step a check of either kind passed (the transient mark);
    ``last_replay_step``: newest step a replay passed (the deterministic mark). ``failed_step`` is
    the step of the first failing check since the last :meth:`reset` (``None`` while everything
    passes); ``suspect`` is True while it is set.
    """

    def __init__(self, last_verified_step: int | None = None, last_replay_step: int | None = None) -> None:
        self.last_verified_step = last_verified_step
        self.last_replay_step = last_replay_step
        self.failed_step: int | None = None

    @property
    def suspect(self) -> bool:
        return self.failed_step is not None

    @property
    def marks(self) -> Marks:
        return Marks(transient=self.last_verified_step, deterministic=self.last_replay_step)

    def record(self, step: int, passed: bool, check: str = "selfcheck") -> int | None:
        """Record one check result (all ranks' verdict at ``step``; ``check`` is ``selfcheck`` or
        ``replay``); return the transient mark."""
        if check not in {"selfcheck", "replay"}:
            raise ConfigError(f"check must be 'selfcheck' or 'replay', got {check!r}")
        if passed:
            if self.failed_step is None:
                if self.last_verified_step is None or step > self.last_verified_step:
                    self.last_verified_step = step
                if check == "replay" and (self.last_replay_step is None or step > self.last_replay_step):
                    self.last_replay_step = step
        elif self.failed_step is None:
            self.failed_step = step
        return self.last_verified_step

    def checkpoint(self, step: int, uri: str) -> CheckpointRecord:
        """The record to store with a checkpoint written at ``step`` (both marks)."""
        return CheckpointRecord(step=step, uri=uri, last_verified_step=self.last_verified_step,
                                last_replay_step=self.last_replay_step)

    def rollback_target(self, checkpoints: Sequence[_C], classification: str | None = None) -> _C | None:
        """The newest checkpoint the mark for ``classification`` vouches for (any but ``transient``
        goes back to the last passing replay)."""
        return rollback_target(checkpoints, bound_for(self.marks, classification))

    def keep(self, checkpoints: Sequence[_C]) -> list[_C]:
        """The checkpoints a retention policy must never delete, whatever its count (oldest first):
        see :func:`~fleethealth.payloads.rollback.retained`."""
        return retained(checkpoints, self.marks)

    def deletable(self, checkpoints: Sequence[_C]) -> list[_C]:
        """The checkpoints no rollback can need under the current marks (the complement of
        :meth:`keep`); none while a failure awaits its rollback (the marks are frozen then, and the
        rollback's target must survive)."""
        return [] if self.suspect else deletable(checkpoints, self.marks)

    def reset(self, step: int) -> None:
        """Resume tracking after rolling back to the checkpoint at ``step``: it is verified against
        transient faults, and against deterministic ones as far as the replay mark reached."""
        self.failed_step = None
        self.last_verified_step = step
        if self.last_replay_step is not None and self.last_replay_step > step:
            self.last_replay_step = step
