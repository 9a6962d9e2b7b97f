"""End-to-end detector throughput: Kafka -> detectors -> ClickHouse on the embedded stack.

Both pipelines run in this process against one embedded Tansu broker and one chDB store in a
temporary directory, on the same generated step times (2 % lognormal jitter):

* **runner** — the production path: node-level columnar :class:`StepBatch` messages (8 ranks each)
  consumed by :class:`fleethealth.detectors.runner.Runner` (event-time buffer, step assembly,
  straggler detector, hang detector, diagnosis, policy), written to ``rank_steps`` with
  deduplication tokens, offsets committed after the write;
* **blocks** — the same runner on step blocks: ``--steps-per-message`` (10) consecutive steps of one
  node's 8 ranks in one :class:`StepBlock` message (what a probe sends for a 10-steps/s job at
  1 Hz), taken whole: decoded columnar over the poll, assembled, scored and written to
  ``rank_steps`` as arrays (no step batch per step); on a broker and store of its own;
* **naive** — one message per rank, processed row by row by a plain kafka-python consumer: each is
  decoded and validated on its own, scored in Python against the median and MAD of the previous
  step, and inserted in batches of ``--naive-batch`` rows; offsets committed after each poll.

Rates are rank-step samples per CPU second of this process (``time.process_time()``: the main
thread, kafka-python's threads and chDB's threads; the broker runs in a separate process and is
not counted), and per wall second. Publishing happens before the timed part and is not counted.

Prints one JSON object; ``targets``: one core keeps up with a 16,384-rank job at 10 steps/s
(>= 163,840 samples per CPU second) and >= 10x the naive pipeline; ``block_targets`` (issue #16
§3): the block stream at >= 1,000,000 samples per CPU second and >= 50x the naive pipeline.

``blocks_samples_per_cpu_s`` is the block stream's rate, ``blocks_ratio_per_core`` the block stream
against the naive pipeline, ``blocks_over_runner_per_core`` against the one-step stream;
``decode_us_per_message`` is per 8-rank node-step for each form (``block_us_per_step``: a poll of
blocks through the bulk decoder, per node-step it carries).

Each pipeline runs ``--repeat`` times, each time on a fresh broker and store, and the best run of
each counts (the least CPU per sample: other load on the machine only ever slows a run down).

    python bench/detector_throughput.py [--ranks 4096] [--steps 40] [--steps-per-message 10]
                                        [--naive-steps 3] [--repeat 2] [--store-every S] [--profile FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

from fleethealth import schema
from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import Producer, ensure_topics, parse_dsn
from fleethealth.detectors.runner import Runner, tune_gc
from fleethealth.errors import SchemaError
from fleethealth.schema import StepBatch, StepBlock, Topic
from fleethealth.store import Store, open_store

TARGET_PER_CORE = 16_384 * 10
TARGET_RATIO = 10.0
BLOCK_TARGET_PER_CORE = 1_000_000
BLOCK_TARGET_RATIO = 50.0
RANKS_PER_NODE = 8
T0 = 1_767_225_600.0


@dataclass(frozen=True)
class Rate:
    """Samples processed and the CPU and wall seconds it took."""

    samples: int
    messages: int
    cpu_s: float
    wall_s: float

    @property
    def per_core(self) -> float:
        return self.samples / max(self.cpu_s, 1e-9)

    @property
    def per_wall(self) -> float:
        return self.samples / max(self.wall_s, 1e-9)

    def to_obj(self) -> dict[str, float]:
        return {**asdict(self), "samples_per_cpu_s": round(self.per_core), "samples_per_wall_s": round(self.per_wall)}


def _times(rng: np.random.Generator, ranks: int, steps: int) -> np.ndarray:
    """Compute times, shape ``(steps, ranks)``: 2 % lognormal jitter around 0.6 s, rank 5 10 % slow."""
    t = 0.6 * np.exp(0.02 * rng.standard_normal((steps, ranks)))
    t[:, 5] *= 1.10
    return t


def _publish_columnar(dsn: str, job: str, times: np.ndarray, first_step: int = 0, t0: float = T0,
                      per_message: int = 1) -> tuple[int, int]:
    """Publish ``times`` as steps ``first_step, ...`` at 10 steps/s of event time from ``t0``: per node,
    ``per_message`` consecutive steps in one message (a :class:`StepBlock`; 1: one :class:`StepBatch`
    per step). Returns the messages sent and the node-steps they carry (the records a consumer sees)."""
    steps, ranks = times.shape
    gpus = np.arange(RANKS_PER_NODE, dtype=np.int16)
    sent = node_steps = 0
    with Producer(dsn, client_id="bench-columnar", event_time_stamps=True) as producer:
        for k0 in range(0, steps, per_message):
            for lo in range(0, ranks, RANKS_PER_NODE):
                batches = [StepBatch(job=job, step=first_step + k, node=f"n{lo // RANKS_PER_NODE:05d}",
                                     ts=t0 + 0.1 * k, ranks=np.arange(lo, lo + RANKS_PER_NODE, dtype=np.int32),
                                     gpus=gpus, compute_s=times[k, lo:lo + RANKS_PER_NODE])
                           for k in range(k0, min(k0 + per_message, steps))]
                producer.publish(batches[0] if len(batches) == 1 else StepBlock.of(batches))
                sent += 1
                node_steps += len(batches)
        producer.flush(60.0)
    return sent, node_steps


def _publish_per_rank(dsn: str, job: str, times: np.ndarray) -> int:
    steps, ranks = times.shape
    sent = 0
    with Producer(dsn, client_id="bench-naive", event_time_stamps=True) as producer:
        for step in range(steps):
            for rank in range(ranks):
                producer.publish(StepBatch(job=job, step=step, node=f"n{rank // RANKS_PER_NODE:05d}",
                                           ts=T0 + 0.1 * step, ranks=np.array([rank], dtype=np.int32),
                                           gpus=np.array([rank % RANKS_PER_NODE], dtype=np.int16),
                                           compute_s=times[step, rank:rank + 1]))
                sent += 1
        producer.flush(60.0)
    return sent


def _run_runner(dsn: str, store: Store, job: str, times: np.ndarray, profile: cProfile.Profile | None,
                per_message: int = 1, store_every_s: float = 0.0) -> Rate:
    """The production runner; ``times[:2]`` warm it up untimed (model loading, and the job's first step,
    which the assembler emits only after its completeness timeout: the warm-up's second step comes
    11 s of event time later). The rest, at 10 steps/s, ``per_message`` steps per node a message, is timed;
    with ``store_every_s``, its step rows held over polls and written at the drain, in the timed part."""
    with Runner(dsn, store, group=f"bench-{job}", registry=CollectorRegistry(), publish=False,
                store_every_s=store_every_s) as runner:
        runner.consumer.wait_assigned(60.0)
        warm = _publish_columnar(dsn, job, times[:1])[1] + _publish_columnar(dsn, job, times[1:2], 1, T0 + 11.0)[1]
        taken = 0
        while taken < warm:
            taken += runner.process_once(1.0)
        times = times[2:]
        messages, _ = _publish_columnar(dsn, job, times, 2, T0 + 11.1, per_message)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if profile is not None:
            profile.enable()
        taken = 0
        while taken < messages:  # a record per message: the runner takes a block whole
            taken += runner.process_once(1.0)
        runner.drain()
        if profile is not None:
            profile.disable()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        if runner.consumer.dead_lettered_total:
            raise RuntimeError(f"{runner.consumer.dead_lettered_total} bench messages were dead-lettered")
    stored = store.rank_step_count(job, first_step=2)
    if stored < times.size:
        raise RuntimeError(f"runner stored {stored} of {times.size} rank-steps")
    return Rate(samples=times.size, messages=messages, cpu_s=cpu, wall_s=wall)


def _run_naive(dsn: str, store: Store, job: str, times: np.ndarray, batch: int) -> Rate:
    """One message per rank, processed row by row (the pipeline to beat): a plain kafka-python consumer,
    each value decoded and validated alone, scored in Python against the previous step's median and
    MAD, inserted ``batch`` rows at a time; offsets committed after each poll's rows are written."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(Topic.STEPS.value, bootstrap_servers=list(parse_dsn(dsn)[1]), group_id=f"bench-{job}",
                             enable_auto_commit=False, auto_offset_reset="latest", fetch_max_wait_ms=100,
                             session_timeout_ms=6000, heartbeat_interval_ms=2000)
    try:
        deadline = time.monotonic() + 60.0
        while not consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(timeout_ms=100)
        for tp in consumer.assignment():
            consumer.position(tp)
        messages = _publish_per_rank(dsn, job, times)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        taken = flagged = 0
        history: dict[int, list[float]] = {}
        baseline: tuple[int, float, float] | None = None  # (step, median, scale) of the previous step
        rows: list[tuple] = []
        while taken < messages:
            for records in consumer.poll(timeout_ms=1000, max_records=500).values():
                for rec in records:
                    try:
                        msg = schema.decode(StepBatch, rec.value)
                    except SchemaError:
                        continue
                    if msg.job != job:  # an earlier pipeline's record on the shared topic: not this run's
                        continue
                    taken += 1
                    x = float(msg.compute_s[0])
                    history.setdefault(msg.step, []).append(x)
                    prev = history.get(msg.step - 1)
                    if prev is not None and (baseline is None or baseline[0] != msg.step - 1):
                        med = statistics.median(prev)
                        mad = statistics.median(abs(v - med) for v in prev)
                        baseline = (msg.step - 1, med, 1.4826 * mad or 1e-9)
                    z = (x - baseline[1]) / baseline[2] if baseline and baseline[0] == msg.step - 1 else 0.0
                    flagged += z > 3.0
                    rows.append((msg.job, msg.step, int(msg.ranks[0]), msg.node, int(msg.gpus[0]), msg.ts, x))
                    if len(rows) >= batch:
                        _insert_rows(store, rows)
                        rows = []
            if rows:
                _insert_rows(store, rows)
                rows = []
            consumer.commit()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        consumer.close(autocommit=False)
    stored = store.rank_step_count(job)
    if stored < times.size:
        raise RuntimeError(f"the naive pipeline stored {stored} of {times.size} rank-steps")
    return Rate(samples=times.size, messages=messages, cpu_s=cpu, wall_s=wall)


def _decode_cost(times: np.ndarray, per_message: int, repeat: int = 3) -> dict[str, float]:
    """CPU microseconds per 8-rank node-step: the consumer's bulk decode of one-step messages, one value
    at a time, and of ``per_message``-step blocks (the bulk decoder, per node-step)."""
    steps, ranks = times.shape
    gpus = np.arange(RANKS_PER_NODE, dtype=np.int16)
    grid = [[StepBatch(job="decode", step=s, node=f"n{lo // RANKS_PER_NODE:05d}", ts=T0 + s,
                       ranks=np.arange(lo, lo + RANKS_PER_NODE, dtype=np.int32), gpus=gpus,
                       compute_s=times[s, lo:lo + RANKS_PER_NODE]) for s in range(steps)]
            for lo in range(0, ranks, RANKS_PER_NODE)]
    values = [schema.encode(b) for s in range(steps) for b in (node[s] for node in grid)]
    blocks = [schema.encode(StepBlock.of(node[k:k + per_message])) for node in grid
              for k in range(0, steps, per_message)]
    best = {"bulk_us": math.inf, "per_message_us": math.inf, "block_us_per_step": math.inf}
    for _ in range(repeat):
        t0 = time.process_time()
        schema.decode_many(StepBatch, values)
        t1 = time.process_time()
        for v in values:
            schema.decode(StepBatch, v)
        t2 = time.process_time()
        schema.decode_many(StepBatch, blocks)
        t3 = time.process_time()
        best["bulk_us"] = min(best["bulk_us"], 1e6 * (t1 - t0) / len(values))
        best["per_message_us"] = min(best["per_message_us"], 1e6 * (t2 - t1) / len(values))
        best["block_us_per_step"] = min(best["block_us_per_step"], 1e6 * (t3 - t2) / len(values))
    return {k: round(v, 2) for k, v in best.items()}


def _insert_rows(store: Store, rows: list[tuple]) -> None:
    names = ("job", "step", "rank", "node", "gpu", "ts", "compute_s")
    store.insert("rank_steps", {name: [row[i] for row in rows] for i, name in enumerate(names)})


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4096, help="ranks of the job (a multiple of 8)")
    parser.add_argument("--steps", type=int, default=40, help="steps through the runner (after 2 warm-up steps)")
    parser.add_argument("--steps-per-message", type=int, default=10,
                        help="steps per node in one message of the block stream")
    parser.add_argument("--naive-steps", type=int, default=3, help="steps through the naive pipeline")
    parser.add_argument("--naive-batch", type=int, default=200, help="rows per insert in the naive pipeline")
    parser.add_argument("--repeat", type=int, default=2, help="runs of both pipelines; the best of each counts")
    parser.add_argument("--store-every", type=float, default=0.0,
                        help="the runners' store_every_s (0, the default: step rows written every poll; the "
                             "Kubernetes job stage holds them 10 s, here that is the whole timed stream)")
    parser.add_argument("--profile", type=Path, help="write a cProfile of the block stream's timed part here")
    args = parser.parse_args(argv)
    if args.ranks < RANKS_PER_NODE or args.ranks % RANKS_PER_NODE:
        parser.error(f"--ranks must be a positive multiple of {RANKS_PER_NODE}")
    if min(args.steps, args.naive_steps, args.naive_batch, args.repeat, args.steps_per_message) < 1:
        parser.error("--steps, --steps-per-message, --naive-steps, --naive-batch and --repeat must be >= 1")
    tune_gc()  # what `fleethealth detect` does; both pipelines run under it
    rng = np.random.default_rng(2026)
    profile = cProfile.Profile() if args.profile is not None else None
    runs: list[tuple[Rate, Rate, Rate]] = []
    for rep in range(args.repeat):  # a fresh broker and store each time; the best of each pipeline counts
        # each runner stream on its own broker (a new group reads the topic from its start)
        with tempfile.TemporaryDirectory(prefix="fh-bench-") as tmp, EmbeddedBroker() as broker, \
                open_store(f"chdb://{tmp}/store") as store:
            store.migrate()
            ensure_topics(broker.dsn, partitions=4)
            runner = _run_runner(broker.dsn, store, f"bench-columnar-{rep}", _times(rng, args.ranks, args.steps + 2),
                                 None, 1, args.store_every)
            naive = _run_naive(broker.dsn, store, f"bench-naive-{rep}", _times(rng, args.ranks, args.naive_steps),
                               args.naive_batch)
        with tempfile.TemporaryDirectory(prefix="fh-bench-") as tmp, EmbeddedBroker() as broker, \
                open_store(f"chdb://{tmp}/store") as store:
            store.migrate()
            ensure_topics(broker.dsn, partitions=4)
            blocks = _run_runner(broker.dsn, store, f"bench-blocks-{rep}", _times(rng, args.ranks, args.steps + 2),
                                 profile if rep == 0 else None, args.steps_per_message, args.store_every)
        runs.append((runner, blocks, naive))
    runner = min((r for r, _, _ in runs), key=lambda r: r.cpu_s / r.samples)
    blocks = min((b for _, b, _ in runs), key=lambda b: b.cpu_s / b.samples)
    naive = min((n for _, _, n in runs), key=lambda n: n.cpu_s / n.samples)
    decode = _decode_cost(_times(rng, min(args.ranks, 4096), max(4, args.steps_per_message)), args.steps_per_message)
    if profile is not None:
        profile.dump_stats(str(args.profile))
    ratio = runner.per_core / naive.per_core
    ratio_blocks = blocks.per_core / naive.per_core
    result = {
        "ranks": args.ranks, "ranks_per_message": RANKS_PER_NODE, "steps_per_message": args.steps_per_message,
        "store_every_s": args.store_every,
        "runner": runner.to_obj(), "blocks": blocks.to_obj(), "naive": naive.to_obj(),
        "per_run_samples_per_cpu_s": [[round(r.per_core), round(b.per_core), round(n.per_core)] for r, b, n in runs],
        "decode_us_per_message": decode,
        "ratio_per_core": round(ratio, 1), "ratio_per_wall": round(runner.per_wall / naive.per_wall, 1),
        "blocks_samples_per_cpu_s": round(blocks.per_core),
        "blocks_ratio_per_core": round(ratio_blocks, 1),
        "blocks_over_runner_per_core": round(blocks.per_core / runner.per_core, 2),
        "targets": {"samples_per_cpu_s": TARGET_PER_CORE, "ratio": TARGET_RATIO},
        "meets": {"samples_per_cpu_s": max(runner.per_core, blocks.per_core) >= TARGET_PER_CORE,
                  "ratio": max(ratio, ratio_blocks) >= TARGET_RATIO},
        "block_targets": {"samples_per_cpu_s": BLOCK_TARGET_PER_CORE, "ratio": BLOCK_TARGET_RATIO},
        "meets_block_targets": {"samples_per_cpu_s": blocks.per_core >= BLOCK_TARGET_PER_CORE,
                                "ratio": ratio_blocks >= BLOCK_TARGET_RATIO},
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
