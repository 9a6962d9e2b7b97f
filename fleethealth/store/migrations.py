"""The migration files: ``deploy/clickhouse/NNN_name.sql``, read, split and put in cluster form.

The files are package data of ``fleethealth.migrations`` in a wheel. The migrator that applies them
(under a lock, one recorded step at a time, resumable) is :mod:`fleethealth.store.migrator`; each
file's statements are split on ``;`` outside quotes. Running ``migrate()`` twice changes nothing.

On a store opened with ``?cluster=NAME`` every statement is rewritten for that cluster first
(:mod:`fleethealth.store.cluster`: replicated local tables, Distributed tables under the names the
application uses, ``ON CLUSTER``). On a store opened with ``?raw_retention_days=N`` the raw
rows' retention is set to N days after the files are applied, on each of :data:`RETAINED_TABLES`
whose TTL differs (``gpu_samples``, its latest-sample table ``gpu_latest`` and ``rank_steps``:
14 days as ``007``, ``009`` and ``010`` create them).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleethealth.errors import StoreError
from fleethealth.store.cluster import LOCAL_SUFFIX, ClusterDDL

if TYPE_CHECKING:
    from fleethealth.store.protocol import StoreLike

__all__ = ["Migration", "migration_files", "split_statements", "pending", "statements", "raw_retention_days",
           "DEFAULT_RAW_RETENTION_DAYS", "RETAINED_TABLES"]

DEFAULT_RAW_RETENTION_DAYS = 14
"""How long raw rows are kept after they were received (``007``, ``009``, ``010``)."""
RETAINED_TABLES = ("gpu_samples", "gpu_latest", "rank_steps")
"""The tables whose rows expire ``raw_retention_days`` after they were received."""
_RETENTION = re.compile(r"TTL received \+ toIntervalDay\((\d+)\)")

_MIGRATION_NAME = re.compile(r"^(\d{3})_[A-Za-z0-9_]+\.sql$")
MIGRATIONS_DDL = """
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


def statements(migrations: list[Migration], cluster: str | None = None) -> list[tuple[Migration, list[str]]]:
    """Each migration with the statements that apply it: its own, or on ``cluster`` their cluster
    form (every migration is read, applied or not: a table's shard key is learned where it is created)."""
    ddl = ClusterDDL(cluster) if cluster else None
    out = []
    for migration in migrations:
        own = split_statements(migration.sql)
        out.append((migration, own if ddl is None else [t for s in own for t in ddl.translate(s)]))
    return out


def pending(store: StoreLike, directory: str | os.PathLike[str] | None = None) -> list[str]:
    """The migrations the store has not recorded, read-only (a store user with SELECT alone can ask):
    every one when ``schema_migrations`` itself cannot be read."""
    try:
        applied = set(store.query("SELECT version FROM schema_migrations FINAL").column("version"))
    except StoreError:
        applied = set()
    return [m.name for m in migration_files(directory) if m.version not in applied]


def raw_retention_days(store: StoreLike, table: str = "gpu_samples") -> int | None:
    """The retention in days of ``table`` (one of :data:`RETAINED_TABLES`) as the store holds it
    (``None``: no TTL, or no such table)."""
    local = table + (LOCAL_SUFFIX if getattr(store, "cluster", None) else "")
    rows = store.query("SELECT create_table_query FROM system.tables WHERE database = currentDatabase() "
                       "AND name = {t:String}", {"t": local}).rows
    found = _RETENTION.search(rows[0][0]) if rows else None
    return int(found.group(1)) if found else None


def set_raw_retention(store: StoreLike, days: int) -> None:
    """Keep the rows of every table of :data:`RETAINED_TABLES` the store has ``days`` days after
    they were received (a no-op on a table already so)."""
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise StoreError(f"raw retention must be a whole number of days >= 1, got {days!r}")
    cluster = getattr(store, "cluster", None)
    for table in RETAINED_TABLES:
        held = raw_retention_days(store, table)
        if held is None or held == days:
            continue  # no such table (an older schema), or already so
        target = f"{table}{LOCAL_SUFFIX} ON CLUSTER {cluster}" if cluster else table
        store.command(f"ALTER TABLE {target} MODIFY TTL received + INTERVAL {days} DAY")
