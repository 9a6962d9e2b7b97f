"""The migrations runner: ``deploy/clickhouse/NNN_name.sql`` applied in order, each once.

The files are package data of ``fleethealth.migrations`` in a wheel. :func:`migrate` creates
``schema_migrations``, applies every file whose version it does not record (its statements one by
one, split on ``;`` outside quotes), and records it; a failing file is not recorded, so the next
run retries it. Running it twice changes nothing.
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
from fleethealth.store.translate import first_line

if TYPE_CHECKING:
    from fleethealth.store.protocol import StoreLike

__all__ = ["Migration", "migration_files", "split_statements", "migrate"]

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


def migrate(store: StoreLike, directory: str | os.PathLike[str] | None = None) -> list[str]:
    """Apply every migration in ``directory`` not yet recorded in ``schema_migrations`` through
    ``store.command``; return the names applied."""
    store.command(_MIGRATIONS_DDL)
    applied = set(store.query("SELECT version FROM schema_migrations FINAL").column("version"))
    done: list[str] = []
    for migration in migration_files(directory):
        if migration.version in applied:
            continue
        for statement in split_statements(migration.sql):
            try:
                store.command(statement)
            except StoreError as exc:  # say which file failed, with the server's own first line
                cause = exc.__cause__
                why = str(exc) if cause is None else first_line(cause)
                raise StoreError(f"migration {migration.name} failed on {store.dsn}: {why}") from (cause or exc)
        store.insert("schema_migrations", {"version": [migration.version], "name": [migration.name],
                                           "checksum": [migration.checksum]})
        done.append(migration.name)
    return done
