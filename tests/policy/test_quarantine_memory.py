"""Quarantine has one home, the book: the runner books the engine's allowed quarantines and drains, and a
node released from the book (through the API's or a sweep's ``release``) is forgotten by the engine, so a
new SDC on it is quarantined again — on the real broker and chDB."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fleethealth.bus import Producer, ensure_topics
from fleethealth.detectors.runner import Runner
from fleethealth.kernels.suite import expected_tests
from fleethealth.payloads.sdc_check import sdc_check_event
from fleethealth.policy.engine import PolicyEngine
from fleethealth.policy.quarantine import history, record, release
from fleethealth.schema import Action, Guard, StepBatch

T0 = 1_800_000_000.0
NODE = "dc2-r14-gpu031"



@pytest.fixture
def broker():
    """A broker of this test's own: the session's holds other tests' records, which a group reading
    from the beginning would take as this test's (and, under signing.mode = require, dead-letter)."""
    from fleethealth.broker import EmbeddedBroker

    with EmbeddedBroker() as running:
        yield running


def _full_pass(ts: float) -> dict:
    covered = [list(pair) for pair in sorted(expected_tests("full", ["cpu"]))]
    return {"suite": "full", "test": "suite", "device": "cpu", "verdict": "pass", "mismatches": [], "node": NODE,
            "ts": ts, "devices": ["cpu"], "covered": covered, "duration_s": 310.0}


def _sdc(ts: float, step: int, *, passed: bool = False):
    return sdc_check_event(ts=ts, check="selfcheck", passed=passed, classification=None if passed else "transient",
                           node=NODE, job="train-7", rank=3, gpu=3, step=step)


def _steps(ts: float, step: int) -> StepBatch:
    """The job's step stream placing rank 3 on the node: what corroborates a single failing check."""
    return StepBatch(job="train-7", step=step, node=NODE, ts=ts, ranks=np.array([2, 3], dtype=np.int32),
                     gpus=np.array([2, 3], dtype=np.int16), compute_s=np.array([1.0, 1.0]))


def _run(runner: Runner, producer: Producer, events: list) -> None:
    for ev in events:
        producer.publish(ev)
    producer.flush()
    want = runner.consumer.consumed_total + len(events)
    deadline = time.monotonic() + 60
    while runner.consumer.consumed_total < want:
        if time.monotonic() > deadline:
            raise AssertionError(f"the runner read {runner.consumer.consumed_total} of {want} records in 60 s")
        runner.process_once(0.5)
    runner.drain()


def test_a_released_node_hit_by_a_new_sdc_is_quarantined_again(broker, store) -> None:
    ensure_topics(broker.dsn, partitions=1)
    with Producer(broker.dsn, event_time_stamps=True) as producer, \
            Runner(broker.dsn, store, group=f"q-{uuid.uuid4().hex[:8]}", publish=False, registry=CollectorRegistry(),
                   session_timeout_s=2.0, max_poll_interval_s=30.0, max_ahead_s=None, max_behind_s=None) as runner:
        _run(runner, producer, [_steps(T0, 99), _sdc(T0, 100)])
        booked = record(store, NODE)
        assert booked is not None and booked.reason.startswith("quarantine: silent data corruption")
        assert booked.runs_affected == ("train-7",) and NODE in runner.policy.engine.quarantined_
        # the node passes a full self-test and is released through the book (as the API route and sweeps do)
        assert release(store, NODE, T0 + 600.0, _full_pass(T0 + 500.0))
        assert record(store, NODE) is None
        # back in a job, its checks pass; a new fault on it an hour later: quarantined again, not "already
        # quarantined"
        _run(runner, producer, [_sdc(T0 + 3000.0, 800, passed=True), _steps(T0 + 3600.0, 899),
                                _sdc(T0 + 3600.0, 900)])
    quarantines = sorted((r for r in store.query(
        "SELECT action, guard, reason, ts FROM recommendations FINAL WHERE node = {n:String} ORDER BY ts",
        {"n": NODE}).dicts() if r["action"] == Action.QUARANTINE.value), key=lambda r: r["ts"])
    assert [(r["action"], r["guard"]) for r in quarantines] == [("quarantine", Guard.ALLOWED.value)] * 2, quarantines
    again = record(store, NODE)
    assert again is not None and again.since == T0 + 3600.0
    assert [h.action for h in history(store, NODE)] == ["quarantine", "release", "quarantine"]


def test_the_book_wins_over_the_engine_memory(store) -> None:
    """A drained or quarantined node the book no longer holds is forgotten; one it holds is kept; an engine
    that remembers no node does not read the book."""
    from fleethealth.policy.persist import sync_quarantine
    from fleethealth.policy.quarantine import quarantine

    engine = PolicyEngine()
    assert sync_quarantine(store, engine) == []
    engine.quarantined_ |= {"a", "b"}
    engine.drained_ |= {"c"}
    quarantine(store, "a", "quarantine: sdc", T0)
    assert sync_quarantine(store, engine) == ["b", "c"]
    assert engine.quarantined_ == {"a"} and engine.drained_ == set()
