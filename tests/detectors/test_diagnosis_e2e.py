"""Diagnosis through the real broker and chDB across load steps, on telemetry from independent GPU
physics (``thermal_fleet.py``: data-centre host names, racks reported by the nodes).

One timeline per test: a first job on every rack (the thermal models learn), idle, then job ``J``
on two racks from ``START`` (idle → busy), a neighbouring job starting on the third rack at
``NEIGHBOUR``, the fleet's power cap falling from 700 W to 450 W at ``CAP`` and ``J`` ending at
``END`` (busy → idle). ``J`` has two GPUs per node, one rank each, a step every 4 s; a rank whose
GPU throttles thermally runs 25 % slower.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fleethealth.bus import Producer
from fleethealth.detectors.runner import Runner
from fleethealth.schema import Action, Diagnosis, Message, StepBatch, Telemetry
from tests.detectors.thermal_fleet import Change, ThermalFleet

OWN_BROKER_PARTITIONS = 2  # own_broker (tests/detectors/conftest.py)
START, NEIGHBOUR, CAP, END = 900.0, 1_200.0, 1_400.0, 1_700.0
STEP_S = 4.0
T_BASE = 1_700_000_000.0  # event times are epoch seconds
JOB = "pretrain-7b"
SEED = 11


@pytest.fixture
def chdb(store):
    """The shared ``store`` fixture (tests/conftest.py): a migrated chDB path of the test's own."""
    return store


def _fleet(extra: list[Change]) -> ThermalFleet:
    f = ThermalFleet(racks=3, nodes_per_rack=3, gpus=2, every_s=8.0, seed=SEED)
    r0, r1, r2 = f.rack_names
    f.timeline += [Change(0.0, busy={r: True for r in f.rack_names}),
                   Change(600.0, busy={r: False for r in f.rack_names}),
                   Change(START, busy={r0: True, r1: True}), Change(NEIGHBOUR, busy={r2: True}),
                   Change(CAP, cap_w=450.0), Change(END, busy={r0: False, r1: False}), *extra]
    return f


def _traffic(fleet: ThermalFleet) -> tuple[list[Message], dict[tuple[str, int], float]]:
    """Telemetry of the whole run and job ``J``'s steps; returns them and each GPU's first throttled time."""
    samples = [dataclasses_replace_ts(s) for s in fleet.run(0.0, END + 120.0)]
    job_nodes = [n for n in fleet.nodes if fleet.rack_of[n] in fleet.rack_names[:2]]
    throttled_since: dict[tuple[str, int], float] = {}
    latest: dict[str, Telemetry] = {}
    by_ts: dict[float, list[Telemetry]] = {}
    for s in samples:
        by_ts.setdefault(s.ts, []).append(s)
    times = sorted(by_ts)
    rng = np.random.default_rng(5)
    steps: list[Message] = []
    i = 0
    for k, ts in enumerate(np.arange(T_BASE + START + STEP_S, T_BASE + END, STEP_S).tolist()):
        while i < len(times) and times[i] <= ts:
            for s in by_ts[times[i]]:
                latest[s.node] = s
                hot = np.flatnonzero(s.columns["clock_reasons"].astype(np.int64) & 0x60)
                for g in hot.tolist():
                    throttled_since.setdefault((s.node, g), s.ts)
            i += 1
        for n, node in enumerate(job_nodes):
            bits = latest[node].columns["clock_reasons"].astype(np.int64) & 0x60
            compute = 3.6 * np.exp(0.01 * rng.standard_normal(fleet.gpus)) * np.where(bits != 0, 1.25, 1.0)
            steps.append(StepBatch(job=JOB, step=k, node=node, ts=ts,
                                   ranks=np.arange(n * fleet.gpus, (n + 1) * fleet.gpus, dtype=np.int32),
                                   gpus=np.arange(fleet.gpus, dtype=np.int16), compute_s=compute))
    return [*samples, *steps], throttled_since


def _gpu0_off_bus(s: Telemetry) -> Telemetry:
    """``s`` with GPU 0 reading NaN in temperature and power, as a GPU fallen off the bus does."""
    import dataclasses

    columns = {name: col.copy() for name, col in s.columns.items()}
    i = int(np.flatnonzero(s.gpu == 0)[0])
    columns["temp_c"][i] = columns["power_w"][i] = np.nan
    return dataclasses.replace(s, columns=columns)


def dataclasses_replace_ts(s: Telemetry) -> Telemetry:
    import dataclasses

    return dataclasses.replace(s, ts=T_BASE + s.ts)


def _publish(dsn: str, messages: Iterable[Message]) -> int:
    n = 0
    with Producer(dsn, client_id="traffic", event_time_stamps=True) as producer:
        for msg in sorted(messages, key=lambda m: m.ts):
            producer.publish(msg)
            n += 1
        producer.flush()
    return n


def _detect(dsn: str, store, total: int, timeout_s: float = 300.0) -> None:
    """``fleethealth detect --until-caught-up`` over the broker: read every partition to its end,
    conclude what is held, write it."""
    with Runner(dsn, store, group=f"diag-{uuid.uuid4().hex[:6]}", publish=False,
                registry=CollectorRegistry()) as runner:
        runner.consumer.wait_assigned(timeout_s=60.0)
        deadline = time.monotonic() + timeout_s
        while not runner.caught_up(runner.process_once(0.5)):
            if time.monotonic() > deadline:
                raise AssertionError(f"not caught up after {timeout_s:.0f} s: read {runner.consumer.consumed_total} "
                                     f"of {total} records")
        runner.drain()
        assert runner.consumer.consumed_total >= total


def test_failing_gpus_at_a_job_start_and_a_power_cap_change_are_node_thermal_through_every_load_step(
        own_broker, chdb) -> None:
    """A GPU whose cooling fails as ``J`` starts, and another as the power cap falls: each its own
    ``NODE_THERMAL`` straggler within a few steps of throttling, evidence with the compared quantities;
    the job start, the neighbouring job, the cap change and the job end alert no one."""
    probe = ThermalFleet(racks=3, nodes_per_rack=3, gpus=2, seed=SEED)
    first, second = (probe.nodes[1], 1), (probe.nodes[4], 0)
    fleet = _fleet([Change(START, cooling={first: 2.2}), Change(CAP, cooling={second: 2.2})])
    messages, throttled = _traffic(fleet)
    assert first in throttled and second in throttled
    total = _publish(own_broker.dsn, messages)
    _detect(own_broker.dsn, chdb, total)
    stragglers = chdb.findings(kind="straggler")
    assert sorted((f.node, f.gpu) for f in stragglers) == sorted([first, second]), \
        [(f.node, f.gpu, f.diagnosis, f.ts) for f in stragglers]
    for f in stragglers:
        assert f.diagnosis is Diagnosis.NODE_THERMAL, f.evidence
        ev = f.evidence
        assert ev["rack"] == fleet.rack_of[f.node]
        assert ev["excess_c"] >= ev["node_excess_limit_c"] and ev["gpu_power_w"] < ev["peer_median_power_w"]
        assert {"temp_c", "peer_temp_at_power_c", "rack_residual_c", "gpu_residual_c"} <= set(ev)
        steps_late = (f.ts - throttled[(f.node, f.gpu)]) / STEP_S
        assert steps_late <= 20, f"{f.node} found {steps_late:.0f} steps after it throttled"
    recs = chdb.recommendations()
    assert not [r for r in recs if r.action is Action.ALERT_FACILITIES]
    assert {r.node for r in recs if r.action is Action.EVICT} <= {first[0], second[0]}


def test_a_hot_aisle_at_a_job_start_is_environmental_and_a_failing_gpu_in_it_is_its_own_finding(
        own_broker, chdb) -> None:
    """Rack 1's inlet runs 20 °C hot from before ``J`` starts: one rack finding, ``ENVIRONMENTAL``, and
    facilities alerted, no eviction for the aisle; a GPU in that rack whose cooling fails during the
    episode is a ``NODE_THERMAL`` straggler of its own, not absorbed into the episode."""
    probe = ThermalFleet(racks=3, nodes_per_rack=3, gpus=2, seed=SEED)
    aisle = probe.rack_names[1]
    in_aisle = [i for i, n in enumerate(probe.nodes) if probe.rack_of[n] == aisle]
    steady = probe.r[in_aisle] * 620.0 + probe.offset[in_aisle]  # the aisle's coolest GPU does not throttle
    i, g = np.unravel_index(int(np.argmin(steady)), steady.shape)
    failing = (probe.nodes[in_aisle[i]], int(g))
    fleet = _fleet([Change(START - 200, aisle={aisle: 20.0}), Change(NEIGHBOUR, cooling={failing: 2.2})])
    messages, throttled = _traffic(fleet)
    assert failing in throttled and throttled[failing] >= T_BASE + NEIGHBOUR
    total = _publish(own_broker.dsn, messages)
    _detect(own_broker.dsn, chdb, total)
    stragglers = chdb.findings(kind="straggler")
    rack_findings = [f for f in stragglers if f.detector == "straggler.rack"]
    assert rack_findings and all(f.diagnosis is Diagnosis.ENVIRONMENTAL for f in rack_findings)
    assert {f.evidence["rack"] for f in rack_findings} == {aisle}
    own = [f for f in stragglers if (f.node, f.gpu) == failing]
    assert own and own[0].diagnosis is Diagnosis.NODE_THERMAL and own[0].ts > rack_findings[0].ts, \
        [(f.node, f.gpu, f.diagnosis, f.detector) for f in stragglers]
    assert own[0].evidence["excess_c"] >= own[0].evidence["node_excess_limit_c"]
    others = [f for f in stragglers if f not in rack_findings and f not in own]
    assert not [f for f in others if fleet.rack_of[f.node] != aisle], others
    recs = chdb.recommendations()
    assert [r.node for r in recs if r.action is Action.ALERT_FACILITIES]
    assert not [r for r in recs if r.action is Action.EVICT and fleet.rack_of[r.node] == aisle
                and r.node != failing[0]]


def test_two_drains_in_one_reported_rack_of_data_centre_hosts_wait_for_a_human(own_broker, chdb) -> None:
    """Host names that say nothing of a rack (``dc1-r11-gpu00.example.net``), racks reported by the nodes'
    telemetry: an Xid 79 on a node, then on another node of the same rack, then on a node of another
    rack. The first and third drains are allowed, the second waits for a human (``same_rack``); every
    finding carries the rack its node reported."""
    from fleethealth.schema import Event, EventKind, Guard

    fleet = ThermalFleet(racks=3, nodes_per_rack=3, gpus=2, every_s=8.0, seed=SEED)
    fleet.timeline.append(Change(0.0, busy={r: True for r in fleet.rack_names}))
    samples = [dataclasses_replace_ts(s) for s in fleet.run(0.0, 200.0)]
    a, b, c = fleet.nodes[0], fleet.nodes[2], fleet.nodes[4]  # a and b share a rack, c is in the next one
    assert fleet.rack_of[a] == fleet.rack_of[b] != fleet.rack_of[c]
    lost = {a: T_BASE + 100.0, b: T_BASE + 120.0, c: T_BASE + 140.0}
    xids = [Event(node=node, ts=ts, kind=EventKind.XID, gpu=0, code=79) for node, ts in lost.items()]
    # an Xid 79 is the GPU falling off the bus: its own stream then reads NaN, which corroborates it
    samples = [_gpu0_off_bus(x) if x.node in lost and x.ts > lost[x.node] else x for x in samples]
    total = _publish(own_broker.dsn, [*samples, *xids])
    _detect(own_broker.dsn, chdb, total)
    findings = chdb.findings(kind="xid")
    assert {f.node: f.evidence["rack"] for f in findings} == {n: fleet.rack_of[n] for n in (a, b, c)}
    drains = {r.node: r for r in chdb.recommendations() if r.action is Action.DRAIN}
    assert drains[a].guard is Guard.ALLOWED and drains[c].guard is Guard.ALLOWED
    assert drains[b].guard is Guard.NEEDS_HUMAN and "same_rack" in drains[b].evidence["guards_fired"]
    assert fleet.rack_of[a] in drains[b].reason
