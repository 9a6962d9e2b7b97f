"""The whole tier in one process (``--stage all``, what ``serve`` runs) restores its snapshot when it starts
again, and then finds what one uninterrupted runner finds: the fault's finding, with the same id."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from prometheus_client import CollectorRegistry

from fleethealth.bus import Producer
from fleethealth.detectors.runner import Runner
from fleethealth.detectors.snapshot import WHOLE, Snapshots
from fleethealth.sim import FleetSim, Scenario
from fleethealth.store import open_store

KEY = b"whole-tier-snapshot-test-key-32b"


def _ticks() -> list:
    scenario = Scenario.from_obj({
        "seed": 5, "fleet": {"racks": 2, "nodes_per_rack": 4, "gpus_per_node": 4},
        "job": {"id": "train-whole", "steps": 240, "step_time_s": 1.0},
        "faults": [{"kind": "thermal_straggler", "node": "n0005", "gpu": 1, "start_step": 60, "slowdown": 0.3}],
    })
    return list(FleetSim(scenario).run())


def _publish(dsn: str, ticks: list) -> None:
    with Producer(dsn, client_id="whole-fleet", event_time_stamps=True) as producer:
        for tick in ticks:
            for msg in (*tick.telemetry, *tick.batches, *tick.events):
                producer.publish(msg)
        producer.flush()


def _runner(dsn: str, store, group: str) -> Runner:
    return Runner(dsn, store, group=group, publish=False, registry=CollectorRegistry(), session_timeout_s=2.0,
                  max_poll_interval_s=5.0, max_ahead_s=None, max_behind_s=None, snapshot_every_s=0.0,
                  snapshots=Snapshots(key=KEY))


def _read_to_end(runner: Runner, expect: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        got = runner.process_once(0.3)
        if runner.consumer.consumed_total >= expect and runner.caught_up(got):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"read {runner.consumer.consumed_total} of {expect} records in 120 s")


def _stragglers(store) -> list[tuple]:
    return store.query("SELECT id, node, gpu, step, diagnosis FROM findings FINAL WHERE kind = 'straggler' "
                       "ORDER BY ts").rows


def test_a_restarted_whole_tier_restores_its_snapshot_and_finds_what_one_run_finds(own_broker, tmp_path: Path):
    ticks = _ticks()
    half = len(ticks) // 2
    first = sum(len(t.telemetry) + len(t.batches) + len(t.events) for t in ticks[:half])
    total = sum(len(t.telemetry) + len(t.batches) + len(t.events) for t in ticks)
    _publish(own_broker.dsn, ticks[:half])
    group = f"whole-{uuid.uuid4().hex[:8]}"
    with open_store(f"chdb://{tmp_path}/store") as store:
        store.migrate()
        with _runner(own_broker.dsn, store, group) as runner:  # stops without draining: as if killed
            _read_to_end(runner, first)
            assert runner.snapshots_total >= 1
            steps_before = runner.pipeline.steps_total_
        assert store.load_snapshot(group, WHOLE) is not None
        _publish(own_broker.dsn, ticks[half:])
        with _runner(own_broker.dsn, store, group) as runner:
            runner.process_once(0.3)
            deadline = time.monotonic() + 60
            while not runner.consumer.assignment() and time.monotonic() < deadline:
                runner.process_once(0.3)
            assert runner.restored_total == 1, "the whole tier started empty"
            assert runner.pipeline.steps_total_ >= steps_before - 20  # the state came back (less what it replays)
            _read_to_end(runner, total - first)
            runner.drain()
        restarted = _stragglers(store)
    with open_store(f"chdb://{tmp_path}/reference") as reference:
        reference.migrate()
        with _runner(own_broker.dsn, reference, f"one-{uuid.uuid4().hex[:8]}") as runner:
            _read_to_end(runner, total)
            runner.drain()
        once = _stragglers(reference)
    # the fault's straggler, found once, at the same step and with the same id as one uninterrupted run
    # finds it: a runner that restarted empty would learn the ranks' baselines again from its commit
    fault = [f for f in once if f[1:3] == ("n0005", 1)]
    assert len(fault) == 1, f"the reference run did not find the fault once: {once}"
    assert [f for f in restarted if f[1:3] == ("n0005", 1)] == fault
