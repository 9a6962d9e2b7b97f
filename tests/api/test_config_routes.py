"""``GET /v1/config`` and ``POST /v1/config/reload`` over the real app and a real chDB store: the
reload needs the write token (401 without one, 403 with the read token or a wrong one), applies a
live key, keeps a restart-only one and says so, refuses an invalid file whole with 422; the GET shows
the values in force, which keys are live, the file and its digest, and never a secret."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from fleethealth.api import create_app
from fleethealth.commands._settings import schema
from fleethealth.config import LiveSettings
from fleethealth.detectors.live import validate

TOKEN = "write-token-never-shown"
READ = "read-token-never-shown"
PASSWORD = "dsn-password-never-shown"


def _write(path, straggler: str) -> None:
    path.write_text(f'kafka = "kafka://svc:{PASSWORD}@broker:9092?sasl_password={PASSWORD}"\n'
                    f'[serve]\ntoken_file = "{path.parent / "token"}"\n[detect.straggler]\n{straggler}\n')


def test_reload_route_needs_the_write_token_and_get_shows_values_in_force_without_secrets(store, tmp_path) -> None:
    (tmp_path / "token").write_text(TOKEN)
    cfg = tmp_path / "fleethealth.toml"
    _write(cfg, "persistent_min = 0.5")
    live = LiveSettings(schema().load(file=cfg, environ={}), environ={}, validate=validate)
    registry = CollectorRegistry()
    live.register(registry)
    app = create_app(store, token=TOKEN, read_token=READ, registry=registry, live=live)
    with TestClient(app) as client:
        _write(cfg, "persistent_min = 0.03")
        assert client.post("/v1/config/reload").status_code == 401
        for wrong in (READ, "nope"):
            assert client.post("/v1/config/reload", headers={"Authorization": f"Bearer {wrong}"}).status_code == 403
        assert client.get("/v1/config").status_code == 401
        before = client.get("/v1/config", headers={"Authorization": f"Bearer {READ}"}).json()
        assert before["keys"]["detect.straggler.persistent_min"] == {"value": 0.5, "source": f"file {cfg}",
                                                                     "live": True}

        auth = {"Authorization": f"Bearer {TOKEN}"}
        _write(cfg, "persistent_min = 0.03\nfalse_rate = 5.0")  # out of range: refused whole
        refused = client.post("/v1/config/reload", headers=auth)
        assert refused.status_code == 422 and "false_rate" in refused.json()["detail"]
        assert live.current["detect.straggler.persistent_min"] == 0.5 and live.failures_total == 1

        _write(cfg, "persistent_min = 0.03")
        cfg.write_text(cfg.read_text().replace("9092", "9093"))  # kafka: restart-only
        done = client.post("/v1/config/reload", headers=auth).json()
        assert done["applied"] == {"detect.straggler.persistent_min": {"old": 0.5, "new": 0.03}}
        assert list(done["ignored_until_restart"]) == ["kafka"]
        shown = client.get("/v1/config", headers={"Authorization": f"Bearer {READ}"})
        body = shown.json()
        assert body["keys"]["detect.straggler.persistent_min"]["value"] == 0.03
        assert body["keys"]["kafka"]["live"] is False and "9092" in body["keys"]["kafka"]["value"]
        assert body["file"] == str(cfg) and body["digest"] == done["digest"] != before["digest"]
        assert body["reloads_total"] == 1 and body["reload_failures_total"] == 1
        metrics = client.get("/metrics").text
        assert "fleethealth_config_reload_failures_total 1.0" in metrics
    for secret in (TOKEN, READ, PASSWORD):
        assert secret not in shown.text and secret not in refused.text and secret not in str(done)
