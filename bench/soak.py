"""Soak: a steady stream through the real detector for minutes, printing its memory each minute.

One embedded Tansu broker, one chDB store in a temporary directory and one
:class:`fleethealth.detectors.runner.Runner` in this process; a publisher thread sends a steady
``--rate`` messages per wall second: per step, a telemetry sample and a step batch from each of
``--nodes`` nodes of one job. Event time moves ``--step-s`` per step, faster than the wall clock, so
a run covers hours of event time. Every ``--job-steps`` steps the job ends and a new one starts on
new node names (a fleet whose jobs and nodes come and go, or a producer forging names), so state
that is never dropped shows as growth; the runner's pipeline forgets idle jobs and nodes after
``--idle-s`` of event time.

Each minute it prints one JSON line: minute, resident set size (``/proc/self/statm``, MiB), records
processed, the distinct job and node names the pipeline holds, the Python objects alive and the full
(generation 2) collections so far, and the embedded engine's memory (``engine``: its own tracker,
each cache, jemalloc's allocated and resident bytes, active parts), to tell growth of this process's
own state from the store's. At the end one JSON object: the RSS series, the slope after
``--warmup-min`` minutes (least squares, MiB per minute, and the change over the measured span as a
share of the mean RSS — target: within 5 %), the plateau (median RSS after the warm-up) with the
lowest and highest sample after it, and whether the runner kept up (records published vs processed).

    python bench/soak.py [--minutes 10] [--rate 300] [--nodes 16] [--job-steps 400] [--idle-s 300]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import Producer, ensure_topics
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.runner import Runner, tune_gc
from fleethealth.schema import StepBatch, Telemetry
from fleethealth.store import Store, open_store

T0 = 1_767_225_600.0
GPUS = 4
TARGET_SHARE = 0.05


def rss_mib() -> float:
    """Resident set size of this process (broker excluded: it is a child process), MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_memory() -> dict[str, float]:
    """The C heap (glibc malloc: NumPy, the Kafka client's buffers, Python's large objects), MiB: in use
    and free but kept; and the small-object blocks Python's own allocator holds."""
    out = {"py_blocks": sys.getallocatedblocks()}
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return out
    out.update(c_in_use=round((info.uordblks + info.hblkhd) / 2**20, 1), c_free=round(info.fordblks / 2**20, 1))
    return out


def engine_memory(store: Store) -> dict[str, float]:
    """What the embedded engine holds (MiB; active parts a count): ``store.engine_memory()``."""
    return {k: (int(v) if k == "active_parts" else round(v / 2**20, 1)) for k, v in store.engine_memory().items()}


def slope(minutes: list[float], values: list[float]) -> float:
    """Least-squares slope of ``values`` over ``minutes`` (per minute); 0 with fewer than two points."""
    if len(values) < 2:
        return 0.0
    return float(np.polyfit(np.asarray(minutes), np.asarray(values), 1)[0])


def publish(dsn: str, rate: float, nodes: int, job_steps: int, step_s: float, stop: threading.Event,
            sent: list[int]) -> None:
    """Publish ``rate`` messages per second until ``stop``: per step a sample and a batch per node."""
    rng = np.random.default_rng(1)
    per_step = 2 * nodes
    step_wall = per_step / rate
    with Producer(dsn, client_id="soak", event_time_stamps=True) as producer:
        step, started = 0, time.monotonic()
        while not stop.is_set():
            gen, k = divmod(step, job_steps)
            ts = T0 + step * step_s
            for i in range(nodes):
                node = f"g{gen:05d}-n{i:04d}"
                producer.publish(Telemetry.from_columns(node, f"r{i // 8:02d}", ts, list(range(GPUS)),
                                                        temp_c=list(60 + rng.normal(0, 1, GPUS))))
                producer.publish(StepBatch(job=f"soak-{gen:05d}", step=k, node=node, ts=ts,
                                           ranks=np.arange(i * GPUS, (i + 1) * GPUS, dtype=np.int32),
                                           gpus=np.arange(GPUS, dtype=np.int16),
                                           compute_s=1.0 + rng.normal(0, 0.02, GPUS)))
            sent[0] += per_step
            step += 1
            behind = started + step * step_wall - time.monotonic()
            if behind > 0:
                producer.flush()
                stop.wait(behind)
        producer.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the stream runs (default 10)")
    ap.add_argument("--rate", type=float, default=300.0, help="messages per wall second (default 300)")
    ap.add_argument("--nodes", type=int, default=16, help="nodes per job (default 16)")
    ap.add_argument("--job-steps", type=int, default=400, help="steps before a job ends and a new one starts")
    ap.add_argument("--step-s", type=float, default=2.0, help="event time per step, seconds (default 2)")
    ap.add_argument("--idle-s", type=float, default=300.0,
                    help="the pipeline's job_idle_s and node_idle_s, event seconds (default 300)")
    ap.add_argument("--warmup-min", type=float, default=4.0,
                    help="minutes left out of the slope and the plateau (default 4: the engine's caches, "
                         "the allocators' pools and the garbage collector's first full cycles settle)")
    ap.add_argument("--sample-s", type=float, default=60.0, help="seconds between RSS samples (default 60)")
    args = ap.parse_args()
    tune_gc()
    stop = threading.Event()
    sent = [0]
    series: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker() as broker:
        ensure_topics(broker.dsn, partitions=4)
        with open_store(f"chdb://{Path(tmp) / 'store'}") as store:
            store.migrate()
            with Runner(broker.dsn, store, group="soak", registry=CollectorRegistry(),
                        pipeline=lambda: Pipeline(job_idle_s=args.idle_s, node_idle_s=args.idle_s),
                        max_records=2000) as runner:
                feeder = threading.Thread(target=publish, daemon=True,
                                          args=(broker.dsn, args.rate, args.nodes, args.job_steps, args.step_s,
                                                stop, sent))
                start = time.monotonic()
                feeder.start()
                next_sample = start
                while True:
                    now = time.monotonic()
                    if now >= next_sample:
                        point = {"minute": round((now - start) / 60.0, 2), "rss_mib": round(rss_mib(), 1),
                                 "published": sent[0], "processed": runner.consumer.consumed_total,
                                 "jobs": len(runner.pipeline.job_seen_),
                                 "nodes": len({n for p in runner.pipelines.values() for n in p.clock_}),
                                 "open_steps": len(runner.pipeline.open_steps()), "held": len(runner.buffer),
                                 "py_objects": len(gc.get_objects()),
                                 "gc_full": gc.get_stats()[2]["collections"], "heap": heap_memory(),
                                 "engine": engine_memory(store)}
                        series.append(point)
                        print(json.dumps(point), flush=True)
                        next_sample += args.sample_s
                    if now - start >= args.minutes * 60.0:
                        break
                    runner.process_once(0.2)
                stop.set()
                feeder.join(timeout=30)
    measured = [p for p in series if p["minute"] >= args.warmup_min]
    minutes = [p["minute"] for p in measured]
    rss = [p["rss_mib"] for p in measured]
    per_min = slope(minutes, rss)
    span = (minutes[-1] - minutes[0]) if len(minutes) > 1 else 0.0
    share = per_min * span / (sum(rss) / len(rss)) if rss else 0.0
    last = series[-1]
    print(json.dumps({
        "minutes": args.minutes, "rate": args.rate, "warmup_min": args.warmup_min, "series": series,
        "rss_start_mib": series[0]["rss_mib"], "plateau_mib": round(float(np.median(rss)), 1) if rss else None,
        "min_after_warmup_mib": min(rss, default=None), "max_after_warmup_mib": max(rss, default=None),
        "slope_mib_per_min": round(per_min, 3), "change_over_span_share": round(share, 4),
        "target_share": TARGET_SHARE, "flat": abs(share) <= TARGET_SHARE,
        "kept_up": last["processed"] >= 0.9 * last["published"], "engine_last": last["engine"],
    }), flush=True)


if __name__ == "__main__":
    main()
