"""Every long-running command (probe, detect, serve, act) takes ``--log-level`` and ``--log-format``
(config keys ``log.level``, ``log.format``) and sends the ``fleethealth`` loggers to standard error
before it does anything else, so the detector runner's info lines are not lost."""

from __future__ import annotations

import json
import logging

import pytest

from fleethealth.commands import main

# each command stops with an expected error (exit 2) right after configuring its logging
STOPS = {
    "probe": [],                                   # no bus
    "detect": [],                                  # no bus, no store
    "serve": ["--token-file", "/nonexistent/token"],  # a token file that cannot be read
    "act": [],                                     # no scheduler
}


@pytest.fixture(autouse=True)
def _restore_logging(monkeypatch):
    for name in ("FLEETHEALTH_KAFKA", "FLEETHEALTH_STORE", "FLEETHEALTH_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    root = logging.getLogger("fleethealth")
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("command", sorted(STOPS))
def test_log_flags_configure_the_fleethealth_loggers(command, capsys) -> None:
    assert main([command, "--log-level", "debug", "--log-format", "json", *STOPS[command]]) == 2
    root = logging.getLogger("fleethealth")
    assert root.level == logging.DEBUG
    logging.getLogger("fleethealth.detectors.runner").info("partition %d restored", 3)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    record = json.loads(lines[-1])
    assert (record["level"], record["logger"], record["msg"]) == ("INFO", "fleethealth.detectors.runner",
                                                                  "partition 3 restored")


def test_log_level_from_the_environment_and_a_bad_value_is_an_error(monkeypatch, capsys) -> None:
    monkeypatch.setenv("FLEETHEALTH_LOG_LEVEL", "warning")
    assert main(["detect"]) == 2
    assert logging.getLogger("fleethealth").level == logging.WARNING
    monkeypatch.setenv("FLEETHEALTH_LOG_LEVEL", "loud")
    assert main(["detect"]) == 2
    assert "log.level" in capsys.readouterr().err
