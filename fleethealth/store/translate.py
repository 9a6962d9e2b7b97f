"""Error translation at the store's boundary: one helper, used by every backend call.

::

    clickhouse_connect.driver.exceptions.Error  -> StoreError ("<doing> on <dsn>: <first line>")
    ... caused by a connection error or timeout -> StoreUnavailable (the same statement may be retried)
    ... the volume out of space (ENOSPC, 243)   -> StoreFull, a StoreUnavailable: retried once space
                                                   returns, counted in fleethealth_store_full_errors_total
    a chDB path locked by another process       -> StoreLocked (raised by the chDB backend)

A DSN that carries a password is shown with ``***`` in its place.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from fleethealth.errors import StoreError, StoreFull, StoreUnavailable

__all__ = ["store_error", "first_line", "redact", "full_errors_total"]

_FULL_MARKS = ("NOT_ENOUGH_SPACE", "No space left on device", "errno: 28,")
_full_counter: Any = None


def store_error(exc: BaseException, doing: str, dsn: str) -> StoreError:
    """``exc`` as a :class:`StoreError` saying what failed where (a StoreError passes unchanged);
    raise it ``from exc``."""
    if isinstance(exc, StoreError):
        return exc
    if _full(exc):
        _count_full()
        return StoreFull(f"{doing} on {dsn}: the store's volume is full (free space or grow it; the write is "
                         f"retried): {first_line(exc)}")
    cls = StoreUnavailable if _unreachable(exc) else StoreError
    return cls(f"{doing} on {dsn}: {first_line(exc)}")


def _full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) says the store's disk is full."""
    for _ in range(8):
        if exc is None:
            return False
        if isinstance(exc, OSError) and exc.errno == 28 or any(m in str(exc) for m in _FULL_MARKS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _count_full() -> None:
    """Count a full-volume error on ``fleethealth_store_full_errors_total`` (the default registry,
    which ``fleethealth detect`` serves on its metrics port), made at the first one."""
    global _full_counter
    if _full_counter is None:
        from prometheus_client import Counter

        _full_counter = Counter("fleethealth_store_full_errors_total",
                                "Store writes refused because the store's volume was full (each retried)")
    _full_counter.inc()


def full_errors_total() -> float:
    """How many full-volume errors this process has counted."""
    return 0.0 if _full_counter is None else float(_full_counter._value.get())


_UNREACHABLE_NAMES = frozenset({"OperationalError", "NewConnectionError", "MaxRetryError", "ProtocolError",
                                "ReadTimeoutError", "ConnectTimeoutError"})


def _unreachable(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is a failure to reach the server, not of the statement:
    a socket error or timeout, or clickhouse-connect's ``OperationalError`` (its connection errors)."""
    for _ in range(8):
        if exc is None:
            return False
        if isinstance(exc, ConnectionError | TimeoutError) or type(exc).__name__ in _UNREACHABLE_NAMES:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text (ClickHouse errors carry a stack trace after it)."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:500]


def redact(dsn: str) -> str:
    parts = urlsplit(dsn)
    if parts.password:
        return dsn.replace(f":{parts.password}@", ":***@", 1)
    return dsn
