"""Failure handling of the stream runner: back off on what is transient, isolate what is not.

A write of the detector runner (:mod:`fleethealth.detectors.runner`) fails in one of two ways:

* **transient** — the store or the broker cannot be reached (:class:`~fleethealth.errors.StoreUnavailable`,
  :class:`~fleethealth.errors.BusUnavailable`, a connection error or a timeout): nothing is wrong with
  the rows, so the same write is tried again, with exponential backoff (``backoff_s`` doubling up to
  ``max_backoff_s``) for as long as it takes, logging at most once per ``log_every_s``, and
  nothing is committed meanwhile;
* **deterministic** — anything else (a row the store refuses, a constraint, a serialisation error):
  the same write is tried ``attempts`` times in all, and if it still fails :func:`isolate` splits the
  rows in halves, recursively, writes every half that succeeds and hands each row that fails on its
  own to ``on_bad`` (the runner dead-letters it, with the error, and moves on).

:class:`Retry` is the policy (parameters and an injectable ``sleep`` and ``clock``, so tests never
wait); it does no I/O of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from fleethealth.errors import BusUnavailable, StoreUnavailable
from fleethealth.params import check_int, check_number

__all__ = ["Retry", "Stopped", "is_transient", "isolate"]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_TRANSIENT = (StoreUnavailable, BusUnavailable, ConnectionError, TimeoutError)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` says the store or the broker could not be reached (retry the same write), as
    opposed to a failure of the write itself. Looks through ``raise … from`` causes."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, _TRANSIENT):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return False


class Stopped(Exception):
    """Raised from a transient retry when the runner was asked to stop; carries the last error."""


class Retry:
    """Backoff and bounded attempts (see the module docstring). ``stopping`` is polled between
    transient attempts: when it returns true the last error is raised (wrapped in :class:`Stopped`)
    so a runner asked to stop does not wait for the store forever."""

    def __init__(self, *, attempts: int = 3, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 log_every_s: float = 60.0, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic,
                 stopping: Callable[[], bool] = lambda: False) -> None:
        self.attempts = check_int("attempts", attempts, at_least=1)
        self.backoff_s = check_number("backoff_s", backoff_s, at_least=0)
        self.max_backoff_s = check_number("max_backoff_s", max_backoff_s, at_least=self.backoff_s)
        self.log_every_s = check_number("log_every_s", log_every_s, at_least=0)
        self.sleep = sleep
        self.clock = clock
        self.stopping = stopping
        self.transient_total = 0
        self.failed_total = 0
        self._logged_at = float("-inf")

    def call(self, what: str, fn: Callable[[], R], *, attempts: int | None = None) -> R:
        """``fn()``; a transient failure is retried until it succeeds (or :attr:`stopping`), a
        deterministic one ``attempts`` times in all (the policy's unless given) and then re-raised."""
        attempts = self.attempts if attempts is None else attempts
        delay = self.backoff_s
        failures = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                if is_transient(exc):
                    self.transient_total += 1
                    if self.stopping():
                        raise Stopped(f"{what}: stopped while the store or broker was unreachable: {exc}") from exc
                    now = self.clock()
                    if now - self._logged_at >= self.log_every_s:
                        self._logged_at = now
                        log.warning("%s: store or broker unreachable, retrying every ≤ %.0f s without "
                                    "committing: %s", what, self.max_backoff_s, exc)
                else:
                    failures += 1
                    self.failed_total += 1
                    if failures >= attempts:
                        raise
                    log.warning("%s failed (attempt %d of %d): %s", what, failures, attempts, exc)
                self.sleep(delay)
                delay = min(self.max_backoff_s, max(delay * 2, 1e-3))


def isolate(retry: Retry, what: str, rows: Sequence[T], write: Callable[[Sequence[T], str], object],
            on_bad: Callable[[T, BaseException], None], *, path: str = "") -> int:
    """Write ``rows`` through ``write(rows, path)``; on a deterministic failure (after the retry's
    attempts), split them in halves and write each, down to single rows, which go to ``on_bad`` with
    their error. The halves are tried once each (the failure is known to be deterministic by then;
    transient failures are still waited out). ``path`` names the part written (``""`` the whole,
    then ``"0"``, ``"1"``, ``"01"`` …), so a caller can derive a deduplication token per part.
    Returns how many rows went to ``on_bad``."""
    if not rows:
        return 0
    try:
        retry.call(what, lambda: write(rows, path), attempts=None if not path else 1)
        return 0
    except Stopped:
        raise
    except Exception as exc:
        if is_transient(exc):
            raise
        if len(rows) == 1:
            on_bad(rows[0], exc)
            return 1
        half = len(rows) // 2
        return (isolate(retry, what, rows[:half], write, on_bad, path=path + "0")
                + isolate(retry, what, rows[half:], write, on_bad, path=path + "1"))
