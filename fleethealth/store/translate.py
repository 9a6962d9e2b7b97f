"""Error translation at the store's boundary: one helper, used by every backend call.

::

    clickhouse_connect.driver.exceptions.Error  -> StoreError ("<doing> on <dsn>: <first line>")
    a chDB path locked by another process       -> StoreLocked (raised by the chDB backend)

A DSN that carries a password is shown with ``***`` in its place.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from fleethealth.errors import StoreError

__all__ = ["store_error", "first_line", "redact"]


def store_error(exc: BaseException, doing: str, dsn: str) -> StoreError:
    """``exc`` as a :class:`StoreError` saying what failed where (a StoreError passes unchanged);
    raise it ``from exc``."""
    if isinstance(exc, StoreError):
        return exc
    return StoreError(f"{doing} on {dsn}: {first_line(exc)}")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's text (ClickHouse errors carry a stack trace after it)."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:500]


def redact(dsn: str) -> str:
    parts = urlsplit(dsn)
    if parts.password:
        return dsn.replace(f":{parts.password}@", ":***@", 1)
    return dsn
