"""gpu_samples at fleet scale on chDB: bytes per sample, insert rate, and the named fleet-wide range
queries through the rollups and on raw samples (deploy/clickhouse/007_samples_at_scale.sql and
013_samples_quantised.sql).

Every field is populated, at the resolution real sources report (NVML / DCGM): whole °C
temperatures on a slow random walk, power to the mW around a per-GPU level with 25 W noise per
sample, whole-% utilisation, SM clocks that drop on 1 % of samples (with the power-cap reason),
ECC / NVLink / PCIe counters with rare increments, energy in mJ accumulated from the power,
tensor activity and NIC utilisation to 1e-3 / 1e-4 with noise, a 36-character UUID per GPU, and
per-node timestamps with 0-20 ms of jitter. Nodes hold 8 GPUs, racks 16 nodes. The data is made
columnar with NumPy and inserted in blocks through ``Store.insert_gpu_samples`` (the production
path: it quantises to the sensors' resolution, store/columns.py ``sample_columns``).

Three stores, one after the other in this process (chDB opens one data path at a time):

1. **baseline** — the schema of migrations 001-006 (every field Float64, no codec): one hour of
   the fleet at 1 Hz inserted as sent (``Store.insert``), ``OPTIMIZE ... FINAL``, bytes per
   sample from ``system.columns``;
2. **scaled** — all migrations: the same hour at 1 Hz (bytes per sample, same rows as the
   baseline), then ``--hours`` of the fleet every ``--interval`` s before it (the rollups' day);
   after ``OPTIMIZE ... FINAL`` the bytes of every table and the rollups' bytes per row;
3. the named range queries (``rack_temperature``, ``hot_gpus``, ``gpu_minutes`` of
   ``fleethealth/store/queries/report.py``) over the day and over the 1 Hz hour as ``auto`` picks
   their table (printed), over the 1 Hz hour and the day on raw samples for comparison; best of
   ``--repeat`` runs each;
4. the API's latest readers (``node_summaries``, ``node_gpu_latest``) through the latest-sample
   table ``gpu_latest`` (009) and, as the baseline, scanning every raw sample (``source="raw"``),
   with the answers compared;
5. ``rank_steps``: one job over every GPU (8 ranks a node), a step every ``--step-interval`` s for
   the hour, compute times to the µs around a per-rank level with 2 % noise, into the 001 table
   (baseline store) and the 010 table (codecs): bytes per rank-step after ``OPTIMIZE ... FINAL``,
   and what compute_s would take as Float32 (a what-if column, not the schema).

The default samples the day every 10 s (1,024 GPUs: 8.8 M rows; the 1 Hz day is 88 M rows, too
heavy for a shared 2-core machine); ``--interval 1`` runs the full rate. The rollups' rows are the
same at any interval of 60 s or less; raw bytes per sample are quoted at 1 Hz.

``--fleet16k`` runs only the query table at 16,384 GPUs (by default a day at 10 s and an hour at
1 Hz: 200 M rows, hours to insert on two shared cores; ``--hours 4 --interval 60 --hz-minutes 2``
gives the rollups the same rows per GPU-minute in minutes), the rows generated in SQL (``INSERT ...
SELECT FROM numbers()``, straight into the stored columns; the views fill the rollups as for any
insert, at most 8 minutes of the fleet an insert and 3 GB a query), parts left as the inserts and
the background merges leave them, and goodput's step times over a job of every GPU.

``--coarse`` sends the two ratios rounded to 1 % (a what-if below the sensors' resolution).

Prints one JSON object; targets: <= 8 bytes per sample with every field populated, < 1 s per
fleet-wide query, < 0.1 s for one GPU.

    nice -n 10 python bench/store_scale.py [--gpus 1024] [--hours 24] [--interval 10] [--repeat 3]
    nice -n 5 python bench/store_scale.py --fleet16k --hours 4 --interval 60 --hz-minutes 2 --step-interval 20
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fleethealth.schema import GPU_FIELDS
from fleethealth.store import Store, migration_files, open_store, synthetic

T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC
GPUS_PER_NODE = 8
NODES_PER_RACK = 16
BLOCK_ROWS = 1_000_000
TARGET_BYTES_PER_SAMPLE = 8.0
TARGET_QUERY_S = 1.0
TARGET_ONE_GPU_S = 0.1
ROLLUPS = ("gpu_samples_1m", "gpu_samples_1h", "gpu_samples_rack_1m")
_COUNTERS = {"ecc_sbe_volatile": 0.001, "nvlink_crc_flit": 0.01, "nvlink_crc_data": 0.001, "nvlink_replay": 0.002,
             "nvlink_recovery": 0.0001, "pcie_replay": 0.0005}


class Fleet:
    """Synthetic telemetry of ``gpus`` GPUs, columnar, one block of time steps after another (the
    random walks and counters carry on from block to block)."""

    def __init__(self, gpus: int, seed: int = 1, coarse: bool = False) -> None:
        self.rng = rng = np.random.default_rng(seed)
        self.coarse = coarse
        self.gpus = gpus
        g = np.arange(gpus)
        self.node_of = g // GPUS_PER_NODE
        n_nodes = int(self.node_of.max()) + 1
        self.nodes = np.array([f"n{i:05d}" for i in range(n_nodes)], dtype=object)
        self.racks = np.array([f"r{i // NODES_PER_RACK:03d}" for i in range(n_nodes)], dtype=object)
        self.uuids = np.array([f"GPU-{rng.integers(2**32):08x}-{rng.integers(2**16):04x}-{rng.integers(2**16):04x}-"
                               f"{rng.integers(2**16):04x}-{rng.integers(2**48):012x}" for _ in g], dtype=object)
        self.local = (g % GPUS_PER_NODE).astype(np.uint16)
        self.base_temp = rng.uniform(55.0, 75.0, gpus)
        self.base_power = rng.uniform(550.0, 680.0, gpus)
        self.walk = np.zeros(gpus)
        self.fb = np.full(gpus, 70_000.0)
        self.energy = rng.integers(10**9, 10**11, gpus).astype(np.float64)
        self.counters = {name: rng.integers(0, 100, gpus).astype(np.float64) for name in _COUNTERS}
        self.sbe_lifetime = rng.integers(0, 1000, gpus).astype(np.float64)
        self.remapped = rng.integers(0, 5, gpus).astype(np.float64)

    def blocks(self, start: float, seconds: float, interval: float) -> Iterator[dict[str, Any]]:
        """Blocks of ``gpu_samples`` columns over ``[start, start + seconds)``, about BLOCK_ROWS rows each."""
        steps = int(round(seconds / interval))
        per_block = max(1, BLOCK_ROWS // self.gpus)
        for first in range(0, steps, per_block):
            yield self._block(start + first * interval, min(per_block, steps - first), interval)

    def _block(self, start: float, n_t: int, dt: float) -> dict[str, Any]:
        rng, gpus = self.rng, self.gpus
        shape = (gpus, n_t)
        node_jitter = rng.integers(0, 20, size=(len(self.nodes), n_t)) / 1000.0
        ts = start + np.arange(n_t) * dt + node_jitter[self.node_of]
        steps = rng.normal(0.0, 0.05 * np.sqrt(dt), shape)
        walk = np.clip(self.walk[:, None] + np.cumsum(steps, axis=1), -8.0, 8.0)
        self.walk = walk[:, -1]
        temp = np.round(self.base_temp[:, None] + walk + rng.normal(0.0, 0.3, shape))
        power = np.round(self.base_power[:, None] + rng.normal(0.0, 25.0, shape), 3)
        capped = rng.random(shape) < 0.01
        cols: dict[str, Any] = {
            "node": np.repeat(self.nodes[self.node_of], n_t), "rack": np.repeat(self.racks[self.node_of], n_t),
            "gpu": np.repeat(self.local, n_t), "ts": ts.reshape(-1),
            "model": np.full(gpus * n_t, "NVIDIA H100 80GB HBM3", dtype=object),
            "uuid": np.repeat(self.uuids, n_t),
            "nic_util": np.round(np.clip(0.7 + rng.normal(0.0, 0.1, (len(self.nodes), n_t)), 0.0, 1.0),
                                 4)[self.node_of].reshape(-1),
        }
        fields: dict[str, np.ndarray] = {
            "temp_c": temp, "mem_temp_c": np.round(temp + 8.0 + rng.normal(0.0, 0.3, shape)), "power_w": power,
            "power_limit_w": np.full(shape, 700.0), "sm_clock_mhz": np.where(capped, 1755.0, 1980.0),
            "sm_clock_max_mhz": np.full(shape, 1980.0), "mem_clock_mhz": np.full(shape, 2619.0),
            "clock_reasons": np.where(capped, 4.0, 0.0),
            "util_pct": np.clip(95.0 + rng.normal(0.0, 3.0, shape), 0.0, 100.0).round(),
            "ecc_dbe_volatile": np.zeros(shape), "ecc_dbe_aggregate": np.zeros(shape),
            "retired_sbe": np.zeros(shape), "retired_dbe": np.zeros(shape), "retired_pending": np.zeros(shape),
            "remap_correctable": np.repeat(self.remapped[:, None], n_t, axis=1),
            "remap_uncorrectable": np.zeros(shape), "remap_pending": np.zeros(shape), "remap_failure": np.zeros(shape),
            "nvlink_links_up": np.full(shape, 18.0), "nvlink_links_max": np.full(shape, 18.0),
            "pcie_gen": np.full(shape, 5.0), "pcie_gen_max": np.full(shape, 5.0),
            "pcie_width": np.full(shape, 16.0), "pcie_width_max": np.full(shape, 16.0),
            "tensor_active": np.round(np.clip(0.6 + rng.normal(0.0, 0.05, shape), 0.0, 1.0), 3),
            "slowdown_temp_c": np.full(shape, 87.0),
        }
        for name, rate in _COUNTERS.items():
            series = self.counters[name][:, None] + np.cumsum(rng.poisson(rate * dt, shape), axis=1)
            self.counters[name] = series[:, -1]
            fields[name] = series
        fields["ecc_sbe_aggregate"] = fields["ecc_sbe_volatile"] + self.sbe_lifetime[:, None]
        fb = self.fb[:, None] + np.cumsum(rng.normal(0.0, 2.0, shape) * (rng.random(shape) < 0.05), axis=1).round()
        self.fb = fb[:, -1]
        fields["fb_used_mib"], fields["fb_free_mib"] = fb, 81_559.0 - fb
        energy = self.energy[:, None] + np.cumsum(np.round(power * 1000.0 * dt), axis=1)
        self.energy = energy[:, -1]
        fields["energy_mj"] = energy
        if self.coarse:  # what coarser ratios would save: 1 % (the store keeps 1e-3)
            fields["tensor_active"] = np.round(fields["tensor_active"], 2)
            cols["nic_util"] = np.round(cols["nic_util"], 2)
        assert set(fields) == set(GPU_FIELDS)
        cols.update({name: fields[name].reshape(-1) for name in GPU_FIELDS})
        return cols


def _insert(store: Store, blocks: Iterator[dict[str, Any]], raw: bool = False) -> tuple[int, float, float]:
    """Insert every block through ``insert_gpu_samples`` (quantised on the way), or as it is (``raw``:
    the 006 schema); ``(rows, insert seconds, generation seconds)``."""
    rows, spent, made = 0, 0.0, 0.0
    t = time.perf_counter()
    for block in blocks:
        t1 = time.perf_counter()
        made += t1 - t
        rows += store.insert("gpu_samples", block) if raw else store.insert_gpu_samples(block)
        t = time.perf_counter()
        spent += t - t1
    return rows, spent, made


def _bytes(store: Store, table: str) -> dict[str, int]:
    return {name: compressed for name, (compressed, _) in store.column_bytes(table).items()}


def _timed(fn: Any, repeat: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _queries(store: Store, since: float, until: float, source: str, repeat: int) -> dict[str, Any]:
    node, gpu = "n00003", 5
    rack_s, racks = _timed(lambda: store.rack_temperature(since=since, until=until, source=source), repeat)
    hot_s, hot = _timed(lambda: store.hot_gpus(since=since, until=until, limit=20, source=source), repeat)
    one_s, one = _timed(lambda: store.gpu_minutes(node, gpu, since=since, until=until, source=source), repeat)
    tables = {q: store.range_table(q, since=since, until=until, source=source)
              for q in ("rack_temperature", "hot_gpus", "gpu_minutes")}
    return {"source": source, "span_s": until - since, "tables": tables,
            "rack_temperature_per_minute_s": round(rack_s, 4), "rack_minutes": len(racks),
            "top_hot_gpus_by_p99_s": round(hot_s, 4), "hottest": {k: hot[0][k] for k in ("node", "gpu", "p99_temp_c")},
            "one_gpu_per_minute_s": round(one_s, 4), "one_gpu_minutes": len(one)}


def rank_steps(gpus: int, seconds: float, interval: float, seed: int = 3) -> dict[str, Any]:
    """``rank_steps`` columns of one job over ``gpus`` ranks, a step every ``interval`` s."""
    rng = np.random.default_rng(seed)
    steps = int(round(seconds / interval))
    rank = np.arange(gpus)
    node_of = rank // GPUS_PER_NODE
    n_nodes = int(node_of.max()) + 1
    base = rng.uniform(1.9, 2.1, gpus)
    end = T0 + np.arange(steps) * interval
    node_ts = end[:, None] + rng.integers(0, 20, size=(steps, n_nodes)) / 1000.0
    compute = np.round(base[None, :] * rng.lognormal(0.0, 0.02, (steps, gpus)), 6)
    return {"job": np.full(steps * gpus, "train-bench", dtype=object),
            "step": np.repeat(np.arange(steps, dtype=np.uint64), gpus),
            "rank": np.tile(rank.astype(np.uint32), steps),
            "node": np.tile(np.array([f"n{i:05d}" for i in range(n_nodes)], dtype=object)[node_of], steps),
            "gpu": np.tile((rank % GPUS_PER_NODE).astype(np.uint16), steps),
            "ts": node_ts[:, node_of].reshape(-1), "compute_s": compute.reshape(-1),
            "rank_group": np.full(steps * gpus, -1, dtype=np.int32)}


def _rank_step_bytes(store: Store, steps: dict[str, Any]) -> dict[str, Any]:
    # wide parts, as at fleet scale: a small part is compact and system.columns has no sizes for it
    store.wide_parts("rank_steps")
    rows = store.insert("rank_steps", steps)
    store.optimize_final("rank_steps")
    by_column = _bytes(store, "rank_steps")
    return {"rows": rows, "bytes_per_rank_step": round(sum(by_column.values()) / rows, 3),
            "bytes_per_rank_step_by_column": {k: round(v / rows, 3) for k, v in
                                              sorted(by_column.items(), key=lambda kv: -kv[1])}}


def _latest_readers(store: Store, node: str, repeat: int) -> dict[str, Any]:
    """The latest readers through ``gpu_latest`` and scanning the raw samples, answers compared."""
    out: dict[str, Any] = {"gpu_latest_rows": store.table_rows("gpu_latest"),
                           "gpu_samples_rows": store.table_rows("gpu_samples")}
    for name, fn in (("node_summaries", store.node_summaries),
                     ("node_gpu_latest", lambda source: store.node_gpu_latest(node, source=source))):
        latest_s, latest = _timed(lambda fn=fn: fn(source="latest"), repeat)
        raw_s, raw = _timed(lambda fn=fn: fn(source="raw"), repeat)
        key = (lambda r: r.get("node", r.get("gpu")))  # noqa: E731
        out[name] = {"latest_s": round(latest_s, 4), "raw_s": round(raw_s, 4),
                     "speedup": round(raw_s / max(latest_s, 1e-9), 1),
                     "same_answer": repr(sorted(latest, key=key)) == repr(sorted(raw, key=key)), "rows": len(latest)}
    return out


def run(gpus: int, hours: float, interval: float, repeat: int, workdir: Path,
        coarse: bool = False, step_interval: float = 2.0) -> dict[str, Any]:
    hour = (T0 + hours * 3600.0, T0 + hours * 3600.0 + 3600.0)  # the 1 Hz hour, after the day
    # 1. baseline: migrations 001-006 only
    old = workdir / "migrations_006"
    old.mkdir()
    for migration in migration_files():
        if migration.version < 7:
            (old / migration.name).write_text(migration.sql)
    with open_store(f"chdb://{workdir}/baseline") as store:
        store.migrate(old)
        rows, spent, _ = _insert(store, Fleet(gpus, coarse=coarse).blocks(hour[0], 3600.0, 1.0), raw=True)
        store.optimize_final("gpu_samples")
        base = _bytes(store, "gpu_samples")
        steps_001 = _rank_step_bytes(store, rank_steps(gpus, 3600.0, step_interval))
    baseline = {"rows": rows, "insert_rows_per_s": round(rows / spent), "bytes_per_sample": sum(base.values()) / rows}

    # 2. every migration: the same hour at 1 Hz, then the day at the interval
    with open_store(f"chdb://{workdir}/scaled") as store:
        store.migrate()
        rows_hour, spent_hour, _ = _insert(store, Fleet(gpus, coarse=coarse).blocks(hour[0], 3600.0, 1.0))
        store.optimize_final("gpu_samples")
        hour_bytes = _bytes(store, "gpu_samples")
        rollup_hour_rows = store.table_rows("gpu_samples_1m")
        day = Fleet(gpus, seed=2, coarse=coarse).blocks(T0, hours * 3600.0, interval)
        rows_day, spent_day, made_day = _insert(store, day)
        t = time.perf_counter()
        for table in ("gpu_samples", *ROLLUPS):
            store.optimize_final(table)
        optimize_s = time.perf_counter() - t
        day_bytes = sum(_bytes(store, "gpu_samples").values()) - sum(hour_bytes.values())
        rollup_bytes = sum(_bytes(store, "gpu_samples_1m").values())
        rollup_rows = store.table_rows("gpu_samples_1m")
        rollups = {table: {"rows": store.table_rows(table),
                           "bytes_per_row": round(sum(_bytes(store, table).values())
                                                  / max(store.table_rows(table), 1), 1)} for table in ROLLUPS}
        per_sample = sum(hour_bytes.values()) / rows_hour
        scaled = {
            "rows_1hz_hour": rows_hour, "bytes_per_sample": round(per_sample, 3),
            "bytes_per_sample_by_column": {k: round(v / rows_hour, 3) for k, v in
                                           sorted(hour_bytes.items(), key=lambda kv: -kv[1]) if v / rows_hour >= 0.05},
            "insert_rows_per_s_1hz": round(rows_hour / spent_hour),
            "rows_day": rows_day, "insert_rows_per_s_day": round(rows_day / spent_day),
            "generate_s_day": round(made_day, 1), "optimize_final_s": round(optimize_s, 1),
            "bytes_per_sample_day_interval": round(day_bytes / rows_day, 3),
            "rollup_rows": rollup_rows, "rollup_bytes_per_gpu_minute": round(rollup_bytes / rollup_rows, 1),
            "rollup_rows_per_gpu_minute_before_merge_hour": round(rollup_hour_rows / (gpus * 60), 2),
            "rollups": rollups,
        }
        queries = {
            "auto_day": _queries(store, T0, T0 + hours * 3600.0, "auto", repeat),
            "auto_1hz_hour": _queries(store, hour[0], hour[1], "auto", repeat),
            "raw_1hz_hour": _queries(store, hour[0], hour[1], "raw", repeat),
            "raw_day": _queries(store, T0, T0 + hours * 3600.0, "raw", 1),
        }
        # the API's latest readers: through gpu_latest (not merged by hand) and scanning every raw row
        latest_readers = _latest_readers(store, "n00003", repeat)
        steps = rank_steps(gpus, 3600.0, step_interval)
        steps_010 = _rank_step_bytes(store, steps)
        f32_bytes = store.column_bytes_as("Float32 CODEC(ZSTD(6))", steps["compute_s"].astype(np.float32)) \
            / len(steps["compute_s"])  # in the table's (job, step, rank) order, as generated
        f32_err = np.abs(steps["compute_s"].astype(np.float32).astype(np.float64) - steps["compute_s"])
        steps_010["what_if_compute_s_float32"] = {
            "bytes_per_rank_step": round(f32_bytes, 3),
            "max_abs_error_us": round(float(f32_err.max()) * 1e6, 3),
            "note": "Float32 keeps 24 bits: half an ulp is 0.12 us at 1-2 s, 0.48 us at 8-16 s, 0.95 us at 16-32 s"}
    slowest = max(v for q in ("auto_day", "auto_1hz_hour") for k, v in queries[q].items() if k.endswith("_s")
                  and k != "span_s")
    return {
        "bench": "store_scale",
        "conditions": {"gpus": gpus, "hours": hours, "interval_s": interval, "raw_hour_interval_s": 1.0,
                       "repeat": repeat, "gpus_per_node": GPUS_PER_NODE, "nodes_per_rack": NODES_PER_RACK,
                       "block_rows": BLOCK_ROWS, "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                       "python": platform.python_version(), "engine": "chDB (embedded ClickHouse)",
                       "fields_populated": len(GPU_FIELDS) + 1,
                       "resolution": "sent: ratios to 1 %" if coarse else
                       "sent: sources' (power mW, energy mJ, tensor activity 1e-3, NIC utilisation 1e-4); "
                       "stored: sensors' (power 0.1 W, energy J, ratios 1e-3, utilisation whole %, 0.1 °C)"},
        "baseline_006": {k: round(v, 3) if isinstance(v, float) else v for k, v in baseline.items()},
        "scaled_013": scaled,
        "queries": queries,
        "latest_readers": latest_readers,
        "rank_steps": {"conditions": {"ranks": gpus, "seconds": 3600.0, "step_interval_s": step_interval,
                                      "compute_s_resolution_s": 1e-6},
                       "baseline_001": steps_001, "scaled_010": steps_010,
                       "bytes_ratio": round(steps_010["bytes_per_rank_step"] / steps_001["bytes_per_rank_step"], 3)},
        "ratios": {"bytes_per_sample_vs_baseline": round(per_sample / baseline["bytes_per_sample"], 3),
                   "insert_rate_vs_baseline": round(scaled["insert_rows_per_s_1hz"] / baseline["insert_rows_per_s"], 3),
                   "auto_day_vs_raw_day_rack_query": round(queries["auto_day"]["rack_temperature_per_minute_s"]
                                                             / max(queries["raw_day"]["rack_temperature_per_minute_s"],
                                                                   1e-9), 4)},
        "targets": {"bytes_per_sample_max": TARGET_BYTES_PER_SAMPLE,
                    "bytes_per_sample_met": per_sample <= TARGET_BYTES_PER_SAMPLE,
                    "query_s_max": TARGET_QUERY_S, "slowest_query_s": slowest, "queries_met": slowest < TARGET_QUERY_S},
    }


# ---------------------------------------------------------------- --fleet16k: the query table at 16,384 GPUs
def _goodput(store: Store, ranks: int, start: float, seconds: float, interval: float, chunk_rows: int,
             repeat: int) -> dict[str, Any]:
    """One job over ``ranks`` ranks, a step every ``interval`` s for ``seconds``, generated in SQL into
    ``rank_steps`` (the view fills ``job_steps``); goodput's step times (``job_step_times``, the API's
    10,000 latest steps) from the per-step rollup and scanning the rank-steps, answers compared."""
    steps = int(round(seconds / interval))
    per = max(1, chunk_rows // ranks)
    t = time.perf_counter()
    for first in range(0, steps, per):
        n = min(per, steps - first)
        synthetic.rank_steps(store, "train-16k", ranks, first, n, start, interval, GPUS_PER_NODE)
    insert_s = time.perf_counter() - t
    rollup_s, rollup = _timed(lambda: store.job_step_times("train-16k", limit=10_000), repeat)
    raw_s, raw = _timed(lambda: store.job_step_times("train-16k", limit=10_000, source="raw"), 1)
    return {"ranks": ranks, "steps": steps, "rank_steps": steps * ranks, "insert_s": round(insert_s, 1),
            "job_steps_rows": store.table_rows("job_steps"), "job_step_times_rollup_s": round(rollup_s, 4),
            "job_step_times_raw_s": round(raw_s, 4), "same_answer": rollup == raw, "steps_read": len(rollup)}


def fleet16k(gpus: int, hours: float, interval: float, repeat: int, workdir: Path,
             chunk_rows: int = 1_000_000, step_interval: float = 2.0, hz_minutes: float = 60.0) -> dict[str, Any]:
    """``gpus`` GPUs: ``hours`` at ``interval`` s, then an hour at 1 Hz, generated in SQL into the
    schema of every migration; each named fleet-wide query over the day and the hour (the table each
    one chose), forced raw over the hour for comparison, one GPU's minutes over the day."""
    day = (T0, T0 + hours * 3600.0)
    hour = (day[1], day[1] + hz_minutes * 60.0)
    with open_store(f"chdb://{workdir}/fleet16k") as store:
        store.migrate()
        rows_day, day_s = synthetic.gpu_samples(store, gpus, day[0], hours * 3600.0, interval, chunk_rows,
                                                GPUS_PER_NODE, NODES_PER_RACK)
        rows_hour, hour_s = synthetic.gpu_samples(store, gpus, hour[0], hz_minutes * 60.0, 1.0, chunk_rows,
                                                  GPUS_PER_NODE, NODES_PER_RACK)
        tables = {t: {"rows": store.table_rows(t),
                      "parts": synthetic.active_parts(store, t)}
                  for t in ("gpu_samples", *ROLLUPS)}
        queries = {
            "auto_day": _queries(store, *day, "auto", repeat),
            "auto_1hz_hour": _queries(store, *hour, "auto", repeat),
            "auto_1hz_mid_minute": _queries(store, hour[0] + 30.0, hour[1] - 30.0, "auto", 1),
            "raw_1hz_hour": _queries(store, *hour, "raw", 1),
        }
        goodput = _goodput(store, gpus, hour[0], hz_minutes * 60.0, step_interval, chunk_rows, repeat)
    fleet = [v for q in ("auto_day", "auto_1hz_hour") for k, v in queries[q].items()
             if k in ("rack_temperature_per_minute_s", "top_hot_gpus_by_p99_s")] + [goodput["job_step_times_rollup_s"]]
    one = [queries[q]["one_gpu_per_minute_s"] for q in ("auto_day", "auto_1hz_hour")]
    return {
        "bench": "store_scale --fleet16k",
        "conditions": {"gpus": gpus, "hours": hours, "interval_s": interval, "raw_1hz_minutes": hz_minutes,
                       "repeat": repeat, "gpus_per_node": GPUS_PER_NODE, "nodes_per_rack": NODES_PER_RACK,
                       "generated": "in SQL (INSERT ... SELECT FROM numbers()), stored columns of 013, "
                                    f"{chunk_rows:,} rows an insert; no OPTIMIZE (parts as the inserts and "
                                    "background merges left them)",
                       "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                       "python": platform.python_version(), "engine": "chDB (embedded ClickHouse)"},
        "insert": {"rows_day": rows_day, "rows_hour": rows_hour, "insert_s_day": round(day_s, 1),
                   "insert_s_hour": round(hour_s, 1),
                   "rows_per_s": round((rows_day + rows_hour) / max(day_s + hour_s, 1e-9))},
        "tables": tables,
        "queries": queries,
        "goodput_step_times": goodput,
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "targets": {"fleet_query_s_max": TARGET_QUERY_S, "slowest_fleet_query_s": max(fleet),
                    "fleet_queries_met": max(fleet) < TARGET_QUERY_S, "one_gpu_s_max": TARGET_ONE_GPU_S,
                    "slowest_one_gpu_s": max(one), "one_gpu_met": max(one) < TARGET_ONE_GPU_S},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=None, help="default 1,024 (16,384 with --fleet16k)")
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples over the day")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--step-interval", type=float, default=2.0, help="seconds between the rank-steps' steps")
    parser.add_argument("--coarse", action="store_true",
                        help="what-if: tensor activity and NIC utilisation sent to 1 %%")
    parser.add_argument("--hz-minutes", type=float, default=60.0, help="--fleet16k: minutes at 1 Hz after the day")
    parser.add_argument("--fleet16k", action="store_true",
                        help="the query table only, at 16,384 GPUs, rows generated in SQL (tens of minutes)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fh-store-scale-") as tmp:
        if args.fleet16k:
            out = fleet16k(args.gpus or 16_384, args.hours, args.interval, args.repeat, Path(tmp),
                           step_interval=args.step_interval, hz_minutes=args.hz_minutes)
        else:
            out = run(args.gpus or 1024, args.hours, args.interval, args.repeat, Path(tmp), args.coarse,
                      args.step_interval)
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
