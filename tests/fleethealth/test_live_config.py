"""``LiveSettings``: a reload is refused whole for an unparsable file or an unknown key (old values kept,
counted), keeps the environment's precedence, applies only at ``take`` and shows no DSN secret."""

from __future__ import annotations

import pytest

from fleethealth.commands._settings import schema
from fleethealth.config import LiveSettings, shown_value
from fleethealth.detectors.live import validate
from fleethealth.errors import ConfigError


def _live(tmp_path, text: str, environ: dict[str, str] | None = None) -> tuple[LiveSettings, object]:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    env = environ or {}
    return LiveSettings(schema().load(file=cfg, environ=env), environ=env, validate=validate), cfg


def test_a_bad_file_is_refused_whole_and_the_old_values_stay(tmp_path) -> None:
    live, cfg = _live(tmp_path, "[detect.straggler]\npersistent_min = 0.5\n")
    for text, why in (("[detect.straggler\npersistent_min = 0.03\n", "not valid TOML"),
                      ("[detect.straggler]\npersistent_min = 0.03\nno_such_key = 1\n", "unknown config key"),
                      ("[detect.straggler]\npersistent_min = 0.03\nmin_group = 2\n", "min_group")):
        cfg.write_text(text)
        with pytest.raises(ConfigError, match=why):
            live.reload()
    assert live.failures_total == 3 and live.take() is None
    assert live.current["detect.straggler.persistent_min"] == 0.5


def test_the_environment_keeps_its_precedence_and_a_reload_waits_for_take(tmp_path) -> None:
    env = {"FLEETHEALTH_DETECT_STRAGGLER_CLIP": "5"}
    live, cfg = _live(tmp_path, "[detect.straggler]\nclip = 4.5\npersistent_min = 0.5\n", env)
    cfg.write_text("[detect.straggler]\nclip = 6.0\npersistent_min = 0.04\n")
    live.request()
    assert live.current["detect.straggler.persistent_min"] == 0.5  # nothing until the batch boundary
    plan = live.take()
    assert plan is not None and plan.applied == {"detect.straggler.persistent_min": (0.5, 0.04)}
    assert live.current["detect.straggler.clip"] == 5.0 and live.take() is None


def test_a_dsn_shows_no_secret() -> None:
    shown = shown_value("kafka", "kafka://svc:pw1@b:9092?sasl_password=pw2&security_protocol=SASL_SSL")
    assert "pw1" not in shown and "pw2" not in shown and "security_protocol=SASL_SSL" in shown
