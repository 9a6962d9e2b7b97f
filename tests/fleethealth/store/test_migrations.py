"""The migrations runner on real chDB: applied once, in order, a failing file not recorded; the
statement splitter; the core tables' keys and types."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleethealth.errors import StoreError
from fleethealth.schema import GPU_FIELDS
from fleethealth.store import Store, migration_files, split_statements
from fleethealth.store.columns import FLOAT32_FIELDS

CORE_TABLES = {"gpu_samples", "rank_steps", "events", "findings", "recommendations", "deadletter"}


# ---------------------------------------------------------------- migrations
def _tables(store: Store) -> dict[str, str]:
    res = store.query("SELECT name, create_table_query FROM system.tables WHERE database = currentDatabase()")
    return dict(res.rows)


def test_migrations_applied_twice_change_nothing(store: Store) -> None:
    before = _tables(store)
    assert CORE_TABLES <= set(before) and "schema_migrations" in before
    assert store.migrate() == []
    assert store.migrate() == []
    assert _tables(store) == before
    recorded = store.query("SELECT version, name FROM schema_migrations ORDER BY version").rows
    assert recorded == [(m.version, m.name) for m in migration_files()]


def test_packaged_migrations_are_ordered_and_start_with_core() -> None:
    found = migration_files()
    assert found[0].name == "001_core.sql"
    versions = [m.version for m in found]
    assert versions == sorted(set(versions))


def test_custom_migrations_apply_in_order_and_a_failure_is_not_recorded(store: Store, tmp_path: Path) -> None:
    (tmp_path / "902_second.sql").write_text("INSERT INTO m900 (a, s) VALUES (2, 'two; still one statement');\n")
    (tmp_path / "900_first.sql").write_text("-- a comment; with a semicolon\n"
                                            "CREATE TABLE IF NOT EXISTS m900 (a UInt8, s String)"
                                            " ENGINE = MergeTree ORDER BY a;\nINSERT INTO m900 VALUES (1, 'one');")
    (tmp_path / "901_broken.sql").write_text("CREATE TABLE nonsense (;")
    (tmp_path / "notes.txt").write_text("ignored")
    with pytest.raises(StoreError, match="migration 901_broken.sql failed"):
        store.migrate(tmp_path)
    assert store.query("SELECT a, s FROM m900").rows == [(1, "one")]
    (tmp_path / "901_broken.sql").write_text("ALTER TABLE m900 ADD COLUMN IF NOT EXISTS b UInt8 DEFAULT 7")
    assert store.migrate(tmp_path) == ["901_broken.sql", "902_second.sql"]
    assert store.query("SELECT a, s, b FROM m900 ORDER BY a").rows == [(1, "one", 7),
                                                                        (2, "two; still one statement", 7)]
    assert store.migrate(tmp_path) == []


def test_two_migrations_with_one_version_are_refused(tmp_path: Path) -> None:
    (tmp_path / "005_a.sql").write_text("SELECT 1")
    (tmp_path / "005_b.sql").write_text("SELECT 2")
    with pytest.raises(StoreError, match="share version 005"):
        migration_files(tmp_path)


def test_split_statements_respects_quotes_and_comments() -> None:
    sql = ("-- header; not a statement\nCREATE TABLE t (s String DEFAULT 'a;b') ENGINE = Log;\n"
           "INSERT INTO t VALUES ('it\\'s; fine'); -- trailing; comment\n  ;\nSELECT \"x;y\"")
    assert split_statements(sql) == ["CREATE TABLE t (s String DEFAULT 'a;b') ENGINE = Log",
                                     "INSERT INTO t VALUES ('it\\'s; fine')", 'SELECT "x;y"']


def test_core_schema_keys(store: Store) -> None:
    res = store.query("SELECT name, engine, sorting_key FROM system.tables WHERE database = currentDatabase()")
    keys = {name: (engine, key) for name, engine, key in res.rows}
    assert keys["gpu_samples"] == ("ReplacingMergeTree", "node, gpu, ts")
    assert keys["rank_steps"] == ("ReplacingMergeTree", "job, step, rank")
    assert keys["events"] == ("ReplacingMergeTree", "node, ts, id")
    # keyed on what a finding is about and its episode start, not on when it was concluded (008)
    assert keys["findings"] == ("ReplacingMergeTree", "node, id")
    # keyed on what a recommendation is about, not on when it was decided (006_outbox.sql)
    assert keys["recommendations"] == ("ReplacingMergeTree", "node, id")
    assert keys["outbox"] == ("ReplacingMergeTree", "topic, id")
    columns = {r[0]: r[1] for r in store.query(
        "SELECT name, type FROM system.columns WHERE database = currentDatabase() AND table = 'gpu_samples'").rows}
    assert {f: columns[f] for f in GPU_FIELDS} == {f: "Float32" if f in FLOAT32_FIELDS else "Float64"
                                                   for f in GPU_FIELDS}  # 007_samples_at_scale.sql
    assert columns["ts"].startswith("DateTime64(3")
    rec_cols = {r[0]: r[1] for r in store.query(
        "SELECT name, type FROM system.columns WHERE database = currentDatabase() "
        "AND table = 'recommendations'").rows}
    assert rec_cols["acked_at"].startswith("Nullable(DateTime64(3") and rec_cols["acked_by"] == "String"




def test_a_recommendation_decided_again_is_one_row_and_keeps_its_acknowledgement(store: Store) -> None:
    """Keyed on (node, id), not on the decision time: the same recommendation decided again after a
    restart (a later ``ts``) is one row under FINAL, and a replayed decision does not undo an ack."""
    from fleethealth.schema import Action, Recommendation
    first = Recommendation(action=Action.DRAIN, node="n0001", ts=1_000.0, reason="r", finding_id="f1")
    again = Recommendation(action=Action.DRAIN, node="n0001", ts=1_500.0, reason="r", finding_id="f1")
    assert first.id == again.id
    store.insert_recommendations([first])
    row = store.recommendation_row(first.id)
    assert row is not None
    store.write_recommendation_row({**row, "ts": float(row["ts_s"]), "acked_at": 1_200.0, "acked_by": "act"})
    store.insert_recommendations([again])
    rows = store.query("SELECT id, ts_s, acked_by FROM recommendations FINAL").rows
    assert rows == [(first.id, 1_000.0, "act")]
