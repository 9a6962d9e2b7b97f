"""How long the rename-copy-drop migrations take per GB, on chDB: the figure behind deploy/README.md,
"Upgrading".

A store is migrated to 006 (the schema before the two rebuilds), then filled with generated rows:
``--samples`` GPU samples (gpu_samples, 43 columns, rebuilt by 007 with codecs and the 1-minute
rollup's materialized view) and ``--steps`` rank-steps (rank_steps, rebuilt by 010). ``fleethealth
migrate up`` then runs 007-011 and each step is timed through the migrator's hook. The baseline,
measured in the same run on the same engine, is the write of the same rows into the old tables
(NumPy columns, 500,000 rows an insert): the copy's seconds against a plain write's.

Prints one JSON object: rows, bytes on disk and uncompressed of each copied table, the copy
step's seconds, GB/s and s/GB (on disk and uncompressed), and the whole migration's seconds.

    python bench/migrate_copy.py --samples 2000000 --steps 10000000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from fleethealth.store import migration_files, open_store
from fleethealth.store.columns import Codes
from fleethealth.store.migrator import table_size

CHUNK = 500_000


def _samples(store, rows: int, nodes: int) -> None:
    """``rows`` GPU samples of ``nodes`` nodes x 8 GPUs at 1 Hz, in the 001-006 schema, in chunks."""
    rng = np.random.default_rng(7)
    names = [f"n{i:05d}" for i in range(nodes)]
    racks = [f"r{i:03d}" for i in range(32)]
    for lo in range(0, rows, CHUNK):
        i = np.arange(lo, min(rows, lo + CHUNK))
        node = (i // 8) % nodes
        n = len(i)
        store.insert("gpu_samples", {
            "node": Codes(names, node.astype(np.int32)), "rack": Codes(racks, (node % 32).astype(np.int32)),
            "gpu": (i % 8).astype(np.uint16), "ts": 1_767_225_600.0 + (i // (8 * nodes)).astype(np.float64),
            "model": Codes(["H100"], np.zeros(n, dtype=np.int32)), "nic_util": rng.random(n),
            "temp_c": 40 + rng.integers(0, 400, n) / 10, "mem_temp_c": 50 + rng.integers(0, 300, n) / 10,
            "power_w": 300 + rng.integers(0, 4000, n) / 10, "power_limit_w": np.full(n, 700.0),
            "sm_clock_mhz": 1980.0 - rng.integers(0, 300, n), "sm_clock_max_mhz": np.full(n, 1980.0),
            "mem_clock_mhz": np.full(n, 2619.0), "clock_reasons": rng.integers(0, 4, n).astype(np.float64),
            "util_pct": rng.integers(0, 100, n).astype(np.float64), "ecc_sbe_volatile": (i // 100_000) * 1.0,
            "ecc_dbe_volatile": np.zeros(n), "ecc_sbe_aggregate": (i // 10_000) * 1.0,
            "ecc_dbe_aggregate": np.zeros(n), "energy_mj": i * 700.0, "tensor_active": rng.random(n)})


def _steps(store, rows: int) -> None:
    """``rows`` rank-steps of one 8,192-rank job at 2 steps/s, in the 001-009 schema, in chunks."""
    rng = np.random.default_rng(8)
    names = [f"n{i:05d}" for i in range(1024)]
    for lo in range(0, rows, CHUNK):
        i = np.arange(lo, min(rows, lo + CHUNK))
        rank = i % 8192
        n = len(i)
        store.insert("rank_steps", {
            "job": Codes(["train-1"], np.zeros(n, dtype=np.int32)), "step": (i // 8192).astype(np.uint64),
            "rank": rank.astype(np.uint32), "node": Codes(names, (rank // 8).astype(np.int32)),
            "gpu": (rank % 8).astype(np.uint16), "ts": 1_767_225_600.0 + (i // 8192) / 2.0,
            "compute_s": 1.2 + rng.integers(0, 100_000, n) / 1e6, "rank_group": np.full(n, -1, dtype=np.int32)})


def _size(store, table: str) -> dict[str, int]:
    rows, disk, raw = table_size(store, table)
    return {"rows": rows, "bytes_on_disk": disk, "bytes_uncompressed": raw}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2_000_000)
    ap.add_argument("--steps", type=int, default=10_000_000)
    ap.add_argument("--nodes", type=int, default=128)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fh-migrate-copy-"))
    old = work / "migrations_006"
    old.mkdir()
    for m in migration_files():
        if m.version < 7:
            (old / m.name).write_text(m.sql)
    with open_store(f"chdb://{work}/store") as store:
        store.migrate(old)
        t = time.perf_counter()
        _samples(store, args.samples, args.nodes)
        samples_write_s = time.perf_counter() - t
        t = time.perf_counter()
        _steps(store, args.steps)
        steps_write_s = time.perf_counter() - t
        store.optimize_final("gpu_samples")
        store.optimize_final("rank_steps")
        before = {"gpu_samples": _size(store, "gpu_samples"), "rank_steps": _size(store, "rank_steps")}
        began: dict[tuple[str, int], float] = {}
        took: dict[tuple[str, int], float] = {}

        def hook(point: str, migration: str, step: int) -> None:
            if point == "begun":
                began[(migration, step)] = time.perf_counter()
            elif point == "ran":
                took[(migration, step)] = time.perf_counter() - began[(migration, step)]

        t = time.perf_counter()
        applied = store.migrate(hook=hook)
        total_s = time.perf_counter() - t
        after = {"gpu_samples": _size(store, "gpu_samples"), "rank_steps": _size(store, "rank_steps")}
    copies = {"gpu_samples": ("007_samples_at_scale.sql", samples_write_s),
              "rank_steps": ("010_rank_steps_at_scale.sql", steps_write_s)}
    conditions = {"engine": "chDB (embedded ClickHouse), one process", "cpus": os.cpu_count(),
                  "platform": platform.platform(), "load_1m": os.getloadavg()[0], "data": str(work)}
    out: dict[str, object] = {"conditions": conditions,
                              "applied": applied, "migrate_s": round(total_s, 2), "tables": {}}
    for table, (migration, write_s) in copies.items():
        copy_s = max(s for (m, _), s in took.items() if m == migration)  # the copy is the migration's longest step
        disk_gb = before[table]["bytes_on_disk"] / 1e9
        raw_gb = before[table]["bytes_uncompressed"] / 1e9
        out["tables"][table] = {  # type: ignore[index]
            "migration": migration, "before": before[table], "after": after[table],
            "copy_s": round(copy_s, 2), "s_per_gb_on_disk": round(copy_s / disk_gb, 1),
            "s_per_gb_uncompressed": round(copy_s / raw_gb, 1), "baseline_write_s": round(write_s, 2),
            "copy_vs_baseline_write": round(copy_s / write_s, 2),
            "steps_s": {str(s + 1): round(v, 3) for (m, s), v in sorted(took.items()) if m == migration}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
