"""The rollback rule of seed 000 R6, with what each check can vouch for.

Two in-job checks see different faults (seed 000 R3):

* the bitwise **self-check** recomputes a microbatch on the same GPU; it sees a *transient* fault
  (a flipped bit that does not recur) but passes a GPU that computes the same wrong answer twice;
* the cross-rank **replay** recomputes on another GPU; it sees a *deterministic* fault too.

So a job carries two verification marks (:class:`Marks`): ``transient`` — the newest step a check of
either kind passed (both see transient faults) — and ``deterministic`` — the newest step a replay
passed. A checkpoint is written with both. When a check fails, the rollback goes to the newest
checkpoint at or before the mark that can vouch for the failure's class:

==========================================  ======================================
classification of the failing check         the checkpoint must be at or before
==========================================  ======================================
``transient``                               the last passing check (either kind)
``persistent``, ``data_or_code``, unknown   the last passing **replay**
==========================================  ======================================

A self-check that passes after a deterministic fault began vouches for nothing about it; rolling
back to the last passing self-check would land on weights the fault already touched.

The in-job guard (:meth:`~fleethealth.injob.guard.SdcGuard.rollback_target`) and the policy both
choose the target through :func:`choose`: the marks as they stood before the failing step, the bound
for the failure's class, the newest checkpoint at or before it.

**Checkpoint step.** A checkpoint's ``step`` is the step whose update it includes: it is written
after ``optimizer.step()`` (or the skipped update) of that step and before the next step's
forward, so resuming from it starts at ``step + 1``. A mark at step ``s`` says the check of step
``s``'s gradients passed, so the update of step ``s`` is vouched for and a checkpoint at ``s`` is a
valid target (``checkpoint.step <= bound``).

**Validated checkpoints** (seed 000 §4, Failure 4). The marks vouch for the *weights* a checkpoint
holds; whether its *files* can be resumed from is the ``checkpoint_validated`` record's
(:mod:`fleethealth.payloads.validation`). :func:`choose` takes the job's validation results as
``validity`` (checkpoint step → valid) and applies :func:`admissible`:

* a job that has reported a validation result (``validity`` not empty), or any job when
  ``require_validation`` is set: only a checkpoint whose newest result is ``valid`` may be a target —
  an invalid one, and one not (yet) validated, never is;
* a job that has never reported one (``validity`` empty or ``None``) and ``require_validation`` unset:
  the marks alone choose, as before validation existed (the policy says so in its evidence).

Validation never changes the marks: a checkpoint refused for its files still says which steps a
check had passed when it was written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = ["Marks", "admissible", "bound_for", "choose", "deletable", "merge", "retained", "rollback_target"]


class _HasStep(Protocol):
    @property
    def step(self) -> int: ...


_C = TypeVar("_C")


def _step_of(item: int | _HasStep) -> int:
    return item if isinstance(item, int) else item.step


@dataclass(frozen=True)
class Marks:
    """The two verification marks of a job (``None``: no such check has passed yet).

    ``transient``: newest step a self-check or a replay passed. ``deterministic``: newest step a
    replay passed (never newer than ``transient``).
    """

    transient: int | None = None
    deterministic: int | None = None

    def before(self, step: int | None) -> Marks:
        """The marks as they stood before a failure at ``step`` (a mark at or after it cannot vouch for it)."""
        if step is None:
            return self

        def cut(mark: int | None) -> int | None:
            return mark if mark is not None and mark < step else None

        return Marks(cut(self.transient), cut(self.deterministic))


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def merge(marks: Iterable[Marks]) -> Marks:
    """The newest of each mark over several sources (checkpoint records, passing checks seen)."""
    out = Marks()
    for m in marks:
        out = Marks(_max(out.transient, m.transient), _max(out.deterministic, m.deterministic))
    return out


def bound_for(marks: Marks, classification: str | None) -> int | None:
    """The newest step a rollback for a failure of ``classification`` may land on (see the table)."""
    if classification == "transient":
        return marks.transient
    return marks.deterministic


def rollback_target(checkpoints: Iterable[_C], last_verified_step: int | None) -> _C | None:
    """The newest checkpoint whose step is <= ``last_verified_step``; ``None`` when none is clean.

    ``checkpoints`` are steps or objects with a ``step`` attribute (e.g.
    :class:`~fleethealth.payloads.checkpoint.CheckpointRecord`), in any order. Pass the bound of
    :func:`bound_for` for the failure at hand.
    """
    if last_verified_step is None:
        return None
    clean = [c for c in checkpoints if _step_of(c) <= last_verified_step]
    return max(clean, key=_step_of) if clean else None


def admissible(checkpoints: Iterable[_C], validity: Mapping[int, bool] | None, *,
               require_validation: bool = False) -> tuple[list[_C], list[_C]]:
    """``(candidates, refused)``: the checkpoints a rollback may land on, and those refused because
    their validation failed or never came (see the module docstring). Without validation results and
    without ``require_validation`` every checkpoint is a candidate and none is refused."""
    book = list(checkpoints)
    if not validity and not require_validation:
        return book, []
    seen = validity or {}
    keep = [c for c in book if seen.get(_step_of(c)) is True]
    return keep, [c for c in book if seen.get(_step_of(c)) is not True]


def choose(checkpoints: Iterable[_C], marks: Iterable[Marks], classification: str | None,
           failed_step: int | None, *, validity: Mapping[int, bool] | None = None,
           require_validation: bool = False) -> tuple[Marks, int | None, _C | None]:
    """The rollback rule: ``(marks, bound, target)`` for a failure of ``classification`` at ``failed_step``.

    ``marks`` are every source of marks known (the job's own, each checkpoint record's); marks at or
    after ``failed_step`` vouch for nothing (:meth:`Marks.before`) and the newest of the rest count
    (:func:`merge`); the bound is the mark for the class (:func:`bound_for`); the target the newest
    checkpoint at or before it among the admissible ones (:func:`admissible`: with ``validity``,
    checkpoint step → valid, only validated ones) (``None``: none is clean, a human must decide)."""
    merged = merge(m.before(failed_step) for m in marks)
    bound = bound_for(merged, classification)
    candidates, _ = admissible(checkpoints, validity, require_validation=require_validation)
    return merged, bound, rollback_target(candidates, bound)


def deletable(checkpoints: Iterable[_C], marks: Marks) -> list[_C]:
    """The checkpoints no rollback can need (oldest first): everything :func:`retained` does not keep."""
    book = list(checkpoints)
    keep = {id(c) for c in retained(book, marks)}
    return sorted((c for c in book if id(c) not in keep), key=_step_of)


def retained(checkpoints: Iterable[_C], marks: Marks) -> list[_C]:
    """The checkpoints a rollback may still need, oldest first: the clean ancestor for a deterministic
    fault (newest at or before the replay mark), the one for a transient fault (newest at or before
    the check mark), and every newer one (not yet verified). Whatever a retention count says, these
    must survive; anything older can go."""
    book = list(checkpoints)
    ancestors = {id(c) for c in (rollback_target(book, marks.deterministic), rollback_target(book, marks.transient))
                 if c is not None}
    floor = -1 if marks.transient is None else marks.transient
    return sorted((c for c in book if id(c) in ancestors or _step_of(c) > floor), key=_step_of)
