"""``GET /v1/runs/{job}/health`` carries the checkpoint interval from what the store measured, on real chDB.

A job of 4 nodes checkpoints every 10 minutes (each save blocks 2 s, writes 30 s in the background)
for 12 hours; another job of 8 nodes runs beside it. Then a flaky rack interrupts the first job
three times in an hour: the interval the route recommends shortens.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fleethealth.payloads.checkpoint import checkpoint_event
from fleethealth.payloads.checkpoint_cost import checkpoint_cost_event
from fleethealth.schema import Event, EventKind, StepBatch

T0 = 1_796_000_000.0
H = 3600.0
DAY = 86400.0


def _steps(job: str, nodes: list[str], hours: float, every_s: float = 60.0) -> list[StepBatch]:
    out = []
    for k, ts in enumerate(np.arange(T0, T0 + hours * H + 1, every_s)):
        for n, node in enumerate(nodes):
            out.append(StepBatch(job=job, step=k, node=node, ts=float(ts), ranks=np.array([2 * n, 2 * n + 1],
                                 dtype=np.int32), gpus=np.array([0, 1], dtype=np.int16),
                                 compute_s=np.array([1.0, 1.0])))
    return out


def _stop(job: str, node: str, ts: float, sid: str, *, phases=(30.0, 60.0, 240.0, 90.0)) -> Event:
    d, i, c, r = phases
    return Event(node=node, ts=ts, kind=EventKind.INTERRUPTION, job=job, step=10,
                 data={"interruption_id": sid, "cause": "gpu_failure", "detected_by": "job_exit", "restarted": True,
                       "detection_s": d, "isolation_s": i, "reconfiguration_s": c, "reload_s": r,
                       "restart_s": i + c + r})


@pytest.fixture
def client(store):
    from fastapi.testclient import TestClient

    from fleethealth.api import create_app

    store.insert_steps(_steps("llm-a", ["gpu-a1", "gpu-a2", "gpu-b1", "gpu-b2"], 12))
    store.insert_steps(_steps("llm-b", [f"gpu-c{k}" for k in range(8)], 12, every_s=600.0))
    events = []
    for k in range(72):  # every 10 minutes for 12 h
        ts = T0 + 300.0 + 600.0 * k
        events.append(checkpoint_event(ts=ts, step=10 * k, uri=f"s3://ckpt/llm-a/{k}", last_verified_step=None,
                                       job="llm-a", node="gpu-a1"))
        events.append(checkpoint_cost_event(ts=ts + 32.0, step=10 * k, blocking_s=2.0 if k % 2 else 3.0,
                                            write_s=30.0, job="llm-a", node="gpu-a1"))
    events += [_stop("llm-a", "gpu-a2", T0 + 2 * H, "a-1"), _stop("llm-b", "gpu-c3", T0 + 5 * H, "b-1")]
    store.insert_events(events)
    app = create_app(store, token=None, open_reads=True)
    with TestClient(app) as test_client:
        yield test_client


def test_health_carries_the_interval_and_a_flaky_rack_shortens_it(client, store):
    before = client.get("/v1/runs/llm-a/health").json()["checkpoint"]
    assert set(before) >= {"interval_s_now", "interval_s_recommended", "mtbf_s", "c_s", "r_s", "overhead_now",
                           "overhead_at_optimum", "basis"}
    # the inputs, recomputed from what is stored
    c_s = float(np.mean([2.0 if k % 2 else 3.0 for k in range(52, 72)]))   # the last 20 saves
    lam_node = (6.5e-3 * 1000 + 1) / (1000 + 8 * 12 / 24)                   # llm-b: 1 stop over 8 nodes × 12 h
    prior_mtbf = DAY / (lam_node * 4)
    mtbf = (DAY + 12 * H) / (DAY / prior_mtbf + 1)
    assert before["c_s"] == pytest.approx(c_s) and before["mtbf_s"] == pytest.approx(mtbf)
    assert before["r_s"] == pytest.approx(30 + 60 + 240 + 90)
    assert before["interval_s_now"] == pytest.approx(600.0)
    assert before["interval_s_recommended"] == pytest.approx(math.sqrt(2 * c_s * mtbf))
    assert before["overhead_now"] == pytest.approx(c_s / 600 + 600 / (2 * mtbf) + 420 / mtbf)
    assert before["restart_term"] == pytest.approx(420 / mtbf)
    assert before["basis"]["c"] == {"source": "measured", "samples": 20, "write_s_max": 30.0}
    assert before["basis"]["mtbf"]["fleet_jobs"] == 1 and before["basis"]["window_s"] == 7 * DAY

    # a flaky rack: three more stops of llm-a on rack b's nodes in its last hours
    store.insert_events([_stop("llm-a", node, T0 + 10 * H + k * 1200.0, f"rack-{k}")
                         for k, node in enumerate(["gpu-b1", "gpu-b2", "gpu-b1"])])
    after = client.get("/v1/runs/llm-a/health").json()["checkpoint"]
    assert after["basis"]["mtbf"]["job_interruptions"] == 4
    assert after["mtbf_s"] == pytest.approx((DAY + 12 * H) / (DAY / prior_mtbf + 4))
    assert after["interval_s_recommended"] < 0.6 * before["interval_s_recommended"]
    assert after["restart_term"] > 3 * before["restart_term"]   # the part no interval changes grew too


def test_a_job_without_checkpoints_gets_the_defaults_and_says_so(client):
    cp = client.get("/v1/runs/llm-b/health").json()["checkpoint"]
    assert cp["interval_s_now"] is None and cp["overhead_now"] is None
    assert cp["c_s"] == 30.0 and cp["basis"]["c"]["source"] == "default"
    assert cp["basis"]["r"]["source"] == "job" and cp["basis"]["mtbf"]["nodes"] == 8


def test_serve_refuses_a_bad_interval_setting_before_starting(capsys):
    from fleethealth.commands import main

    assert main(["serve", "--set", "policy.interval.method=guess"]) == 2
    assert "unknown method 'guess' (known: young, daly)" in capsys.readouterr().err
