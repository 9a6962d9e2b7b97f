"""What the query modules share: the small contract they are written over, and two SQL fragments.

Each query module of this package holds one caller's named queries as a mixin over
:class:`QueriesBase` (``query``, ``insert``, ``command``, which :class:`~fleethealth.store.Store`
provides); the fragments here are the ones more than one module writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleethealth.store.protocol import QueryResult

__all__ = ["QueriesBase", "TS", "dec"]

TS = "toFloat64(toUnixTimestamp64Milli(ts)) / 1000"
"""A DateTime64 ``ts`` as exact epoch seconds."""


def dec(expr: str) -> str:
    """A Float32 expression as the float64 of its shortest decimal (71.3 reads 71.3, not 71.30000305)."""
    return f"toFloat64(toString({expr}))"


class QueriesBase:
    """The small contract the named queries are written over; :class:`~fleethealth.store.Store` has it."""

    if TYPE_CHECKING:
        def query(self, sql: str, parameters: Mapping[str, Any] | None = None, *,
                  readonly: bool = False) -> QueryResult: ...

        def insert(self, table: str, columns: Mapping[str, Any], *, dedup_token: str | None = None) -> int: ...

        def command(self, sql: str, parameters: Mapping[str, Any] | None = None) -> None: ...
