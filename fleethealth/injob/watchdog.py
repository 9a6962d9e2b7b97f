"""The hang watchdog: a progress check, not a liveness check (seed 000 §7, failure 1; torch-free).

::

    if now - last_completed_step > STEP_TIMEOUT:
        dump_stacks()                 # faulthandler, every thread
        report_hang(rank, step, last_collective)
        abort()                       # optional

A hung rank is perfectly alive, so the watchdog watches step completions (:meth:`HangWatchdog.beat`)
and names the collective the rank last entered (:meth:`HangWatchdog.collective`). The dump goes to
the node probe as a ``hang_report`` event; with 1,024 ranks in the same collective, the one whose
stack differs is the culprit. The watchdog fires once per stall and re-arms at the next beat.

A long check inside a step (the guard's start-up probe and calibration, a self-check, a cross-rank
replay) runs inside :meth:`HangWatchdog.checking`: while it runs the limit is ``check_timeout_s``
(default 10 x ``timeout_s``) instead of ``timeout_s``, and the step clock restarts when it ends, so a
healthy but slow check is not reported as a hang (nor aborted) while a check that truly stalls still is.

:meth:`HangWatchdog.poll` holds the whole decision and takes the monotonic time as an argument, so
tests drive it without sleeping; :meth:`HangWatchdog.start` runs it on a daemon thread.
"""

from __future__ import annotations

import faulthandler
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from fleethealth.errors import ConfigError
from fleethealth.injob.reporter import Reporter
from fleethealth.payloads.hang_report import hang_report_event
from fleethealth.schema import Event

__all__ = ["HangWatchdog", "dump_all_stacks", "abort_process_group"]

_log = logging.getLogger("fleethealth.injob")


def dump_all_stacks() -> str:
    """Every thread's Python stack, as ``faulthandler`` writes it (works while the GIL holder waits
    in C code, because faulthandler reads the frames without running Python)."""
    with tempfile.TemporaryFile(mode="w+") as fh:
        faulthandler.dump_traceback(file=fh, all_threads=True)
        fh.flush()
        fh.seek(0)
        return fh.read()


def abort_process_group() -> None:
    """Abort torch.distributed's default process group so blocked collectives return with an error.

    Uses ``torch.distributed.distributed_c10d._abort_process_group`` where this torch has it (NCCL
    communicators abort without waiting), else destroys the group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort()
    else:
        dist.destroy_process_group()


class HangWatchdog:
    """Fire when no step completes within ``timeout_s``.

    On firing: dump every thread's stack, emit a ``hang_report`` through ``reporter`` with the rank,
    the last completed step and the last collective, call ``on_hang(event)`` if given, and with
    ``abort=True`` call ``abort_fn`` (default :func:`abort_process_group`). ``fired_total`` counts
    firings; ``last_report`` holds the latest event. ``clock`` is a monotonic clock.
    ``check_timeout_s``: the limit while a check runs (see :meth:`checking`; default 10 x ``timeout_s``).
    """

    def __init__(self, timeout_s: float, *, reporter: Reporter | None = None, abort: bool = False,
                 abort_fn: Callable[[], None] = abort_process_group,
                 on_hang: Callable[[Event], None] | None = None, poll_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, check_timeout_s: float | None = None) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
        if check_timeout_s is not None and not check_timeout_s >= timeout_s:
            raise ConfigError(f"check_timeout_s ({check_timeout_s}) must be >= timeout_s ({timeout_s})")
        self.timeout_s = float(timeout_s)
        self.check_timeout_s = float(check_timeout_s) if check_timeout_s is not None else 10.0 * self.timeout_s
        self.reporter = reporter if reporter is not None else Reporter()
        self.abort = abort
        self.abort_fn = abort_fn
        self.on_hang = on_hang
        self.poll_s = poll_s if poll_s is not None else min(1.0, self.timeout_s / 4)
        self.clock = clock
        self.step: int | None = None
        self.last_collective: str | None = None
        self.fired_total = 0
        self.last_report: Event | None = None
        self._last_beat = clock()
        self._armed = True
        self._checks = 0
        self.check: str | None = None  # the check running now, if any
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int) -> None:
        """Record that ``step`` completed; re-arms the watchdog."""
        with self._lock:
            self.step = step
            self._last_beat = self.clock()
            self._armed = True

    @contextmanager
    def checking(self, what: str) -> Iterator[None]:
        """Run a long check (``what`` names it in the log) under ``check_timeout_s``; the step clock
        restarts on entry and on exit. Nests."""
        with self._lock:
            self._checks += 1
            self._last_beat = self.clock()
            self._armed = True
            outer, self.check = self.check, what
        try:
            yield
        finally:
            with self._lock:
                self._checks -= 1
                self._last_beat = self.clock()
                self._armed = True
                self.check = outer

    @property
    def limit_s(self) -> float:
        """The limit in force now: ``check_timeout_s`` while a check runs, else ``timeout_s``."""
        return self.check_timeout_s if self._checks else self.timeout_s

    def collective(self, name: str) -> None:
        """Record the collective this rank is about to enter (e.g. ``"all_reduce"``)."""
        self.last_collective = name

    def poll(self, now: float) -> Event | None:
        """Fire if the last beat is older than the timeout at monotonic time ``now``; return the report."""
        with self._lock:
            limit = self.limit_s
            if not self._armed or now - self._last_beat <= limit:
                return None
            self._armed = False
            step = self.step
        event = hang_report_event(ts=self.reporter.now(), stacks=dump_all_stacks(), timeout_s=limit,
                                  last_collective=self.last_collective, step=step, job=self.reporter.job,
                                  rank=self.reporter.rank, gpu=self.reporter.gpu)
        self.fired_total += 1
        self.last_report = event
        self.reporter.emit(event)
        _log.error("fleethealth: rank %s made no progress for %.1f s after step %s (last collective %s%s)",
                   self.reporter.rank, limit, step, self.last_collective,
                   "" if self.check is None else f", inside the {self.check} check")
        if self.on_hang is not None:
            self.on_hang(event)
        if self.abort:
            self.abort_fn()
        return event

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll(self.clock())
            except Exception:  # the watchdog must outlive a failing hook
                _log.exception("fleethealth: hang watchdog hook failed")

    def start(self) -> HangWatchdog:
        """Start the daemon thread (idempotent) and arm from now."""
        if self._thread is None:
            with self._lock:
                self._last_beat = self.clock()
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="fleethealth-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def __enter__(self) -> HangWatchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
