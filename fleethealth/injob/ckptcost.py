"""What each checkpoint save cost the training job, reported without blocking it (torch-free).

The checkpoint interval the service recommends (:mod:`fleethealth.policy.interval`) needs the cost C of a
checkpoint: how long a save held training up. A save blocks for all of its write when it is
synchronous (``torch.save``, ``dcp.save``), or only for the copy to host memory when the write runs in
the background (``dcp.async_save``); the background write then bounds how often one can checkpoint.
Both go to the node probe as one ``checkpoint_cost`` record (:mod:`fleethealth.payloads.checkpoint_cost`)::

    saves = SaveTimer(reporter)
    with saves.timed(step, uri):                       # a synchronous save: all of it blocks
        torch.save(state, uri)

    with saves.timed(step, uri) as save:               # a background write
        save.background(dcp.async_save(state, checkpoint_id=uri))

:func:`report_checkpoint_cost` is the one call underneath, for a loop that measures its saves itself.
Only ``emit_rank`` (rank 0 by default) reports, as for the ``checkpoint`` record. Delivery goes through
the :class:`~fleethealth.injob.reporter.Reporter` (non-blocking, drop-counting); the background write's
record is sent from the thread that completes its future.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fleethealth.errors import ConfigError, SchemaError
from fleethealth.injob.reporter import Reporter
from fleethealth.payloads.checkpoint_cost import checkpoint_cost_event

__all__ = ["SaveTimer", "Save", "report_checkpoint_cost"]

_log = logging.getLogger("fleethealth.injob")


def report_checkpoint_cost(reporter: Reporter, *, step: int, blocking_s: float, write_s: float = 0.0,
                           uri: str = "") -> bool:
    """Send one ``checkpoint_cost`` record; False (logged) when a value is invalid or delivery failed.
    Never raises: a bad measurement must not stop training."""
    try:
        event = checkpoint_cost_event(ts=reporter.now(), step=step, blocking_s=blocking_s, write_s=write_s, uri=uri)
    except SchemaError as exc:
        _log.warning("fleethealth: checkpoint cost of step %s not reported: %s", step, exc)
        return False
    return reporter.emit(event)


class Save:
    """One save being timed (from :meth:`SaveTimer.timed`); call :meth:`background` with the future of a
    write that goes on after the ``with`` block, or :meth:`written` when a write of your own is done."""

    def __init__(self, timer: SaveTimer, step: int, uri: str, started: float) -> None:
        self._timer, self.step, self.uri, self._started = timer, step, uri, started
        self.blocking_s: float | None = None
        self.write_s: float | None = None
        self._lock = threading.Lock()
        self._background = False
        self._done_early = False
        self._reported = False

    def background(self, future: Any) -> Any:
        """The write goes on in the background; ``future`` (anything with ``add_done_callback``, such as
        the ``concurrent.futures.Future`` of ``dcp.async_save``) says when it is done. Returns ``future``."""
        if not callable(getattr(future, "add_done_callback", None)):
            raise ConfigError(f"Save.background needs a future with add_done_callback, got {type(future).__name__}")
        self._background = True
        future.add_done_callback(lambda _f: self.written())
        return future

    def written(self) -> None:
        """The background write is done: report the save (once; from any thread)."""
        with self._lock:
            self._background = True
            if self.blocking_s is None:  # done before the with-block ended: reported at its end
                self._done_early = True
                return
            write_s = max(0.0, self._timer.clock() - self._started - self.blocking_s)
        self._report(write_s)

    def _ended(self) -> None:
        with self._lock:
            self.blocking_s = max(0.0, self._timer.clock() - self._started)
            now = not self._background or self._done_early
        if now:
            self._report(0.0)

    def _report(self, write_s: float) -> None:
        with self._lock:
            if self._reported:
                return
            self._reported, self.write_s = True, write_s
        if self._timer.reports:
            report_checkpoint_cost(self._timer.reporter, step=self.step, blocking_s=self.blocking_s or 0.0,
                                   write_s=write_s, uri=self.uri)


class SaveTimer:
    """Times checkpoint saves and reports their cost (see the module docstring).

    ``rank`` is this process's job rank (default: the reporter's, else 0); only ``emit_rank`` reports.
    ``clock`` measures durations (monotonic seconds; a test passes its own).
    """

    def __init__(self, reporter: Reporter, *, rank: int | None = None, emit_rank: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.reporter = reporter
        self.rank = rank if rank is not None else reporter.rank if reporter.rank is not None else 0
        self.emit_rank = emit_rank
        self.clock = clock

    @property
    def reports(self) -> bool:
        return self.rank == self.emit_rank

    @contextmanager
    def timed(self, step: int, uri: str = "") -> Iterator[Save]:
        """Time the save in the ``with`` block; a save that raises is not reported."""
        save = Save(self, step, uri, self.clock())
        yield save
        save._ended()
