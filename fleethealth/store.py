"""The store: ClickHouse through clickhouse-connect, chosen from a DSN.

::

    open_store("chdb:///var/lib/fleethealth")   embedded chDB (ClickHouse's engine in-process)
    open_store("http://clickhouse:8123/db")     a ClickHouse server (https:// likewise)

A registry maps the DSN scheme to a factory that imports clickhouse-connect lazily; an unknown
scheme raises :class:`ConfigError` listing the known ones. Errors are translated at this boundary::

    clickhouse_connect.driver.exceptions.Error  -> StoreError
    a chDB path locked by another process       -> StoreLocked (names the path)

The contract is small: ``insert`` (columnar: NumPy columns, one call per batch), ``query``
(-> :class:`QueryResult`), ``command``, ``migrate``, ``close``; typed helpers convert the schema
dataclasses to columns and back. ``migrate()`` applies ``deploy/clickhouse/NNN_name.sql`` (package
data of ``fleethealth.migrations`` in a wheel) in order, records each in ``schema_migrations`` and
skips those already applied, so running it twice changes nothing.

chDB allows ONE open data path per process at a time: a second store on the same path shares the
engine, a store on a different path fails with :class:`StoreError` until every store on the first
path is closed. Another process holding the path gives :class:`StoreLocked`. Close stores
(``with open_store(...) as store:``) so the engine releases its path.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.resources
import math
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

import numpy as np
import orjson

from fleethealth import schema
from fleethealth.errors import ConfigError, StoreError, StoreLocked
from fleethealth.schema import GPU_FIELDS, Event, Finding, Recommendation, StepBatch, Telemetry

__all__ = [
    "Store",
    "QueryResult",
    "Migration",
    "open_store",
    "register_backend",
    "known_schemes",
    "migration_files",
    "split_statements",
]

_MIGRATION_NAME = re.compile(r"^(\d{3})_[A-Za-z0-9_]+\.sql$")
_MIGRATIONS_DDL = """
CREATE TABLE IF NOT EXISTS schema_migrations
(
    version UInt32,
    name String,
    checksum String,
    applied_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree
ORDER BY version
"""


# ---------------------------------------------------------------- results and migrations
@dataclass(frozen=True)
class QueryResult:
    """Rows of a query: ``columns`` names them, ``rows`` holds one tuple per row."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]

    def dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]

    def column(self, name: str) -> list[Any]:
        if not self.columns and not self.rows:
            return []  # chDB names no columns for an empty result
        try:
            i = self.columns.index(name)
        except ValueError:
            raise StoreError(f"no column {name!r} in the result (columns: {', '.join(self.columns)})") from None
        return [row[i] for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class Migration:
    """One ``NNN_name.sql`` file: ``version`` NNN, its statements separated by ``;``."""

    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()[:16]


def migration_files(directory: str | os.PathLike[str] | None = None) -> list[Migration]:
    """The migrations in ``directory`` (default: package data ``fleethealth.migrations``), in order."""
    root: Any = Path(directory) if directory is not None else importlib.resources.files("fleethealth.migrations")
    found: dict[int, Migration] = {}
    for entry in root.iterdir():
        match = _MIGRATION_NAME.match(entry.name)
        if not match:
            continue
        version = int(match.group(1))
        if version in found:
            raise StoreError(f"migrations {found[version].name} and {entry.name} share version {version:03d}")
        found[version] = Migration(version, entry.name, entry.read_text(encoding="utf-8"))
    return [found[v] for v in sorted(found)]


def split_statements(sql: str) -> list[str]:
    """Split SQL text on ``;`` outside quotes, dropping ``--`` comments and empty statements."""
    statements: list[str] = []
    current: list[str] = []
    quote: str | None = None
    i, n = 0, len(sql)
    while i < n:
        ch = sql[i]
        if quote is not None:
            current.append(ch)
            if ch == "\\" and i + 1 < n:
                current.append(sql[i + 1])
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"`":
            quote = ch
            current.append(ch)
        elif ch == "-" and sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end
            continue
        elif ch == ";":
            statements.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    statements.append("".join(current))
    return [s.strip() for s in statements if s.strip()]


# ---------------------------------------------------------------- backends
_CHDB_LOCK = threading.Lock()
_CHDB_OPEN: dict[str, int] = {}
"""chDB data paths opened by this process, with the number of open stores on each."""


def _chdb_path(dsn: str) -> str:
    parts = urlsplit(dsn)
    path = parts.netloc + parts.path
    if not path:
        raise ConfigError(f"store DSN {dsn!r} names no data path (chdb:///absolute/path)")
    return str(Path(path).expanduser().resolve())


def _locked_by_other_process(path: str) -> bool:
    """True when another process holds the ClickHouse status-file lock of ``path``."""
    status = Path(path) / "status"
    try:
        fd = os.open(status, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _open_chdb(dsn: str) -> Store:
    path = _chdb_path(dsn)
    try:
        import clickhouse_connect
    except ImportError as exc:
        raise ConfigError("the chdb:// store needs clickhouse-connect and chdb: install fleethealth[embedded]") \
            from exc
    with _CHDB_LOCK:
        others = [p for p, count in _CHDB_OPEN.items() if count and p != path]
        if others:
            raise StoreError(f"chDB allows one open data path per process: {others[0]} is open here; "
                             f"close that store before opening {path}")
        if not _CHDB_OPEN.get(path) and _locked_by_other_process(path):
            raise StoreLocked(f"chDB data path {path} is in use by another process (only one process can "
                              f"open it; stop that process or query through it)")
        Path(path).mkdir(parents=True, exist_ok=True)
        try:
            client = clickhouse_connect.get_client(dsn=f"chdb://{path}")
        except Exception as exc:
            if _locked_by_other_process(path):
                raise StoreLocked(f"chDB data path {path} is in use by another process") from exc
            raise StoreError(f"cannot open chDB at {path}: {_first_line(exc)}") from exc
        _CHDB_OPEN[path] = _CHDB_OPEN.get(path, 0) + 1
    return Store(client, dsn, chdb_path=path)


def _open_http(dsn: str) -> Store:
    try:
        import clickhouse_connect
    except ImportError as exc:
        raise ConfigError("the http(s):// store needs clickhouse-connect") from exc
    try:
        client = clickhouse_connect.get_client(dsn=dsn, connect_timeout=5, send_receive_timeout=60)
    except Exception as exc:
        raise StoreError(f"cannot reach ClickHouse at {_redact(dsn)}: {_first_line(exc)}") from exc
    return Store(client, _redact(dsn))


_BACKENDS: dict[str, Callable[[str], Store]] = {"chdb": _open_chdb, "http": _open_http, "https": _open_http}


def register_backend(scheme: str, factory: Callable[[str], Store]) -> None:
    """Map a DSN scheme to a factory ``dsn -> Store``."""
    _BACKENDS[scheme.lower()] = factory


def known_schemes() -> str:
    return ", ".join(f"{s}://" for s in sorted(_BACKENDS))


def open_store(dsn: str) -> Store:
    """Open the store a DSN names: ``chdb:///path`` or ``http(s)://host:8123[/database]``."""
    scheme = dsn.split("://", 1)[0].lower() if isinstance(dsn, str) and "://" in dsn else ""
    factory = _BACKENDS.get(scheme)
    if factory is None:
        raise ConfigError(f"unknown store DSN {dsn!r} (known schemes: {known_schemes()})")
    return factory(dsn)


def _redact(dsn: str) -> str:
    parts = urlsplit(dsn)
    if parts.password:
        return dsn.replace(f":{parts.password}@", ":***@", 1)
    return dsn


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:500]


# ---------------------------------------------------------------- column conversion
def _epoch_ms(values: Any, nullable: bool) -> list[Any]:
    """Epoch seconds (floats; NaN/None = null when ``nullable``) -> integer milliseconds."""
    arr = np.asarray(values)
    if arr.dtype.kind == "M":
        return arr.astype("datetime64[ms]").astype(np.int64).tolist()
    if arr.dtype.kind == "O":
        if not nullable:
            return [int(round(float(v) * 1000.0)) for v in arr.tolist()]
        return [None if v is None or (isinstance(v, float) and math.isnan(v)) else int(round(float(v) * 1000.0))
                for v in arr.tolist()]
    secs = arr.astype(np.float64)
    ms = np.round(secs * 1000.0)
    if not nullable:
        if not np.isfinite(ms).all():
            raise StoreError("a non-nullable DateTime64 column holds NaN or infinity")
        return ms.astype(np.int64).tolist()
    out = ms.astype(object)
    out[~np.isfinite(ms)] = None
    return [None if v is None else int(v) for v in out.tolist()]


def _prepare(ch_type: str, column: Any) -> Any:
    """Fit one column to its ClickHouse type: times in seconds to ticks, text arrays to lists."""
    base = ch_type.removeprefix("LowCardinality(").removeprefix("Nullable(")
    nullable = "Nullable(" in ch_type
    if base.startswith("DateTime64"):
        return _epoch_ms(column, nullable)
    if isinstance(column, np.ndarray):
        if column.dtype.kind in "USO" or base.startswith(("String", "Bool")) or nullable:
            return column.tolist()
        return column
    return column


def _json(obj: Any) -> str:
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY).decode()


def _opt(value: Any, default: Any = None) -> Any:
    return default if value is None else value


# ---------------------------------------------------------------- the store
class Store:
    """One open ClickHouse (or chDB) client; a context manager. Build it with :func:`open_store`."""

    def __init__(self, client: Any, dsn: str, *, chdb_path: str | None = None) -> None:
        self._client = client
        self.dsn = dsn
        self.chdb_path = chdb_path
        self._types: dict[str, dict[str, str]] = {}
        self._closed = False

    # -- the small contract
    def query(self, sql: str, parameters: Mapping[str, Any] | None = None, *,
              readonly: bool = False) -> QueryResult:
        """Run a SELECT; ``readonly`` makes the server refuse anything that writes."""
        settings = {"readonly": 1} if readonly else None
        try:
            result = self._client.query(sql, parameters=dict(parameters or {}), settings=settings)
        except Exception as exc:
            raise self._error(exc, "query failed") from exc
        return QueryResult(tuple(result.column_names), [tuple(r) for r in result.result_rows])

    def command(self, sql: str, parameters: Mapping[str, Any] | None = None) -> None:
        """Run a statement that returns no rows (DDL, ALTER, OPTIMIZE, ...)."""
        try:
            self._client.command(sql, parameters=dict(parameters or {}))
        except Exception as exc:
            raise self._error(exc, "statement failed") from exc

    def insert(self, table: str, columns: Mapping[str, np.ndarray | Sequence[Any]], *,
               dedup_token: str | None = None) -> int:
        """Insert columns (name -> NumPy array or sequence, all of one length) in one call.

        ``DateTime64`` columns take epoch seconds (float; NaN = null where the column is Nullable).
        With ``dedup_token``, repeating the same insert stores it once. Returns the row count.
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
        data = [_prepare(types[n], columns[n]) for n in names]
        settings = {"insert_deduplication_token": dedup_token} if dedup_token else None
        try:
            self._client.insert(table, data, column_names=names, column_oriented=True, settings=settings)
        except Exception as exc:
            raise self._error(exc, f"insert into {table} failed") from exc
        return rows

    def _table_types(self, table: str) -> dict[str, str]:
        types = self._types.get(table)
        if types is None:
            res = self.query("SELECT name, type FROM system.columns WHERE database = currentDatabase() "
                             "AND table = {t:String} ORDER BY position", {"t": table})
            if not res.rows:
                raise StoreError(f"no table {table!r} in {self.dsn} (did migrate() run?)")
            types = self._types[table] = {name: ch_type for name, ch_type in res.rows}
        return types

    def migrate(self, directory: str | os.PathLike[str] | None = None) -> list[str]:
        """Apply every migration not yet recorded in ``schema_migrations``; return the names applied."""
        self.command(_MIGRATIONS_DDL)
        applied = set(self.query("SELECT version FROM schema_migrations FINAL").column("version"))
        done: list[str] = []
        for migration in migration_files(directory):
            if migration.version in applied:
                continue
            for statement in split_statements(migration.sql):
                try:
                    self._client.command(statement)
                except Exception as exc:
                    raise self._error(exc, f"migration {migration.name} failed") from exc
            self._types.clear()
            self.insert("schema_migrations", {"version": [migration.version], "name": [migration.name],
                                              "checksum": [migration.checksum]})
            done.append(migration.name)
        self._types.clear()
        return done

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._client.close()
        finally:
            if self.chdb_path is not None:
                with _CHDB_LOCK:
                    left = _CHDB_OPEN.get(self.chdb_path, 1) - 1
                    if left > 0:
                        _CHDB_OPEN[self.chdb_path] = left
                    else:
                        _CHDB_OPEN.pop(self.chdb_path, None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _error(self, exc: Exception, doing: str) -> StoreError:
        if isinstance(exc, StoreError):
            return exc
        return StoreError(f"{doing} on {self.dsn}: {_first_line(exc)}")

    # -- typed writers (columnar: one insert per call, NumPy columns concatenated over messages)
    def insert_telemetry(self, samples: Sequence[Telemetry], *, dedup_token: str | None = None) -> int:
        if not samples:
            return 0
        counts = np.fromiter((s.gpu.size for s in samples), dtype=np.int64, count=len(samples))
        cols: dict[str, Any] = {
            "node": np.repeat(np.array([s.node for s in samples], dtype=object), counts),
            "rack": np.repeat(np.array([s.rack for s in samples], dtype=object), counts),
            "gpu": np.concatenate([s.gpu for s in samples]).astype(np.uint16),
            "ts": np.repeat(np.fromiter((s.ts for s in samples), dtype=np.float64, count=len(samples)), counts),
            "model": np.repeat(np.array([s.model for s in samples], dtype=object), counts),
            "uuid": np.concatenate([np.asarray(s.uuid if len(s.uuid) == s.gpu.size else ("",) * s.gpu.size,
                                               dtype=object) for s in samples]),
            "nic_util": np.repeat(np.fromiter((s.nic_util for s in samples), dtype=np.float64,
                                              count=len(samples)), counts),
        }
        for name in GPU_FIELDS:
            cols[name] = np.concatenate([s.columns[name] for s in samples]).astype(np.float64)
        return self.insert("gpu_samples", cols, dedup_token=dedup_token)

    def insert_steps(self, batches: Sequence[StepBatch], *, dedup_token: str | None = None) -> int:
        if not batches:
            return 0
        n = len(batches)
        counts = np.fromiter((b.ranks.size for b in batches), dtype=np.int64, count=n)
        total = int(counts.sum())
        if any(b.groups is not None for b in batches):
            groups = np.concatenate([b.groups if b.groups is not None else np.full(b.ranks.size, -1, dtype=np.int32)
                                     for b in batches])
        else:
            groups = np.full(total, -1, dtype=np.int32)
        cols = {
            "job": np.repeat(np.array([b.job for b in batches], dtype=object), counts),
            "step": np.repeat(np.fromiter((b.step for b in batches), dtype=np.uint64, count=n), counts),
            "rank": np.concatenate([b.ranks for b in batches]).astype(np.uint32),
            "node": np.repeat(np.array([b.node for b in batches], dtype=object), counts),
            "gpu": np.concatenate([b.gpus for b in batches]).astype(np.uint16),
            "ts": np.repeat(np.fromiter((b.ts for b in batches), dtype=np.float64, count=n), counts),
            "compute_s": np.concatenate([b.compute_s for b in batches]).astype(np.float64),
            "rank_group": groups.astype(np.int32, copy=False),
        }
        return self.insert("rank_steps", cols, dedup_token=dedup_token)

    def insert_events(self, events: Sequence[Event], *, dedup_token: str | None = None) -> int:
        return self.insert("events", {
            "id": [e.id for e in events], "node": [e.node for e in events], "ts": [e.ts for e in events],
            "ts_s": [e.ts for e in events], "kind": [e.kind.value for e in events],
            "job": [_opt(e.job, "") for e in events], "gpu": [e.gpu for e in events],
            "rank": [e.rank for e in events], "step": [e.step for e in events],
            "code": [e.code for e in events], "message": [e.message for e in events],
            "data": [_json(e.data) for e in events],
        }, dedup_token=dedup_token)

    def insert_findings(self, findings: Sequence[Finding], *, dedup_token: str | None = None) -> int:
        return self.insert("findings", {
            "id": [f.id for f in findings], "kind": [f.kind.value for f in findings],
            "detector": [f.detector for f in findings], "job": [_opt(f.job, "") for f in findings],
            "node": [f.node for f in findings], "gpu": [f.gpu for f in findings],
            "rank": [f.rank for f in findings], "step": [f.step for f in findings],
            "ts": [f.ts for f in findings], "ts_s": [f.ts for f in findings],
            "diagnosis": [None if f.diagnosis is None else f.diagnosis.value for f in findings],
            "z": [f.z for f in findings], "slowdown": [f.slowdown for f in findings],
            "probability": [f.probability for f in findings], "evidence": [_json(f.evidence) for f in findings],
        }, dedup_token=dedup_token)

    def insert_recommendations(self, recs: Sequence[Recommendation], *, dedup_token: str | None = None) -> int:
        return self.insert("recommendations", {
            "id": [r.id for r in recs], "action": [r.action.value for r in recs], "node": [r.node for r in recs],
            "job": [_opt(r.job, "") for r in recs], "reason": [r.reason for r in recs],
            "guard": [r.guard.value for r in recs], "ts": [r.ts for r in recs], "ts_s": [r.ts for r in recs],
            "finding_id": [_opt(r.finding_id, "") for r in recs], "dry_run": [r.dry_run for r in recs],
            "evidence": [_json(r.evidence) for r in recs], "acked_by": ["" for _ in recs],
        }, dedup_token=dedup_token)

    # -- typed readers (FINAL: one row per natural key even before a merge)
    def findings(self, *, kind: str | None = None, node: str | None = None, job: str | None = None,
                 since: float | None = None, until: float | None = None,
                 limit: int | None = None) -> list[Finding]:
        """Findings ordered by event time, filtered by any of kind, node, job and ``since <= ts < until``."""
        where, params = _filters(kind=kind, node=node, job=job, since=since, until=until)
        res = self.query(
            "SELECT kind, node, ts_s AS ts, nullIf(job, '') AS job, gpu, rank, step, diagnosis, z, slowdown, "
            f"probability, detector, evidence FROM findings FINAL {where} ORDER BY ts_s, id{_limit(limit)}", params)
        return [schema.decode(Finding, _row_obj(res.columns, row, "evidence")) for row in res.rows]

    def recommendations(self, *, node: str | None = None, job: str | None = None, action: str | None = None,
                        since: float | None = None, until: float | None = None,
                        limit: int | None = None) -> list[Recommendation]:
        """Recommendations ordered by event time, filtered by any of node, job, action and time."""
        where, params = _filters(node=node, job=job, action=action, since=since, until=until)
        res = self.query(
            "SELECT action, node, ts_s AS ts, reason, guard, nullIf(job, '') AS job, "
            "nullIf(finding_id, '') AS finding_id, dry_run, evidence "
            f"FROM recommendations FINAL {where} ORDER BY ts_s, id{_limit(limit)}", params)
        return [schema.decode(Recommendation, _row_obj(res.columns, row, "evidence")) for row in res.rows]

    def events(self, kind: str | None = None, node: str | None = None, *, job: str | None = None,
               since: float | None = None, until: float | None = None, limit: int | None = None) -> list[Event]:
        """Events ordered by event time, filtered by any of kind, node, job and time."""
        where, params = _filters(kind=kind, node=node, job=job, since=since, until=until)
        res = self.query(
            "SELECT node, ts_s AS ts, kind, nullIf(job, '') AS job, gpu, rank, step, code, message, data "
            f"FROM events FINAL {where} ORDER BY ts_s, id{_limit(limit)}", params)
        return [schema.decode(Event, _row_obj(res.columns, row, "data")) for row in res.rows]

    def steps(self, job: str, *, first_step: int = 0, last_step: int | None = None,
              node: str | None = None) -> list[StepBatch]:
        """One :class:`StepBatch` per (step, node) of ``job``, ranks ascending, ``ts`` to the millisecond."""
        clauses = ["job = {job:String}", "step >= {first:UInt64}"]
        params: dict[str, Any] = {"job": job, "first": first_step}
        if last_step is not None:
            clauses.append("step <= {last:UInt64}")
            params["last"] = last_step
        if node is not None:
            clauses.append("node = {node:String}")
            params["node"] = node
        res = self.query("SELECT step, node, toUnixTimestamp64Milli(ts) AS ms, rank, gpu, compute_s, rank_group "
                         f"FROM rank_steps FINAL WHERE {' AND '.join(clauses)} ORDER BY step, node, rank", params)
        if not res.rows:
            return []
        step, node_col, ms, rank, gpu, compute, group = (np.asarray(c) for c in zip(*res.rows, strict=True))
        out = []
        for lo, hi in _segments(step, node_col):
            groups = group[lo:hi].astype(np.int32)
            out.append(StepBatch(job=job, step=int(step[lo]), node=str(node_col[lo]), ts=float(ms[lo]) / 1000.0,
                                 ranks=rank[lo:hi].astype(np.int32), gpus=gpu[lo:hi].astype(np.int16),
                                 compute_s=compute[lo:hi].astype(np.float64),
                                 groups=None if (groups < 0).all() else groups))
        return out

    def telemetry(self, *, node: str | None = None, since: float | None = None,
                  until: float | None = None) -> list[Telemetry]:
        """One :class:`Telemetry` per (node, ts), ordered by node then time, GPUs ascending, ``ts`` to the
        millisecond; ``since <= ts < until``."""
        clauses, params = [], {}
        if node is not None:
            clauses.append("node = {node:String}")
            params["node"] = node
        if since is not None:
            clauses.append("ts >= fromUnixTimestamp64Milli(toInt64({since_ms:Int64}))")
            params["since_ms"] = int(round(since * 1000))
        if until is not None:
            clauses.append("ts < fromUnixTimestamp64Milli(toInt64({until_ms:Int64}))")
            params["until_ms"] = int(round(until * 1000))
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        fields = list(GPU_FIELDS)
        res = self.query("SELECT node, toUnixTimestamp64Milli(ts) AS ms, rack, model, nic_util, gpu, uuid, "
                         f"{', '.join(fields)} FROM gpu_samples FINAL {where} ORDER BY node, ts, gpu", params)
        if not res.rows:
            return []
        cols = [np.asarray(c) for c in zip(*res.rows, strict=True)]
        node_col, ms, rack, model, nic, gpu, uuid = cols[:7]
        values = cols[7:]
        out = []
        for lo, hi in _segments(node_col, ms):
            uuids = tuple(str(u) for u in uuid[lo:hi])
            out.append(Telemetry(node=str(node_col[lo]), rack=str(rack[lo]), ts=float(ms[lo]) / 1000.0,
                                 gpu=gpu[lo:hi].astype(np.int16),
                                 columns={f: v[lo:hi].astype(np.float64) for f, v in zip(fields, values, strict=True)},
                                 nic_util=float(nic[lo]), model=str(model[lo]),
                                 uuid=uuids if any(uuids) else ()))
        return out


def _segments(*keys: np.ndarray) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of equal key tuples in sorted key columns."""
    n = len(keys[0])
    change = np.zeros(max(n - 1, 0), dtype=bool)
    for key in keys:
        change |= key[1:] != key[:-1]
    bounds = np.concatenate([[0], np.flatnonzero(change) + 1, [n]])
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))


def _filters(**conds: Any) -> tuple[str, dict[str, Any]]:
    clauses: list[str] = []
    params: dict[str, Any] = {}
    for name, value in conds.items():
        if value is None:
            continue
        if name == "since":
            clauses.append("ts_s >= {since:Float64}")
        elif name == "until":
            clauses.append("ts_s < {until:Float64}")
        else:
            clauses.append(f"{name} = {{{name}:String}}")
            value = str(value)
        params[name] = value
    return ("WHERE " + " AND ".join(clauses) if clauses else ""), params


def _limit(limit: int | None) -> str:
    if limit is None:
        return ""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ConfigError(f"limit must be a non-negative integer, got {limit!r}")
    return f" LIMIT {limit}"


def _row_obj(columns: Iterable[str], row: Sequence[Any], json_column: str) -> dict[str, Any]:
    obj = dict(zip(columns, row, strict=True))
    obj[json_column] = orjson.loads(obj[json_column] or "{}")
    obj["v"] = schema.SCHEMA_VERSION
    return obj
