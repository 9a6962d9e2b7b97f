"""The HTTP API over a real chDB store (FastAPI's TestClient; nothing mocked).

Reads: recommendations with filters, nodes, run health and timeline, quarantine, breaker.
Writes need the bearer token: missing -> 401, wrong -> 403, and in both cases nothing is written.
"""

from __future__ import annotations

import numpy as np
import pytest

T0 = 1_795_900_000.0  # the seeded run's start (tests/api/conftest.py)


def test_every_route_is_in_the_published_openapi_schema(client):
    schema = client.get("/openapi.json").json()
    served = {(route.path, method.lower()) for route in client.app.routes
              if getattr(route, "include_in_schema", False) for method in route.methods}
    published = {(path, method) for path, ops in schema["paths"].items() for method in ops}
    assert served and served <= published, served - published
    for path in ("/v1/recommendations", "/v1/recommendations/{rec_id}/ack", "/v1/nodes", "/v1/nodes/{node}",
                 "/v1/runs/{job}/health", "/v1/runs/{job}/timeline", "/v1/quarantine",
                 "/v1/quarantine/{node}/release", "/v1/breaker/reset", "/v1/query", "/healthz", "/metrics"):
        assert path in schema["paths"], path
    assert "HTTPBearer" in schema["components"]["securitySchemes"]


def test_healthz_and_metrics(client):
    assert client.get("/healthz").json()["status"] == "ok"
    client.get("/v1/nodes/n9999")
    text = client.get("/metrics").text
    assert 'fleethealth_api_requests_total{method="GET",route="/v1/nodes/{node}",status="404"} 1.0' in text
    assert "fleethealth_api_request_duration_seconds_bucket" in text


def test_recommendations_filters(client, seeded):
    body = client.get("/v1/recommendations").json()
    assert body["count"] == 3
    assert [r["action"] for r in body["items"]] == ["alert_facilities", "quarantine", "evict"]  # newest first
    assert {r["id"] for r in body["items"]} == {r.id for r in seeded.recs}
    assert client.get("/v1/recommendations", params={"node": "n0001"}).json()["count"] == 2
    assert client.get("/v1/recommendations", params={"action": "evict"}).json()["items"][0]["evidence"] == {
        "payback_s": 2400.0}
    assert client.get("/v1/recommendations", params={"job": "train-1", "since": seeded.recs[1].ts}).json()[
        "count"] == 1
    assert client.get("/v1/recommendations", params={"job": "nope"}).json()["count"] == 0


@pytest.mark.parametrize("params", [{"action": "reboot"}, {"node": "n[0-9]"}, {"limit": 0}, {"since": "yesterday"},
                                    {"guard": "maybe"}])
def test_recommendations_malformed_filters_are_422(client, params):
    assert client.get("/v1/recommendations", params=params).status_code == 422


def test_ack_needs_the_token_and_is_idempotent(client, seeded, auth):
    rec_id = seeded.recs[0].id
    url = f"/v1/recommendations/{rec_id}/ack"
    missing = client.post(url, json={"by": "alice"}, headers={"Authorization": ""})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    # the read token the analyst's client carries does not write
    assert client.post(url, json={"by": "alice"}).status_code == 403
    assert client.post(url, json={"by": "alice"}, headers={"Authorization": "Bearer nope"}).status_code == 403
    assert client.post(url, json={"by": "alice"}, headers={"Authorization": "Basic YTpi"}).status_code == 401
    listed = {r["id"]: r for r in client.get("/v1/recommendations").json()["items"]}
    assert listed[rec_id]["acked_at"] is None  # nothing written by the refused requests
    first = client.post(url, json={"by": "alice"}, headers=auth).json()
    assert first["acknowledged"] is True
    assert first["recommendation"]["acked_by"] == "alice"
    assert first["recommendation"]["acked_at"] == pytest.approx(T0 + 3600.0)
    again = client.post(url, json={"by": "bob"}, headers=auth).json()
    assert again["acknowledged"] is False and again["recommendation"]["acked_by"] == "alice"
    listed = {r["id"]: r for r in client.get("/v1/recommendations").json()["items"]}
    assert listed[rec_id]["acked_by"] == "alice" and len(listed) == 3
    nodes = {n["node"]: n for n in client.get("/v1/nodes").json()["items"]}
    assert nodes["n0001"]["open_recommendations"] == 1


def test_ack_bad_input(client, auth):
    assert client.post("/v1/recommendations/0123456789abcdef01234567/ack", json={"by": "a"},
                       headers=auth).status_code == 404
    assert client.post("/v1/recommendations/not-hex!/ack", json={"by": "a"}, headers=auth).status_code == 422
    assert client.post("/v1/recommendations/0123456789abcdef/ack", json={}, headers=auth).status_code == 422
    assert client.post("/v1/recommendations/0123456789abcdef/ack", json={"by": "a", "x": 1},
                       headers=auth).status_code == 422


def test_server_without_token_refuses_writes(store, seeded):
    from fastapi.testclient import TestClient

    from fleethealth.api import create_app

    with TestClient(create_app(store, token=None, open_reads=True)) as open_client:
        url = f"/v1/recommendations/{seeded.recs[0].id}/ack"
        assert open_client.post(url, json={"by": "x"}, headers={"Authorization": "Bearer "}).status_code == 401
        assert open_client.post(url, json={"by": "x"}, headers={"Authorization": "Bearer x"}).status_code == 403
        assert open_client.get("/v1/nodes").status_code == 200


def test_nodes_and_node_detail(client):
    items = {n["node"]: n for n in client.get("/v1/nodes").json()["items"]}
    assert set(items) == {"n0000", "n0001", "n0002"}
    assert items["n0001"] == {"node": "n0001", "rack": "r00", "gpus": 8, "last_seen": pytest.approx(T0 + 10),
                              "max_temp_c": 89.0, "findings": 1, "open_recommendations": 2, "quarantined": True}
    detail = client.get("/v1/nodes/n0001").json()
    assert len(detail["gpus"]) == 8 and detail["gpus"][5]["temp_c"] == 89.0
    assert detail["findings"][0]["diagnosis"] == "NODE_THERMAL"
    assert {e["kind"] for e in detail["events"]} == {"interruption", "sdc_check"}
    assert detail["quarantine"]["runs_affected"] == ["train-1"]
    assert client.get("/v1/nodes/n0999").status_code == 404
    assert client.get("/v1/nodes/n0001;DROP").status_code == 422


def test_run_health(client, seeded):
    health = client.get("/v1/runs/train-1/health").json()
    assert health["steps"] == 40 and health["first_step"] == 0 and health["last_step"] == 39
    assert health["step_time_p50"] == pytest.approx(float(np.median(seeded.step_s)))
    assert health["step_time_max"] == pytest.approx(float(seeded.step_s.max()))
    slow = health["slowest_rank"]
    assert (slow["rank"], slow["node"], slow["gpu"]) == (13, "n0001", 5)
    assert slow["ratio_to_median"] == pytest.approx(1.25, abs=0.02)
    # goodput = (1 - overhead) x ideal / actual over the slowest rank's step times; the ideal
    # excludes the stalled step 20; overhead is the restart plus the 4 replayed steps over the wallclock
    from fleethealth.policy.goodput import ideal_step_time

    step_s = seeded.step_s
    ideal = ideal_step_time(step_s)
    assert ideal < float(np.median(step_s)) * 1.05 and health["goodput"]["excluded_steps"] >= 1
    wall = float(seeded.end_ts[-1] - (seeded.end_ts[0] - step_s[0]))
    overhead = (30.0 + 4 * ideal) / wall
    assert health["goodput"]["goodput"] == pytest.approx((1 - overhead) * ideal / step_s.mean(), rel=1e-6)
    assert [i["cause"] for i in health["interruptions"]] == ["xid 79"]
    assert [q["node"] for q in health["quarantined_nodes"]] == ["n0001"]
    assert health["sdc_checks"]["status"] == "fail" and health["sdc_checks"]["count"] == 2
    assert health["sdc_checks"]["failed"] == 1 and health["sdc_checks"]["last"]["data"]["check"] == "replay"
    assert client.get("/v1/runs/train-2/health").status_code == 404
    assert client.get("/v1/runs/%20bad/health").status_code == 422


def test_run_timeline(client):
    tl = client.get("/v1/runs/train-1/timeline").json()
    (one,) = tl["interruptions"]
    assert (one["node"], one["detected_by"], one["lost_steps"], one["restart_s"]) == ("n0001", "xid", 4, 30.0)
    assert tl["binding_phase"] == "reload_s" and tl["nodes"] == {"n0001": 1}
    assert client.get("/v1/runs/nope/timeline").status_code == 404


def _passing(node: str, ts: float) -> dict:
    """The suite-level record of a complete, passing full suite on the CPU."""
    from fleethealth.kernels.suite import expected_tests

    covered = [list(pair) for pair in sorted(expected_tests("full", ["cpu"]))]
    return {"node": node, "ts": ts, "suite": "full", "test": "suite", "device": "cpu", "verdict": "pass",
            "mismatches": [], "devices": ["cpu"], "covered": covered, "duration_s": 600.0}


def _stored(store, node: str, ts: float, **override) -> str:
    """A passing full self-test of ``node`` stored as the sweep or the detectors store it; its event id."""
    from fleethealth.schema import Event, EventKind

    data = {k: v for k, v in {**_passing(node, ts), **override}.items() if k not in ("node", "ts")}
    ev = Event(node=node, ts=ts, kind=EventKind.SELFTEST, data=data)
    store.insert_events([ev])
    return ev.id


def test_quarantine_release_needs_token_and_a_full_passing_selftest(client, store, auth):
    assert [q["node"] for q in client.get("/v1/quarantine").json()["items"]] == ["n0001"]
    url = "/v1/quarantine/n0001/release"
    good = _stored(store, "n0001", T0 + 100)
    assert client.post(url, json={"event_id": good}, headers={"Authorization": ""}).status_code == 401
    refused = client.post(url, json={"event_id": _stored(store, "n0001", T0 + 90, suite="quick")}, headers=auth)
    assert refused.status_code == 409 and "full" in refused.json()["detail"]
    stale = client.post(url, json={"event_id": _stored(store, "n0001", T0 + 1)}, headers=auth)
    assert stale.status_code == 409 and "predates" in stale.json()["detail"]
    assert client.get("/v1/quarantine").json()["count"] == 1
    assert client.post(url, json={}, headers=auth).status_code == 422
    ok = client.post(url, json={"event_id": good, "by": "ops"}, headers=auth)
    assert ok.status_code == 200 and ok.json()["released"] is True
    assert client.get("/v1/quarantine").json()["count"] == 0
    assert client.post(url, json={"event_id": good}, headers=auth).status_code == 404
    assert client.post("/v1/quarantine/n0777/release", json={"event_id": good}, headers=auth).status_code == 404


def test_release_evidence_from_the_request_body_is_refused(client, store, auth):
    """Issue 23 §3: a passing record in the body, or another node's stored result, releases nothing."""
    url = "/v1/quarantine/n0001/release"
    body = client.post(url, json={"evidence": _passing("n0001", T0 + 100)}, headers=auth)
    assert body.status_code == 422 and "stored self-test" in body.text
    other = _stored(store, "n0000", T0 + 100)
    assert client.post(url, json={"event_id": other}, headers=auth).status_code == 404
    assert client.get("/v1/quarantine").json()["count"] == 1


def test_with_signing_required_a_release_needs_the_nodes_own_signature(client, store, auth):
    """signing.mode = require: the stored suite record must carry the node's signature (the sweep on the
    node signs it); an unsigned one, or one a compromised node signed for another, releases nothing."""
    from fleethealth.schema import Event, EventKind
    from fleethealth.signing import KeyRing, Signer, sign_record

    secret = b"k" * 32
    client.app.state.release_keys = KeyRing(fleet_secret=secret)
    url = "/v1/quarantine/n0001/release"
    unsigned = client.post(url, json={"event_id": _stored(store, "n0001", T0 + 100)}, headers=auth)
    assert unsigned.status_code == 409 and "carries no signature" in unsigned.json()["detail"]

    def signed(signer, ts):
        data = {k: v for k, v in _passing("n0001", ts).items() if k not in ("node", "ts")}
        kid = signer.kid
        data = sign_record(signer, kid, ts, "selftest", data)
        ev = Event(node="n0001", ts=ts, kind=EventKind.SELFTEST, data=data)
        store.insert_events([ev])
        return ev.id

    forged = client.post(url, json={"event_id": signed(Signer.for_node(secret, "evil"), T0 + 110)}, headers=auth)
    assert forged.status_code == 409 and "signed by 'evil'" in forged.json()["detail"]
    assert client.get("/v1/quarantine").json()["count"] == 1
    ok = client.post(url, json={"event_id": signed(Signer.for_node(secret, "n0001"), T0 + 120)}, headers=auth)
    assert ok.status_code == 200 and ok.json()["released"] is True


def test_release_by_selftest_event_id(client, store, auth):
    url = "/v1/quarantine/n0001/release"
    ev = _stored(store, "n0001", T0 + 200.0)
    assert client.post(url, json={"event_id": "0" * 24}, headers=auth).status_code == 404
    assert client.post(url, json={"event_id": ev}, headers=auth).json()["released"] is True


def test_one_passing_test_or_an_incomplete_suite_does_not_release(client, store, auth):
    """A per-test selftest event of the full suite, and a suite record missing a test, are 409."""
    from fleethealth.schema import Event, EventKind

    one = Event(node="n0001", ts=T0 + 200.0, kind=EventKind.SELFTEST,
                data={"suite": "full", "test": "gemm_exact_fp32", "device": "cpu", "verdict": "pass",
                      "mismatches": []})
    store.insert_events([one])
    url = "/v1/quarantine/n0001/release"
    by_id = client.post(url, json={"event_id": one.id}, headers=auth)
    assert by_id.status_code == 409 and "one test" in by_id.json()["detail"]
    partial = _passing("n0001", T0 + 100)["covered"][1:]
    missing = client.post(url, json={"event_id": _stored(store, "n0001", T0 + 100, covered=partial)}, headers=auth)
    assert missing.status_code == 409 and "incomplete full suite" in missing.json()["detail"]
    assert client.get("/v1/quarantine").json()["count"] == 1


def test_breaker_reset(client, seeded, auth):
    assert client.get("/v1/breaker").json()["open"] is False
    assert client.post("/v1/breaker/reset", json={"by": "ops"}, headers={"Authorization": ""}).status_code == 401
    assert client.post("/v1/breaker/reset", json={"by": "ops"}).status_code == 403  # a read token
    assert client.post("/v1/breaker/reset", json={"by": "ops"},
                       headers={"Authorization": "Bearer x"}).status_code == 403
    assert seeded.hooks == []
    out = client.post("/v1/breaker/reset", json={"by": "ops", "reason": "rack r02 fixed"}, headers=auth).json()
    assert out["open"] is False and out["reset_by"] == "ops: rack r02 fixed" and out["engine"] is True
    assert out["reset_ts"] == pytest.approx(T0 + 3600.0)
    assert seeded.hooks == ["reset"]
    assert client.get("/v1/breaker").json()["reset_by"] == "ops: rack r02 fixed"


def test_public_surface_and_light_client():
    import subprocess
    import sys

    import fleethealth.api as api

    assert set(api.__all__) == {"create_app", "query_via_api", "server_running", "check_select", "QueryRefused"}
    assert all(callable(getattr(api, name)) for name in api.__all__)
    # the CLI's client needs neither FastAPI nor pydantic
    code = "import sys, fleethealth.api.client; print('fastapi' in sys.modules, 'pydantic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
