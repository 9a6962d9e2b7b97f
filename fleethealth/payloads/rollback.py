"""The rollback rule of seed 000 R6: roll back to the newest checkpoint whose step is at or before
the last passing SDC check (the verification watermark); anything written after it is in the
suspect window.

The in-job watermark and the policy both choose the target through :func:`rollback_target`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

__all__ = ["rollback_target"]


class _HasStep(Protocol):
    @property
    def step(self) -> int: ...


_C = TypeVar("_C")


def _step_of(item: int | _HasStep) -> int:
    return item if isinstance(item, int) else item.step


def rollback_target(checkpoints: Iterable[_C], last_verified_step: int | None) -> _C | None:
    """The newest checkpoint whose step is <= ``last_verified_step``; ``None`` when none is clean.

    ``checkpoints`` are steps or objects with a ``step`` attribute (e.g.
    :class:`~fleethealth.payloads.checkpoint.CheckpointRecord`), in any order.
    """
    if last_verified_step is None:
        return None
    clean = [c for c in checkpoints if _step_of(c) <= last_verified_step]
    return max(clean, key=_step_of) if clean else None
