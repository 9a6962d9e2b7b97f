"""Detector snapshot size and time: one pipeline holding a 16,384-rank job after ~500 steps.

Builds a :class:`~fleethealth.detectors.pipeline.Pipeline` in the state a job-stage partition
holds, snapshots it with :meth:`fleethealth.detectors.snapshot.Snapshots.dump` and restores it
with :meth:`~fleethealth.detectors.snapshot.Snapshots.load`, and prints one JSON object: the blob's
bytes (and the manifest's and arrays' before compression), the dump and load times (best of
``--repeat``, CPU seconds of this process, and per rank), the explicit state alone
(:func:`~fleethealth.detectors.state.state_dict`), each part's state size (manifest JSON and
array bytes), zlib levels 1 (what :mod:`~fleethealth.detectors.snapshot` uses) and 6 on the
uncompressed body, and the caps the loader applies against the sizes measured.

The state is built on generated data (2 % lognormal compute jitter, 8 GPUs per node, telemetry
every ``--telemetry-every`` steps: a 10-steps/s job sampled at 1 Hz). The first ``--fed-steps``
steps go through ``Pipeline.feed`` as the stream delivers them (one step batch per node), so the
assembler, hang detector and lifecycle hold their per-rank state; the other steps go straight to
the job's straggler detector as assembled steps (what the pipeline hands it), since feeding a
million node messages through the pipeline would take minutes and the state it keeps per rank
is the same size after 30 steps as after 500 (its arrays are sized by rank, not by step).
Telemetry goes through ``feed`` throughout, so the diagnoser, health rules and failure predictor
hold every node's windows. A final check restores the blob and feeds the original and the copy
the same next step: the findings must match.

Last full run: ``bench/results/snapshot_size.json``.

    nice -n 10 python bench/snapshot_size.py [--ranks 16384] [--steps 500] [--fed-steps 30]
                                             [--telemetry-every 10] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib

import numpy as np

from fleethealth.detectors.assembly import AssembledStep
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.snapshot import SNAPSHOT_VERSION, Snapshots
from fleethealth.detectors.state import state_dict
from fleethealth.schema import StepBatch, Telemetry

T0 = 1_767_225_600.0
GPUS = 8
STEP_S = 0.1
JOB = "big"
PARTS = ("stragglers_", "hang", "assembler", "lifecycle", "diagnoser", "health", "predictor", "rack_episodes", "sdc")


def _telemetry(rng: np.random.Generator, nodes: int, ts: float, tick: int) -> list[Telemetry]:
    out = []
    for n in range(nodes):
        out.append(Telemetry.from_columns(
            f"n{n:05d}", f"r{n // 16:03d}", ts, np.arange(GPUS),
            temp_c=60.0 + rng.normal(0, 1.0, GPUS), power_w=600.0 + rng.normal(0, 10.0, GPUS),
            sm_clock_mhz=np.full(GPUS, 1980.0), util_pct=np.full(GPUS, 98.0), clock_reasons=np.zeros(GPUS),
            ecc_sbe_volatile=np.full(GPUS, float(tick // 20)), ecc_dbe_volatile=np.zeros(GPUS),
            nvlink_links_up=np.full(GPUS, 18.0)))
    return out


def _batches(step: int, compute: np.ndarray, nodes: int, ts: float) -> list[StepBatch]:
    gpus = np.arange(GPUS, dtype=np.int16)
    return [StepBatch(job=JOB, step=step, node=f"n{n:05d}", ts=ts,
                      ranks=np.arange(n * GPUS, (n + 1) * GPUS, dtype=np.int32), gpus=gpus,
                      compute_s=compute[n * GPUS:(n + 1) * GPUS]) for n in range(nodes)]


def build(ranks: int, steps: int, fed_steps: int, telemetry_every: int, seed: int = 16) -> tuple[Pipeline, dict]:
    """The pipeline after ``steps`` steps of a ``ranks``-rank job, and the next step's messages."""
    rng = np.random.default_rng(seed)
    nodes = ranks // GPUS
    pipe = Pipeline()
    node_of = np.array([f"n{r // GPUS:05d}" for r in range(ranks)], dtype=object)
    gpu_of = (np.arange(ranks) % GPUS).astype(np.int16)
    all_ranks = np.arange(ranks, dtype=np.int32)
    started = time.process_time()
    shift = 0.0
    for step in range(steps + 1):
        if step == fed_steps:
            # a job's first step waits for the step timeout (nothing says yet how many ranks it has):
            # one telemetry tick past it concludes the fed steps, and the job's clock moves on from there
            shift = pipe.hang.timeout_s(JOB) + 1.0
            pipe.feed(_telemetry(rng, nodes, T0 + STEP_S * step + shift, step // telemetry_every))
            assert JOB in pipe.stragglers_, "the fed steps were not assembled"
        ts = T0 + STEP_S * step + shift
        compute = 0.08 * rng.lognormal(0.0, 0.02, ranks)
        messages: list = _telemetry(rng, nodes, ts, step // telemetry_every) if step % telemetry_every == 0 else []
        if step == steps:
            return pipe, {"messages": messages + _batches(step, compute, nodes, ts),
                          "build_cpu_s": round(time.process_time() - started, 2)}
        if step < fed_steps:
            pipe.feed(messages + _batches(step, compute, nodes, ts))
            continue
        if messages:
            pipe.feed(messages)
        detector = pipe.stragglers_[JOB]
        placed = AssembledStep(job=JOB, step=step, ts=ts, ranks=all_ranks, gpus=gpu_of, nodes=node_of,
                               compute_s=compute, groups=None, complete=True)
        pipe._wait(detector.check(step, all_ranks, compute, None, placement=placed))
    raise AssertionError("unreachable")


def _best(fn, repeat: int) -> tuple[float, float, object]:
    cpu, wall, out = float("inf"), float("inf"), None
    for _ in range(repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        cpu, wall = min(cpu, time.process_time() - c0), min(wall, time.perf_counter() - w0)
    return cpu, wall, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16_384)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--fed-steps", type=int, default=30)
    ap.add_argument("--telemetry-every", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    pipe, nxt = build(args.ranks, args.steps, args.fed_steps, args.telemetry_every)
    offsets = {("fh.steps", 0): 1_000_000, ("fh.telemetry", 0): 2_000_000, ("fh.events", 0): 3_000}
    snaps = Snapshots(key=os.urandom(32))
    dump_cpu, dump_wall, blob = _best(lambda: snaps.dump(pipe, offsets), args.repeat)
    load_cpu, load_wall, loaded = _best(lambda: snaps.load(blob, like=Pipeline(), expect=Pipeline), args.repeat)
    restored, back = loaded
    assert back == offsets
    same = pipe.feed(nxt["messages"]).findings == restored.feed(nxt["messages"]).findings

    head = snaps.info(blob)
    state_cpu, _, _ = _best(lambda: state_dict(pipe), args.repeat)
    state, _ = snaps.open(blob)
    raw = json.dumps(state.tree).encode() + b"".join(a.tobytes() for a in state.arrays)
    level1_cpu, _, level1 = _best(lambda: zlib.compress(raw, 1), args.repeat)
    level6_cpu, _, level6 = _best(lambda: zlib.compress(raw, 6), args.repeat)

    def size(part: object) -> dict[str, int]:
        s = state_dict(part)
        return {"manifest": len(json.dumps(s.tree)), "arrays": sum(a.nbytes for a in s.arrays)}

    parts = {name: size(getattr(pipe, name)) for name in PARTS}
    body = head["manifest_bytes"] + head["data_bytes"]
    print(json.dumps({
        "bench": "snapshot_size", "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
        "ranks": args.ranks, "nodes": args.ranks // GPUS, "steps": args.steps, "fed_steps": args.fed_steps,
        "telemetry_every_steps": args.telemetry_every, "snapshot_version": SNAPSHOT_VERSION,
        "build_cpu_s": nxt["build_cpu_s"],
        "blob_bytes": len(blob), "manifest_bytes": head["manifest_bytes"], "array_bytes": head["data_bytes"],
        "arrays": len(state.arrays), "largest_array_bytes": max((a.nbytes for a in state.arrays), default=0),
        "blob_bytes_per_rank": round(len(blob) / args.ranks, 1),
        "compression_ratio": round(body / len(blob), 2),
        "dump_cpu_s": round(dump_cpu, 4), "dump_wall_s": round(dump_wall, 4),
        "load_cpu_s": round(load_cpu, 4), "load_wall_s": round(load_wall, 4),
        "dump_us_per_rank": round(dump_cpu / args.ranks * 1e6, 2),
        "load_us_per_rank": round(load_cpu / args.ranks * 1e6, 2),
        "state_dict_cpu_s": round(state_cpu, 4),
        "zlib1_bytes": len(level1), "zlib1_cpu_s": round(level1_cpu, 4),
        "zlib6_bytes": len(level6), "zlib6_cpu_s": round(level6_cpu, 4),
        "caps": {"max_bytes": snaps.max_bytes, "max_manifest_bytes": snaps.max_manifest_bytes,
                 "max_array_bytes": snaps.max_array_bytes,
                 "max_bytes_over_body": round(snaps.max_bytes / body, 2),
                 "max_manifest_over_manifest": round(snaps.max_manifest_bytes / head["manifest_bytes"], 2)},
        "state_bytes_by_part": parts,
        "restored_findings_match": same,
    }, indent=2))


if __name__ == "__main__":
    main()
