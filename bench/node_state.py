"""Node-stage state over hours of event time: what each detector holds per node, and its snapshot.

A node-stage partition's :class:`~fleethealth.detectors.pipeline.Pipeline` is fed healthy 1 Hz
telemetry of ``--nodes`` nodes of 8 GPUs (``bench/node_throughput.py``'s fleet: every field
populated, counters that rise now and then) in event time, not wall time: ``--minutes`` at 1 Hz
(the diagnoser's, health rules' and node-state windows fill), then one sample a minute up to
``--hours`` (the failure predictor keeps one row a minute for its 6-hour window, whatever the
sampling), then ``--minutes`` at 1 Hz again (the windows full at the predictor's plateau). At each
checkpoint it prints one JSON line: the event time and each detector's explicit state
(:func:`~fleethealth.detectors.state.state_dict`: JSON tree bytes plus array bytes, and the array
count). At the end one JSON object: the same per node, the snapshot blob
(:meth:`~fleethealth.detectors.snapshot.Snapshots.dump`, zlib level 1) in bytes and its dump and
load CPU seconds, whether the restored pipeline gives the same findings on the next sample, this
process's peak RSS, and what follows for the caps: how many nodes one partition may hold before its
state passes ``detect.snapshot.max_bytes`` (the inflated body; default 128 MiB) and the bus's
largest snapshot record (compressed; 64 MiB), and the node stage's state for 100,000 GPUs (derived,
from the bytes per node measured here).

    python bench/node_state.py [--nodes 128] [--minutes 15] [--hours 6.1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node_throughput import GPUS_PER_NODE, T0, Fleet  # noqa: E402

from fleethealth.bus.snapshots import SNAPSHOT_MAX_BYTES  # noqa: E402
from fleethealth.detectors.pipeline import Pipeline  # noqa: E402
from fleethealth.detectors.snapshot import Snapshots  # noqa: E402
from fleethealth.detectors.state import state_dict  # noqa: E402

PARTS = ("diagnoser", "health", "predictor", "hang", "lifecycle", "assembler", "rack_episodes", "sdc")
FLEET_GPUS = 100_000


def _sizes(pipe: Pipeline) -> dict[str, dict[str, int]]:
    out = {}
    for name in PARTS:
        state = state_dict(getattr(pipe, name))
        tree = len(orjson.dumps(state.tree))
        data = sum(a.nbytes for a in state.arrays)
        out[name] = {"bytes": tree + data, "tree_bytes": tree, "array_bytes": data, "arrays": len(state.arrays)}
    return out


def _checkpoint(pipe: Pipeline, ts: float, cpu0: float) -> dict[str, object]:
    sizes = _sizes(pipe)
    return {"event_h": round((ts - T0) / 3600.0, 3), "cpu_s": round(time.process_time() - cpu0, 1),
            "mib": {k: round(v["bytes"] / 2**20, 2) for k, v in sizes.items()},
            "arrays": {k: v["arrays"] for k, v in sizes.items()}}


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--minutes", type=float, default=15.0, help="1 Hz at the start and again at the end")
    ap.add_argument("--hours", type=float, default=6.1, help="event time in all (the predictor's window is 6 h)")
    ap.add_argument("--every-min", type=float, default=30.0, help="minutes of event time between checkpoints")
    args = ap.parse_args(argv)
    if args.nodes < 1 or args.minutes <= 0 or args.hours * 60 < 2 * args.minutes:
        ap.error("--nodes >= 1, --minutes > 0 and --hours at least twice --minutes")

    fleet, pipe = Fleet(args.nodes), Pipeline()
    end = T0 + args.hours * 3600.0
    dense_until, dense_from = T0 + args.minutes * 60.0, end - args.minutes * 60.0
    cpu0 = time.process_time()
    ts, next_checkpoint = T0, T0 + args.every_min * 60.0
    while ts < end:
        pipe.feed(fleet.tick(ts))
        if ts >= next_checkpoint:
            print(json.dumps(_checkpoint(pipe, ts, cpu0)), flush=True)
            next_checkpoint += args.every_min * 60.0
        ts += 1.0 if ts < dense_until or ts >= dense_from else 60.0
    feed_cpu = time.process_time() - cpu0

    sizes = _sizes(pipe)
    snaps = Snapshots(key=os.urandom(32), max_bytes=1 << 40, max_manifest_bytes=1 << 40, max_array_bytes=1 << 40)
    offsets = {("fh.telemetry", 0): 1_000_000, ("fh.events", 0): 1_000}
    c0 = time.process_time()
    blob = snaps.dump(pipe, offsets)
    dump_cpu = time.process_time() - c0
    c0 = time.process_time()
    restored, _ = snaps.load(blob, like=Pipeline(), expect=Pipeline)
    load_cpu = time.process_time() - c0
    nxt = fleet.tick(ts)
    same = pipe.feed(nxt).findings == restored.feed(nxt).findings
    head = snaps.info(blob)
    inflated = head["manifest_bytes"] + head["data_bytes"]
    per_node = inflated / args.nodes
    out = {
        "nodes": args.nodes, "gpus": args.nodes * GPUS_PER_NODE, "event_hours": args.hours,
        "dense_minutes": args.minutes, "feed_cpu_s": round(feed_cpu, 1),
        "state_bytes_per_node": {k: round(v["bytes"] / args.nodes) for k, v in sizes.items()},
        "arrays_per_node": {k: round(v["arrays"] / args.nodes, 2) for k, v in sizes.items()},
        "snapshot": {"blob_bytes": len(blob), "manifest_bytes": head["manifest_bytes"],
                     "data_bytes": head["data_bytes"], "inflated_bytes_per_node": round(per_node),
                     "blob_bytes_per_node": round(len(blob) / args.nodes),
                     "dump_cpu_s": round(dump_cpu, 3), "load_cpu_s": round(load_cpu, 3),
                     "dump_us_per_node": round(1e6 * dump_cpu / args.nodes, 1),
                     "restored_gives_the_same_findings": same},
        "caps": {"nodes_per_partition_within_max_bytes": int(Snapshots().max_bytes // per_node),
                 "nodes_per_partition_within_bus_record": int(SNAPSHOT_MAX_BYTES // (len(blob) / args.nodes))},
        "derived_for_100k_gpus": {"inflated_state_gib": round(FLEET_GPUS / GPUS_PER_NODE * per_node / 2**30, 2),
                                  "snapshot_gib": round(FLEET_GPUS / GPUS_PER_NODE * len(blob) / args.nodes / 2**30,
                                                        2)},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
