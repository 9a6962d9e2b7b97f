"""The store: ClickHouse through clickhouse-connect, chosen from a DSN, behind :class:`StoreLike`.

::

    open_store("chdb:///var/lib/fleethealth")   embedded chDB (ClickHouse's engine in-process)
    open_store("http://clickhouse:8123/db")     a ClickHouse server (https:// likewise)
    open_store("http://ch:8123/db?cluster=fleet&raw_retention_days=30")   a cluster; raw rows kept 30 days

One concern a module:

* :mod:`~fleethealth.store.protocol` — :class:`StoreLike`, the contract every caller types against,
  and :class:`QueryResult`;
* :mod:`~fleethealth.store.backends` — the DSN registry (:func:`open_store`,
  :func:`register_backend`) and the chDB / HTTP(S) factories, which import clickhouse-connect lazily;
* :mod:`~fleethealth.store.client` — :class:`Store`, one open client: ``insert`` (columnar: NumPy
  columns, one call per batch), ``query``, ``command``, ``migrate``, ``close``;
* :mod:`~fleethealth.store.translate` — client errors to :class:`~fleethealth.errors.StoreError`;
* :mod:`~fleethealth.store.migrations` — ``deploy/clickhouse/NNN_name.sql`` (package data of
  ``fleethealth.migrations`` in a wheel), read and split; :mod:`~fleethealth.store.migrator` applies
  them in order under a lock held in the store, each statement recorded so a stopped run resumes
  (:mod:`~fleethealth.store.steps`: how each kind of statement resumes), each migration recorded in
  ``schema_migrations`` and skipped once applied, so running ``migrate()`` twice changes nothing;
* :mod:`~fleethealth.store.cluster` — the cluster form of the migrations (DSN ``?cluster=NAME``):
  replicated local tables under Distributed ones, ``ON CLUSTER``, generated from the same text;
* :mod:`~fleethealth.store.columns` — schema dataclasses to columns and back (``FLOAT32_FIELDS``);
* :mod:`~fleethealth.store.queries` — every named application query, one module a caller (the
  detectors', the policy's, the API's, the report's, the operators'); the only SQL outside it is
  the analyst's own, through the API's SQL gate, and the migrations.

chDB allows ONE open data path per process at a time: a second store on the same path shares the
engine, a store on a different path fails with :class:`~fleethealth.errors.StoreError` until every
store on the first path is closed. Another process holding the path gives
:class:`~fleethealth.errors.StoreLocked`. Close stores (``with open_store(...) as store:``) so the
engine releases its path.
"""

from __future__ import annotations

from fleethealth.store.backends import known_schemes, open_store, register_backend
from fleethealth.store.client import Store
from fleethealth.store.migrations import Migration, migration_files, split_statements
from fleethealth.store.protocol import QueryResult, StoreLike

__all__ = [
    "StoreLike",
    "Store",
    "QueryResult",
    "Migration",
    "open_store",
    "register_backend",
    "known_schemes",
    "migration_files",
    "split_statements",
]
