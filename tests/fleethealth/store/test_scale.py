"""gpu_samples at fleet scale (007_samples_at_scale.sql) on real chDB: the migration on a fresh store
and on a store the older migrations made, codecs and retention, the 1-minute rollup its view fills,
the range queries that read it, the DSN options, and the cluster form of every migration."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fleethealth.errors import ConfigError, StoreError
from fleethealth.schema import GPU_FIELDS, ClockReason, Telemetry
from fleethealth.store import Store, migration_files, open_store, split_statements
from fleethealth.store.backends import split_options
from fleethealth.store.cluster import ClusterDDL, migrations_ddl
from fleethealth.store.columns import FLOAT32_FIELDS, QUANTISED, telemetry_columns
from fleethealth.store.migrations import raw_retention_days, statements

T0 = 1_767_225_600.0  # a whole minute


def _codecs(store: Store, table: str) -> dict[str, str]:
    res = store.query("SELECT name, compression_codec FROM system.columns WHERE database = currentDatabase() "
                      "AND table = {t:String}", {"t": table})
    return dict(res.rows)


def _create(store: Store, table: str) -> str:
    return store.query("SELECT create_table_query FROM system.tables WHERE database = currentDatabase() "
                       "AND name = {t:String}", {"t": table}).rows[0][0]


def _samples(minutes: int = 3, start: float = T0) -> list[Telemetry]:
    """Two nodes of two GPUs in racks r00 / r01, one sample every 20 s; n0001 GPU 1 runs hot and
    throttles in minute 1; GPU 0 of n0000 does not report power."""
    out = []
    for k in range(minutes * 3):
        minute = k // 3
        for n in range(2):
            hot = n == 1 and minute == 1
            out.append(Telemetry.from_columns(
                f"n{n:04d}", f"r{n:02d}", start + 20.0 * k, [0, 1], nic_util=0.5, model="H100", uuid=("a", "b"),
                temp_c=[60.0 + minute, 71.3 + (20.0 if hot else 0.0) + k % 3],
                power_w=[math.nan, 300.5 + k], sm_clock_mhz=[1980.0, 1500.0 if hot else 1980.0],
                util_pct=[90.0, 95.0], energy_mj=[1e12 + k, 2e12 + 1000.0 * k],
                clock_reasons=[0.0, float(ClockReason.HW_THERMAL) if hot else 0.0]))
    return out


# ---------------------------------------------------------------- the migration
def test_fresh_store_has_typed_compressed_columns_and_a_retention(store: Store) -> None:
    codecs = _codecs(store, "gpu_samples")
    assert codecs["ts"] == "CODEC(Delta(8), ZSTD(1))"
    assert codecs["temp_dc"] == "CODEC(T64, ZSTD(3))" and codecs["power_dw"] == "CODEC(T64, ZSTD(3))"
    assert codecs["energy_j"] == "CODEC(Delta(8), ZSTD(3))" and codecs["uuid"] == "CODEC(ZSTD(3))"
    stored = {QUANTISED[f][0] if f in QUANTISED else f for f in GPU_FIELDS}
    assert all(codecs[f] for f in stored)  # every stored field has a codec
    assert all(codecs[f] == "" for f in QUANTISED)  # the fields' own names are aliases of them
    ddl = _create(store, "gpu_samples")
    assert "TTL received + toIntervalDay(14)" in ddl and "ttl_only_drop_parts = 1" in ddl
    assert "PARTITION BY toDate(ts)" in ddl and raw_retention_days(store) == 14
    assert "TTL received + toIntervalDay(90)" in _create(store, "gpu_samples_1m")
    engines = dict(store.query("SELECT name, engine FROM system.tables WHERE database = currentDatabase() "
                               "AND name LIKE 'gpu_samples%'").rows)
    assert engines == {"gpu_samples": "ReplacingMergeTree", "gpu_samples_1m": "AggregatingMergeTree",
                       "gpu_samples_1m_mv": "MaterializedView", "gpu_samples_1h": "AggregatingMergeTree",
                       "gpu_samples_1h_mv": "MaterializedView", "gpu_samples_rack_1m": "AggregatingMergeTree",
                       "gpu_samples_rack_1m_mv": "MaterializedView"}


def test_an_old_store_upgrades_keeping_its_rows_and_backfills_the_rollup(tmp_path: Path) -> None:
    old = tmp_path / "old_migrations"
    old.mkdir()
    for m in migration_files():
        if m.version < 7:
            (old / m.name).write_text(m.sql)
    samples = _samples()
    with open_store(f"chdb://{tmp_path}/store") as store:
        store.migrate(old)
        assert "gpu_samples_1m" not in _tables(store)
        assert _codecs(store, "gpu_samples")["temp_c"] == ""  # 001: plain Float64, no codec
        store.insert("gpu_samples", telemetry_columns(samples))  # as written before 013: not quantised
        assert store.migrate() == ["007_samples_at_scale.sql", "008_finding_episodes.sql", "009_gpu_latest.sql",
                                  "010_rank_steps_at_scale.sql", "011_detector_snapshots.sql",
                                  "012_job_node_hours.sql", "013_samples_quantised.sql",
                                  "014_job_steps.sql"]
        assert _codecs(store, "gpu_samples")["temp_dc"] == "CODEC(T64, ZSTD(3))"
        assert "gpu_samples_006" not in _tables(store)
        back = store.telemetry()
        assert len(back) == len(samples)
        by_key = {(t.node, t.ts): t for t in back}
        for sent in samples:
            got = by_key[(sent.node, sent.ts)]
            for field in ("temp_c", "power_w", "clock_reasons"):
                assert got.columns[field].tolist() == pytest.approx(sent.columns[field].tolist(), nan_ok=True,
                                                                    rel=0, abs=0)
            # copied by 013 at the sensor's resolution: the energy counter to the J
            assert got.columns["energy_mj"].tolist() == (np.round(sent.columns["energy_mj"] / 1000) * 1000).tolist()
        rollup = store.gpu_minutes("n0001", 1, since=T0, until=T0 + 180.0, source="rollup")
        assert [r["samples"] for r in rollup] == [3, 3, 3]
        assert store.migrate() == []


def _tables(store: Store) -> set[str]:
    return set(store.query("SELECT name FROM system.tables WHERE database = currentDatabase()").column("name"))


# ---------------------------------------------------------------- the rollup and the range queries
def test_the_rollup_fills_on_insert_with_the_right_minute_aggregates(store: Store) -> None:
    store.insert_telemetry(_samples())
    rows = store.gpu_minutes("n0001", 1, since=T0, until=T0 + 180.0, source="rollup")
    assert [r["minute"] for r in rows] == [T0, T0 + 60.0, T0 + 120.0]
    hot = rows[1]  # samples 71.3 + 20 + (0, 1, 2)
    assert (hot["temp_c_min"], hot["temp_c_max"]) == (91.3, 93.3)
    assert hot["temp_c_avg"] == pytest.approx(92.3, abs=1e-5)
    assert hot["sm_clock_mhz_min"] == 1500.0 and hot["clock_reasons"] == int(ClockReason.HW_THERMAL)
    assert rows[0]["clock_reasons"] == 0 and (rows[0]["power_w_min"], rows[0]["power_w_max"]) == (300.5, 302.5)
    assert rows == store.gpu_minutes("n0001", 1, since=T0, until=T0 + 180.0, source="raw")
    quiet = store.gpu_minutes("n0000", 0, since=T0, until=T0 + 180.0, source="rollup")
    assert quiet[0]["power_w_max"] is None and quiet[0]["power_w_avg"] is None  # never reported: null
    assert repr(quiet) == repr(store.gpu_minutes("n0000", 0, since=T0, until=T0 + 180.0, source="raw"))  # nan p99
    assert store.query("SELECT max(energy_mj_max) FROM gpu_samples_1m WHERE node = 'n0001' AND gpu = 1").rows == \
        [(2e12 + 8000.0,)]  # counters keep their full Float64 value


def test_range_queries_read_the_rollup_past_an_hour_and_agree_with_raw(store: Store) -> None:
    store.insert_telemetry(_samples())
    short = (T0, T0 + 180.0)
    racks = store.rack_temperature(since=short[0], until=short[1])
    assert racks == store.rack_temperature(since=short[0], until=short[1], source="rollup")
    assert [(r, m, hi) for r, m, _, hi in racks if r == "r01"] == [("r01", T0, 73.3), ("r01", T0 + 60.0, 93.3),
                                                                   ("r01", T0 + 120.0, 73.3)]
    hot = store.hot_gpus(since=short[0], until=short[1], limit=2)
    assert [(h["node"], h["gpu"]) for h in hot] == [("n0001", 1), ("n0000", 1)]
    assert hot == store.hot_gpus(since=short[0], until=short[1], limit=2, source="rollup")
    assert hot[0]["max_temp_c"] == 93.3 and hot[0]["samples"] == 9
    # the rollup counts whole minutes: a long range starting mid-minute tells which table answered
    late = T0 + 30.0
    assert store.gpu_minutes("n0001", 1, since=late, until=late + 3600.0, source="raw")[0]["samples"] == 1
    assert store.gpu_minutes("n0001", 1, since=late, until=late + 3601.0)[0]["samples"] == 3  # auto: rollup
    assert store.gpu_minutes("n0001", 1, since=late, until=late + 3600.0)[0]["samples"] == 1  # auto: raw
    with pytest.raises(ConfigError, match="source"):
        store.hot_gpus(since=0.0, until=1.0, source="cache")


def test_the_report_reads_long_ranges_from_the_rollup(store: Store) -> None:
    store.insert_telemetry(_samples(start=T0) + _samples(start=T0 + 7200.0))
    cells = store.report_rack_temperature(["n0000", "n0001"], since=T0, until=T0 + 7380.0, bin_s=60.0)
    hot = [(b, hi, bits) for rack, b, _, hi, bits in cells if rack == "r01"]
    assert hot[:3] == [(0, 73.3, 0), (1, 93.3, int(ClockReason.HW_THERMAL)), (2, 73.3, 0)]
    assert [b for b, _, _ in hot[3:]] == [120, 121, 122]


# ---------------------------------------------------------------- DSN options
def test_a_dsn_sets_the_raw_retention(tmp_path: Path) -> None:
    with open_store(f"chdb://{tmp_path}/store?raw_retention_days=30") as store:
        assert store.raw_retention_days == 30 and store.dsn == f"chdb://{tmp_path}/store"
        store.migrate()
        assert raw_retention_days(store) == 30 and "toIntervalDay(30)" in _create(store, "gpu_samples")
    with open_store(f"chdb://{tmp_path}/store") as store:
        assert store.migrate() == [] and raw_retention_days(store) == 30  # as left, when the DSN names none


def test_store_dsn_options_are_checked_and_kept_from_the_client() -> None:
    assert split_options("http://h:8123/db?cluster=fleet&secure=1&raw_retention_days=7") == \
        ("http://h:8123/db?secure=1", {"cluster": "fleet", "raw_retention_days": "7"})
    assert split_options("chdb:///x") == ("chdb:///x", {})
    with pytest.raises(ConfigError, match="needs a ClickHouse server"):
        open_store("chdb:///tmp/nowhere?cluster=fleet")
    with pytest.raises(ConfigError, match="whole number"):
        open_store("chdb:///tmp/nowhere?raw_retention_days=-3")


# ---------------------------------------------------------------- the cluster form
def test_every_migration_has_a_cluster_form_that_clickhouse_parses(store: Store) -> None:
    generated = [migrations_ddl("fleet")] + [s for _, todo in statements(migration_files(), "fleet") for s in todo]
    for statement in generated:
        assert store.explain_ast(statement), statement
    ddl = [s for s in generated if not s.startswith("INSERT")]
    assert all(" ON CLUSTER fleet" in s for s in ddl)
    text = "\n".join(generated)
    assert "CREATE TABLE gpu_samples_local ON CLUSTER fleet" in text
    assert "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')" \
        in text
    assert ("ENGINE = Distributed(fleet, currentDatabase(), gpu_samples_local, cityHash64(node))" in text
            and "Distributed(fleet, currentDatabase(), rank_steps_local, cityHash64(job))" in text)
    assert "ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', version)" \
        in text  # an engine's own arguments follow the replica's
    assert "ReplicatedAggregatingMergeTree" in text
    view = next(s for s in generated if s.startswith("CREATE MATERIALIZED VIEW"))
    assert "TO gpu_samples_1m_local" in view and "FROM gpu_samples_local" in view
    latest = next(s for s in generated if s.startswith("CREATE MATERIALIZED VIEW IF NOT EXISTS gpu_latest_mv"))
    assert "TO gpu_latest_local" in latest and "FROM gpu_samples_local" in latest  # each shard: its own GPUs
    assert "Distributed(fleet, currentDatabase(), gpu_latest_local, cityHash64(node))" in text
    assert "'{replica}', ts)\nORDER BY (node, gpu)" in text  # the version column follows the replica
    # 006 renames recommendations: the Distributed table is re-created over the renamed local table
    assert "Distributed(fleet, currentDatabase(), recommendations_local, cityHash64(node))" in text
    formatted = store.query("SELECT formatQuery({s:String})", {"s": generated[1]}).rows[0][0]
    assert formatted.startswith("CREATE TABLE IF NOT EXISTS gpu_samples_local ON CLUSTER fleet")


def test_a_cluster_store_sends_the_cluster_form_and_unknown_statements_are_refused(store: Store) -> None:
    store.cluster = "fleet"  # no cluster runs here: the server itself refuses the ON CLUSTER form
    try:
        with pytest.raises(StoreError, match="fleet"):
            store.migrate()
    finally:
        store.cluster = None
    with pytest.raises(StoreError, match="no cluster form"):
        ClusterDDL("fleet").translate("OPTIMIZE TABLE gpu_samples FINAL")
    with pytest.raises(StoreError, match="not created by an earlier migration"):
        ClusterDDL("fleet").translate("DROP TABLE nowhere")
    with pytest.raises(StoreError, match="plain identifier"):
        ClusterDDL("fleet; DROP")
    at_scale = next(m for m in migration_files() if m.name == "007_samples_at_scale.sql")
    assert split_statements(at_scale.sql)[0].startswith("RENAME TABLE gpu_samples")
    assert FLOAT32_FIELDS <= set(GPU_FIELDS) | {"nic_util"}  # the Float32 set names real fields


# ---------------------------------------------------------------- the latest-sample table (009)
def _one(node: str, ts: float, temp: float, rack: str = "r00", gpus: tuple[int, ...] = (0, 1)) -> Telemetry:
    return Telemetry.from_columns(node, rack, ts, list(gpus), nic_util=0.5, model="H100",
                                  temp_c=[temp + g for g in gpus], power_w=[300.5 + temp] * len(gpus),
                                  sm_clock_mhz=[1980.0] * len(gpus), util_pct=[90.0] * len(gpus),
                                  clock_reasons=[0.0] * len(gpus), ecc_dbe_volatile=[float(temp > 80)] * len(gpus),
                                  nvlink_links_up=[18.0] * len(gpus))


def test_the_latest_readers_read_gpu_latest_and_agree_with_the_raw_scan(store: Store) -> None:
    # n0001's newest sample (81.5 °C at +1000 s) is stored first, an older one (+990 s) after it
    store.insert_telemetry(_samples())
    store.insert_telemetry([_one("n0001", T0 + 1000.0, 81.5, rack="r01")])
    store.insert_telemetry([_one("n0001", T0 + 990.0, 40.0, rack="r01"), _one("n0002", T0 + 5.0, 50.0, gpus=(3,))])
    for _merged in (False, True):  # before the merge, then after
        summaries = sorted(store.node_summaries(), key=lambda r: r["node"])
        assert summaries == sorted(store.node_summaries(source="raw"), key=lambda r: r["node"])
        assert [(r["node"], r["rack"], r["gpus"], r["last_seen"], r["max_temp_c"]) for r in summaries] == [
            ("n0000", "r00", 2, T0 + 160.0, 73.3), ("n0001", "r01", 2, T0 + 1000.0, 82.5),
            ("n0002", "r00", 1, T0 + 5.0, 53.0)]
        gpus = store.node_gpu_latest("n0001")
        assert gpus == store.node_gpu_latest("n0001", source="raw")
        assert [(g["gpu"], g["last_ts"], g["temp_c"], g["power_w"], g["ecc_dbe_volatile"]) for g in gpus] == [
            (0, T0 + 1000.0, 81.5, 382.0, 1.0), (1, T0 + 1000.0, 82.5, 382.0, 1.0)]
        assert repr(store.node_gpu_latest("n0000")) == repr(store.node_gpu_latest("n0000", source="raw"))  # nan
        store.optimize_final("gpu_latest")
    assert store.table_rows("gpu_latest") == 5  # one row per GPU once merged
    assert store.node_gpu_latest("nowhere") == []
    with pytest.raises(ConfigError, match="source"):
        store.node_summaries(source="rollup")


def test_an_old_store_backfills_gpu_latest_and_rank_steps_keep_their_rows(tmp_path: Path, make_batches) -> None:
    old = tmp_path / "old_migrations"
    old.mkdir()
    for m in migration_files():
        if m.version < 9:
            (old / m.name).write_text(m.sql)
    batches = make_batches(steps=4, nodes=2)
    with open_store(f"chdb://{tmp_path}/store?raw_retention_days=21") as store:
        store.migrate(old)
        store.insert("gpu_samples", telemetry_columns(_samples() + [_one("n0001", T0 + 990.0, 40.0, rack="r01")]))
        store.insert_steps(batches)
        raw = store.node_summaries(source="raw")
        assert "gpu_latest" not in _tables(store)
        assert store.migrate() == ["009_gpu_latest.sql", "010_rank_steps_at_scale.sql",
                                   "011_detector_snapshots.sql", "012_job_node_hours.sql",
                                   "013_samples_quantised.sql", "014_job_steps.sql"]
        assert store.node_summaries() == raw and store.table_rows("gpu_latest") == 4
        back = store.steps("train-1")
        assert [(b.step, b.node) for b in back] == [(b.step, b.node) for b in batches]
        for got, sent in zip(back, batches, strict=True):
            assert got.compute_s.tolist() == sent.compute_s.tolist()  # Float64: exactly what was sent
            assert got.ranks.tolist() == sent.ranks.tolist() and got.ts == sent.ts
        assert "rank_steps_009" not in _tables(store)
        assert {t: raw_retention_days(store, t) for t in ("gpu_samples", "gpu_latest", "rank_steps")} == \
            {"gpu_samples": 21, "gpu_latest": 21, "rank_steps": 21}


def test_rank_steps_have_codecs_and_a_retention(store: Store) -> None:
    codecs = _codecs(store, "rank_steps")
    assert codecs["step"] == "CODEC(DoubleDelta, ZSTD(1))" and codecs["rank"] == "CODEC(Delta(4), ZSTD(1))"
    assert codecs["compute_s"] == "CODEC(ZSTD(6))" and codecs["ts"] == "CODEC(DoubleDelta, ZSTD(1))"
    ddl = _create(store, "rank_steps")
    assert "TTL received + toIntervalDay(14)" in ddl and "ttl_only_drop_parts = 1" in ddl
    assert "PARTITION BY toDate(ts)" in ddl and "`compute_s` Float64" in ddl
    assert "TTL received + toIntervalDay(14)" in _create(store, "gpu_latest")
    assert "ReplacingMergeTree(ts)" in _create(store, "gpu_latest")


def test_storage_accounting_sizes_another_column_type_and_small_parts_by_column(store: Store, make_batches) -> None:
    values = [1.0 + k / 1024 for k in range(4096)]
    as64, as32 = (store.column_bytes_as(t, values) for t in ("Float64", "Float32 CODEC(ZSTD(6))"))
    assert 0 < as32 < as64 and "what_if_column" not in _tables(store)
    with pytest.raises(ConfigError, match="column type"):
        store.column_bytes_as("Float32) ENGINE = Log; DROP TABLE rank_steps; --", values)
    store.wide_parts("rank_steps")
    store.insert_steps(make_batches())
    assert all(compressed > 0 for compressed, _ in store.column_bytes("rank_steps").values())
