"""A snapshot names where its state begins on every input partition of its unit, not only on those the
replica has committed.

A job-stage replica commits ``fh.steps`` and snapshots before any job event has come; later it reads
and commits an event, and is stopped before its next snapshot is due. The replica that takes the
partition over restores the snapshot: it must read that event again (the snapshot's state has not
seen it), not start ``fh.events`` at the group's newer commit and fold the rest in past a gap.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
from prometheus_client import CollectorRegistry

from fleethealth.bus import Producer
from fleethealth.detectors.runner import Runner
from fleethealth.detectors.snapshot import Snapshots
from fleethealth.detectors.stages import Stage
from fleethealth.schema import Event, EventKind, StepBatch, Topic

OWN_BROKER_PARTITIONS = 1
T0 = 1_767_225_600.0
JOB = "snap-offsets"
KEY = b"snapshot-offsets-test-key-0123456789"


def _batch(step: int) -> StepBatch:
    ranks = np.arange(8, dtype=np.int32)
    return StepBatch(job=JOB, step=step, node="gpu-host-a", ts=T0 + step, ranks=ranks,
                     gpus=ranks.astype(np.int16), compute_s=np.full(8, 0.1))


def _publish(dsn: str, messages: list) -> None:
    with Producer(dsn, client_id="traffic", event_time_stamps=True) as producer:
        for m in messages:
            producer.publish(m)
        producer.flush()


def _runner(dsn: str, store, group: str) -> Runner:
    return Runner(dsn, store, group=group, stage=Stage.JOB, registry=CollectorRegistry(), snapshot_every_s=3600.0,
                  snapshots=Snapshots(key=KEY),
                  publish=False, max_ahead_s=None, max_behind_s=None, session_timeout_s=2.0,
                  max_poll_interval_s=30.0)


def _until(runner: Runner, done, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        runner.process_once(0.3)


def _events_read(runner: Runner) -> float:
    return runner.metrics.records.labels(Topic.EVENTS.value)._value.get()


def test_a_restored_snapshot_reads_again_an_event_committed_after_it(own_broker, store) -> None:
    chdb = store
    group = f"snapoff-{uuid.uuid4().hex[:6]}"
    _publish(own_broker.dsn, [_batch(s) for s in range(5)])
    with _runner(own_broker.dsn, chdb, group) as first:
        first.consumer.wait_assigned(30.0)
        _until(first, lambda: first.snapshots_total >= 1, "the first snapshot, at the first commit")
        _, offsets, _ = chdb.load_snapshot(group, 0)
        # the snapshot names fh.events too, where this replica began reading it (nothing read: the start)
        assert offsets.get((Topic.EVENTS.value, 0)) == 0, offsets
        start = Event(node="gpu-host-a", ts=T0 + 5.5, kind=EventKind.JOB_START, job=JOB)
        _publish(own_broker.dsn, [start, *(_batch(s) for s in range(5, 10))])
        _until(first, lambda: first.consumer.committed().get((Topic.EVENTS.value, 0), 0) >= 1,
               "the event committed")
        assert first.snapshots_total == 1  # no snapshot since: the next is an hour away
    with _runner(own_broker.dsn, chdb, group) as second:
        second.consumer.wait_assigned(30.0)
        _until(second, lambda: second.restored_total >= 1 and _events_read(second) >= 1,
               "the restored replica reading the event its snapshot has not seen")
    assert _events_read(second) == 1
