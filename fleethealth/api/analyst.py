"""Analyst SQL under limits that hold: engine settings, a concurrency cap and a wall-clock guard.

What the gates (:mod:`fleethealth.api.sqlgate`, :mod:`fleethealth.api.sqlast`) let through still
runs on the engine the detector writes to, so each statement runs under three bounds:

* **ClickHouse's own limits**, sent with the statement (:meth:`QueryLimits.settings`): time
  (``max_execution_time`` with ``timeout_overflow_mode='throw'``), memory (``max_memory_usage``;
  GROUP BY and ORDER BY spill to disk at half of it, anything that cannot spill fails), rows and
  bytes read (``max_rows_to_read``, ``max_bytes_to_read``, thrown), the result (rows and bytes, cut),
  one thread (``max_threads``: an analyst query takes one core, not every core the detector has),
  and ``readonly=1``;
* **a concurrency cap**: at most ``max_concurrent`` statements run at once; another waits at most
  ``queue_wait_s`` for a slot, then is answered ``429`` with ``Retry-After``. A slot is held until
  the engine has really finished the statement, not until its client was answered, so statements
  that overran cannot pile up behind the answered ones;
* **a wall-clock guard**: the statement runs on its own thread, and the client is answered once
  ``max_execution_s + grace_s`` have passed whatever the engine is doing (``504``, reason
  ``timeout``); the statement is then cancelled (``KILL QUERY`` on a second handle, found by a
  random marker at the head of its text) and its slot comes back when the engine lets go of it.

A refused run is a :class:`QueryFailed` with a ``reason`` (:class:`LimitReason`) and the status
to answer; the reason is also the label of ``fleethealth_api_query_limited_total``.
"""

from __future__ import annotations

import math
import re
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from fleethealth.errors import StoreError

if TYPE_CHECKING:
    from fleethealth.store.protocol import QueryResult

__all__ = ["QueryLimits", "LimitReason", "QueryFailed", "AnalystQueries", "classify"]


@dataclass(frozen=True)
class QueryLimits:
    """Store-side bounds on one analyst query beyond rows and time (ClickHouse settings), and the
    bounds on all of them together (concurrency, the wall-clock guard)."""

    max_memory_bytes: int = 1024**3
    """``max_memory_usage``: the query fails rather than grow past this (GROUP BY and ORDER BY
    spill to disk at half of it first)."""
    max_read_bytes: int = 20 * 1024**3
    """``max_bytes_to_read``: the query fails rather than scan more."""
    max_read_rows: int = 2_000_000_000
    """``max_rows_to_read``: the query fails rather than read more rows (``numbers(N)`` counts)."""
    max_result_bytes: int = 32 * 1024**2
    """``max_result_bytes``: the result is cut (``result_overflow_mode='break'``) past this."""
    max_threads: int = 1
    """``max_threads``: cores one analyst query may use."""
    max_concurrent: int = 1
    """Analyst queries running at once; more wait ``queue_wait_s``, then get 429."""
    queue_wait_s: float = 0.5
    """How long a query waits for a free slot before it is answered 429."""
    grace_s: float = 2.0
    """The wall-clock guard answers the client ``grace_s`` after the time limit, finished or not."""

    def __post_init__(self) -> None:
        sizes = (self.max_memory_bytes, self.max_read_bytes, self.max_read_rows, self.max_result_bytes,
                 self.max_threads, self.max_concurrent)
        if min(sizes) < 1 or self.queue_wait_s < 0 or self.grace_s <= 0:
            raise ValueError(f"query limits must be positive, got {self}")

    def settings(self, *, max_rows: int, max_execution_s: float) -> str:
        """The ``SETTINGS`` clause a statement runs under."""
        spill = max(self.max_memory_bytes // 2, 1)
        return (f"SETTINGS max_result_rows={max_rows}, result_overflow_mode='break', "
                f"max_result_bytes={self.max_result_bytes}, max_execution_time={max_execution_s:g}, "
                f"timeout_overflow_mode='throw', max_memory_usage={self.max_memory_bytes}, "
                f"max_bytes_before_external_group_by={spill}, max_bytes_before_external_sort={spill}, "
                f"max_rows_to_read={self.max_read_rows}, max_bytes_to_read={self.max_read_bytes}, "
                f"read_overflow_mode='throw', max_threads={self.max_threads}, readonly=1")


class LimitReason(StrEnum):
    """Why a gated statement did not answer (the ``reason`` of the problem, and the metric label)."""

    TIMEOUT = "timeout"
    MEMORY = "memory"
    READ_LIMIT = "read_limit"
    BUSY = "busy"
    FAILED = "failed"


class QueryFailed(Exception):
    """A gated statement that did not answer: ``status`` to send, ``reason``, ``detail``, and for
    429 and 504 the seconds to put in ``Retry-After``."""

    def __init__(self, status: int, reason: LimitReason, detail: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason
        self.detail = detail
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str] | None:
        if self.retry_after_s is None:
            return None
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


_CODES = {
    159: LimitReason.TIMEOUT,      # TIMEOUT_EXCEEDED
    160: LimitReason.TIMEOUT,      # TOO_SLOW (the engine's estimate says it cannot finish in time)
    394: LimitReason.TIMEOUT,      # QUERY_WAS_CANCELLED (by the wall-clock guard)
    241: LimitReason.MEMORY,       # MEMORY_LIMIT_EXCEEDED
    158: LimitReason.READ_LIMIT,   # TOO_MANY_ROWS
    307: LimitReason.READ_LIMIT,   # TOO_MANY_BYTES
}
_CODE = re.compile(r"Code: (\d+)\.")


def classify(exc: StoreError) -> LimitReason:
    """The limit a store error reports, from ClickHouse's error code (``FAILED`` for any other)."""
    match = _CODE.search(str(exc))
    return _CODES.get(int(match.group(1)), LimitReason.FAILED) if match else LimitReason.FAILED


class AnalystQueries:
    """Runs gated statements under :class:`QueryLimits`: ``run(statement, max_rows)``.

    ``query`` runs a statement (best a store handle of its own, so an analyst query does not
    queue the detector's writes behind it on one client); ``kill`` runs a ``KILL QUERY`` on another
    handle (the owner's), so a cancel does not queue behind the statement it cancels. The client is
    answered after ``answer_after_s`` (default ``max_execution_s + limits.grace_s``).
    """

    def __init__(self, query: Callable[[str], QueryResult], kill: Callable[[str], None], *, limits: QueryLimits,
                 max_execution_s: float, answer_after_s: float | None = None) -> None:
        self._query = query
        self._kill = kill
        self.limits = limits
        self.max_execution_s = max_execution_s
        self.answer_after_s = max_execution_s + limits.grace_s if answer_after_s is None else answer_after_s
        self._slots = threading.BoundedSemaphore(limits.max_concurrent)
        self._lock = threading.Lock()
        self._running = 0

    @property
    def running(self) -> int:
        """Statements the engine is running now (answered or not)."""
        return self._running

    def run(self, statement: str, *, max_rows: int) -> QueryResult:
        if not self._slots.acquire(timeout=self.limits.queue_wait_s):
            raise QueryFailed(429, LimitReason.BUSY,
                              f"{self.limits.max_concurrent} analyst quer"
                              f"{'y is' if self.limits.max_concurrent == 1 else 'ies are'} running; try again later",
                              retry_after_s=self.max_execution_s)
        marker = f"/* fh-analyst:{uuid.uuid4().hex} */"
        # a newline before the clause ends any line comment the statement closes with
        settings = self.limits.settings(max_rows=max_rows, max_execution_s=self.max_execution_s)
        sql = f"{marker}\n{statement.rstrip(chr(10))}\n{settings}"
        done: Future[QueryResult] = Future()
        with self._lock:
            self._running += 1
        worker = threading.Thread(target=self._work, args=(sql, done), name="fleethealth-analyst-query", daemon=True)
        try:
            worker.start()
        except BaseException:
            self._finish()
            raise
        wait_s = self.answer_after_s
        try:
            return done.result(timeout=wait_s)
        except TimeoutError:
            self._cancel(marker)
            raise QueryFailed(504, LimitReason.TIMEOUT,
                              f"the query did not finish within {wait_s:g} s (limit {self.max_execution_s:g} s); "
                              "it is being cancelled", retry_after_s=self.max_execution_s) from None
        except StoreError as exc:
            reason = classify(exc)
            raise QueryFailed(400, reason, f"query failed: {exc}") from None

    def _work(self, sql: str, done: Future[QueryResult]) -> None:
        try:
            done.set_result(self._query(sql))
        except BaseException as exc:  # handed to the waiting request (or dropped once it was answered)
            done.set_exception(exc)
        finally:
            self._finish()

    def _finish(self) -> None:
        with self._lock:
            self._running -= 1
        self._slots.release()

    def _cancel(self, marker: str) -> None:
        """Ask the engine to stop the statement whose text starts with ``marker``; on a thread, so
        a kill that queues behind a busy handle does not hold the answer back."""
        sql = f"KILL QUERY WHERE startsWith(query, '{marker}') ASYNC"

        def kill() -> None:
            try:
                self._kill(sql)
            except StoreError:
                pass  # the statement finished meanwhile, or the engine cannot kill: its own limit stops it

        threading.Thread(target=kill, name="fleethealth-analyst-kill", daemon=True).start()
