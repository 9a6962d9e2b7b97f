"""The migrator on real chDB: a migration stopped between any two of its recorded actions (an
injected failure point in-process, and SIGKILLed subprocesses) resumes to the same rows and data as
an uninterrupted run; the lock keeps a second migrator out naming the holder, and is taken over
only when stale; a changed applied migration is an error naming it; a dirty migration is shown
where it stopped; the commands refuse to start on a store with pending migrations."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fleethealth.commands import main
from fleethealth.errors import MigrationLocked, MigrationsPending, StoreError
from fleethealth.store import Store, migration_files, open_store
from fleethealth.store.migrator import _Lock, plan, require_current, status
from fleethealth.store.steps import plan_steps, resume_plan

_STATE = {"schema_migration_steps", "schema_migrations_lock"}
_VOLATILE = {"received", "applied_at", "at"}  # arrival times: differ between any two runs


class _Killed(BaseException):
    """Stands for a kill: not an Exception, so the migrator neither records a failure nor releases its lock."""


def _old_store(store: Store, tmp_path: Path) -> None:
    """Migrations 001-006 and rows in every table 007-010 rebuild or copy."""
    old = tmp_path / "migrations_006"
    old.mkdir(exist_ok=True)
    for m in migration_files():
        if m.version < 7:
            (old / m.name).write_text(m.sql)
    store.migrate(old)
    store.command("INSERT INTO gpu_samples (node, rack, gpu, ts, model, uuid, temp_c, power_w, energy_mj) "
                  "SELECT concat('n', toString(number % 13)), 'r1', number % 8, "
                  "toDateTime64(1700000000 + intDiv(number, 104), 3, 'UTC'), 'H100', "
                  "concat('GPU-', toString(number % 8)), "
                  "40 + number % 37, 300 + (number * 7) % 400, number * 1000.5 FROM numbers(3000)")
    store.command("INSERT INTO rank_steps (job, step, rank, node, gpu, ts, compute_s, rank_group) "
                  "SELECT 'train-1', intDiv(number, 64), number % 64, concat('n', toString(intDiv(number % 64, 8))), "
                  "number % 8, toDateTime64(1700000000 + intDiv(number, 64), 3, 'UTC'), 1 + (number % 97) / 1000, -1 "
                  "FROM numbers(4000)")
    store.command("INSERT INTO findings (id, kind, detector, job, node, gpu, rank, step, ts, ts_s, diagnosis, z, "
                  "slowdown, evidence) SELECT concat('f', toString(number)), 'straggler', 'straggler', 'train-1', "
                  "'n1', 3, 7, number, toDateTime64(1700000000 + number, 3, 'UTC'), 1700000000 + number, "
                  "'node_thermal', 5.5, 0.2, '{}' FROM numbers(40)")


def _fingerprint(store: Store) -> dict[str, tuple[int, int]]:
    """Every table's row count and a hash of its rows (order-free), arrival times left out; the
    rollups read FINAL (their merges are the engine's, not the migration's)."""
    tables = store.query("SELECT name, engine FROM system.tables WHERE database = currentDatabase() "
                         "AND engine LIKE '%MergeTree'").rows
    out = {}
    for table, engine in tables:
        if table in _STATE:
            continue
        cols = store.query("SELECT name, type FROM system.columns WHERE database = currentDatabase() AND "
                           "table = {t:String} ORDER BY position", {"t": table}).rows
        exprs = [f"finalizeAggregation({n})" if t.startswith("AggregateFunction") else n
                 for n, t in cols if n not in _VOLATILE]
        final = " FINAL" if engine.startswith("Aggregating") else ""
        count, digest = store.query(f"SELECT count(), sum(cityHash64({', '.join(exprs)})) FROM {table}{final}").rows[0]
        out[table] = (int(count or 0), int(digest or 0))
    return out


def test_a_migrator_stopped_between_every_two_steps_ends_as_an_uninterrupted_run(tmp_path: Path) -> None:
    with open_store(f"chdb://{tmp_path}/clean") as store:
        _old_store(store, tmp_path)
        store.migrate()
        clean = _fingerprint(store)
    assert clean["gpu_samples"][0] == 3000 and clean["rank_steps"][0] == 4000 and clean["findings"][0] == 40
    assert clean["gpu_samples_1m"][0] > 0 and clean["gpu_latest"][0] == 13 * 8

    points: list[tuple[str, str, int]] = []

    def kill_at_the_next_point(point: str, migration: str, step: int) -> None:
        if (point, migration, step) not in points:
            points.append((point, migration, step))
            raise _Killed(f"{point} {migration} {step}")

    runs = 0
    with open_store(f"chdb://{tmp_path}/killed") as store:
        _old_store(store, tmp_path)
        while True:
            runs += 1
            try:
                store.migrate(hook=kill_at_the_next_point)
                break
            except _Killed:
                # stopped: pending until done, never current half-way (after the last one's record it is)
                assert not status(store).current or points[-1] == ("applied", migration_files()[-1].name, -1)
        interrupted = _fingerprint(store)
        assert status(store).current and status(store).dirty == {}
    recorded = [s for _, todo in _pending_statements(7) for s in plan_steps(todo) if not s.idempotent]
    # renames, CREATEs without IF NOT EXISTS, copies, DROPs without IF EXISTS, 012's backfill, and 013's
    # rename, create, copy, drop, the minute rollup's new setting and the two rollups' backfills, 014's backfill
    assert len(recorded) == 22
    # begun, ran, done around each recorded step (a kill between two idempotent ones is the same as one
    # before the next recorded step), applied after each migration
    applied = sum(1 for f in migration_files() if int(f.name[:3]) >= 7)
    assert len(points) == 3 * len(recorded) + applied and runs == len(points) + 1
    assert interrupted == clean


def _pending_statements(since: int) -> list:
    from fleethealth.store.migrations import statements

    return [(m, s) for m, s in statements(migration_files()) if m.version >= since]


def test_a_copy_stopped_half_way_is_redone_without_duplicates(tmp_path: Path) -> None:
    """A kill inside the copy statement leaves part of the rows: the resume empties the new table
    and its rollup and copies again (the fault injected by copying a part before the kill)."""
    with open_store(f"chdb://{tmp_path}/store") as store:
        _old_store(store, tmp_path)

        def half_copy_then_die(point: str, migration: str, step: int) -> None:
            if (point, migration, step) == ("begun", "007_samples_at_scale.sql", 4):
                store.command("INSERT INTO gpu_samples (node, rack, gpu, ts, model, uuid) "
                              "SELECT node, rack, gpu, ts, model, uuid FROM gpu_samples_006 LIMIT 1000")
                raise _Killed("inside the copy")

        with pytest.raises(_Killed):
            store.migrate(hook=half_copy_then_die)
        dirty = status(store).dirty["007_samples_at_scale.sql"]
        assert "stopped after 4 of 6 steps; step 5 begun: INSERT INTO gpu_samples" in dirty
        with pytest.raises(MigrationsPending, match=r"007_samples_at_scale.sql \(dirty: stopped after 4 of 6"):
            require_current(store)
        store.migrate()
        assert store.query("SELECT count(), uniqExact(node, gpu, ts) FROM gpu_samples").rows == [(3000, 3000)]
        assert store.query("SELECT sum(samples) FROM gpu_samples_1m").rows == [(3000,)]


def test_a_copy_into_a_table_an_earlier_migration_made_is_not_redone_blind() -> None:
    steps = plan_steps(["INSERT INTO findings (id) SELECT id FROM old"])
    with pytest.raises(StoreError, match=r"migration 099_x.sql stopped during step 1 .*findings, which an earlier"):
        resume_plan(steps, 0, migration="099_x.sql")


def test_multi_pair_renames_are_one_step_each_and_a_rename_that_ran_is_skipped() -> None:
    steps = plan_steps(["RENAME TABLE recommendations TO recommendations_by_ts, recommendations_by_id TO "
                        "recommendations"])
    assert [s.sql for s in steps] == ["RENAME TABLE recommendations TO recommendations_by_ts",
                                      "RENAME TABLE recommendations_by_id TO recommendations"]
    assert resume_plan(steps, 1, migration="006").skip_if == ("recommendations_by_id", "recommendations")


def test_a_second_migrator_refuses_naming_the_holder_and_a_stale_claim_is_taken_over(store: Store) -> None:
    holder = _Lock(store, "migrate-job-7f9c:1", 600.0)
    holder.acquire()
    with pytest.raises(MigrationLocked, match=r"another migrator holds the migration lock .*: migrate-job-7f9c:1 "
                                              r"\(claimed .* UTC, expires .* UTC\)"):
        store.migrate()
    assert str(status(store).lock).startswith("migrate-job-7f9c:1")
    assert store.migrate(break_lock=True) == [] and status(store).lock is None
    # a claim that expired (by the server's clock) is no one's
    store.command("INSERT INTO schema_migrations_lock SELECT 'old', 'gone-host:9', now64(3) - 60, now64(3) - 1, 0, 1")
    assert store.migrate() == []
    # a migrator on this host whose process is gone: its claim is stale at once
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = _Lock(store, f"{os.uname().nodename}:{done.stdout.strip()}", 600.0)
    dead.acquire()
    assert store.migrate() == [] and status(store).lock is None
    # the holder finds its claim taken away at its next step
    with pytest.raises(MigrationLocked, match="the migration lock was taken from migrate-job-7f9c:1"):
        holder.extend()


def test_a_changed_applied_migration_is_an_error_naming_it(store: Store, tmp_path: Path) -> None:
    (tmp_path / "901_a.sql").write_text("CREATE TABLE IF NOT EXISTS m901 (a UInt8) ENGINE = MergeTree ORDER BY a")
    assert store.migrate(tmp_path) == ["901_a.sql"]
    (tmp_path / "901_a.sql").write_text("CREATE TABLE IF NOT EXISTS m901 (a UInt16) ENGINE = MergeTree ORDER BY a")
    with pytest.raises(StoreError, match=r"changed since they were applied: 901_a.sql \(applied with checksum"):
        store.migrate(tmp_path)
    assert "901_a.sql" in status(store, tmp_path).changed
    with pytest.raises(MigrationsPending, match="applied migration.s. changed since: 901_a.sql"):
        require_current(store, tmp_path)


def test_plan_names_each_copy_with_its_size(tmp_path: Path) -> None:
    with open_store(f"chdb://{tmp_path}/store") as store:
        _old_store(store, tmp_path)
        planned = {m.name: m for m in plan(store)}
    assert list(planned) == [m.name for m in migration_files() if m.version >= 7]
    assert planned["007_samples_at_scale.sql"].copies["gpu_samples"][0] == 3000  # read before the rename
    assert planned["010_rank_steps_at_scale.sql"].copies["rank_steps"][0] == 4000


_WORKER = """
import os, signal, sys
from fleethealth.store import open_store
kill_at = int(sys.argv[2]); seen = []
def hook(point, migration, step):
    seen.append(point)
    if len(seen) == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
with open_store(sys.argv[1]) as store:
    store.migrate(hook=hook)
"""


def test_migrators_sigkilled_mid_migration_resume_with_migrate_up(tmp_path: Path, capsys) -> None:
    """Three migrator processes SIGKILLed at the 7th, 12th and 21st point each run reaches: 007's copy
    begun, 008's first rename run but not recorded, 010's copy begun; then `fleethealth migrate up`
    (the dead holders' claims are stale: same host, process gone) ends with the rows of an
    uninterrupted run."""
    with open_store(f"chdb://{tmp_path}/clean") as store:
        _old_store(store, tmp_path)
        store.migrate()
        clean = _fingerprint(store)
    dsn = f"chdb://{tmp_path}/killed"
    with open_store(dsn) as store:
        _old_store(store, tmp_path)
    for kill_at in (7, 12, 21):  # counted from where each run starts
        run = subprocess.run([sys.executable, "-c", _WORKER, dsn, str(kill_at)], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == -signal.SIGKILL, run.stderr
    assert main(["migrate", "status", "--store", dsn]) == 1
    dirty = "pending  010_rank_steps_at_scale.sql  DIRTY: stopped after 2 of 4 steps; step 3 begun: INSERT INTO"
    assert dirty in capsys.readouterr().out
    assert main(["migrate", "up", "--store", dsn]) == 0
    assert main(["migrate", "status", "--store", dsn]) == 0
    with open_store(dsn) as store:
        assert _fingerprint(store) == clean


def test_detect_serve_and_act_refuse_a_store_with_pending_migrations(tmp_path: Path, capsys, broker) -> None:
    dsn = f"chdb://{tmp_path}/store"
    old = tmp_path / "m"
    old.mkdir()
    (old / "001_core.sql").write_text(migration_files()[0].sql)
    with open_store(dsn) as store:
        store.migrate(old)
    for argv in (["detect", "--kafka", "kafka://127.0.0.1:9"], ["serve", "--kafka", "kafka://127.0.0.1:9"],
                 ["serve", "--no-detect", "--migrate"], ["act", "--scheduler", "slurm", "--kafka", "kafka://127.0.0.1:9"]):
        capsys.readouterr()
        assert main([*argv, "--store", dsn]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"fleethealth {argv[0]}: error: the store chdb://") and "12 pending migration(s): " \
            "003_policy.sql, 004_gpu_memory.sql" in err and "run `fleethealth migrate up`" in err, err
    with open_store(dsn) as store:
        assert len(status(store).pending) == 12  # nothing migrated, --no-detect --migrate included
    # --migrate applies them (then act joins its group on the broker and, idle, exits)
    assert main(["act", "--scheduler", "slurm", "--kafka", broker.dsn, "--store", dsn, "--migrate",
                 "--dry-run", "--idle-exit", "0", "--data", str(tmp_path / "act")]) in (0, 2)
    with open_store(dsn) as store:
        assert status(store).current


def test_migrate_help_explains_each_action_and_the_writers_gate() -> None:
    from fleethealth.commands import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["migrate"].format_help()
    for words in ("status ", "plan ", "up ", "refuse to start while a migration is pending", "--migrate",
                  "never migrates", "Stop the writers", "--break-lock"):
        assert words in text, words
