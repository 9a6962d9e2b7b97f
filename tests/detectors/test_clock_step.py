"""A node whose clock steps an hour (an NTP correction) in the middle of a job: its records are
dead-lettered with the reason, naming ``ts`` and the bound, and the detectors raise no false hang
and no false straggler.

The record timestamp is the broker's clock here (what a topic with ``LogAppendTime`` gives, and the
only clock that bounds every producer): a producer's own ``CreateTime`` steps with its event times,
so against it a stepped clock is invisible. An hour ahead passes ``detect.runner.max_ahead_s``
(300 s by default). An hour behind is within the default ``detect.runner.max_behind_s`` (a day,
so that a spool replayed after a long outage is accepted); a deployment that wants a backward step
caught sets it below the step (here 1,800 s) and gives up replays of outages longer than that;
within the default bound the hour-old records are taken as late data: the stepped node's stretch can
then reach the hang detector an hour ahead of the other nodes' steps in event time, and the others, at
lower steps, must not read as the job resuming after an hour's whole-job hang (the third case).
Real broker (Tansu), real chDB, the runner in process.
"""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fleethealth import schema
from fleethealth.bus import Producer
from fleethealth.detectors.runner import Runner
from fleethealth.schema import FindingKind, StepBatch, Telemetry, Topic
from fleethealth.store import open_store

OWN_BROKER_PARTITIONS = 2  # own_broker (tests/detectors/conftest.py)
NODES = [f"host-{c}" for c in "abcd"]
GPUS = 4
STEPS, STEP_FROM, STEP_TO = 90, 30, 60
"""Steps 0 … 89, every 2 s; the stepped node's clock is off for steps 30 … 59, then NTP sets it right."""
STEPPED = "host-c"


@pytest.fixture
def chdb(tmp_path):
    with open_store(f"chdb://{tmp_path}/store") as store:
        store.migrate()
        yield store


def _traffic(t0: float, shift_s: float) -> list[tuple[object, float]]:
    """(message, the broker's time) for every step batch and telemetry sample, the stepped node's event
    times off by ``shift_s`` while its clock is wrong."""
    out: list[tuple[object, float]] = []
    for k in range(STEPS):
        true = t0 + 2.0 * k
        for i, node in enumerate(NODES):
            ts = true + (shift_s if node == STEPPED and STEP_FROM <= k < STEP_TO else 0.0)
            out.append((StepBatch(job="clock-job", step=k, node=node, ts=ts,
                                  ranks=np.arange(i * GPUS, (i + 1) * GPUS, dtype=np.int32),
                                  gpus=np.arange(GPUS, dtype=np.int16),
                                  compute_s=np.full(GPUS, 1.9) + 0.01 * np.sin(k + np.arange(GPUS))), true))
            out.append((Telemetry.from_columns(node, "rack-1", ts, list(range(GPUS)), temp_c=[55.0] * GPUS,
                                               util_pct=[97.0] * GPUS, power_w=[650.0] * GPUS), true))
    return out


def _dead_letters(dsn: str) -> list[dict]:
    from kafka import KafkaConsumer

    kc = KafkaConsumer(Topic.DEADLETTER.value, bootstrap_servers=dsn.removeprefix("kafka://"), group_id=None,
                       auto_offset_reset="earliest", enable_auto_commit=False, consumer_timeout_ms=2000)
    try:
        return [json.loads(r.value) for r in kc]
    finally:
        kc.close(autocommit=False)


@pytest.mark.parametrize(("shift_s", "max_behind_s"),
                         [(3600.0, 86_400.0), (-3600.0, 1800.0), (-3600.0, 86_400.0)],
                         ids=["ahead", "behind", "behind-within-default-bound"])
def test_a_node_clock_stepping_an_hour_is_dead_lettered_and_raises_no_false_hang_or_straggler(
        own_broker, chdb, shift_s, max_behind_s) -> None:
    t0 = time.time() - 2.0 * STEPS - 60.0
    traffic = _traffic(t0, shift_s)
    with Producer(own_broker.dsn, client_id="clock") as producer:
        for msg, broker_time in traffic:  # the record timestamp is the broker's clock (LogAppendTime)
            producer.publish_raw(msg.TOPIC.value, schema.encode(msg), msg.key.encode(),
                                 timestamp_ms=int(broker_time * 1000))
        producer.flush()
    with Runner(own_broker.dsn, chdb, group=f"clock-{uuid.uuid4().hex[:6]}", publish=False,
                registry=CollectorRegistry(), session_timeout_s=2.0, max_poll_interval_s=30.0,
                max_ahead_s=300.0, max_behind_s=max_behind_s) as runner:
        deadline = time.monotonic() + 90.0
        while runner.consumer.consumed_total + runner.consumer.dead_lettered_total < len(traffic):
            if time.monotonic() > deadline:
                raise AssertionError(f"read {runner.consumer.consumed_total} and dead-lettered "
                                     f"{runner.consumer.dead_lettered_total} of {len(traffic)} records in 90 s")
            runner.process_once(0.5)
        runner.drain()
        dead = runner.consumer.dead_lettered_total
    caught = shift_s > 0 or -shift_s > max_behind_s
    # a step batch and a sample per step while the clock was wrong; none when the bound allows the step
    stepped = 2 * (STEP_TO - STEP_FROM) if caught else 0
    letters = _dead_letters(own_broker.dsn)
    bound = "max_ahead_s=300" if shift_s > 0 else f"max_behind_s={max_behind_s:g}"
    assert dead == len(letters) == stepped, (dead, len(letters))
    assert all(d["reason"].startswith("ts: event time") and bound in d["reason"] for d in letters), letters[:2]
    assert {json.loads(d["raw"])["node"] for d in letters} == ({STEPPED} if caught else set())
    kinds = [f.kind for f in chdb.findings()]
    assert FindingKind.HANG not in kinds and FindingKind.STRAGGLER not in kinds, \
        [(f.kind, f.step, f.node, f.ts - t0, f.evidence) for f in chdb.findings()]
    stored = chdb.query("SELECT count() FROM rank_steps FINAL WHERE job = 'clock-job'").rows[0][0]
    print(f"clock stepped {shift_s:+.0f} s on {STEPPED}: {dead} records dead-lettered ({bound}), "
          f"{stored} rank-steps stored, findings {sorted(k.value for k in kinds)}")
    assert stored == len(NODES) * GPUS * STEPS - (GPUS * (STEP_TO - STEP_FROM) if caught else 0)
