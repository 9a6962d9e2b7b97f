"""The node stage at a 1 Hz trickle: writing the samples every poll against holding them for one insert.

A node-stage replica of a live fleet reads one telemetry message per node a second, so each poll is one
second of its nodes. This bench runs the production node stage
(:class:`fleethealth.detectors.runner.Runner`, ``stage="node"``: decode, node states, health rules,
predictor, node states published, ``gpu_samples`` stored with its rollups, offsets committed) on that
shape without waiting for the wall clock: ``--seconds`` seconds of ``--nodes`` nodes (8 GPUs and one
InfiniBand port each, :class:`node_throughput.Fleet`) are published first, the runner polls at most one
second's messages (``max_records = nodes``) and its clock (``Runner.clock``, which decides when held
rows are due) moves one second a poll. Each arm of ``--every`` is one ``store_every_s``: 0 writes every
poll (the runner's default), 60 holds a minute of samples for one insert per table. Arms alternate,
each on a fresh broker and chDB store, ``--repeat`` times; the best run of each counts.

Rates are GPU samples per CPU second of this process (main thread, kafka-python's and chDB's threads;
the broker is another process), over the timed polls and the final drain (which writes what is held).
``ratio`` is the CPU per GPU sample of the first arm over each other arm.

    python bench/node_trickle.py [--nodes 43] [--seconds 180] [--every 0 60] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time

from node_throughput import GPUS_PER_NODE, T0, Fleet, Rate, _publish, _stored
from prometheus_client import CollectorRegistry

from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import ensure_topics
from fleethealth.detectors.runner import Runner, tune_gc
from fleethealth.store import open_store


def _run(every_s: float, nodes: int, seconds: int, seed: int) -> dict[str, object]:
    fleet = Fleet(nodes, seed=seed)
    with tempfile.TemporaryDirectory(prefix="fh-trickle-") as tmp, EmbeddedBroker() as broker, \
            open_store(f"chdb://{tmp}/store") as store:
        store.migrate()
        ensure_topics(broker.dsn, partitions=4)
        inserts = 0
        real = store.insert_telemetry

        def counted(samples, **kw):  # type: ignore[no-untyped-def]
            nonlocal inserts
            inserts += 1
            return real(samples, **kw)

        store.insert_telemetry = counted  # type: ignore[method-assign]
        with Runner(broker.dsn, store, group=f"trickle-{every_s}", registry=CollectorRegistry(), stage="node",
                    max_records=nodes, store_every_s=every_s) as runner:
            clock = [0.0]
            runner.clock = lambda: clock[0]
            runner.consumer.wait_assigned(60.0)
            warm = _publish(broker.dsn, [fleet.tick(T0)])
            taken = 0
            while taken < warm:
                taken += runner.process_once(1.0)
            runner.drain()
            first = T0 + 1.0
            messages = _publish(broker.dsn, [fleet.tick(first + k) for k in range(seconds)])
            inserts, polls = 0, 0
            cpu0, wall0 = time.process_time(), time.perf_counter()
            taken = 0
            while taken < messages:
                got = runner.process_once(1.0)
                taken += got
                polls += got > 0
                clock[0] += 1.0
            runner.drain()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        gpus = messages * GPUS_PER_NODE
        stored = _stored(store, first)
        if stored < gpus:
            raise RuntimeError(f"store_every_s={every_s}: stored {stored} of {gpus} GPU samples")
    return {"store_every_s": every_s, **Rate(samples=gpus, messages=messages, cpu_s=cpu, wall_s=wall).to_obj(),
            "polls": polls, "telemetry_inserts": inserts}


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=43, help="nodes of the replica (8 GPUs each)")
    parser.add_argument("--seconds", type=int, default=180, help="seconds of 1 Hz telemetry timed")
    parser.add_argument("--every", type=float, nargs="+", default=[0.0, 60.0], help="store_every_s of each arm")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of the arms, alternating")
    args = parser.parse_args(argv)
    tune_gc()
    load0 = os.getloadavg()
    runs: dict[float, list[dict[str, object]]] = {e: [] for e in args.every}
    for rep in range(args.repeat):
        for every in args.every:
            runs[every].append(_run(every, args.nodes, args.seconds, seed=2026 + rep))
    best = {e: min(rs, key=lambda r: float(r["us_per_sample"])) for e, rs in runs.items()}  # type: ignore[arg-type]
    first = args.every[0]
    result = {
        "bench": "node stage at a 1 Hz trickle: one second of the replica's nodes a poll",
        "nodes": args.nodes, "gpus": args.nodes * GPUS_PER_NODE, "seconds": args.seconds,
        "best": {str(e): r for e, r in best.items()},
        "runs": {str(e): rs for e, rs in runs.items()},
        "ratio_cpu_per_sample": {str(e): round(float(best[first]["us_per_sample"])  # type: ignore[arg-type]
                                               / float(r["us_per_sample"]), 2)  # type: ignore[arg-type]
                                 for e, r in best.items() if e != first},
        "conditions": {"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load0],
                       "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                       "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)},
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
