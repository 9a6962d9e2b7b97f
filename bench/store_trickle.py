"""The node stage's store writes at a 1 Hz trickle, against the same rows written a minute at a time.

A node-stage replica holding ``--nodes`` nodes writes each poll's telemetry to its chDB store
(``gpu_samples`` and the materialized views behind it: the minute, rack-minute, hour and latest-sample
rollups). At 1 Hz a poll holds one sample a node. This writes ``--nodes`` nodes of 8 GPUs
(``bench/node_throughput.py``'s fleet) for ``--minutes`` of wall time in each of two phases, each on a
fresh store:

* **trickle** — one ``insert_telemetry`` a second (what a replica at 1 Hz does per poll);
* **batched** (the baseline) — the same samples, one insert a minute holding the minute's 60.

Each phase prints a JSON line a minute: this process's RSS (``VmRSS``), chDB's tracked memory
(``system.metrics`` ``MemoryTracking``), the active parts of ``gpu_samples`` and the CPU seconds so far
(``time.process_time()``: the Python side and chDB's threads, merges included). At the end one JSON
object: per phase the CPU per GPU sample after the first minute, the ratio trickle / batched, and the
spread of RSS and tracked memory after the first minute (their minimum and maximum: a merge takes
memory and gives it back, so two single minutes compared say little).

    python bench/store_trickle.py [--nodes 43] [--minutes 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node_throughput import GPUS_PER_NODE, Fleet  # noqa: E402

from fleethealth.store import Store, open_store, synthetic  # noqa: E402


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _tracked_mib(store: Store) -> float:
    """chDB's tracked memory (``system.metrics`` ``MemoryTracking``), MiB."""
    return round(store.engine_memory().get("tracked", float("nan")) / 2**20, 1)


def _phase(name: str, nodes: int, minutes: float, per_insert_s: int) -> dict[str, object]:
    """``minutes`` of 1 Hz samples, inserted ``per_insert_s`` seconds of them at a time, paced in wall time."""
    fleet = Fleet(nodes)
    series: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="fh-trickle-") as folder, open_store(f"chdb://{folder}") as store:
        store.migrate()
        t0 = time.time()
        cpu0 = time.process_time()
        second, waiting, inserts = 0, [], 0
        next_minute = t0 + 60.0
        cpu_after_first = samples_after_first = None
        while time.time() - t0 < minutes * 60.0:
            waiting += fleet.tick(t0 + second)
            second += 1
            if second % per_insert_s == 0:
                store.insert_telemetry(waiting, dedup_token=f"{name}-{second}")
                inserts += 1
                waiting = []
            if time.time() >= next_minute:
                cpu = time.process_time() - cpu0
                series.append({"minute": len(series) + 1, "rss_mib": round(_rss_mib(), 1),
                               "tracked_mib": _tracked_mib(store),
                               "gpu_samples_parts": synthetic.active_parts(store, "gpu_samples"),
                               "cpu_s": round(cpu, 2)})
                print(json.dumps({"phase": name, **series[-1]}), flush=True)
                if cpu_after_first is None:
                    cpu_after_first, samples_after_first = cpu, second * nodes * GPUS_PER_NODE
                next_minute += 60.0
            delay = t0 + second - time.time()
            if delay > 0:
                time.sleep(delay)
        cpu = time.process_time() - cpu0
    if cpu_after_first is None:
        raise SystemExit(f"{name}: --minutes must cover more than one minute")
    later = series[1:] or series
    gpu_samples = second * nodes * GPUS_PER_NODE - samples_after_first
    return {"inserts": inserts, "seconds_of_samples": second,
            "cpu_us_per_gpu_sample_after_first_minute": round(1e6 * (cpu - cpu_after_first) / max(gpu_samples, 1), 2),
            "rss_mib_after_first_minute": [min(s["rss_mib"] for s in later), max(s["rss_mib"] for s in later)],
            "tracked_mib_after_first_minute": [min(s["tracked_mib"] for s in later),
                                               max(s["tracked_mib"] for s in later)],
            "per_minute": series}


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--nodes", type=int, default=43, help="nodes of one replica (43: a third of 128)")
    ap.add_argument("--minutes", type=float, default=5.0, help="wall minutes of each phase (more than 1)")
    args = ap.parse_args(argv)
    if args.nodes < 1 or args.minutes <= 1:
        ap.error("--nodes >= 1 and --minutes > 1")
    trickle = _phase("trickle", args.nodes, args.minutes, 1)
    batched = _phase("batched", args.nodes, args.minutes, 60)
    out = {"nodes": args.nodes, "gpus": args.nodes * GPUS_PER_NODE, "minutes_each": args.minutes,
           "trickle": trickle, "batched": batched,
           "ratio_cpu_trickle_to_batched": round(trickle["cpu_us_per_gpu_sample_after_first_minute"]
                                                 / max(batched["cpu_us_per_gpu_sample_after_first_minute"], 1e-9), 1)}
    print(json.dumps({k: v for k, v in out.items() if k not in ("trickle", "batched")}
                     | {p: {k: v for k, v in out[p].items() if k != "per_minute"} for p in ("trickle", "batched")},
                     indent=1))
    return out


if __name__ == "__main__":
    main()
