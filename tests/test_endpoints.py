"""``/metrics`` and ``/healthz`` of the probe and ``fleethealth act`` over real HTTP: a degraded
process answers 503 with its reasons, a healthy one 200, and counts start at zero."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from fleethealth.adapters.act import ActMetrics
from fleethealth.adapters.base import ActionRecord, Outcome
from fleethealth.broker import free_port
from fleethealth.endpoints import Endpoints, health_body
from fleethealth.probe.metrics import ProbeHealth, ProbeMetrics
from fleethealth.schema import Action


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_health_body() -> None:
    assert health_body([]) == (200, b'{"status": "ok"}')
    code, body = health_body(["broker away"])
    assert code == 503 and json.loads(body) == {"status": "degraded", "reasons": ["broker away"]}


def test_probe_healthz_degrades_on_a_stall_and_a_lost_broker() -> None:
    state = {"h": ProbeHealth(bus_connected=1)}
    metrics = ProbeMetrics("gpu-017", health=lambda: state["h"])
    port = free_port()
    server = metrics.serve(port, "127.0.0.1")
    try:
        assert _get(port, "/healthz") == (200, b'{"status": "ok"}')
        state["h"] = ProbeHealth(bus_connected=0, stalled=1, spool_records=12)
        code, body = _get(port, "/healthz")
        reasons = json.loads(body)["reasons"]
        assert code == 503 and "stalled" in reasons[0] and "12 records spooled" in reasons[1]
        code, page = _get(port, "/metrics")  # the process still answers: liveness stays on /metrics
        assert code == 200 and b"fleethealth_probe_stalled 1" in page
        assert _get(port, "/nope")[0] == 404
    finally:
        server.shutdown()


def _record(outcome: Outcome) -> ActionRecord:
    return ActionRecord(recommendation_id="r1", scheduler="slurm", node="gpu-017", action=Action.DRAIN,
                        outcome=outcome, ts=1.0, rec_ts=1.0)


def test_act_metrics_count_outcomes_from_zero_and_degrade_on_refusals_and_a_stuck_loop() -> None:
    now = {"t": 0.0}
    metrics = ActMetrics(stall_s=60.0, failures_degraded=3, clock=lambda: now["t"], wall_clock=lambda: 1e9)
    page = metrics.render().decode()
    assert 'fleethealth_act_records_total{outcome="failed"} 0.0' in page  # present before it happens
    assert metrics.degraded() == []
    for _ in range(3):
        metrics.observe(_record(Outcome.FAILED))
    assert metrics.degraded() == ["the scheduler refused the last 3 actions"]
    metrics.observe(_record(Outcome.DONE))
    assert metrics.degraded() == []
    now["t"] = 61.0
    assert "no poll of fh.recommendations for 61 s" in metrics.degraded()[0]
    metrics.polled()
    assert metrics.degraded() == []
    page = metrics.render().decode()
    assert 'fleethealth_act_records_total{outcome="failed"} 3.0' in page
    assert "fleethealth_act_polls_total 1.0" in page


def test_a_health_check_that_raises_is_degraded_not_a_crash() -> None:
    def broken() -> list[str]:
        raise RuntimeError("lost")

    code, ctype, body = Endpoints(metrics=lambda: b"", health=broken).answer("/healthz")
    assert code == 503 and "RuntimeError: lost" in json.loads(body)["reasons"][0]
