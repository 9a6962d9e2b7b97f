"""How long the rename-copy-drop migrations take per GB, on chDB: the figure behind deploy/README.md,
"Upgrading".

A store is migrated to 006 (the schema before the two rebuilds), then filled with generated rows:
``--samples`` GPU samples (gpu_samples, 43 columns, rebuilt by 007 with codecs and the 1-minute
rollup's materialized view) and ``--steps`` rank-steps (rank_steps, rebuilt by 010). ``fleethealth
migrate up`` then runs 007-011 and each step is timed through the migrator's hook. The baseline,
measured in the same run on the same engine, is the generation of the same rows (an INSERT ...
SELECT FROM numbers() into the old tables): the copy's seconds per GB against a plain write's.

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

from fleethealth.store import migration_files, open_store

_SAMPLES = ("INSERT INTO gpu_samples (node, rack, gpu, ts, model, uuid, nic_util, temp_c, mem_temp_c, power_w, "
            "power_limit_w, sm_clock_mhz, sm_clock_max_mhz, mem_clock_mhz, clock_reasons, util_pct, ecc_sbe_volatile, "
            "ecc_dbe_volatile, ecc_sbe_aggregate, ecc_dbe_aggregate, energy_mj, tensor_active) "
            "SELECT concat('n', toString(intDiv(number, 8) % {nodes})), concat('r', toString(intDiv(number, 8) % 32)), "
            "number % 8, toDateTime64(1767225600 + intDiv(number, 8 * {nodes}), 3, 'UTC'), 'H100', "
            "concat('GPU-', toString(number % (8 * {nodes}))), rand() / 4294967295, 40 + rand() % 400 / 10, "
            "50 + rand() % 300 / 10, 300 + rand() % 4000 / 10, 700, 1980 - rand() % 300, 1980, 2619, rand() % 4, "
            "rand() % 100, intDiv(number, 100000), 0, intDiv(number, 10000), 0, number * 700, rand() / 4294967295 "
            "FROM numbers({rows})")
_STEPS = ("INSERT INTO rank_steps (job, step, rank, node, gpu, ts, compute_s, rank_group) "
          "SELECT 'train-1', intDiv(number, 8192), number % 8192, concat('n', toString(intDiv(number % 8192, 8))), "
          "number % 8, toDateTime64(1767225600 + intDiv(number, 8192) / 2, 3, 'UTC'), 1.2 + rand() % 100000 / 1e6, "
          "-1 FROM numbers({rows})")


def _size(store, table: str) -> dict[str, int]:
    rows, disk, raw = store.query("SELECT sum(rows), sum(bytes_on_disk), sum(data_uncompressed_bytes) "
                                  "FROM system.parts WHERE active AND database = currentDatabase() "
                                  "AND table = {t:String}",
                                  {"t": table}).rows[0]
    return {"rows": int(rows or 0), "bytes_on_disk": int(disk or 0), "bytes_uncompressed": int(raw or 0)}


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
        store.command(_SAMPLES.format(rows=args.samples, nodes=args.nodes))
        samples_write_s = time.perf_counter() - t
        t = time.perf_counter()
        store.command(_STEPS.format(rows=args.steps))
        steps_write_s = time.perf_counter() - t
        store.command("OPTIMIZE TABLE gpu_samples FINAL")
        store.command("OPTIMIZE TABLE rank_steps FINAL")
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
