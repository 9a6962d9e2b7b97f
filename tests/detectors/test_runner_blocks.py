"""Step blocks (several steps of one node in one ``fh.steps`` message) through the real broker, the
runner and chDB: every rank-step stored once, a straggler found as in the one-step form, and a block
with one bad value dead-lettered whole, naming the field."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import orjson
from prometheus_client import CollectorRegistry

from fleethealth.bus import Consumer, DeadLetter, Producer
from fleethealth.detectors.runner import Runner
from fleethealth.schema import StepBatch, StepBlock, Topic, encode
from fleethealth.store import open_store

OWN_BROKER_PARTITIONS = 2  # own_broker (tests/detectors/conftest.py)
NODES, GPUS, STEPS, PER_MESSAGE = 4, 8, 80, 10
SLOW_RANK = 13
T0 = 1_767_225_600.0


def _blocks(job: str) -> list[StepBlock]:
    """Four nodes of eight ranks, a step every 2 s, ten steps per node a message; rank 13 is 20 % slow
    from step 30 on."""
    rng = np.random.default_rng(7)
    times = 1.9 * np.exp(0.02 * rng.standard_normal((STEPS, NODES * GPUS)))
    times[30:, SLOW_RANK] *= 1.2
    out = []
    for lo in range(0, STEPS, PER_MESSAGE):
        for n in range(NODES):
            ranks = np.arange(n * GPUS, (n + 1) * GPUS, dtype=np.int32)
            out.append(StepBlock.of([StepBatch(job=job, step=k, node=f"n{n:04d}", ts=T0 + 2.0 * k, ranks=ranks,
                                               gpus=np.arange(GPUS, dtype=np.int16), compute_s=times[k, ranks])
                                     for k in range(lo, lo + PER_MESSAGE)]))
    return out


def test_blocks_are_stored_once_per_rank_step_and_the_straggler_in_them_is_found(own_broker, tmp_path: Path) -> None:
    job = f"blocks-{uuid.uuid4().hex[:6]}"
    blocks = _blocks(job)
    with Producer(own_broker.dsn, event_time_stamps=True) as producer:
        for block in blocks:
            producer.publish(block)
        producer.flush()
    with open_store(f"chdb://{tmp_path}/store") as store:
        store.migrate()
        with Runner(own_broker.dsn, store, group=f"g-{job}", publish=False, registry=CollectorRegistry(),
                    session_timeout_s=2.0, max_poll_interval_s=30.0, max_records=37) as runner:
            deadline = time.monotonic() + 60
            while runner.consumer.consumed_total < len(blocks) and time.monotonic() < deadline:
                runner.process_once(0.5)
            runner.process_once(0.2)
            runner.drain()
            assert runner.consumer.consumed_total == len(blocks)  # the runner takes a block as one record
            assert runner.consumer.dead_lettered_total == 0
        rows = store.query("SELECT count(), uniqExact(step, rank) FROM rank_steps FINAL WHERE job = {j:String}",
                           {"j": job}).rows[0]
        assert tuple(rows) == (STEPS * NODES * GPUS, STEPS * NODES * GPUS)
        raw = store.query("SELECT count() FROM rank_steps WHERE job = {j:String}", {"j": job}).rows[0][0]
        assert raw == STEPS * NODES * GPUS  # written once, not merged away
        stragglers = store.findings(kind="straggler", job=job)
    assert stragglers and {f.rank for f in stragglers} == {SLOW_RANK}
    assert {f.node for f in stragglers} == {"n0001"}


def test_a_block_with_one_bad_value_is_dead_lettered_whole_naming_the_field(own_broker) -> None:
    job = f"bad-{uuid.uuid4().hex[:6]}"
    good, bad = _blocks(job)[:2]
    obj = orjson.loads(encode(bad))
    obj["compute_s"][3][5] = -1.0  # one rank of one step
    with Producer(own_broker.dsn) as producer:
        producer.publish_raw(Topic.STEPS.value, orjson.dumps(obj), job.encode())
        producer.publish(good)
        producer.flush()
    got, letters = [], []
    with Consumer(own_broker.dsn, [Topic.STEPS.value], group=f"c-{job}", session_timeout_s=2.0,
                  max_poll_interval_s=2.0) as steps:
        deadline = time.monotonic() + 30
        while (len(got) < PER_MESSAGE or not steps.dead_lettered_total) and time.monotonic() < deadline:
            got += [r.msg for r in steps.poll(0.5) if r.msg.job == job]
        steps.commit()  # flushes the dead letters
    assert [b.step for b in got] == good.steps.tolist() and all(isinstance(b, StepBatch) for b in got)
    with Consumer(own_broker.dsn, [Topic.DEADLETTER.value], group=f"d-{job}", session_timeout_s=2.0,
                  max_poll_interval_s=2.0) as dead:
        deadline = time.monotonic() + 30
        while not letters and time.monotonic() < deadline:
            letters += [r.msg for r in dead.poll(0.2) if isinstance(r.msg, DeadLetter) and r.msg.key == job]
    [letter] = letters
    assert letter.reason.startswith("compute_s:") and f"step {int(bad.steps[3])}" in letter.reason


def test_the_steps_of_a_block_the_assembler_refuses_are_not_stored_and_the_rest_are(own_broker, tmp_path: Path) -> None:
    """A block whose last step claims a step far beyond the job's (a forged or corrupt counter): that
    step is refused, the block's other steps are stored and scored."""
    job = f"part-{uuid.uuid4().hex[:6]}"
    blocks = _blocks(job)[:8]  # steps 0-19 of the four nodes
    forged = blocks[-1]
    steps = forged.steps.copy()
    steps[-1] = 10**9
    blocks[-1] = StepBlock(job=job, node=forged.node, steps=steps, step_ts=forged.step_ts, ranks=forged.ranks,
                           gpus=forged.gpus, compute_s=forged.compute_s)
    with Producer(own_broker.dsn, event_time_stamps=True) as producer:
        for block in blocks:
            producer.publish(block)
        producer.flush()
    with open_store(f"chdb://{tmp_path}/store") as store:
        store.migrate()
        with Runner(own_broker.dsn, store, group=f"g-{job}", publish=False, registry=CollectorRegistry(),
                    session_timeout_s=2.0, max_poll_interval_s=30.0) as runner:
            deadline = time.monotonic() + 60
            while runner.consumer.consumed_total < len(blocks) and time.monotonic() < deadline:
                runner.process_once(0.5)
            runner.drain()
            assert runner.pipeline.assembler.implausible_total == 1 and runner.consumer.dead_lettered_total == 0
        got = store.query("SELECT step, count() FROM rank_steps FINAL WHERE job = {j:String} GROUP BY step "
                          "ORDER BY step", {"j": job}).rows
    assert [tuple(r) for r in got] == [(k, NODES * GPUS) for k in range(19)] + [(19, (NODES - 1) * GPUS)]
