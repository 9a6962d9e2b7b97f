"""API fixtures: a real chDB store (``store`` from tests/conftest.py) filled with one small run.

The run ``train-1`` has 16 ranks on two nodes (``n0000`` GPUs 0-7, ``n0001`` GPUs 0-7) over 40
steps; rank 13 (n0001 GPU 5) computes 25 % slower, step 20 stalls for a checkpoint. Node
``n0001`` interrupted the run after step 24 (30 s restart, 4 steps lost) and is quarantined; two
SDC checks ran (the last failed); three recommendations exist. ``client`` is FastAPI's TestClient
over the real app and store.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from fleethealth.payloads.sdc_check import sdc_check_event
from fleethealth.policy import quarantine as qb
from fleethealth.schema import (
    Action,
    Diagnosis,
    Event,
    EventKind,
    Finding,
    FindingKind,
    Guard,
    Recommendation,
    StepBatch,
    Telemetry,
)

TOKEN = "s3cret-token-for-tests"
READ_TOKEN = "read-only-token-for-tests"
T0 = 1_795_900_000.0
STEP_S = 2.0
RESTART_S = 30.0


@dataclass
class Seeded:
    step_s: np.ndarray
    end_ts: np.ndarray
    recs: list[Recommendation] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)


def _seed(store) -> Seeded:
    rng = np.random.default_rng(7)
    steps = 40
    compute = STEP_S * (1 + 0.01 * rng.standard_normal((steps, 16)))
    compute[:, 13] *= 1.25
    compute[20, :] += 30.0  # a checkpoint stall
    # each step ends when its slowest rank does; the restart after step 24 adds RESTART_S
    end_ts = T0 + np.cumsum(compute.max(axis=1)) + RESTART_S * (np.arange(steps) > 24)
    batches = []
    for step in range(steps):
        for n, node in enumerate(("n0000", "n0001")):
            ranks = np.arange(8 * n, 8 * n + 8, dtype=np.int32)
            batches.append(StepBatch(job="train-1", step=step, node=node, ts=float(end_ts[step]),
                                     ranks=ranks, gpus=np.arange(8, dtype=np.int16), compute_s=compute[step, ranks]))
    store.insert_steps(batches)
    samples = []
    for node, rack, temp in (("n0000", "r00", 61.0), ("n0001", "r00", 88.0), ("n0002", "r00", 55.0)):
        for k in range(2):
            samples.append(Telemetry.from_columns(node, rack, T0 + 10 * k, list(range(8)),
                                                  temp_c=np.full(8, temp + k), power_w=np.full(8, 500.0),
                                                  util_pct=np.full(8, 99.0)))
    store.insert_telemetry(samples)
    store.insert_events([
        Event(node="n0001", ts=float(end_ts[24]) + 1.0, kind=EventKind.INTERRUPTION, job="train-1", step=24,
              data={"cause": "xid 79", "detected_by": "xid", "lost_steps": 4, "restart_s": RESTART_S,
                    "detection_s": 2.0, "isolation_s": 10.0, "reconfiguration_s": 6.0, "reload_s": 12.0}),
        sdc_check_event(ts=T0 + 40.0, check="selfcheck", passed=True, node="n0000", job="train-1", rank=0,
                        step=20),
        sdc_check_event(ts=T0 + 70.0, check="replay", passed=False, classification="persistent", node="n0001",
                        job="train-1", rank=13, step=30, culprit_rank=13, peer_ranks=[13, 5]),
    ])
    finding = Finding(kind=FindingKind.STRAGGLER, node="n0001", ts=T0 + 60.0, job="train-1", gpu=5, rank=13,
                      step=30, diagnosis=Diagnosis.NODE_THERMAL, z=6.1, slowdown=0.25, detector="straggler",
                      evidence={"temp_c": 88.0})
    store.insert_findings([finding])
    recs = [
        Recommendation(action=Action.EVICT, node="n0001", ts=T0 + 61.0, reason="thermal straggler",
                       guard=Guard.ALLOWED, job="train-1", finding_id=finding.id, evidence={"payback_s": 2400.0}),
        Recommendation(action=Action.QUARANTINE, node="n0001", ts=T0 + 71.0, reason="sdc: replay mismatch",
                       guard=Guard.ALLOWED, job="train-1", finding_id="sdc-1"),
        Recommendation(action=Action.ALERT_FACILITIES, node="n0002", ts=T0 + 80.0, reason="hot aisle r00",
                       guard=Guard.NEEDS_HUMAN, job=None, finding_id="env-1"),
    ]
    store.insert_recommendations(recs)
    qb.quarantine(store, "n0001", "sdc: replay mismatch", T0 + 71.0, finding_id="sdc-1", runs=["train-1"])
    return Seeded(step_s=compute.max(axis=1), end_ts=end_ts, recs=recs)


@pytest.fixture
def seeded(store) -> Seeded:
    return _seed(store)


def _client(store, seeded: Seeded):
    from fastapi.testclient import TestClient

    from fleethealth.api import create_app

    app = create_app(store, token=TOKEN, read_token=READ_TOKEN, max_rows=50, max_execution_s=1.0,
                     on_breaker_reset=lambda: seeded.hooks.append("reset"), clock=lambda: T0 + 3600.0)
    # an analyst's client: every request carries the read token unless a test passes its own header
    return TestClient(app, headers={"Authorization": f"Bearer {READ_TOKEN}"})


@pytest.fixture
def client(store, seeded) -> Iterator[object]:
    with _client(store, seeded) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory) -> Iterator[object]:
    """One seeded store for a whole module of read-only tests (chDB holds one path at a time, so a
    module using it must not also use the per-test ``store``)."""
    from fleethealth.store import open_store

    with open_store(f"chdb://{tmp_path_factory.mktemp('api')}/store") as opened:
        opened.migrate()
        opened.seeded = _seed(opened)
        yield opened


@pytest.fixture(scope="module")
def shared_client(shared_store) -> Iterator[object]:
    with _client(shared_store, shared_store.seeded) as test_client:
        yield test_client


@pytest.fixture
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}
