"""Error translation at the store's boundary: one helper, used by every backend call.

::

    clickhouse_connect.driver.exceptions.Error  -> StoreError ("<doing> on <dsn>: <first line>")
    ... caused by a connection error or timeout -> StoreUnavailable (the same statement may be retried)
    a chDB path locked by another process       -> StoreLocked (raised by the chDB backend)

A DSN that carries a password is shown with ``***`` in its place.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from fleethealth.errors import StoreError, StoreUnavailable

__all__ = ["store_error", "first_line", "redact"]


def store_error(exc: BaseException, doing: str, dsn: str) -> StoreError:
    """``exc`` as a :class:`StoreError` saying what failed where (a StoreError passes unchanged);
    raise it ``from exc``."""
    if isinstance(exc, StoreError):
        return exc
    cls = StoreUnavailable if _unreachable(exc) else StoreError
    return cls(f"{doing} on {dsn}: {first_line(exc)}")


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
