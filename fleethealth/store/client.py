"""The store: one open clickhouse-connect client (chDB in-process or a ClickHouse server).

:class:`Store` implements :class:`~fleethealth.store.protocol.StoreLike`: the small contract here
(``query``, ``command``, ``insert``, ``migrate``, ``close``, the context manager) and the named
queries mixed in from :mod:`fleethealth.store.queries`. Every client exception becomes a
:class:`~fleethealth.errors.StoreError` through :func:`~fleethealth.store.translate.store_error`.
Build one with :func:`fleethealth.store.open_store`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import numpy as np

from fleethealth.errors import StoreError
from fleethealth.store.columns import prepare
from fleethealth.store.migrator import migrate
from fleethealth.store.native import encode_native
from fleethealth.store.protocol import QueryResult
from fleethealth.store.queries import NamedQueries
from fleethealth.store.translate import store_error

__all__ = ["Store"]


class Store(NamedQueries):
    """One open ClickHouse (or chDB) client; a context manager. Build it with :func:`open_store`.

    ``on_close`` runs once after the client is closed (the chDB backend releases its data path).
    """

    def __init__(self, client: Any, dsn: str, *, chdb_path: str | None = None,
                 on_close: Callable[[], None] | None = None) -> None:
        self._client = client
        self.dsn = dsn
        self.chdb_path = chdb_path
        self._on_close = on_close
        self._types: dict[str, dict[str, str]] = {}
        self._closed = False
        self.cluster: str | None = None
        """The ClickHouse cluster the migrations target (DSN ``?cluster=``), or ``None``: one server."""
        self.raw_retention_days: int | None = None
        """Raw-sample retention the migrations set (DSN ``?raw_retention_days=``), or ``None``: as migrated."""

    # -- the small contract
    def query(self, sql: str, parameters: Mapping[str, Any] | None = None, *,
              readonly: bool = False) -> QueryResult:
        """Run a SELECT; ``readonly`` makes the server refuse anything that writes."""
        settings = {"readonly": 1} if readonly else None
        try:
            result = self._client.query(sql, parameters=dict(parameters or {}), settings=settings)
        except Exception as exc:
            raise store_error(exc, "query failed", self.dsn) from exc
        return QueryResult(tuple(result.column_names), [tuple(r) for r in result.result_rows])

    def command(self, sql: str, parameters: Mapping[str, Any] | None = None) -> None:
        """Run a statement that returns no rows (DDL, ALTER, OPTIMIZE, ...). The column types cached
        for inserts are forgotten, since the statement may have changed a table."""
        self._types.clear()
        try:
            self._client.command(sql, parameters=dict(parameters or {}))
        except Exception as exc:
            raise store_error(exc, "statement failed", self.dsn) from exc

    def insert(self, table: str, columns: Mapping[str, np.ndarray | Sequence[Any]], *,
               dedup_token: str | None = None) -> int:
        """Insert columns (name -> NumPy array or sequence, all of one length) in one call.

        ``DateTime64`` columns take epoch seconds (float; NaN = null where the column is Nullable).
        With ``dedup_token``, repeating the same insert stores it once. Returns the row count. When
        every column is a NumPy array (or :class:`~fleethealth.store.columns.Codes`) of a type
        :func:`~fleethealth.store.native.encode_native` takes, the rows go as one Native block
        built from the arrays; otherwise through clickhouse-connect's per-column serialisation.
        """
        names = list(columns)
        if not names:
            return 0
        lengths = {name: len(columns[name]) for name in names}
        if len(set(lengths.values())) != 1:
            raise StoreError(f"insert into {table}: columns of unequal length {lengths}")
        rows = next(iter(lengths.values()))
        if rows == 0:
            return 0
        types = self._table_types(table)
        unknown = [n for n in names if n not in types]
        if unknown:
            raise StoreError(f"insert into {table}: no column {unknown[0]!r} (columns: {', '.join(types)})")
        settings = {"insert_deduplication_token": dedup_token} if dedup_token else None
        block = encode_native(columns, types)
        if block is not None:  # every column an array or Codes of a type the Native writer takes
            try:
                self._client.raw_insert(table, names, block, settings=settings, fmt="Native")
            except Exception as exc:
                raise store_error(exc, f"insert into {table} failed", self.dsn) from exc
            return rows
        data = [prepare(types[n], columns[n]) for n in names]
        context = None
        try:
            context = self._client.create_insert_context(table, names, column_oriented=True, settings=settings)
            self._client.insert(context=context, data=data)
        except Exception as exc:
            raise store_error(exc, f"insert into {table} failed", self.dsn) from exc
        finally:
            # clickhouse-connect's insert context keeps the columns and a bound method of itself after
            # the insert: a reference cycle only the cyclic collector frees. A stream process that
            # collects rarely (detectors/runner.py tune_gc) held every insert's data for minutes
            # (bench/soak.py: +15 MiB a minute at 300 messages/s); emptying it frees it at once.
            if context is not None:
                vars(context).clear()
        return rows

    def _table_types(self, table: str) -> dict[str, str]:
        types = self._types.get(table)
        if types is None:  # every table's at once: one query, not one per table a stream writes
            res = self.query("SELECT table, name, type FROM system.columns WHERE database = currentDatabase() "
                             "ORDER BY table, position")
            for name, column, ch_type in res.rows:
                self._types.setdefault(name, {})[column] = ch_type
            types = self._types.get(table)
            if types is None:
                raise StoreError(f"no table {table!r} in {self.dsn} (did migrate() run?)")
        return types

    def migrate(self, directory: str | os.PathLike[str] | None = None, **kwargs: Any) -> list[str]:
        """Apply every migration not yet recorded in ``schema_migrations``, under the store's migration
        lock; return the names applied (:func:`fleethealth.store.migrator.migrate`, which takes
        ``kwargs``: ``owner``, ``lock_ttl_s``, ``break_lock``, ``hook``)."""
        return migrate(self, directory, **kwargs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._client.close()
        finally:
            if self._on_close is not None:
                self._on_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
