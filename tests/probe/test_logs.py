"""What the probe logs for an operator: formats, levels, and the rate-limited warnings.

The watch's clock is injected, so nothing here sleeps.
"""

from __future__ import annotations

import io
import json
import logging

import pytest

from fleethealth.commands import build_parser
from fleethealth.commands._settings import load_settings
from fleethealth.errors import BusUnavailable, ConfigError
from fleethealth.probe.daemon import Probe, ProbeConfig
from fleethealth.probe.delivery import Delivery
from fleethealth.probe.logs import ProbeWatch, configure_logging
from fleethealth.probe.simsource import SimSource
from fleethealth.probe.spool import Spool
from fleethealth.schema import Event, EventKind


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _watch(caplog) -> tuple[ProbeWatch, _Clock]:
    caplog.set_level(logging.INFO, logger="fleethealth.probe")
    clock = _Clock()
    return ProbeWatch(every_s=60.0, clock=clock), clock


def _messages(caplog, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_broker_unreachable_is_warned_once_a_minute_and_its_return_noted(caplog) -> None:
    watch, clock = _watch(caplog)
    for t in range(0, 150, 10):
        clock.now = float(t)
        watch.delivery(connected=False, failures_total=1 + t, last_error="NoBrokersAvailable", dsn="kafka://b:9092")
    warnings = _messages(caplog)
    assert len(warnings) == 3  # at 0, 60 and 120 s
    assert "kafka://b:9092 unreachable" in warnings[0] and "NoBrokersAvailable" in warnings[0]
    watch.delivery(connected=True, failures_total=200, last_error=None, dsn="kafka://b:9092")
    assert _messages(caplog, logging.INFO) == ["broker kafka://b:9092 reachable again"]
    # a healthy probe that never failed says nothing
    caplog.clear()
    fresh, _ = _watch(caplog)
    fresh.delivery(connected=False, failures_total=0, last_error=None, dsn="kafka://b:9092")
    assert _messages(caplog) == []


def test_spool_crossing_50_and_90_percent_and_dropping(caplog) -> None:
    watch, clock = _watch(caplog)
    for pending in (100, 400, 500, 700, 900, 950, 910):
        watch.spool(pending_bytes=pending, max_bytes=1000, dropped_total=0)
    warnings = _messages(caplog)
    assert [w.split(" full")[0] for w in warnings] == ["spool 50 %", "spool 90 %"]
    watch.spool(pending_bytes=100, max_bytes=1000, dropped_total=0)
    watch.spool(pending_bytes=600, max_bytes=1000, dropped_total=0)  # re-armed after draining
    assert len(_messages(caplog)) == 3 and "below 50 %" in _messages(caplog, logging.INFO)[0]
    caplog.clear()
    watch.spool(pending_bytes=990, max_bytes=1000, dropped_total=5)
    clock.now = 10.0
    watch.spool(pending_bytes=990, max_bytes=1000, dropped_total=9)  # within the minute: not again
    clock.now = 70.0
    watch.spool(pending_bytes=990, max_bytes=1000, dropped_total=12)
    drops = [w for w in _messages(caplog) if "dropped" in w]
    assert drops == ["spool full: dropped 5 oldest records (5 in all)",
                     "spool full: dropped 7 oldest records (12 in all)"]


def test_gpu_falling_off_the_bus_is_always_warned(caplog) -> None:
    watch, _ = _watch(caplog)
    watch.event(Event(node="n0001", ts=1.0, kind=EventKind.GPU_LOST, gpu=3, message="GPU 3 stopped answering"))
    watch.event(Event(node="n0001", ts=2.0, kind=EventKind.XID, gpu=5, code=79, message="Xid 79"))
    watch.event(Event(node="n0001", ts=3.0, kind=EventKind.XID, gpu=5, code=13, message="Xid 13"))
    warnings = _messages(caplog)
    assert len(warnings) == 2 and "GPU 3 on n0001 fell off the bus" in warnings[0] and "GPU 5" in warnings[1]
    assert caplog.records[0].event == "gpu_lost"


def test_json_and_text_formats_and_bad_levels() -> None:
    out = io.StringIO()
    configure_logging("warning", "json", stream=out)
    log = logging.getLogger("fleethealth.probe")
    log.info("not shown")
    log.warning("spool %d %% full", 90, extra={"event": "spool_filling"})
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert obj["level"] == "WARNING" and obj["msg"] == "spool 90 % full" and obj["event"] == "spool_filling"
    assert obj["logger"] == "fleethealth.probe" and obj["ts"].endswith("Z")
    text = io.StringIO()
    configure_logging("debug", "text", stream=text)  # replaces the previous handler, not a second one
    log.debug("hello")
    assert out.getvalue().count("\n") == 1 and text.getvalue().rstrip().endswith("DEBUG fleethealth.probe: hello")
    with pytest.raises(ConfigError, match="--log-format"):
        configure_logging("info", "xml")
    with pytest.raises(ConfigError, match="--log-level"):
        configure_logging("loud", "text")
    configure_logging("warning", "text", stream=io.StringIO())


def test_cli_flags_and_env(monkeypatch) -> None:
    monkeypatch.setenv("FLEETHEALTH_LOG_FORMAT", "json")
    monkeypatch.setenv("FLEETHEALTH_DCGM_HOST", "nvidia-dcgm:5555")
    s = load_settings(build_parser().parse_args(["probe", "--log-level", "debug"]))
    assert (s["log.level"], s["log.format"], s["probe.dcgm_host"]) == ("debug", "json", "nvidia-dcgm:5555")
    assert s["probe.sysfs_root"] == "/" and not s["probe.no_nic"] and not s["probe.dcgm_exporter_compat"]


def test_probe_warns_about_an_unreachable_broker_and_keeps_sampling(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="fleethealth.probe")
    config = ProbeConfig(node="n0001", socket_path=None, metrics_port=None)
    def refused(dsn: str) -> None:  # what the bus layer raises when no broker answers (tested on a real one)
        raise BusUnavailable(f"no broker at {dsn}")

    delivery = Delivery("kafka://127.0.0.1:9", Spool(tmp_path / "spool"), backoff_s=0.0, producer_factory=refused)
    probe = Probe(SimSource("n0001"), config, delivery=delivery).open(background_delivery=False)
    try:
        probe.tick(now=1.0)
        delivery.step(force=True)
        probe.tick(now=2.0)
        probe.tick(now=3.0)
    finally:
        probe.close(drain_timeout_s=0.0)
    warnings = [r for r in caplog.records if getattr(r, "event", "") == "broker_unreachable"]
    assert len(warnings) == 1 and probe.health().samples_total == 3
    assert "no broker at kafka://127.0.0.1:9" in warnings[0].getMessage()
