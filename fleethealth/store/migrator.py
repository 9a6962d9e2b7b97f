"""The migrator: applies ``deploy/clickhouse/NNN_name.sql`` under a lock held in the store, one
recorded step at a time, so a migrator stopped anywhere (killed, out of space, a server gone)
continues where it stopped when run again.

Three tables of its own, created first (all read with a SELECT-only user):

* ``schema_migrations`` — one row per applied migration: version, name, the file's checksum.
  An applied migration whose file no longer has that checksum is an error naming it (the store
  was built from other text than this release carries).
* ``schema_migration_steps`` — append-only: a row when a step (one statement,
  :mod:`fleethealth.store.steps`) is begun, when it is done, and when it failed (with the error);
  steps idempotent as written (``IF NOT EXISTS``) are not recorded, and run again only when no later
  step was. A migration with steps recorded but no ``schema_migrations`` row is *dirty*: it stopped
  half-way. ``up`` resumes it after its last step done, finishing a begun step as
  :func:`~fleethealth.store.steps.resume_plan` says (a rename that ran is skipped, a copy is emptied
  and run again).
* ``schema_migrations_lock`` — claims ``(token, owner, claimed_at, expires_at, released)``. A
  migrator inserts its claim, then reads every live claim (not released, not expired by the
  server's clock); the earliest wins, so two migrators that claim at once agree on one winner.
  The loser withdraws and raises :class:`~fleethealth.errors.MigrationLocked` naming the holder.
  The holder checks before every recorded step that its claim was not taken away, and extends
  it (``lock_ttl_s`` from now) before a migration's first recorded step and around every copy.
  A killed migrator leaves its claim until it expires, unless it is found stale sooner: an owner
  ``host:pid`` on this host whose process is gone, or any owner with ``break_lock``.

Expiry is judged by the server's clock (``now64()``), never this host's (a claim's ``seq``, the local
time in ns, only orders that claim's own rows). Test hooks (``hook``) see
each point between two recorded actions: ``begun``, ``ran``, ``done`` for a step, ``applied`` for
a migration; a hook that raises stops the migrator there, as a kill would (the lock is kept).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleethealth.errors import MigrationLocked, MigrationsPending, StoreError
from fleethealth.store.cluster import LOCAL_SUFFIX, migrations_ddl
from fleethealth.store.migrations import MIGRATIONS_DDL, Migration, migration_files, set_raw_retention, statements
from fleethealth.store.steps import Step, plan_steps, resume_plan
from fleethealth.store.translate import first_line

if TYPE_CHECKING:
    from fleethealth.store.protocol import StoreLike

__all__ = ["migrate", "status", "plan", "require_current", "table_size", "MigrationStatus", "PlannedMigration",
           "DEFAULT_LOCK_TTL_S", "default_owner"]

DEFAULT_LOCK_TTL_S = 3600.0
"""How long a claim on the migration lock lasts without being extended (config ``migrate.lock_ttl_s``).
The claim is extended before every step, so it must outlast the longest step: the copy of the
largest table (deploy/README.md, "Upgrading", gives the measured copy rate)."""

Hook = Callable[[str, str, int], None]
"""``hook(point, migration, step)``: called at ``begun``, ``ran``, ``done`` (step) and ``applied`` (-1)."""

_STEPS_COLUMNS = """(
    version UInt32,
    step UInt32,
    name String,
    checksum String COMMENT 'the file''s checksum when the step was recorded',
    state LowCardinality(String) COMMENT 'begun, done or failed',
    statement String,
    error String,
    owner String,
    at DateTime64(3, 'UTC') DEFAULT now64(3)
)"""
_LOCK_COLUMNS = """(
    token String,
    owner String COMMENT 'host:pid of the migrator',
    claimed_at DateTime64(3, 'UTC'),
    expires_at DateTime64(3, 'UTC'),
    released UInt8,
    seq UInt64 COMMENT 'the claim''s version: the highest is its state'
)"""


def _own_tables(cluster: str | None) -> list[str]:
    if not cluster:
        return [MIGRATIONS_DDL,
                f"CREATE TABLE IF NOT EXISTS schema_migration_steps\n{_STEPS_COLUMNS}\nENGINE = MergeTree\n"
                "ORDER BY (version, step, at)",
                f"CREATE TABLE IF NOT EXISTS schema_migrations_lock\n{_LOCK_COLUMNS}\n"
                "ENGINE = ReplacingMergeTree(seq)\nORDER BY token"]
    path = "'/clickhouse/tables/{database}/%s', '{replica}'"
    return [migrations_ddl(cluster),
            f"CREATE TABLE IF NOT EXISTS schema_migration_steps ON CLUSTER {cluster}\n{_STEPS_COLUMNS}\n"
            f"ENGINE = ReplicatedMergeTree({path % 'schema_migration_steps'})\nORDER BY (version, step, at)",
            f"CREATE TABLE IF NOT EXISTS schema_migrations_lock ON CLUSTER {cluster}\n{_LOCK_COLUMNS}\n"
            f"ENGINE = ReplicatedReplacingMergeTree({path % 'schema_migrations_lock'}, seq)\nORDER BY token"]


def default_owner() -> str:
    """This migrator's name in the lock: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


# ---------------------------------------------------------------- reading the store's records
@dataclass(frozen=True)
class _Recorded:
    applied: dict[int, tuple[str, str, Any]]  # version -> (name, checksum, applied_at)
    steps: dict[int, dict[int, set[str]]]  # version -> step -> states
    step_checksum: dict[int, str]  # version -> the checksum its steps were recorded under (the latest)
    errors: dict[int, str]  # version -> the last error of a failed step


def _read(store: StoreLike) -> _Recorded:
    try:
        rows = store.query("SELECT version, name, checksum, applied_at FROM schema_migrations FINAL").rows
    except StoreError:
        rows = []  # a store never migrated
    applied = {int(v): (n, c, at) for v, n, c, at in rows}
    steps: dict[int, dict[int, set[str]]] = {}
    checksum: dict[int, str] = {}
    errors: dict[int, str] = {}
    try:
        recs = store.query("SELECT version, step, state, checksum, error FROM schema_migration_steps "
                           "ORDER BY at, state = 'done'").rows
    except StoreError:
        recs = []  # a store migrated before steps were recorded
    for version, step, state, sums, error in recs:
        steps.setdefault(int(version), {}).setdefault(int(step), set()).add(state)
        checksum[int(version)] = sums
        if state == "failed":
            errors[int(version)] = error
    return _Recorded(applied, steps, checksum, errors)


@dataclass(frozen=True)
class LockHolder:
    owner: str
    claimed_at: Any
    expires_at: Any

    def __str__(self) -> str:
        if not hasattr(self.claimed_at, "strftime"):
            return self.owner
        return f"{self.owner} (claimed {self.claimed_at:%Y-%m-%d %H:%M:%S} UTC, expires {self.expires_at:%H:%M:%S} UTC)"


def _live_claims(store: StoreLike) -> list[tuple[str, LockHolder]]:
    try:
        rows = store.query("SELECT token, owner, claimed_at, expires_at FROM schema_migrations_lock FINAL "
                           "WHERE released = 0 AND expires_at > now64(3) ORDER BY claimed_at, token").rows
    except StoreError:
        return []
    return [(token, LockHolder(owner, at, until)) for token, owner, at, until in rows]


# ---------------------------------------------------------------- status and plan
@dataclass(frozen=True)
class MigrationStatus:
    """What the store holds against this release's migration files."""

    applied: list[str]
    pending: list[str]
    dirty: dict[str, str] = field(default_factory=dict)  # name -> where it stopped
    changed: dict[str, str] = field(default_factory=dict)  # name -> "stored X, file Y"
    unknown: list[str] = field(default_factory=list)  # applied in the store, no file here (a newer release's)
    lock: LockHolder | None = None

    @property
    def current(self) -> bool:
        return not (self.pending or self.changed)

    def as_dict(self) -> dict[str, Any]:
        return {"applied": self.applied, "pending": self.pending, "dirty": self.dirty, "changed": self.changed,
                "unknown": self.unknown, "lock": None if self.lock is None else str(self.lock)}


def status(store: StoreLike, directory: str | os.PathLike[str] | None = None) -> MigrationStatus:
    """The store's migrations against the files, read-only (a SELECT-only user may ask)."""
    files = migration_files(directory)
    rec = _read(store)
    known = {m.version for m in files}
    cluster = getattr(store, "cluster", None)
    applied, pending, dirty, changed = [], [], {}, {}
    for migration, todo in statements(files, cluster):
        if migration.version in rec.applied:
            applied.append(migration.name)
            stored = rec.applied[migration.version][1]
            if stored != migration.checksum:
                changed[migration.name] = f"applied with checksum {stored}, the file now has {migration.checksum}"
            continue
        pending.append(migration.name)
        recorded = rec.steps.get(migration.version)
        if recorded:
            steps = plan_steps(todo)
            last = max(recorded)
            done = sum(1 for s in steps if "done" in recorded.get(s.index, ()) or (s.idempotent and s.index < last))
            begun = next((s for s in steps if s.index in recorded and "done" not in recorded[s.index]), None)
            where = f"stopped after {done} of {len(steps)} steps"
            if begun is not None:
                where += f"; step {begun.index + 1} begun: {begun.summary}"
            if migration.version in rec.errors and rec.errors[migration.version]:
                where += f"; last error: {rec.errors[migration.version]}"
            dirty[migration.name] = where
    unknown = [name for v, (name, _, _) in sorted(rec.applied.items()) if v not in known]
    claims = _live_claims(store)
    return MigrationStatus(applied, pending, dirty, changed, unknown, claims[0][1] if claims else None)


@dataclass(frozen=True)
class PlannedMigration:
    """A pending migration: its steps, which are done, and the tables it copies with their size."""

    name: str
    steps: list[Step]
    done: set[int]
    copies: dict[str, tuple[int, int]]  # source table -> (rows, bytes on disk)


def plan(store: StoreLike, directory: str | os.PathLike[str] | None = None) -> list[PlannedMigration]:
    """What ``up`` would do, read-only: each pending migration's steps (those done marked) and the
    rows and bytes of every table it copies (copy time: deploy/README.md, "Upgrading")."""
    rec = _read(store)
    out = []
    for migration, todo in statements(migration_files(directory), getattr(store, "cluster", None)):
        if migration.version in rec.applied:
            continue
        steps = plan_steps(todo)
        recorded = rec.steps.get(migration.version, {})
        renamed: dict[str, str] = {}
        copies: dict[str, tuple[int, int]] = {}
        for step in steps:
            if step.kind == "rename":
                renamed[step.names[1]] = renamed.get(step.names[0], step.names[0])
            elif step.kind == "copy":
                source = _copy_source(step.sql)
                if source:
                    source = renamed.get(source, source)
                    copies[source] = table_size(store, source)[:2]
        out.append(PlannedMigration(migration.name, steps, {i for i, s in recorded.items() if "done" in s}, copies))
    return out


def _copy_source(sql: str) -> str | None:
    import re

    found = re.search(r"\bFROM\s+([A-Za-z_][A-Za-z0-9_]*)", sql.split("SELECT", 1)[-1], re.I)
    return found.group(1) if found else None


def table_size(store: StoreLike, table: str) -> tuple[int, int, int]:
    """``(rows, bytes on disk, bytes uncompressed)`` of ``table``'s active parts."""
    rows = store.query("SELECT sum(rows), sum(bytes_on_disk), sum(data_uncompressed_bytes) FROM system.parts "
                       "WHERE active AND database = currentDatabase() AND table = {t:String}", {"t": table}).rows
    return (int(rows[0][0] or 0), int(rows[0][1] or 0), int(rows[0][2] or 0)) if rows else (0, 0, 0)


def require_current(store: StoreLike, directory: str | os.PathLike[str] | None = None) -> None:
    """Raise :class:`MigrationsPending` naming every pending, dirty or changed migration."""
    found = status(store, directory)
    if found.current:
        return
    parts = []
    if found.pending:
        names = [f"{n} (dirty: {found.dirty[n]})" if n in found.dirty else n for n in found.pending]
        parts.append(f"{len(found.pending)} pending migration(s): {', '.join(names)}")
    if found.changed:
        changed = ", ".join(f"{n} ({why})" for n, why in found.changed.items())
        parts.append(f"applied migration(s) changed since: {changed}")
    raise MigrationsPending(f"the store {getattr(store, 'dsn', '')} has {'; '.join(parts)}; run `fleethealth migrate "
                            "up` first (deploy/README.md, \"Upgrading\"), or start with --migrate")


# ---------------------------------------------------------------- the lock
class _Lock:
    def __init__(self, store: StoreLike, owner: str, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise StoreError(f"migrate.lock_ttl_s must be > 0, got {ttl_s!r}")
        self.store, self.owner, self.ttl_ms = store, owner, int(ttl_s * 1000)
        self.token = uuid.uuid4().hex

    def _write(self, *, released: int, claimed: str = "now64(3)") -> None:
        self.store.command(
            "INSERT INTO schema_migrations_lock (token, owner, claimed_at, expires_at, released, seq) "
            f"SELECT {{t:String}}, {{o:String}}, {claimed}, now64(3) + toIntervalMillisecond({{ms:UInt64}}), "
            "{r:UInt8}, {s:UInt64}" + (" FROM schema_migrations_lock FINAL WHERE token = {t:String}"
                                       if claimed != "now64(3)" else ""),
            {"t": self.token, "o": self.owner, "ms": self.ttl_ms, "r": released, "s": time.time_ns()})

    def acquire(self, *, break_lock: bool = False) -> None:
        self._write(released=0)
        for token, holder in _live_claims(self.store):
            if token == self.token:
                return
            if break_lock or _stale(holder.owner, self.owner):
                _release(self.store, token)
                continue
            _release(self.store, self.token)
            raise MigrationLocked(f"another migrator holds the migration lock of {getattr(self.store, 'dsn', '')}: "
                                  f"{holder}; wait for it, or if it is gone run `fleethealth migrate up --break-lock`")
        raise StoreError(f"the migration lock claim of {self.owner} was not found after it was written")

    def extend(self, *, write: bool = True) -> None:
        """Check the claim is still this migrator's (else :class:`MigrationLocked`) and, with ``write``,
        extend it by the TTL from now."""
        claims = _live_claims(self.store)
        if not claims or claims[0][0] != self.token:
            holder = next((h for t, h in claims if t != self.token), None)
            raise MigrationLocked(f"the migration lock was taken from {self.owner}"
                                  + (f" by {holder}" if holder else " (it expired)") + "; stopping")
        if write:
            self._write(released=0, claimed="claimed_at")

    def release(self) -> None:
        _release(self.store, self.token)


def _release(store: StoreLike, token: str) -> None:
    store.command("INSERT INTO schema_migrations_lock (token, owner, claimed_at, expires_at, released, seq) "
                  "SELECT token, owner, claimed_at, expires_at, 1, {s:UInt64} FROM schema_migrations_lock FINAL "
                  "WHERE token = {t:String}", {"t": token, "s": time.time_ns()})


def _stale(holder: str, me: str) -> bool:
    """A claim this migrator may take over: its own owner's (this very process stopped a run without
    releasing), or a process on this host that is gone."""
    if holder == me:
        return True
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


# ---------------------------------------------------------------- up
def migrate(store: StoreLike, directory: str | os.PathLike[str] | None = None, *, owner: str | None = None,
            lock_ttl_s: float = DEFAULT_LOCK_TTL_S, break_lock: bool = False, hook: Hook | None = None) -> list[str]:
    """Apply every pending migration under the lock, resuming a dirty one; return the names applied.
    ``store.cluster`` and ``store.raw_retention_days`` (from the DSN) are read when set. Raises
    :class:`MigrationLocked` when another migrator holds the lock and :class:`StoreError` for a
    changed applied migration (naming it) or a failed statement (naming the migration and step)."""
    cluster = getattr(store, "cluster", None)
    for ddl in _own_tables(cluster):
        store.command(ddl)
    lock = _Lock(store, owner or default_owner(), lock_ttl_s)
    lock.acquire(break_lock=break_lock)
    try:
        done = _up(store, directory, lock, hook or (lambda *_: None))
        days = getattr(store, "raw_retention_days", None)
        if days is not None and directory is None:
            set_raw_retention(store, int(days))
    except (Exception, KeyboardInterrupt):
        lock.release()
        raise
    lock.release()
    return done


def _up(store: StoreLike, directory: str | os.PathLike[str] | None, lock: _Lock, hook: Hook) -> list[str]:
    files = migration_files(directory)
    rec = _read(store)
    changed = [f"{m.name} (applied with checksum {rec.applied[m.version][1]}, the file now has {m.checksum})"
               for m in files if m.version in rec.applied and rec.applied[m.version][1] != m.checksum]
    if changed:
        raise StoreError(f"applied migration(s) changed since they were applied: {', '.join(changed)}; "
                         "a release must never edit an applied migration (add a new one)")
    cluster = getattr(store, "cluster", None)
    applied: list[str] = []
    for migration, todo in statements(files, cluster):
        if migration.version in rec.applied:
            continue
        steps = plan_steps(todo)
        recorded = rec.steps.get(migration.version, {})
        if recorded and rec.step_checksum.get(migration.version) != migration.checksum:
            if any("done" in s for s in recorded.values()):
                raise StoreError(f"migration {migration.name} stopped half-way and its file has changed since "
                                 f"(steps recorded under checksum {rec.step_checksum[migration.version]}, the file "
                                 f"has {migration.checksum}): finish it with the release that began it")
            recorded = {}  # nothing of it was done: the new text starts afresh
        extended = False
        last = max(recorded, default=-1)  # steps run in order: every step before a recorded one has run
        for step in steps:
            states = recorded.get(step.index, set())
            if "done" in states or (step.idempotent and step.index < last):
                continue  # (an idempotent step run again after a later rename or drop would undo it)
            if step.idempotent:  # not recorded: run again when a run stopped before the next recorded step
                _run(store, migration, steps, step, step.sql)
                continue
            # the claim is extended before a migration's first recorded step and around every copy (the
            # long steps), and checked before every other one
            lock.extend(write=not extended or step.kind == "copy")
            extended = True
            _run_step(store, migration, steps, step, resumed=bool(states), owner=lock.owner, hook=hook,
                      cluster=cluster)
            if step.kind == "copy":
                lock.extend()
        store.command("INSERT INTO schema_migrations (version, name, checksum) "
                      "SELECT {v:UInt32}, {n:String}, {c:String}",
                      {"v": migration.version, "n": migration.name, "c": migration.checksum})
        hook("applied", migration.name, -1)
        applied.append(migration.name)
    return applied


def _record(store: StoreLike, migration: Migration, step: Step, state: str, owner: str, error: str = "") -> None:
    # one statement, not Store.insert: an insert after DDL first reads every table's columns again
    store.command("INSERT INTO schema_migration_steps (version, step, name, checksum, state, statement, error, "
                  "owner) SELECT {v:UInt32}, {i:UInt32}, {n:String}, {c:String}, {s:String}, {t:String}, {e:String}, "
                  "{o:String}", {"v": migration.version, "i": step.index, "n": migration.name, "c": migration.checksum,
                                 "s": state, "t": step.summary, "e": error, "o": owner})


def _run_step(store: StoreLike, migration: Migration, steps: list[Step], step: Step, *, resumed: bool, owner: str,
              hook: Hook, cluster: str | None) -> None:
    _record(store, migration, step, "begun", owner)
    hook("begun", migration.name, step.index)
    if not resumed:
        _run(store, migration, steps, step, step.sql, owner=owner)
    else:
        how = resume_plan(steps, step.index, migration=migration.name, local_suffix=LOCAL_SUFFIX if cluster else "")
        if how.skip_if is None or not (not _exists(store, how.skip_if[0]) and _exists(store, how.skip_if[1])):
            for table in how.truncate:
                _run(store, migration, steps, step, f"TRUNCATE TABLE IF EXISTS {table}"
                     + (f" ON CLUSTER {cluster}" if cluster else ""), owner=owner)
            _run(store, migration, steps, step, how.sql, owner=owner)
    hook("ran", migration.name, step.index)
    _record(store, migration, step, "done", owner)
    hook("done", migration.name, step.index)


def _run(store: StoreLike, migration: Migration, steps: list[Step], step: Step, sql: str, *,
         owner: str | None = None) -> None:
    """Run one statement of ``step``; a failure names the file and the step, with the server's own
    first line, and (``owner`` given: a recorded step) is recorded as the step's last error."""
    try:
        store.command(sql)
    except StoreError as exc:
        cause = exc.__cause__
        why = str(exc) if cause is None else first_line(cause)
        if owner is not None:
            try:
                _record(store, migration, step, "failed", owner, why)
            except StoreError:
                pass  # the store is gone too: the step stays begun, which resumes the same way
        raise StoreError(f"migration {migration.name} failed at step {step.index + 1} of {len(steps)} on "
                         f"{getattr(store, 'dsn', '')}: {why}") from (cause or exc)


def _exists(store: StoreLike, table: str) -> bool:
    return bool(store.query("SELECT count() FROM system.tables WHERE database = currentDatabase() AND "
                            "name = {t:String}", {"t": table}).rows[0][0])

