"""gpu_samples at the sensors' resolution and the rollups cascaded from the minute one
(013_samples_quantised.sql) on real chDB: what a value reads back as, the hourly per-GPU and per-rack
per-minute rollups against an aggregate of the raw rows (late rows and a replayed insert included),
which table each named range query reads, and the per-step rollup goodput reads (014_job_steps.sql)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fleethealth.errors import ConfigError, StoreError
from fleethealth.schema import ClockReason, Telemetry
from fleethealth.store import Store
from fleethealth.store.columns import sample_columns, telemetry_columns

T0 = 1_767_225_600.0  # a whole hour


def _fleet(start: float, seconds: float, step: float, *, offset: float = 0.0, seed: int = 1) -> list[Telemetry]:
    """Four nodes of two GPUs in racks r00 / r01, a sample every ``step`` s from ``start + offset``;
    temperatures to 0.01 °C and power to the mW (more digits than stored), n0003 GPU 1 hottest."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(int(seconds // step)):
        ts = start + offset + k * step
        for n in range(4):
            base = 60.0 + 5.0 * n
            out.append(Telemetry.from_columns(
                f"n{n:04d}", f"r{n // 2:02d}", ts, [0, 1], nic_util=float(rng.uniform(0.2, 0.9)), model="H100",
                temp_c=np.round(base + np.array([0.0, 3.0]) + rng.normal(0.0, 1.0, 2), 2).tolist(),
                power_w=np.round(500.0 + rng.normal(0.0, 30.0, 2), 3).tolist(),
                sm_clock_mhz=[1980.0, 1755.0 if k % 7 == 0 else 1980.0], util_pct=[95.0, 90.0],
                clock_reasons=[0.0, float(ClockReason.SW_POWER_CAP) if k % 7 == 0 else 0.0],
                energy_mj=[1e9 + 512_345.0 * k, 2e9 + 498_765.0 * k]))
    return out


# ---------------------------------------------------------------- quantisation
def test_a_value_sent_with_more_digits_reads_back_at_the_sensor_resolution_and_counters_exactly(store: Store) -> None:
    big = 2.0**40 + 3.0  # a counter past Float32's 24 bits
    sent = Telemetry.from_columns(
        "n0000", "r00", T0 + 0.123, [0, 1, 2], nic_util=0.53217, model="H100", uuid=("a", "b", "c"),
        temp_c=[71.34, 71.36, math.nan], mem_temp_c=[80.04, 80.06, 79.0], power_w=[612.345, 612.35, 0.04],
        power_limit_w=[699.96, 700.0, 700.0], energy_mj=[123_456_789.0, 5e9 + 499.0, 5e9 + 500.0],
        tensor_active=[0.61234, 0.6125, 1.0], util_pct=[95.4, 3.0, 100.0], sm_clock_mhz=[1979.6, 1980.0, 1755.0],
        fb_used_mib=[1234.4, 1234.6, 0.0], ecc_sbe_volatile=[big, 0.0, 1.0], nvlink_crc_flit=[big + 1, 7.0, 0.0],
        clock_reasons=[float(ClockReason.HW_THERMAL | ClockReason.SW_POWER_CAP), 0.0, math.nan])
    store.insert_telemetry([sent])
    got = store.telemetry()[0].columns

    def back(field: str) -> list[float]:
        return got[field].tolist()

    assert back("power_w") == [612.3, 612.4, 0.0]  # 0.1 W (round half to even: 612.35 -> 612.4, 612.345 -> 612.3)
    assert back("power_limit_w") == [700.0, 700.0, 700.0]
    assert back("energy_mj") == [123_457_000.0, 5e9, 5e9]  # whole joules (5e9 + 500 mJ: half to even)
    assert back("tensor_active") == [0.612, 0.612, 1.0] and store.telemetry()[0].nic_util == 0.532  # 1e-3
    assert back("util_pct") == [95.0, 3.0, 100.0] and back("sm_clock_mhz") == [1980.0, 1980.0, 1755.0]
    assert back("temp_c")[:2] == [71.3, 71.4] and math.isnan(back("temp_c")[2])  # 0.1 °C; not reported stays NaN
    assert back("mem_temp_c") == [80.0, 80.1, 79.0] and back("fb_used_mib") == [1234.0, 1235.0, 0.0]
    assert back("ecc_sbe_volatile") == [big, 0.0, 1.0] and back("nvlink_crc_flit") == [big + 1, 7.0, 0.0]  # exact
    assert back("clock_reasons")[:2] == [float(ClockReason.HW_THERMAL | ClockReason.SW_POWER_CAP), 0.0]
    stored = store.query("SELECT power_dw, energy_j, tensor_active_pm, util_pct_i, temp_dc FROM gpu_samples "
                         "ORDER BY gpu").rows
    assert stored[2] == (0, 5_000_000, 1000, 100, -32768)  # scaled integers; -32768 = not reported


def test_a_value_that_does_not_fit_its_stored_column_is_refused_naming_it() -> None:
    cols = telemetry_columns([Telemetry.from_columns("n0000", "r00", T0, [0], power_w=[1e9])])
    with pytest.raises(StoreError, match=r"power_w = 1000000000.0 does not fit"):
        sample_columns(cols)
    cols["power_w"] = np.array([math.inf])
    assert sample_columns(cols)["power_dw"].tolist() == [2**32 - 1]  # not a number: not reported


# ---------------------------------------------------------------- the rollups against the raw rows
def _raw(store: Store, sql: str) -> list[tuple]:
    return sorted(store.query(sql).rows)


def test_the_cascaded_rollups_agree_with_the_raw_rows_with_late_rows_and_a_replayed_insert(store: Store) -> None:
    first, second = _fleet(T0, 3600.0, 30.0), _fleet(T0 + 3600.0, 3600.0, 30.0, seed=2)
    store.insert_telemetry(first, dedup_token="p-1")
    store.insert_telemetry(second, dedup_token="p-2")
    late = _fleet(T0, 3600.0, 60.0, offset=15.0, seed=3)  # the first hour's stragglers, after the second hour
    store.insert_telemetry(late, dedup_token="p-3")
    assert store.insert_telemetry(second, dedup_token="p-2") == len(second) * 2  # replayed: stored once
    raw_rows = store.query("SELECT count() FROM gpu_samples").rows[0][0]
    assert raw_rows == (len(first) + len(second) + len(late)) * 2  # no merge needed: the replay was dropped
    for _merged in (False, True):
        hourly = _raw(store, "SELECT node, gpu, hour, sum(samples), min(temp_c_min), max(temp_c_max), "
                             "round(avgMerge(power_w_avg), 3), quantilesBFloat16Merge(0.5, 0.9, 0.99)(temp_c_q), "
                             "groupBitOr(clock_reasons_or), max(energy_mj_max) FROM gpu_samples_1h GROUP BY ALL")
        assert hourly == _raw(
            store, "SELECT node, gpu, toStartOfHour(ts) AS h, count(), min(toFloat32(temp_c)), "
                   "max(toFloat32(temp_c)), round(avg(toFloat32(power_w)), 3), "
                   "quantilesBFloat16(0.5, 0.9, 0.99)(toFloat32(temp_c)), groupBitOr(toUInt64(clock_reasons)), "
                   "max(energy_mj) FROM gpu_samples GROUP BY ALL")
        assert len(hourly) == 16 and {r[3] for r in hourly} == {180, 120}  # 120 + 60 late, then 120
        racks = _raw(store, "SELECT rack, minute, sum(samples), max(temp_c_max), round(avgMerge(temp_c_avg), 3), "
                            "quantilesBFloat16Merge(0.5, 0.9, 0.99)(temp_c_q), groupBitOr(clock_reasons_or) "
                            "FROM gpu_samples_rack_1m GROUP BY ALL")
        assert racks == _raw(
            store, "SELECT rack, toStartOfMinute(ts) AS m, count(), max(toFloat32(temp_c)), "
                   "round(avg(toFloat32(temp_c)), 3), quantilesBFloat16(0.5, 0.9, 0.99)(toFloat32(temp_c)), "
                   "groupBitOr(toUInt64(clock_reasons)) FROM gpu_samples GROUP BY ALL")
        assert len(racks) == 2 * 120
        for table in ("gpu_samples_1m", "gpu_samples_1h", "gpu_samples_rack_1m"):
            store.optimize_final(table)  # then again, merged


# ---------------------------------------------------------------- which table each named query reads
def test_each_named_range_query_reads_the_coarsest_table_that_answers_with_the_raw_answer(store: Store) -> None:
    store.insert_telemetry(_fleet(T0, 3 * 3600.0, 30.0) + _fleet(T0, 3 * 3600.0, 60.0, offset=15.0, seed=5))
    day = (T0, T0 + 3 * 3600.0)  # long, whole hours
    assert {q: store.range_table(q, since=day[0], until=day[1]) for q in ("rack_temperature", "hot_gpus",
                                                                          "gpu_minutes")} == \
        {"rack_temperature": "gpu_samples_rack_1m", "hot_gpus": "gpu_samples_1h", "gpu_minutes": "gpu_samples_1m"}
    odd = (T0 + 1234.5, T0 + 1234.5 + 600.0)  # short and mid-minute: only the raw rows answer it
    assert {store.range_table(q, since=odd[0], until=odd[1]) for q in ("rack_temperature", "hot_gpus",
                                                                       "gpu_minutes")} == {"gpu_samples"}
    minutes = (T0 + 600.0, T0 + 1800.0)  # whole minutes, no whole hour: the minute rollups
    assert store.range_table("hot_gpus", since=minutes[0], until=minutes[1]) == "gpu_samples_1m"
    assert store.range_table("rack_temperature", since=minutes[0], until=minutes[1]) == "gpu_samples_rack_1m"
    edges = (T0 + 1800.0, T0 + 3 * 3600.0 - 600.0)  # whole hours inside, minutes at both ends
    assert store.range_table("hot_gpus", since=edges[0], until=edges[1]) == "gpu_samples_1h"
    for since, until in (day, minutes, edges):
        hot = store.hot_gpus(since=since, until=until, limit=8)
        assert hot == store.hot_gpus(since=since, until=until, limit=8, source="raw")  # same states merged
        assert hot[0]["node"] == "n0003" and hot[0]["gpu"] == 1
        racks = store.rack_temperature(since=since, until=until)
        raw = store.rack_temperature(since=since, until=until, source="raw")
        assert [(r, m, hi) for r, m, _, hi in racks] == [(r, m, hi) for r, m, _, hi in raw]
        assert np.allclose([mean for *_, mean, _ in racks], [mean for *_, mean, _ in raw], rtol=0, atol=1e-4)
        one = store.gpu_minutes("n0002", 0, since=since, until=until)
        assert one == store.gpu_minutes("n0002", 0, since=since, until=until, source="raw")
    # a range the rollups cannot answer exactly gives the raw rows' answer (a part of a minute)
    part = store.hot_gpus(since=odd[0], until=odd[1], limit=8)
    assert part == store.hot_gpus(since=odd[0], until=odd[1], limit=8, source="raw")
    assert sum(h["samples"] for h in part) == 8 * 30  # 600 s: 20 samples every 30 s and 10 of the late ones
    with pytest.raises(ConfigError, match="no named range query"):
        store.range_table("goodput", since=day[0], until=day[1])


# ---------------------------------------------------------------- goodput's step times (014)
def test_step_times_read_from_the_per_step_rollup_agree_with_the_rank_steps(store: Store, make_batches) -> None:
    batches = make_batches(steps=6, nodes=3)
    store.insert_steps([b for b in batches if b.node != "n0002"], dedup_token="s-1")
    store.insert_steps(make_batches(job="other", steps=2, nodes=1))
    store.insert_steps([b for b in batches if b.node == "n0002"], dedup_token="s-2")  # a node's rows, late
    store.insert_steps([b for b in batches if b.node == "n0002"], dedup_token="s-2")  # replayed: dropped
    rollup = store.job_step_times("train-1", limit=4)
    assert rollup == store.job_step_times("train-1", limit=4, source="raw")
    assert [int(r[0]) for r in rollup] == [2, 3, 4, 5]
    assert rollup[-1][1] == max(float(b.compute_s.max()) for b in batches if b.step == 5)
    assert store.query("SELECT sum(ranks) FROM job_steps WHERE job = 'train-1'").rows == [(6 * 3 * 8,)]
    assert store.query("SELECT count() FROM job_steps").rows[0][0] <= 2 * 6 + 2  # per step, not per rank
    with pytest.raises(ConfigError, match="source"):
        store.job_step_times("train-1", limit=1, source="auto")
