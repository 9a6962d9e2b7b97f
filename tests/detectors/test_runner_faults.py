"""Faults of real traffic, through the real broker and chDB: a whole job that hangs with every rank
level, a steps partition that stalls and resumes, NVLink error counters that climb on a GPU that is
not slow, a job whose last step never completes, a power brake across nodes, and a node whose driver
calls stall again and again.

Each test builds its traffic by hand (a small fleet: four nodes of two GPUs, one job, a step and a
telemetry sample every 2 s), publishes it to a broker of its own (the runner reads every input
topic from the beginning) and runs a :class:`Runner` over it into a chDB store.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fleethealth.bus import Consumer, Producer
from fleethealth.detectors.runner import Runner
from fleethealth.schema import Action, ClockReason, Event, EventKind, Guard, Message, StepBatch, Telemetry, Topic

NODES = [f"n{i:04d}" for i in range(4)]
GPUS = 2
T0 = 1_000.0
JOB = "train-x"


OWN_BROKER_PARTITIONS = 4  # own_broker (tests/detectors/conftest.py)


@pytest.fixture
def chdb(store):
    """The shared ``store`` fixture (tests/conftest.py): a migrated chDB path of the test's own."""
    return store


def _sample(node: str, ts: float, **cols: list[float]) -> Telemetry:
    i = NODES.index(node)
    base = {"temp_c": [55.0] * GPUS, "util_pct": [97.0] * GPUS, "clock_reasons": [0.0] * GPUS,
            "nvlink_crc_flit": [0.0] * GPUS, "nvlink_crc_data": [0.0] * GPUS, "nvlink_replay": [0.0] * GPUS,
            "nvlink_recovery": [0.0] * GPUS, "power_w": [650.0] * GPUS, "power_limit_w": [700.0] * GPUS}
    return Telemetry.from_columns(node, f"r{i // 2:02d}", ts, list(range(GPUS)), **{**base, **cols})


def _telemetry(start: float, stop: float, every: float = 2.0) -> list[Telemetry]:
    return [_sample(n, ts) for ts in np.arange(start, stop, every).tolist() for n in NODES]


def _step(step: int, node: str, ts: float) -> StepBatch:
    i = NODES.index(node)
    ranks = np.arange(i * GPUS, (i + 1) * GPUS, dtype=np.int32)
    return StepBatch(job=JOB, step=step, node=node, ts=ts, ranks=ranks, gpus=np.arange(GPUS, dtype=np.int16),
                     compute_s=np.full(GPUS, 1.9))


def _steps(first: int, last: int, *, missing: dict[int, str] | None = None) -> list[StepBatch]:
    """Steps ``first`` … ``last - 1``, step k at ``T0 + 2k``; ``missing``: step -> the node whose batch never comes."""
    missing = missing or {}
    return [_step(k, n, T0 + 2.0 * k) for k in range(first, last) for n in NODES if missing.get(k) != n]


def _publish(dsn: str, messages: Iterable[Message]) -> int:
    n = 0
    with Producer(dsn, client_id="traffic", event_time_stamps=True) as producer:
        for msg in messages:
            producer.publish(msg)
            n += 1
        producer.flush()
    return n


def _runner(dsn: str, store, group: str) -> Runner:
    # one member alone in its group: a poll interval long enough that a batch slowed by a loaded machine
    # does not cost it its partitions (a rebalance redelivers records, which these tests count)
    return Runner(dsn, store, group=group, publish=False, registry=CollectorRegistry(), session_timeout_s=2.0,
                  max_poll_interval_s=30.0)


def _consume(runner: Runner, total: int, timeout_s: float = 90.0) -> None:
    """Process until ``total`` records are read, then once more with an empty poll (releases the buffer)."""
    deadline = time.monotonic() + timeout_s
    while runner.consumer.consumed_total < total and time.monotonic() < deadline:
        runner.process_once(0.5)
    assert runner.consumer.consumed_total == total
    runner.process_once(0.2)


def test_a_hang_with_every_rank_level_is_reported_without_a_culprit_and_pages(own_broker, chdb) -> None:
    """Every rank stops after step 59 while all four nodes go on sending telemetry for ten minutes: one
    ``hang`` finding with no culprit rank (all level, last step 59), and the policy pages, drains nothing."""
    total = _publish(own_broker.dsn, [*_steps(0, 60), *_telemetry(T0, T0 + 120.0 + 600.0)])
    with _runner(own_broker.dsn, chdb, f"hang-{uuid.uuid4().hex[:6]}") as runner:
        _consume(runner, total)
    [hang] = chdb.findings(kind="hang")
    assert hang.job == JOB and hang.rank is None and hang.gpu is None and hang.step == 60
    ev = hang.evidence
    assert ev["culprit"] is False and ev["level"] is True and ev["last_step"] == 59 and ev["behind_ranks"] == []
    assert ev["nodes_reporting"] == len(NODES) and ev["stacks"] == []
    recs = chdb.recommendations()
    assert [r.action for r in recs] == [Action.PAGE]
    assert not [r for r in recs if r.action in (Action.DRAIN, Action.EVICT, Action.QUARANTINE)]


def test_a_job_that_finished_while_its_nodes_went_quiet_is_not_a_hang(own_broker, chdb) -> None:
    """The same stop with telemetry ending with the steps: finished or idle, no finding."""
    total = _publish(own_broker.dsn, [*_steps(0, 60), *_telemetry(T0, T0 + 120.0)])
    with _runner(own_broker.dsn, chdb, f"idle-{uuid.uuid4().hex[:6]}") as runner:
        _consume(runner, total)
        runner.drain()
    assert chdb.findings(kind="hang") == []


def test_a_stalled_steps_partition_is_not_a_hang_and_drains_no_node(own_broker, chdb) -> None:
    """The steps partition delivers nothing for ~60 s of event time while telemetry runs on (the clock
    passes the 30 s step timeout), then its backlog arrives with the event times the steps were made
    at: the job progressed all along. No hang, no node action."""
    group = f"stall-{uuid.uuid4().hex[:6]}"
    first = _publish(own_broker.dsn, [*_steps(0, 50), *_telemetry(T0, T0 + 160.0)])
    with _runner(own_broker.dsn, chdb, group) as runner:
        _consume(runner, first)
        assert runner.pipeline.now_ > T0 + 98.0 + 30.0  # past the deadline of the last step delivered
        second = _publish(own_broker.dsn, [*_steps(50, 150), *_telemetry(T0 + 160.0, T0 + 300.0)])
        _consume(runner, first + second)
    assert chdb.findings(kind="hang") == []
    assert [r for r in chdb.recommendations() if r.action is not Action.NONE] == []
    assert runner.pipeline.hang.clock_ahead_total_ >= 1  # the deadline was passed, then withdrawn


def test_climbing_nvlink_errors_on_a_gpu_that_is_not_slow_are_one_link_finding(own_broker, chdb) -> None:
    """GPU 1 of n0002 logs NVLink replays and CRC errors at a steady 30 a minute, then 300 a minute (its
    steps are as fast as everyone's): one ``link`` episode for that GPU (the rule holds with
    hysteresis), reported as a warning, re-reported when it turns critical; the policy reports the
    first and treats the second as a failure risk: a planned drain of the node."""
    tel = []
    for k, ts in enumerate(np.arange(T0, T0 + 600.0, 10.0).tolist()):
        for n in NODES:
            if n == "n0002":
                errs = max(0, k - 10) * 5.0 + max(0, k - 35) * 45.0
                tel.append(_sample(n, ts, nvlink_replay=[0.0, errs * 0.6], nvlink_crc_flit=[0.0, errs * 0.4]))
            else:
                tel.append(_sample(n, ts))
    total = _publish(own_broker.dsn, [*_steps(0, 300), *tel])
    with _runner(own_broker.dsn, chdb, f"link-{uuid.uuid4().hex[:6]}") as runner:
        _consume(runner, total)
    warning, critical = chdb.findings(kind="link")
    assert {(f.node, f.gpu, f.evidence["rule"]) for f in (warning, critical)} == {("n0002", 1, "nvlink")}
    assert warning.evidence["severity"] == "warning" and warning.evidence["errors_per_min"] >= 10.0
    assert critical.evidence["escalated_from"] == "warning" and critical.evidence["errors_per_min"] >= 100.0
    assert chdb.findings(kind="straggler") == []
    [watch] = [r for r in chdb.recommendations() if r.finding_id == warning.id]
    [rec] = [r for r in chdb.recommendations() if r.finding_id == critical.id]
    assert watch.action is Action.NONE
    assert rec.action is Action.DRAIN and rec.node == "n0002" and rec.evidence["planned"] is True


def test_offsets_of_a_last_step_that_never_completes_are_committed(own_broker, chdb) -> None:
    """The job's last step lacks n0003's batch and step 10 never completes either (its batch from n0001
    never comes); telemetry goes on. After the step timeout both steps are concluded and every offset
    is committed: a runner that restarts in the group reads nothing again."""
    group = f"commit-{uuid.uuid4().hex[:6]}"
    total = _publish(own_broker.dsn, [*_steps(0, 30, missing={10: "n0001", 29: "n0003"}),
                                      *_telemetry(T0, T0 + 200.0)])
    with _runner(own_broker.dsn, chdb, group) as runner:
        _consume(runner, total)
        runner.process_once(0.2)
    again = []
    with Consumer(own_broker.dsn, [Topic.STEPS.value, Topic.TELEMETRY.value, Topic.EVENTS.value], group,
                  session_timeout_s=2.0, max_poll_interval_s=2.0) as consumer:
        consumer.wait_assigned(30.0)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            again += consumer.poll(0.3)
    assert [r for r in again if r.topic == Topic.STEPS.value] == []
    assert runner.pipeline.open_steps() == set()
    stored = chdb.query(f"SELECT count() FROM rank_steps FINAL WHERE job = '{JOB}'").rows[0][0]
    assert stored == (30 * len(NODES) - 2) * GPUS


def test_a_power_brake_across_nodes_is_one_power_brake_finding_per_node_not_thermal(own_broker, chdb) -> None:
    """Every GPU of every node has its power brake asserted at 50 °C: four ``power_brake`` findings, one
    per node listing both GPUs, and no ``thermal`` finding."""
    brake = float(ClockReason.HW_POWER_BRAKE | ClockReason.HW_SLOWDOWN)
    tel = [_sample(n, ts, temp_c=[50.0] * GPUS, clock_reasons=[brake if 100 <= k < 130 else 0.0] * GPUS)
           for k, ts in enumerate(np.arange(T0, T0 + 400.0, 2.0).tolist()) for n in NODES]
    total = _publish(own_broker.dsn, tel)
    with _runner(own_broker.dsn, chdb, f"brake-{uuid.uuid4().hex[:6]}") as runner:
        _consume(runner, total)
    brakes = chdb.findings(kind="power_brake")
    assert sorted(f.node for f in brakes) == NODES
    assert all(f.gpu is None and f.evidence["gpus"] == [0, 1] for f in brakes)
    assert chdb.findings(kind="thermal") == []
    assert all(r.guard is Guard.ALLOWED and r.action is Action.NONE for r in chdb.recommendations())


def test_a_node_whose_driver_calls_stall_repeatedly_is_one_telemetry_stall_finding(own_broker, chdb) -> None:
    """n0001's probe reports ``telemetry_stalled`` three times in 200 s (the default rule: 3 within an
    hour) while its samples keep coming; n0002 stalls once. One ``telemetry_stall`` finding, on n0001,
    reported and not acted on."""
    tel = _telemetry(T0, T0 + 300.0, every=10.0)
    stalls = [Event(node=node, ts=ts, kind=EventKind.TELEMETRY_STALLED, data={"source": "nvml", "timeout_s": 5.0},
                    message="nvml source did not answer within 5 s")
              for node, ts in (("n0001", T0 + 50.0), ("n0002", T0 + 60.0), ("n0001", T0 + 150.0),
                               ("n0001", T0 + 250.0))]
    total = _publish(own_broker.dsn, [*tel, *stalls])
    with _runner(own_broker.dsn, chdb, f"stall-{uuid.uuid4().hex[:6]}") as runner:
        _consume(runner, total)
    (found,) = chdb.findings(kind="telemetry_stall")
    assert found.node == "n0001" and found.ts == T0 + 250.0
    assert found.evidence["stall_ts"] == [T0 + 50.0, T0 + 150.0, T0 + 250.0]
    (rec,) = [r for r in chdb.recommendations() if r.finding_id == found.id]
    assert rec.action is Action.NONE and rec.guard is Guard.ALLOWED
