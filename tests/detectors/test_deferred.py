"""Sample rows held over polls for one insert (``Runner(store_every_s=…)``, :mod:`detectors.deferred`).

On the real broker and chDB: a node-stage runner reading a trickle of telemetry holds the rows of every
poll until ``store_every_s`` of its clock passed (the clock is the test's, so nothing here depends on
timing), commits no offset past them meanwhile, and then writes them all in one insert; the end of the
input writes what is held. The pure part (what is held, its token, dropping a moved partition's rows)
is checked on :class:`DeferredSamples` directly. The kill test with held rows is
``tests/detectors/test_runner.py::test_sigkilled_runner_restarts_and_every_rank_step_is_stored_exactly_once``.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import Producer, Record
from fleethealth.detectors.deferred import DeferredSamples
from fleethealth.detectors.effects import Effects
from fleethealth.detectors.runner import Runner
from fleethealth.detectors.stages import Stage
from fleethealth.schema import StepBatch, Telemetry, Topic
from fleethealth.store import open_store

NODES, GPUS, SAMPLES = 6, 4, 30


def _telemetry(node: int, k: int) -> Telemetry:
    return Telemetry.from_columns(f"dc1-r{node % 2}-host{node}", f"r{node % 2}", 1_000.0 + k, list(range(GPUS)),
                                  temp_c=[60.0 + g for g in range(GPUS)], power_w=[300.0] * GPUS)


def _effects(msgs: list, partition: int, first_offset: int, token: str) -> Effects:
    records = [Record(Topic.TELEMETRY.value if isinstance(m, Telemetry) else Topic.STEPS.value, partition,
                      first_offset + i, None, m) for i, m in enumerate(msgs)]
    return Effects(taken=tuple(records), token=token,
                   telemetry=tuple(m for m in msgs if isinstance(m, Telemetry)),
                   steps=tuple(m for m in msgs if isinstance(m, StepBatch)),
                   origin_={id(r.msg): r for r in records})


def test_held_rows_are_due_by_age_size_or_end_and_name_their_first_offsets() -> None:
    held = DeferredSamples(10.0, max_rows=5)
    assert not held.due(0.0, final=True)  # nothing held: nothing to write
    held.add(_effects([_telemetry(0, 0), _telemetry(1, 0)], 0, 40, "a"), now=100.0)
    held.add(_effects([_telemetry(0, 1)], 1, 7, "b"), now=104.0)
    step = StepBatch(job="j", step=3, node="n", ts=1.0, ranks=np.arange(2, dtype=np.int32),
                     gpus=np.arange(2, dtype=np.int16), compute_s=np.ones(2))
    held.add(_effects([step], 0, 39, "c"), now=105.0)
    assert (len(held.telemetry), len(held.steps)) == (3, 1)
    assert held.first == {(Topic.TELEMETRY.value, 0): 40, (Topic.TELEMETRY.value, 1): 7, (Topic.STEPS.value, 0): 39}
    assert not held.due(109.9) and held.due(110.0) and held.due(101.0, final=True)
    assert held.token not in {"a", "b", "c"}  # one token naming the three steps' writes
    held.add(_effects([_telemetry(2, 1), _telemetry(3, 1)], 1, 8, "d"), now=106.0)
    assert held.due(106.0)  # 6 rows held, over max_rows

    # partition 1 moved away: its rows go, and with them its first offset; the token changes
    before = held.token
    assert held.discard(lambda rec: rec.partition == 1) == 3
    assert held.first == {(Topic.TELEMETRY.value, 0): 40, (Topic.STEPS.value, 0): 39}
    assert (len(held.telemetry), len(held.steps), held.since) == (2, 1, 100.0) and held.token != before
    held.clear()
    assert (len(held), held.first, held.since) == (0, {}, None)

    once = DeferredSamples(0.0, max_rows=5)  # 0: every poll's rows are due at once, under that poll's token
    once.add(_effects([_telemetry(0, 0)], 0, 1, "only"), now=0.0)
    assert once.due(0.0) and once.token == "only"
    with pytest.raises(ValueError, match="store_every_s"):
        DeferredSamples(-1.0, max_rows=5)


def test_a_node_stage_holds_a_trickle_of_telemetry_commits_nothing_past_it_then_writes_it_in_one_insert(
        own_broker: EmbeddedBroker, tmp_path: Path) -> None:
    with Producer(own_broker.dsn, client_id="held-fleet", event_time_stamps=True) as producer:
        for k in range(SAMPLES):
            for node in range(NODES):
                producer.publish(_telemetry(node, k))
        producer.flush()
    clock = [0.0]
    inserts: list[int] = []
    registry = CollectorRegistry()
    with open_store(f"chdb://{tmp_path}/store") as store:
        store.migrate()
        real = store.insert_telemetry

        def counted(samples, **kw):
            inserts.append(len(samples))
            return real(samples, **kw)

        store.insert_telemetry = counted  # type: ignore[method-assign]
        with Runner(own_broker.dsn, store, group=f"held-{uuid.uuid4().hex[:8]}", stage=Stage.NODE, max_records=13,
                    registry=registry, session_timeout_s=2.0, publish=False, snapshot_every_s=None,
                    store_every_s=60.0) as runner:
            runner.clock = lambda: clock[0]
            polls, deadline = 0, time.monotonic() + 60
            while time.monotonic() < deadline:
                polled = runner.process_once(0.3)
                polls += polled > 0
                clock[0] += 1.0  # one second of the runner's clock a poll: the trickle's pace
                if runner.caught_up(polled) and len(runner.buffer) == 0:
                    break
            assert runner.deferred.since is not None and clock[0] < runner.deferred.since + 60.0, \
                "the runner's clock passed store_every_s before the input was read"
            assert polls >= 10, "the input came in a few polls: nothing was held over polls"
            assert inserts == [] and store.query("SELECT count() FROM gpu_samples").rows[0][0] == 0
            held = len(runner.deferred.telemetry)
            assert held == NODES * SAMPLES, "every sample released so far is held (lateness keeps none back)"
            assert registry.get_sample_value("fleethealth_detect_held_sample_rows") == held
            ends = runner.consumer.offset_range(list(runner.deferred.first))
            committed = runner.consumer.committed()
            for tp, first in runner.deferred.first.items():
                assert committed.get(tp, 0) <= first < ends[tp][1]  # nothing committed past a held row

            assert runner.deferred.since is not None
            clock[0] = runner.deferred.since + 59.9
            runner.process_once(0.3)
            assert inserts == [], "written before store_every_s passed"
            clock[0] = runner.deferred.since + 60.0  # store_every_s passed since the first row was held
            runner.process_once(0.3)
            assert inserts == [NODES * SAMPLES], "the held rows of every poll went in one insert"
            assert len(runner.deferred) == 0 and runner.deferred.first == {}
            assert registry.get_sample_value("fleethealth_detect_held_sample_rows") == 0
            committed = runner.consumer.committed()
            assert all(committed[tp] == end for tp, (_, end) in ends.items()), (committed, ends)
    with open_store(f"chdb://{tmp_path}/store") as store:
        rows = store.query("SELECT count(), uniqExact(node, gpu, ts) FROM gpu_samples FINAL").rows[0]
    assert rows == (NODES * SAMPLES * GPUS, NODES * SAMPLES * GPUS)


def test_the_end_of_the_input_writes_what_is_held(own_broker: EmbeddedBroker, tmp_path: Path) -> None:
    with Producer(own_broker.dsn, client_id="held-end", event_time_stamps=True) as producer:
        for k in range(5):
            producer.publish(_telemetry(0, k))
        producer.flush()
    with open_store(f"chdb://{tmp_path}/store") as store:
        store.migrate()
        with Runner(own_broker.dsn, store, group=f"held-end-{uuid.uuid4().hex[:8]}", stage=Stage.NODE,
                    registry=CollectorRegistry(), session_timeout_s=2.0, publish=False, snapshot_every_s=None,
                    store_every_s=3600.0) as runner:
            deadline = time.monotonic() + 60
            while not runner.caught_up(runner.process_once(0.3)) and time.monotonic() < deadline:
                pass
            assert store.query("SELECT count() FROM gpu_samples").rows[0][0] == 0
            runner.drain()
            assert len(runner.deferred) == 0
        assert store.query("SELECT count() FROM gpu_samples FINAL").rows[0][0] == 5 * GPUS
