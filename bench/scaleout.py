"""Scale-out of the detector tier: the same stream through 1 and through 3 replicas of each stage.

One embedded Tansu broker; the stream is published once before anything is timed: ``--jobs`` jobs of
``--nodes-per-job`` nodes × 8 ranks, ``--steps`` steps at 10 steps/s of event time sent as step
blocks of 10 steps per node (what a probe sends at 1 Hz), and one telemetry sample per node per
second. The jobs' names are chosen so that every partition of ``fh.steps`` carries jobs (Kafka's
murmur2 partitioner, as the producers use), the nodes spread over ``fh.telemetry`` by their names.

The node stage runs with 1 replica — its replica reads the telemetry and publishes node states on
``fh.nodestate`` — then the job stage with 1 and with 3, whose replicas read the steps and the whole
of ``fh.nodestate`` (one node run's states, as in a fleet), then the node stage with 3. Each replica
is its own process (``bench/_scaleout_worker.py``) in a consumer group of its own for that run,
with its own embedded chDB store (chDB allows one process per
data path; in a fleet the replicas share a ClickHouse server). A replica reports the records it read,
its CPU seconds and the event of its first and last record; a run's throughput is the samples
(rank-steps for the job stage, GPU samples for the node stage) over the time from the first replica's
first record to the last replica's end.

Prints one JSON object: per stage ``replicas_1_samples_per_s``, ``replicas_3_samples_per_s``,
``speedup`` and the CPU seconds per sample of each (``cpu_per_sample_ratio`` = 3 replicas over 1; the
issue's bound: at most 1.10), with the machine's core count. On a machine with fewer cores than
replicas the speedup is bounded by the cores; the CPU per sample is the figure that must not grow.

``--steps`` is 2,400 by default: a job replica's start-up (its group's join, its read of the
node-state table) is fixed, and at 600 steps it is most of a run, so three runs of one code gave CPU
per rank-step ratios from 1.10 to 2.04; at 2,400 two runs gave 1.06 and 0.98
(``bench/results/scaleout_table_wait_20261203.json``). ``--store-every`` is each replica's
``store_every_s``, 10 s by default as the Kubernetes detectors run (0: every poll).

    nice -n 10 python bench/scaleout.py [--jobs 6] [--nodes-per-job 16] [--steps 2400] [--partitions 6]
                                        [--store-every 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import Producer, ensure_topics
from fleethealth.schema import StepBatch, StepBlock, Telemetry

RANKS_PER_NODE = 8
GPUS = 8
T0 = 1_767_225_600.0
WORKER = Path(__file__).with_name("_scaleout_worker.py")


def _job_names(count: int, partitions: int) -> list[str]:
    """``count`` job names whose keys fall on every partition in turn (Kafka's default partitioner)."""
    from kafka.partitioner.default import murmur2

    names: list[str] = []
    want, k = 0, 0
    while len(names) < count:
        name = f"job-{k}"
        if (murmur2(name.encode()) & 0x7FFFFFFF) % partitions == want % partitions:
            names.append(name)
            want += 1
        k += 1
    return names


def publish(dsn: str, jobs: list[str], nodes_per_job: int, steps: int, seed: int = 7) -> dict[str, int]:
    """The stream; returns the messages and samples per topic."""
    rng = np.random.default_rng(seed)
    gpus = np.arange(GPUS, dtype=np.int16)
    counts = {"step_messages": 0, "rank_steps": 0, "telemetry": 0, "gpu_samples": 0}
    with Producer(dsn, client_id="bench-scaleout", event_time_stamps=True) as producer:
        for j, job in enumerate(jobs):
            ranks = nodes_per_job * RANKS_PER_NODE
            times = 0.6 * np.exp(0.02 * rng.standard_normal((steps, ranks)))
            for n in range(nodes_per_job):
                node = f"n{j * nodes_per_job + n:05d}"
                lo = n * RANKS_PER_NODE
                for k0 in range(0, steps, 10):
                    batches = [StepBatch(job=job, step=k, node=node, ts=T0 + 0.1 * k,
                                         ranks=np.arange(lo, lo + RANKS_PER_NODE, dtype=np.int32), gpus=gpus,
                                         compute_s=times[k, lo:lo + RANKS_PER_NODE])
                               for k in range(k0, min(k0 + 10, steps))]
                    producer.publish(StepBlock.of(batches))
                    counts["step_messages"] += 1
                    counts["rank_steps"] += len(batches) * RANKS_PER_NODE
                for s in range(int(steps * 0.1) + 1):
                    producer.publish(Telemetry.from_columns(
                        node, f"r{(j * nodes_per_job + n) // 8:03d}", T0 + s, gpus,
                        temp_c=60 + rng.normal(0, 1, GPUS), power_w=650 + rng.normal(0, 5, GPUS),
                        sm_clock_mhz=np.full(GPUS, 1980.0), util_pct=np.full(GPUS, 98.0),
                        clock_reasons=np.zeros(GPUS), slowdown_temp_c=np.full(GPUS, 87.0),
                        nvlink_links_up=np.full(GPUS, 18.0), nvlink_links_max=np.full(GPUS, 18.0)))
                    counts["telemetry"] += 1
                    counts["gpu_samples"] += GPUS
        producer.flush(120.0)
    return counts


def run_stage(dsn: str, stage: str, replicas: int, tag: str, work: Path, partitions: int,
              store_every_s: float = 0.0) -> dict[str, object]:
    """``replicas`` worker processes of ``stage`` in group ``bench-<stage>-<tag>``, until all caught up."""
    procs = []
    for i in range(replicas):
        out = work / f"{stage}-{tag}-{i}.json"
        procs.append((subprocess.Popen([sys.executable, str(WORKER), dsn, stage, f"bench-{stage}-{tag}",
                                        str(work / f"store-{stage}-{tag}-{i}"), str(out), str(replicas),
                                        str(partitions), str(store_every_s)]), out))
    for proc, _ in procs:
        if proc.wait(timeout=1800) != 0:
            raise SystemExit(f"a {stage} replica exited with {proc.returncode}")
    reports = [json.loads(out.read_text()) for _, out in procs]
    first = min(r["first_s"] for r in reports if r["records"])
    last = max(r["end_s"] for r in reports)
    out = {"records": sum(r["records"] for r in reports), "cpu_s": round(sum(r["cpu_s"] for r in reports), 3),
           "wall_s": round(last - first, 3), "per_replica_records": [r["records"] for r in reports]}
    for name in ("table_records", "node_states_decoded", "node_states_passed_over"):
        if all(name in r for r in reports):
            out[f"per_replica_{name}"] = [r[name] for r in reports]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--nodes-per-job", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2400,
                    help="steps of each job (at 600 a replica's start-up is most of a run and the ratio is noise)")
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--store-every", type=float, default=10.0,
                    help="each replica's store_every_s (10, as the Kubernetes manifests set; 0: its samples "
                         "written every poll)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fh-scaleout-") as tmp, \
            EmbeddedBroker(log_path=Path(tmp) / "broker.log") as broker:
        work = Path(tmp)
        ensure_topics(broker.dsn, partitions=args.partitions)
        jobs = _job_names(args.jobs, args.partitions)
        t = time.perf_counter()
        counts = publish(broker.dsn, jobs, args.nodes_per_job, args.steps)
        published_s = time.perf_counter() - t
        result: dict[str, object] = {"cores": os.cpu_count(), "jobs": len(jobs),
                                     "nodes": len(jobs) * args.nodes_per_job, "partitions": args.partitions,
                                     "store_every_s": args.store_every,
                                     **counts, "publish_s": round(published_s, 1)}
        samples = {"node": counts["gpu_samples"], "job": counts["rank_steps"]}
        # the 3-replica node run goes last: fh.nodestate then holds one node run's states (as in a fleet)
        # when the job runs read it, not two copies
        done = {(stage, n): run_stage(broker.dsn, stage, n, f"r{n}", work, args.partitions, args.store_every)
                for stage, n in (("node", 1), ("job", 1), ("job", 3), ("node", 3))}
        for stage in ("node", "job"):
            runs = {n: done[(stage, n)] for n in (1, 3)}
            one, three = runs[1], runs[3]
            rate = {n: samples[stage] / max(r["wall_s"], 1e-9) for n, r in runs.items()}
            cpu = {n: r["cpu_s"] / samples[stage] for n, r in runs.items()}
            result[stage] = {
                "replicas_1_samples_per_s": round(rate[1]), "replicas_3_samples_per_s": round(rate[3]),
                "speedup": round(rate[3] / rate[1], 3),
                "cpu_us_per_sample_1": round(cpu[1] * 1e6, 3), "cpu_us_per_sample_3": round(cpu[3] * 1e6, 3),
                "cpu_per_sample_ratio": round(cpu[3] / cpu[1], 3), "runs": {"1": one, "3": three}}
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
