"""The store on real chDB (the ``store`` fixture: a fresh data path, migrations applied): migrations,
columnar inserts and typed readers for every table, deduplication, read-only queries, the
one-path-per-process rule, a path held by another process, and ``fleethealth query``."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from fleethealth.commands import main
from fleethealth.errors import ConfigError, StoreError, StoreLocked
from fleethealth.schema import (
    GPU_FIELDS,
    Action,
    ClockReason,
    Diagnosis,
    Event,
    EventKind,
    Finding,
    FindingKind,
    Guard,
    Recommendation,
    StepBatch,
    Telemetry,
)
from fleethealth.store import Store, migration_files, open_store, split_statements

CORE_TABLES = {"gpu_samples", "rank_steps", "events", "findings", "recommendations", "deadletter"}


def _batches(job: str = "train-1", steps: int = 5, nodes: int = 3, gpus: int = 8) -> list[StepBatch]:
    rng = np.random.default_rng(7)
    return [StepBatch(job=job, step=s, node=f"n{n:04d}", ts=1_700_000_000.0 + 2.0 * s,
                      ranks=np.arange(n * gpus, (n + 1) * gpus, dtype=np.int32),
                      gpus=np.arange(gpus, dtype=np.int16), compute_s=rng.lognormal(0.7, 0.02, gpus),
                      groups=None if n else np.zeros(gpus, dtype=np.int32))
            for s in range(steps) for n in range(nodes)]


def _finding(node: str = "n0013", step: int = 199, kind: FindingKind = FindingKind.STRAGGLER) -> Finding:
    return Finding(kind=kind, node=node, ts=1_700_000_398.123456, job="train-1", gpu=3, rank=107, step=step,
                   diagnosis=Diagnosis.NODE_THERMAL if kind is FindingKind.STRAGGLER else None,
                   z=7.25, slowdown=0.2, detector="straggler", evidence={"temp_c": 91.5, "why": ["HW_THERMAL"]})


# ---------------------------------------------------------------- DSNs
def test_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown store DSN 'mysql://db'.*chdb://, http://, https://"):
        open_store("mysql://db")
    with pytest.raises(ConfigError):
        open_store("/var/lib/fleethealth")


def test_chdb_dsn_needs_a_path() -> None:
    with pytest.raises(ConfigError, match="names no data path"):
        open_store("chdb://")


def test_unreachable_server_is_a_store_error() -> None:
    from fleethealth.broker import free_port

    with pytest.raises(StoreError, match=r"cannot reach ClickHouse at http://127\.0\.0\.1"):
        open_store(f"http://127.0.0.1:{free_port()}/fleet")


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
    for table in ("events", "findings", "recommendations"):
        assert keys[table] == ("ReplacingMergeTree", "node, ts, id")
    columns = {r[0]: r[1] for r in store.query(
        "SELECT name, type FROM system.columns WHERE database = currentDatabase() AND table = 'gpu_samples'").rows}
    assert all(columns[f] == "Float64" for f in GPU_FIELDS)
    assert columns["ts"].startswith("DateTime64(3")
    rec_cols = {r[0]: r[1] for r in store.query(
        "SELECT name, type FROM system.columns WHERE database = currentDatabase() "
        "AND table = 'recommendations'").rows}
    assert rec_cols["acked_at"].startswith("Nullable(DateTime64(3") and rec_cols["acked_by"] == "String"


# ---------------------------------------------------------------- round trips
def test_telemetry_round_trip(store: Store) -> None:
    samples = [Telemetry.from_columns(f"n{i:04d}", "r00", 1_700_000_000.5 + i, [0, 1, 2], nic_util=0.25,
                                      model="H100", uuid=("u0", "u1", "u2"), temp_c=[60.0, 61.0, 90.0 + i],
                                      clock_reasons=[0, 0, float(ClockReason.HW_THERMAL)])
               for i in range(4)]
    assert store.insert_telemetry(samples) == 12
    res = store.query("SELECT node, gpu, toUnixTimestamp64Milli(ts) AS ms, uuid, nic_util, temp_c, clock_reasons, "
                      "power_w FROM gpu_samples ORDER BY node, gpu")
    rows = res.dicts()
    assert len(rows) == 12
    assert rows[2] == {"node": "n0000", "gpu": 2, "ms": 1_700_000_000_500, "uuid": "u2", "nic_util": 0.25,
                       "temp_c": 90.0, "clock_reasons": 64.0, "power_w": rows[2]["power_w"]}
    assert math.isnan(rows[2]["power_w"])  # not reported stays NaN
    assert res.column("temp_c")[-1] == 93.0


def test_steps_round_trip_columnar(store: Store) -> None:
    batches = _batches()
    assert store.insert_steps(batches) == 5 * 3 * 8
    res = store.query("SELECT step, rank, node, gpu, compute_s, rank_group, toUnixTimestamp64Milli(ts) "
                      "FROM rank_steps WHERE job = {j:String} ORDER BY step, rank", {"j": "train-1"})
    step, rank, node, gpu, compute, group, ms = map(np.array, zip(*res.rows, strict=True))
    np.testing.assert_array_equal(compute, np.concatenate([b.compute_s for b in batches]))
    np.testing.assert_array_equal(rank, np.concatenate([b.ranks for b in batches]))
    assert set(group[node == "n0000"]) == {0} and set(group[node != "n0000"]) == {-1}
    assert ms[-1] == 1_700_000_008_000 and step[-1] == 4 and gpu[-1] == 7


def test_steps_reader_regroups_batches(store: Store) -> None:
    batches = _batches(steps=4, nodes=3)
    store.insert_steps(batches)
    store.insert_steps(batches[:3])  # a replayed step: FINAL keeps one copy per (job, step, rank)
    back = store.steps("train-1")
    assert [(b.step, b.node) for b in back] == [(b.step, b.node) for b in batches]
    for got, sent in zip(back, batches, strict=True):
        np.testing.assert_array_equal(got.ranks, sent.ranks)
        np.testing.assert_array_equal(got.gpus, sent.gpus)
        np.testing.assert_array_equal(got.compute_s, sent.compute_s)
        assert got.ts == sent.ts and (got.groups is None) == (sent.groups is None)
    assert [b.step for b in store.steps("train-1", first_step=1, last_step=2, node="n0002")] == [1, 2]
    assert store.steps("other-job") == []


def test_telemetry_reader_regroups_samples(store: Store) -> None:
    samples = [Telemetry.from_columns(f"n{i % 2:04d}", "r00", 100.0 + i, [0, 1], nic_util=0.5, model="H100",
                                      temp_c=[60.0 + i, 70.0 + i]) for i in range(4)]
    store.insert_telemetry(samples)
    back = store.telemetry(node="n0001")
    assert [t.ts for t in back] == [101.0, 103.0]
    np.testing.assert_array_equal(back[1].columns["temp_c"], [63.0, 73.0])
    assert math.isnan(back[0].columns["power_w"][0]) and back[0].uuid == () and back[0].model == "H100"
    window = store.telemetry(since=101.0, until=103.0)  # ordered by node, then time
    assert [(t.node, t.ts) for t in window] == [("n0000", 102.0), ("n0001", 101.0)]


@pytest.mark.parametrize("dedup", [True, False])
def test_events_round_trip(store: Store, dedup: bool) -> None:
    events = [Event(node="n0019", ts=640.0, kind=EventKind.XID, gpu=6, code=79, data={"severity": "fatal"}),
              Event(node="n0030", ts=600.25, kind=EventKind.SDC_CHECK, job="train-1", gpu=5, rank=245, step=300,
                    message="selfcheck mismatch", data={"check": "selfcheck", "passed": False,
                                                        "digests": ["aa", "bb"], "tolerance": None})]
    store.insert_events(events, dedup_token="ev-1" if dedup else None)
    store.insert_events(events, dedup_token="ev-1" if dedup else None)  # a replay
    assert store.events() == sorted(events, key=lambda e: e.ts)
    assert store.events(kind="xid") == [events[0]]
    assert store.events(node="n0030", job="train-1") == [events[1]]
    assert store.events(kind="hang_report") == []


def test_findings_round_trip_keep_ids_and_filter(store: Store) -> None:
    findings = [_finding(), _finding("n0021", 150), _finding("n0007", 50, FindingKind.FAILURE_RISK)]
    assert store.insert_findings(findings) == 3
    store.insert_findings(findings[:1])  # replayed without a token: ReplacingMergeTree keeps one
    back = store.findings()
    assert back == sorted(findings, key=lambda f: (f.ts, f.id))
    assert [f.id for f in store.findings(node="n0013")] == [findings[0].id]
    stored_ids = set(store.query("SELECT id FROM findings").column("id"))
    assert stored_ids == {f.id for f in findings}  # ids survive the exact event time (ts_s)
    assert store.findings(kind="failure_risk") == [findings[2]]
    assert store.findings(since=1_700_000_398.2) == []
    assert len(store.findings(until=1_700_000_399.0, limit=2)) == 2
    with pytest.raises(ConfigError):
        store.findings(limit=-1)


def test_recommendations_round_trip(store: Store) -> None:
    recs = [Recommendation(action=Action.EVICT, node="n0013", ts=400.0, reason="thermal straggler",
                           guard=Guard.ALLOWED, job="train-1", finding_id=_finding().id, evidence={"payback_s": 90}),
            Recommendation(action=Action.ALERT_FACILITIES, node="n0016", ts=401.0, reason="hot aisle r02",
                           guard=Guard.NEEDS_HUMAN, dry_run=True)]
    store.insert_recommendations(recs)
    assert store.recommendations() == recs
    assert store.recommendations(action="alert_facilities") == [recs[1]]
    acked = store.query("SELECT acked_at, acked_by FROM recommendations ORDER BY ts").rows
    assert acked == [(None, ""), (None, "")]


def test_deadletter_round_trip(store: Store) -> None:
    store.insert("deadletter", {"ts": [1_700_000_000.25], "topic": ["fh.steps"], "partition": [2], "offset": [41],
                                "key": ["train-1"], "reason": ["compute_s: must be >= 0"], "raw": ["{}"],
                                "raw_base64": [False]})
    row = store.query("SELECT toUnixTimestamp64Milli(ts), topic, partition, offset, reason, raw_base64 "
                      "FROM deadletter").rows
    assert row == [(1_700_000_000_250, "fh.steps", 2, 41, "compute_s: must be >= 0", False)]


# ---------------------------------------------------------------- deduplication
def test_dedup_token_stores_one_copy_of_three_identical_inserts(store: Store) -> None:
    batches = _batches(steps=4)
    for _ in range(3):
        store.insert_steps(batches, dedup_token="steps-0-3")
    assert store.query("SELECT count() FROM rank_steps").rows == [(4 * 3 * 8,)]
    store.insert_steps(batches, dedup_token="steps-0-3-again")  # a new token is a new insert ...
    assert store.query("SELECT count() FROM rank_steps").rows == [(2 * 4 * 3 * 8,)]
    # ... but the natural key (job, step, rank) still collapses it in FINAL / after a merge
    assert store.query("SELECT count() FROM rank_steps FINAL").rows == [(4 * 3 * 8,)]
    store.command("OPTIMIZE TABLE rank_steps FINAL")
    assert store.query("SELECT count() FROM rank_steps").rows == [(4 * 3 * 8,)]


# ---------------------------------------------------------------- errors
def test_readonly_query_refuses_writes(store: Store) -> None:
    store.insert_findings([_finding()])
    with pytest.raises(StoreError, match="READONLY|readonly"):
        store.query("INSERT INTO findings (id, node) VALUES ('x', 'n9')", readonly=True)
    with pytest.raises(StoreError, match="READONLY|readonly"):
        store.query("DROP TABLE findings", readonly=True)
    assert store.query("SELECT count() FROM findings", readonly=True).rows == [(1,)]


def test_bad_inserts_and_queries_are_store_errors(store: Store) -> None:
    with pytest.raises(StoreError, match="unequal length"):
        store.insert("rank_steps", {"job": ["a", "b"], "step": [1]})
    with pytest.raises(StoreError, match="no column 'nonsense'"):
        store.insert("rank_steps", {"nonsense": [1]})
    with pytest.raises(StoreError, match="no table 'nowhere'"):
        store.insert("nowhere", {"a": [1]})
    with pytest.raises(StoreError, match="NaN"):
        store.insert("deadletter", {"ts": [math.nan], "topic": ["t"]})
    with pytest.raises(StoreError, match="query failed"):
        store.query("SELEC 1")
    assert store.insert("rank_steps", {"job": []}) == 0


# ---------------------------------------------------------------- one path per process, locks, CLI
def test_one_chdb_path_per_process(store: Store, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="one open data path per process"):
        open_store(f"chdb://{tmp_path}/other")
    with open_store(store.dsn) as same:  # the same path shares the engine
        same.insert_findings([_finding()])
    assert len(store.findings()) == 1  # and closing the second store leaves the first usable


_HOLDER = """
import sys
from fleethealth.store import open_store
with open_store(sys.argv[1]) as store:
    store.migrate()
    store.insert_findings([])
    print("ready", flush=True)
    sys.stdin.read()
"""


def test_a_path_held_by_another_process_is_store_locked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "data" / "store"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, f"chdb://{path}"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(StoreLocked, match=f"chDB data path {path} is in use by another process"):
            open_store(f"chdb://{path}")
        assert main(["query", "SELECT 1", "--data", str(tmp_path / "data")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "in use by another process" in err[0]
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    with open_store(f"chdb://{path}") as store:  # released when the holder exits
        assert "findings" in _tables(store)


def test_cli_query_prints_a_table_or_json_and_is_read_only(store: Store, capsys: pytest.CaptureFixture) -> None:
    assert store.chdb_path is not None and store.chdb_path.endswith("/store")
    data = str(Path(store.chdb_path).parent)
    store.insert_findings([_finding(), _finding("n0021", 150)])
    assert main(["query", "SELECT node, step, z FROM findings ORDER BY node", "--data", data]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["node", "step", "z"] and out[2].split() == ["n0013", "199", "7.25"]
    assert main(["query", "SELECT node, diagnosis, ts FROM findings ORDER BY node", "--data", data, "--json"]) == 0
    rows = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["node"] for r in rows] == ["n0013", "n0021"] and rows[0]["diagnosis"] == "NODE_THERMAL"
    assert main(["query", "INSERT INTO findings (id, node) VALUES ('x', 'n9')", "--data", data]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "readonly" in err[0].lower()
    assert main(["query", "SELECT 1", "--data", str(Path(data) / "missing")]) == 2
    assert "no store at" in capsys.readouterr().err
