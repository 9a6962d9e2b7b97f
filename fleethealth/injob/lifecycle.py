"""``job_start`` / ``job_exit`` events from inside the training job (torch-free).

::

    with JobLife(reporter, world=world, first_step=start, resumed_from=uri) as life:
        for step in range(start, steps):
            ...
            life.step = step
            if guard.watermark.suspect:          # a check failed: stop, let the launcher roll back
                life.halt(f"SDC check failed at step {guard.watermark.failed_step}")
                break

On leaving the block the exit event goes out: ``completed`` when the loop ran to its end,
``halted`` after :meth:`JobLife.halt`, ``failed`` (with the exception's one-line text) when an
exception escaped — which is then re-raised. Only ``emit_rank`` (rank 0 by default) emits, so a job
reports its life once, not once per rank. Delivery goes through the :class:`Reporter`, so it never
blocks or raises on the step path.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleethealth.injob.reporter import Reporter
from fleethealth.payloads.job import ExitStatus, job_exit_event, job_start_event

__all__ = ["JobLife"]


class JobLife:
    """Emits ``job_start`` on entry and ``job_exit`` on exit (see the module docstring).

    ``rank`` is this process's job rank (default: the reporter's, else 0); ``placement`` the node of
    each rank when the launcher knows it. ``step`` is the last step trained; set it every step.
    """

    def __init__(self, reporter: Reporter, *, world: int, first_step: int = 0, resumed_from: str | None = None,
                 placement: Sequence[str] = (), rank: int | None = None, emit_rank: int = 0) -> None:
        self.reporter = reporter
        self.world, self.first_step, self.resumed_from = world, first_step, resumed_from
        self.placement = tuple(placement)
        self.rank = rank if rank is not None else reporter.rank if reporter.rank is not None else 0
        self.emit_rank = emit_rank
        self.step: int | None = None
        self.status: ExitStatus | None = None
        self.reason = ""

    def halt(self, reason: str) -> None:
        """Mark the run as stopped on purpose (a failed SDC check), to be reported on exit."""
        self.status, self.reason = ExitStatus.HALTED, reason

    def __enter__(self) -> JobLife:
        if self.rank == self.emit_rank:
            self.reporter.emit(job_start_event(ts=self.reporter.now(), world=self.world, first_step=self.first_step,
                                               resumed_from=self.resumed_from, placement=self.placement))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: object) -> None:
        if exc is not None:
            self.status = ExitStatus.FAILED
            self.reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        elif self.status is None:
            self.status = ExitStatus.COMPLETED
        if self.rank == self.emit_rank:
            self.reporter.emit(job_exit_event(ts=self.reporter.now(), status=self.status, last_step=self.step,
                                              reason=self.reason))
