"""Broker faults end to end on the durable cluster: the run of ``bench/broker_faults.py``.

:func:`run` streams simulated rank-steps of two jobs (one rank of the first 20 % slow from a third of
the way) through the probe's spool-backed :class:`~fleethealth.probe.delivery.Delivery` into the
cluster, while ``fleethealth detect`` runs in the staged form — two job-stage replicas and one policy
replica, processes of their own, each with a chDB store of its own (chDB allows one process per data
path; a shared ClickHouse holds their union, deduplicated by each table's key as ``FINAL`` reads it) —
and injects broker faults at random points: ``kills`` SIGKILLs of a broker followed by its restart,
then (``lose_broker``) one broker killed for good with two chunks of the stream still to come, timing
how soon the producer and the detectors carry on through the other. It then waits until the groups have
committed their inputs, stops the replicas with SIGTERM and checks the stores and the topics:
every rank-step once, the straggler's one finding within two steps of one uninterrupted pipeline's,
every recommendation stored once and on ``fh.recommendations`` (at least once per id: the copies a
fail-over sent again are counted).

The stream ends with a tail: one step per node :data:`TAIL_S` of event time after the last, which
moves every job's event-time watermark past the stream so the job stage concludes, stores and
commits all of it (the tail itself stays held and is not checked).
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fleethealth import schema
from fleethealth.schema import FindingKind, Recommendation, StepBatch, StepBlock, Topic

__all__ = ["Report", "Stream", "run"]

PARTITIONS = 2
NODES_PER_JOB, RANKS_PER_NODE = 2, 8
SLOW_RANK, SLOW_BY = 5, 1.20
STEP_S = 0.2
TAIL_S = 60.0
GROUP = "fh-faults"
MAX_STEP_DELTA = 2
"""How far the step at which the straggler is concluded may fall from one uninterrupted pipeline's."""


@dataclass
class Report:
    """What a run did and found; ``ok`` when nothing was lost or duplicated."""

    faults: int = 0
    restarts: int = 0
    brokers_lost: int = 0
    records_sent: int = 0
    records_acknowledged: int = 0
    acknowledged_without_offset: int = 0
    """Records a broker answered as duplicates (acknowledged at offset -1), each read back."""
    acknowledged_not_stored: int = 0
    """Of those, the ones not found when read back (a restarted broker that never stored them): published again."""
    producer_rebuilt: int = 0
    consumer_failovers: int = 0
    rank_steps_expected: int = 0
    rank_steps_stored: int = 0
    rank_steps_missing: int = 0
    rank_steps_duplicated: int = 0
    findings: int = 0
    findings_expected: int = 0
    finding_step_delta: int = 0
    finding_same_id: bool = True
    recommendations_stored: int = 0
    recommendations_published: int = 0
    recommendations_published_twice: int = 0
    producer_resumed_s: float | None = None
    detectors_resumed_s: float | None = None
    caught_up_s: float = 0.0
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


class Stream:
    """The rank-steps of two jobs, one on each partition, in ``chunks`` step blocks per job and node."""

    def __init__(self, steps: int, *, seed: int = 11, t0: float | None = None) -> None:
        self.steps = steps
        self.t0 = time.time() - 30.0 if t0 is None else t0  # near the wall clock: the record timestamps are
        self.jobs = _jobs()
        self.slow_from = steps // 3
        rng = np.random.default_rng(seed)
        ranks = NODES_PER_JOB * RANKS_PER_NODE
        self.times = {job: 0.5 * np.exp(0.02 * rng.standard_normal((steps, ranks))) for job in self.jobs}
        self.times[self.jobs[0]][self.slow_from:, SLOW_RANK] *= SLOW_BY

    def batch(self, job: str, step: int, n: int, *, ts: float | None = None) -> StepBatch:
        lo = n * RANKS_PER_NODE
        times = self.times[job][min(step, self.steps - 1), lo:lo + RANKS_PER_NODE]
        return StepBatch(job=job, step=step, node=f"{job}-node{n}", ts=self.t0 + STEP_S * step if ts is None else ts,
                         ranks=np.arange(lo, lo + RANKS_PER_NODE, dtype=np.int32),
                         gpus=np.arange(RANKS_PER_NODE, dtype=np.int16), compute_s=times)

    def chunks(self, count: int) -> list[list[StepBlock]]:
        """The stream as ``count`` chunks of step blocks (10 steps of one node each)."""
        out: list[list[StepBlock]] = [[] for _ in range(count)]
        per = max(10, -(-self.steps // count) // 10 * 10)
        for k0 in range(0, self.steps, 10):
            for job in self.jobs:
                for n in range(NODES_PER_JOB):
                    blocks = [self.batch(job, k, n) for k in range(k0, min(k0 + 10, self.steps))]
                    out[min(k0 // per, count - 1)].append(StepBlock.of(blocks))
        return out

    def tail(self) -> list[StepBatch]:
        end = self.t0 + STEP_S * self.steps + TAIL_S
        return [self.batch(job, self.steps, n, ts=end) for job in self.jobs for n in range(NODES_PER_JOB)]

    def expected(self) -> set[tuple[str, int, int]]:
        ranks = NODES_PER_JOB * RANKS_PER_NODE
        return {(job, s, r) for job in self.jobs for s in range(self.steps) for r in range(ranks)}

    def reference(self) -> dict[str, int]:
        """The findings (id -> step) of the detectors fed the whole stream in one process."""
        from fleethealth.detectors.pipeline import Pipeline

        pipeline = Pipeline()
        found: dict[str, int] = {}
        batches = sorted((self.batch(job, k, n) for job in self.jobs for k in range(self.steps)
                          for n in range(NODES_PER_JOB)), key=lambda b: b.ts)
        for i in range(0, len(batches), 64):
            found.update({f.id: f.step for f in pipeline.feed(batches[i:i + 64]).findings})
        found.update({f.id: f.step for f in pipeline.drain().findings})
        return found


def _jobs() -> list[str]:
    """One job on each partition (Kafka's default partitioner, as the producers use)."""
    from kafka.partitioner.default import murmur2

    names: dict[int, str] = {}
    k = 0
    while len(names) < PARTITIONS:
        name = f"train-{k}"
        names.setdefault((murmur2(name.encode()) & 0x7FFFFFFF) % PARTITIONS, name)
        k += 1
    return [names[p] for p in sorted(names)]


class Detector:
    """One ``fleethealth detect`` replica in a process of its own, its output read by a thread."""

    def __init__(self, dsn: str, stage: str, store_dir: Path, log: Path, settings: Sequence[str] = ()) -> None:
        from fleethealth.store import open_store

        with open_store(f"chdb://{store_dir}") as store:  # the store is migrated before detect starts
            store.migrate()
        argv = [sys.executable, "-m", "fleethealth", "detect", "--kafka", dsn, "--store", f"chdb://{store_dir}",
                "--stage", stage, "--group", GROUP, "--metrics-port", "0",
                "--set", "detect.runner.session_timeout_s=3", "--set", "detect.runner.max_poll_interval_s=6",
                "--set", "detect.runner.snapshot_every_s=2", "--set", "detect.runner.snapshot_to=bus",
                "--set", "detect.snapshot.key_file=" + str(_key_file(store_dir.parent)),
                *(arg for kv in settings for arg in ("--set", kv))]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETHEALTH_")}
        self.store_dir = store_dir
        self.log = log
        self._out = open(log, "w")  # noqa: SIM115 — closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_die_with_parent())

    def joined(self) -> bool:
        return "fleethealth detect: joined group" in self.tail(100_000)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
        self._out.close()
        return code

    def failovers(self) -> int:
        """Consumer fail-overs this replica logged (``fleethealth/bus/consumer.py``)."""
        return self.tail(10_000_000).count("reconnecting from every broker of the DSN")

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def _key_file(root: Path) -> Path:
    path = root / "snapshot.key"
    if not path.exists():
        path.write_bytes(b"broker-faults-snapshot-key-0123456789")
        path.chmod(0o600)
    return path


def _die_with_parent() -> Any:
    from fleethealth.broker import _die_with_parent as hook

    return hook()


class _Offsets:
    """A group's committed offsets and the log ends (from a fetch's high watermark: Tansu 0.6's
    ListOffsets answers the last batch's base offset plus one). Reconnects after a broker fault."""

    def __init__(self, dsn: str, partitions: int = PARTITIONS) -> None:
        self.bootstrap = dsn.split("://", 1)[1].split(",")
        self.partitions = partitions

    def ends(self, topic: str) -> dict[int, int]:
        from kafka import KafkaConsumer, TopicPartition

        kc = KafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                           auto_offset_reset="earliest", fetch_max_wait_ms=100)
        try:
            parts = [TopicPartition(topic, p) for p in range(self.partitions)]
            kc.assign(parts)
            deadline = time.monotonic() + 30.0
            while any(kc.highwater(tp) is None for tp in parts):
                if time.monotonic() > deadline:
                    raise AssertionError(f"no fetch of every partition of {topic} answered in 30 s")
                kc.poll(timeout_ms=200)
            return {tp.partition: int(kc.highwater(tp)) for tp in parts}
        finally:
            kc.close(autocommit=False)

    def committed(self, group: str, topic: str) -> dict[int, int]:
        from kafka import KafkaConsumer, TopicPartition

        kc = KafkaConsumer(bootstrap_servers=self.bootstrap, group_id=group, enable_auto_commit=False)
        try:
            return {p: kc.committed(TopicPartition(topic, p)) or 0 for p in range(self.partitions)}
        finally:
            kc.close(autocommit=False)


def _published(dsn: str, topic: str) -> list[bytes]:
    from kafka import KafkaConsumer

    kc = KafkaConsumer(topic, bootstrap_servers=dsn.split("://", 1)[1].split(","), group_id=None,
                       auto_offset_reset="earliest", enable_auto_commit=False, consumer_timeout_ms=3000)
    try:
        return [r.value for r in kc]
    finally:
        kc.close(autocommit=False)


def run(cluster: Any, root: Path, *, steps: int = 300, chunks: int = 6, kills: int = 2, lose_broker: bool = False,
        seed: int = 20261202, catch_up_s: float = 240.0, log: Any = None) -> Report:
    """Stream, fault and check (see the module docstring); ``cluster`` is a started
    :class:`tests.cluster.DurableCluster` with at least two brokers."""
    from fleethealth.bus import ensure_topics
    from fleethealth.probe.delivery import Delivery
    from fleethealth.probe.spool import Spool

    say = log or (lambda *_: None)
    started = time.monotonic()
    rng = random.Random(seed)
    report = Report()
    stream = Stream(steps)
    reference = stream.reference()
    report.findings_expected = len(reference)
    ensure_topics(cluster.dsn, partitions=PARTITIONS)
    # the faults fall mid-stream, on replicas that joined their groups (a fault during the start-up is
    # test_detect_startup's case)
    detectors = [Detector(cluster.dsn, stage, root / name, root / f"{name}.log")
                 for stage, name in (("job", "job-0"), ("job", "job-1"), ("policy", "policy"))]
    if _until(lambda: all(d.joined() for d in detectors), 180.0, started, every_s=0.2) is None:
        for d in detectors:
            d.stop()
        raise AssertionError("the detect replicas did not join their groups in 180 s: "
                             + " | ".join(d.tail(500) for d in detectors))
    offsets = _Offsets(cluster.dsn)
    say(f"replicas joined {time.monotonic() - started:.1f} s after the start")
    producers: list[Any] = []

    def producer_factory(dsn: str) -> Any:  # Delivery's own producer, kept to count what it was told
        from fleethealth.bus import Producer

        producers.append(Producer(dsn, client_id="fleethealth-probe", max_block_s=2.0, request_timeout_s=2.0,
                                  delivery_timeout_s=math.inf, reconnect_backoff_max_s=0.5))
        return producers[-1]

    delivery = Delivery(cluster.dsn, Spool(root / "spool"), node="faults-probe", flush_timeout_s=1.0,
                        request_timeout_s=2.0, reconnect_backoff_max_s=0.5, producer_factory=producer_factory)
    delivery.start()
    # the restarts at random chunks; the loss (if asked) after them, with two chunks still to come
    last = chunks - 2 if lose_broker else chunks
    plan = sorted(rng.sample(range(last), min(kills, last)))
    loss_at = chunks - 2 if lose_broker else None
    watchers: list[threading.Thread] = []
    try:
        for c, chunk in enumerate(stream.chunks(chunks)):
            for block in chunk:
                delivery.submit(block)
            report.records_sent += len(chunk)
            if c not in plan and c != loss_at:
                time.sleep(rng.uniform(0.2, 0.8))
                continue
            time.sleep(rng.uniform(0.0, 1.0))  # a random point of the stream's delivery and processing
            alive = [k for k, b in enumerate(cluster.brokers) if b.running]
            victim = alive[0] if c == loss_at else rng.choice(alive)
            delivered, committed = delivery.stats.delivered_total, _committed_sum(offsets)
            cluster.brokers[victim].kill()
            killed = time.monotonic()
            report.faults += 1
            say(f"fault {report.faults}: broker {victim} SIGKILLed at chunk {c} of {chunks}"
                + (", for good" if c == loss_at else ""))
            if c == loss_at:  # the stream goes on through the other broker: how soon does each side resume?
                report.brokers_lost = 1

                def producer(delivered: int = delivered, killed: float = killed) -> None:
                    report.producer_resumed_s = _until(lambda: delivery.stats.delivered_total > delivered, 120.0,
                                                       killed)

                def detectors_(committed: int = committed, killed: float = killed) -> None:
                    report.detectors_resumed_s = _until(lambda: _committed_sum(offsets) > committed, 120.0,
                                                        killed, every_s=0.5)

                watchers = [_thread(producer), _thread(detectors_)]
            else:
                time.sleep(rng.uniform(0.2, 1.0))
                cluster.brokers[victim].start()
                report.restarts += 1
        for watcher in watchers:
            watcher.join(130.0)
        if watchers:
            say(f"resumed after the loss: producer {report.producer_resumed_s} s, "
                f"detectors {report.detectors_resumed_s} s")
        for batch in stream.tail():
            delivery.submit(batch)
            report.records_sent += 1
        if _until(lambda: len(delivery.spool) == 0, 120.0, time.monotonic()) is None:
            report.problems.append(f"the probe's spool still held {len(delivery.spool)} records after 120 s")
        caught = time.monotonic()
        tail_per_partition = NODES_PER_JOB
        steps_end = {p: e - tail_per_partition for p, e in offsets.ends(Topic.STEPS.value).items()}

        def caught_up() -> bool:
            done = offsets.committed(f"{GROUP}-job", Topic.STEPS.value)
            if any(done[p] < end for p, end in steps_end.items()):
                return False
            findings_end = offsets.ends(Topic.FINDINGS.value)
            policy = offsets.committed(f"{GROUP}-policy", Topic.FINDINGS.value)
            return all(policy[p] >= end for p, end in findings_end.items())

        if _until(caught_up, catch_up_s, caught, every_s=1.0) is None:
            report.problems.append(f"the groups had not committed their inputs {catch_up_s} s after the stream "
                                   f"ended: job {offsets.committed(f'{GROUP}-job', Topic.STEPS.value)} of "
                                   f"{steps_end}")
        report.caught_up_s = round(time.monotonic() - caught, 1)
    finally:
        delivery.close(drain_timeout_s=5.0)
        report.records_acknowledged = delivery.stats.delivered_total
        report.acknowledged_without_offset = sum(p.read_back_total for p in producers)
        report.acknowledged_not_stored = sum(p.unplaced_total for p in producers)
        report.producer_rebuilt = max(0, len(producers) - 1)
        codes = [d.stop() for d in detectors]
        report.consumer_failovers = sum(d.failovers() for d in detectors)
    for d, code in zip(detectors, codes, strict=True):
        if code != 0:
            report.problems.append(f"{d.store_dir.name} exited {code}: {d.tail()}")
    _check(report, stream, reference, detectors, _alive_dsn(cluster))
    report.wall_s = round(time.monotonic() - started, 1)
    return report


def _committed_sum(offsets: _Offsets) -> int:
    try:
        return sum(offsets.committed(f"{GROUP}-job", Topic.STEPS.value).values())
    except Exception:  # a broker fault in progress: not advanced yet
        return -1


def _alive_dsn(cluster: Any) -> str:
    return "kafka://" + ",".join(b.bootstrap for b in cluster.brokers if b.running)


def _until(cond: Any, timeout_s: float, since: float, every_s: float = 0.1) -> float | None:
    """Seconds from ``since`` until ``cond()`` held, polled every ``every_s``; None if not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if cond():
                return round(time.monotonic() - since, 2)
        except Exception:  # noqa: BLE001 — a broker fault in progress: ask again
            pass
        if time.monotonic() > deadline:
            return None
        time.sleep(every_s)


def _check(report: Report, stream: Stream, reference: dict[str, int], detectors: list[Detector], dsn: str) -> None:
    from fleethealth.store import open_store

    expected = stream.expected()
    report.rank_steps_expected = len(expected)
    rank_steps: dict[tuple[str, int, int], float] = {}
    findings: dict[str, int] = {}
    for d in detectors[:2]:
        with open_store(f"chdb://{d.store_dir}") as store:
            rows = store.query("SELECT job, step, rank, compute_s FROM rank_steps FINAL "
                               f"WHERE step < {stream.steps}").rows
            keys = Counter((j, int(s), int(r)) for j, s, r, _ in rows)
            report.rank_steps_duplicated += sum(n - 1 for n in keys.values() if n > 1)
            for j, s, r, c in rows:
                if rank_steps.setdefault((j, int(s), int(r)), float(c)) != float(c):
                    report.problems.append(f"rank-step {(j, s, r)} stored with two values")
            for f in store.findings():
                if f.kind is not FindingKind.STRAGGLER or findings.setdefault(f.id, f.step) != f.step:
                    report.problems.append(f"unexpected finding {f.kind} {f.id} at step {f.step}")
    report.rank_steps_stored = len(rank_steps)
    report.rank_steps_missing = len(expected - set(rank_steps))
    report.findings = len(findings)
    if report.rank_steps_missing:
        report.problems.append(f"{report.rank_steps_missing} rank-steps missing")
    if report.rank_steps_duplicated:
        report.problems.append(f"{report.rank_steps_duplicated} rank-steps twice in one store (FINAL)")
    # one straggler finding, about the slow rank, concluded within MAX_STEP_DELTA steps of one uninterrupted
    # pipeline's. Its id names the episode's start, which a partition restored from a snapshot taken before
    # the episode began may date a step apart (README: "Not guaranteed"): reported, not asserted
    report.finding_same_id = set(findings) == set(reference)
    if len(findings) != len(reference):
        report.problems.append(f"findings {findings}, one uninterrupted pipeline's {reference}")
    else:
        report.finding_step_delta = max((abs(a - b) for a, b in zip(sorted(findings.values()),
                                                                    sorted(reference.values()), strict=True)),
                                        default=0)
        if report.finding_step_delta > MAX_STEP_DELTA:
            report.problems.append(f"findings {findings} concluded more than {MAX_STEP_DELTA} steps from one "
                                   f"uninterrupted pipeline's {reference}")
    with open_store(f"chdb://{detectors[2].store_dir}") as store:
        stored = [r for r in store.recommendations() if r.action.value != "none"]
    published = Counter(schema.decode(Recommendation, v).id for v in _published(dsn, Topic.RECOMMENDATIONS.value))
    report.recommendations_stored = len(stored)
    report.recommendations_published = len(published)
    report.recommendations_published_twice = sum(n - 1 for n in published.values() if n > 1)
    if not stored:
        report.problems.append("no recommendation stored (the straggler's evict)")
    if {r.id for r in stored} != set(published):
        report.problems.append(f"stored recommendations {sorted(r.id for r in stored)} != "
                               f"published {sorted(published)}")
    # published at least once per id: a flush that failed over to another broker publishes its records
    # again, and a copy the dead broker had already taken arrives twice, with the same id, which
    # `fleethealth act` drops (README, "No decision stored but never published"): counted, not an error


def _thread(fn: Any) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t
