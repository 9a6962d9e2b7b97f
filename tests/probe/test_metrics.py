"""/metrics: the probe's own names by default, dcgm-exporter's exact names and labels in its
compatibility mode, and the official dcgm-exporter dashboard's PromQL against that mode.

The GPU values come from a recorded NVML answer set (these machines have no GPU) or from the
simulator source. ``fixtures/dcgm-exporter-dashboard.json`` is a verbatim copy of NVIDIA's
dashboard (source and commit in ``fixtures/README.md``). The page is parsed here by a small
parser that keeps sample names exactly as served (prometheus-client's parser renames counter
samples to ``*_total``, which would hide the very difference compatibility is about).
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from fleethealth.broker import free_port
from fleethealth.commands import build_parser
from fleethealth.commands._settings import load_settings
from fleethealth.probe.daemon import Probe, ProbeConfig
from fleethealth.probe.delivery import Delivery
from fleethealth.probe.metrics import GPU_LABELS, ProbeHealth, ProbeMetrics
from fleethealth.probe.nvml import NvmlSource
from fleethealth.probe.recorded import NvmlReplay
from fleethealth.probe.simsource import SimSource
from fleethealth.probe.spool import Spool
from fleethealth.schema import Event, EventKind

DASHBOARD = Path(__file__).parent / "fixtures" / "dcgm-exporter-dashboard.json"
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
PROMETHEUS_TARGET_LABELS = {"instance", "job"}
"""Labels Prometheus attaches at scrape time, not the exporter."""


def _parse(text: str) -> dict[str, dict]:
    """``name -> {"type", "samples": [(sample name, labels, value)]}``, names exactly as served."""
    fams: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            current = fams.setdefault(name, {"type": kind, "samples": []})
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m is not None, line
            name, body, value = m.groups()
            assert current is not None and name == [n for n, f in fams.items() if f is current][0], line
            current["samples"].append((name, dict(_LABEL.findall(body or "")), float(value)))
    return fams


def _nvml_metrics(recording, *, compat: bool = False) -> ProbeMetrics:
    source = NvmlSource("gpu-node-7", "r03", nvml=NvmlReplay(recording("nvml_h100_faults.json")), xid_events=False)
    source.open()
    metrics = ProbeMetrics("gpu-node-7", compat=compat, driver_version="550.54.15",
                           health=lambda: ProbeHealth(samples_total=12, datagrams_garbage_total=3,
                                                      spool_records=5, bus_connected=1))
    metrics.observe(source.sample(1.0).telemetry)
    return metrics


def test_default_gpu_metrics_use_the_probes_own_names_and_units(recording) -> None:
    fams = _parse(_nvml_metrics(recording).render().decode())
    assert not [n for n in fams if n.startswith("DCGM_FI_")]
    temp = fams["fleethealth_gpu_temperature_celsius"]
    assert temp["type"] == "gauge"
    by_gpu = {s[1]["gpu"]: s for s in temp["samples"]}
    assert set(by_gpu) == {"0", "1", "2", "3"}
    assert by_gpu["1"][2] == 47.0 and by_gpu["1"][1]["Hostname"] == "gpu-node-7"
    assert by_gpu["1"][1]["UUID"] == "GPU-7a2e9c51-0b4f-6d1a-8e3c-5b7f9a2c4d22"
    assert tuple(by_gpu["1"][1]) == GPU_LABELS and by_gpu["1"][1]["device"] == "nvidia1"
    reasons = {s[1]["gpu"]: s[2] for s in fams["fleethealth_gpu_clock_event_reasons"]["samples"]}
    assert int(reasons["1"]) & 0x80
    clock = fams["fleethealth_gpu_sm_clock_hertz"]["samples"][0][2]
    assert clock > 1e8  # MHz scaled to Hz
    gen = {s[1]["gpu"]: s[2] for s in fams["fleethealth_gpu_pcie_link_gen"]["samples"]}
    assert gen["2"] == 3
    pending = {s[1]["gpu"]: s[2] for s in fams["fleethealth_gpu_row_remap_pending"]["samples"]}
    assert pending == {"0": 0, "1": 0, "2": 0, "3": 1}
    assert fams["fleethealth_gpu_ecc_corrected_volatile_total"]["type"] == "counter"
    # NaN (retired pages unsupported on Hopper) is left out, not exported as NaN
    assert fams["fleethealth_gpu_retired_pages_corrected_total"]["samples"] == []
    for name, fam in fams.items():
        assert name.startswith(("fleethealth_gpu_", "fleethealth_probe_", "fleethealth_nic_")) \
            or name == "fleethealth_build_info", name
        assert (fam["type"] == "counter") == name.endswith("_total"), name


def test_xid_is_a_counter_per_code_and_probe_health_counters_end_in_total(recording) -> None:
    metrics = _nvml_metrics(recording)
    for code in (79, 79, 48):
        metrics.count_event(Event(node="gpu-node-7", ts=1.0, kind=EventKind.XID, gpu=3, code=code))
    metrics.count_event(Event(node="gpu-node-7", ts=1.0, kind=EventKind.GPU_LOST, gpu=3))
    text = metrics.render().decode()
    fams = _parse(text)
    xid = fams["fleethealth_gpu_xid_errors_total"]
    assert xid["type"] == "counter"
    counts = {(s[1]["xid"], s[1]["gpu"]): s[2] for s in xid["samples"]}
    assert {k: v for k, v in counts.items() if v} == {("79", "3"): 2.0, ("48", "3"): 1.0}
    assert all(s[1]["UUID"].startswith("GPU-e09a4b6c") for s in xid["samples"] if s[1]["gpu"] == "3")
    assert "fleethealth_probe_samples_total 12\n" in text
    assert "fleethealth_probe_datagrams_garbage_total 3\n" in text
    assert fams["fleethealth_probe_spool_records"]["type"] == "gauge"


def test_compat_mode_serves_dcgm_exporter_names_types_and_labels(recording) -> None:
    metrics = _nvml_metrics(recording, compat=True)
    metrics.count_event(Event(node="gpu-node-7", ts=1.0, kind=EventKind.XID, gpu=3, code=79))
    fams = _parse(metrics.render().decode())
    assert not [n for n in fams if n.startswith("fleethealth_gpu_")]
    temp = fams["DCGM_FI_DEV_GPU_TEMP"]
    assert temp["type"] == "gauge"
    labels = temp["samples"][1][1]
    assert tuple(labels) == (*GPU_LABELS, "DCGM_FI_DRIVER_VERSION")
    assert labels["DCGM_FI_DRIVER_VERSION"] == "550.54.15" and labels["device"] == "nvidia1"
    assert {s[2] for s in fams["DCGM_FI_DEV_SM_CLOCK"]["samples"]} < {float(x) for x in range(100, 3000)}  # MHz
    # counters are typed counters and keep dcgm-exporter's names, no _total added
    replay = fams["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"]
    assert replay["type"] == "counter" and {s[0] for s in replay["samples"]} == {"DCGM_FI_DEV_PCIE_REPLAY_COUNTER"}
    assert fams["DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"]["type"] == "counter"
    assert fams["DCGM_FI_DEV_ROW_REMAP_FAILURE"]["type"] == "gauge"
    xid = {s[1]["gpu"]: s for s in fams["DCGM_FI_DEV_XID_ERRORS"]["samples"]}
    assert fams["DCGM_FI_DEV_XID_ERRORS"]["type"] == "gauge"
    assert xid["3"][2] == 79 and xid["3"][1]["err_code"] == "79"
    assert xid["3"][1]["err_msg"] == "GPU has fallen off the bus"
    assert xid["0"][2] == 0 and xid["0"][1]["err_msg"] == "No Error"


def _sim_probe(tmp_path: Path, argv: list[str]) -> Probe:
    """A probe built from ``fleethealth probe --source sim ARGV`` as the CLI parses it (spooling only)."""
    s = load_settings(build_parser().parse_args(["probe", "--source", "sim", "--node", "n0001", *argv]))
    source = SimSource(s["node.name"], scenario=None)
    config = ProbeConfig(node=s["node.name"], socket_path=None, metrics_port=None,
                         dcgm_exporter_compat=s["probe.dcgm_exporter_compat"],
                         nic_root=None if s["probe.no_nic"] else s["probe.sysfs_root"])
    delivery = Delivery("kafka://127.0.0.1:9", Spool(tmp_path / "spool"))
    probe = Probe(source, config, delivery=delivery).open(background_delivery=False)
    for i in range(3):
        probe.tick(now=1000.0 + i)
    return probe


def test_probe_source_sim_default_flags_expose_no_dcgm_series(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("FLEETHEALTH_DCGM_EXPORTER_COMPAT", raising=False)
    probe = _sim_probe(tmp_path, [])
    try:
        fams = _parse(probe.metrics.render().decode())
    finally:
        probe.close(drain_timeout_s=0.0)
    assert fams and not [n for n in fams if n.startswith("DCGM_FI_")]
    assert fams["fleethealth_gpu_memory_used_bytes"]["samples"]
    nic = fams["fleethealth_nic_transmit_bytes_total"]["samples"]
    assert [s[1]["port"] for s in nic] == ["mlx5_0/1"]  # the simulator's port, not this machine's


@pytest.mark.parametrize("how", ["flag", "env"])
def test_probe_source_sim_compat_exposes_xid_and_pci_labels_on_every_series(tmp_path, monkeypatch, how) -> None:
    if how == "env":
        monkeypatch.setenv("FLEETHEALTH_DCGM_EXPORTER_COMPAT", "1")
    probe = _sim_probe(tmp_path, ["--dcgm-exporter-compat"] if how == "flag" else [])
    try:
        fams = _parse(probe.metrics.render().decode())
    finally:
        probe.close(drain_timeout_s=0.0)
    assert fams["DCGM_FI_DEV_XID_ERRORS"]["samples"]
    for name in ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"):
        assert fams[name]["type"] == "gauge" and fams[name]["samples"]
    dcgm = {n: f for n, f in fams.items() if n.startswith("DCGM_FI_")}
    assert len(dcgm) >= 20
    for name, fam in dcgm.items():
        for _, labels, _ in fam["samples"]:
            assert labels["pci_bus_id"].startswith("00000000:") and labels["device"].startswith("nvidia"), name


def _promql(dashboard: dict) -> list[str]:
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "query", "definition") and isinstance(value, str):
                    found.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard)
    return [q for q in found if "DCGM_FI_" in q]


def _names_and_labels(query: str) -> tuple[set[str], set[str]]:
    """Metric names and every label a PromQL query uses (matchers, by/without, label_values)."""
    names = set(re.findall(r"\bDCGM_FI_[A-Z0-9_]+\b", query))
    labels = set()
    for body in re.findall(r"\{([^}]*)\}", query):
        labels |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", body))
    for body in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", query):
        labels |= {x.strip() for x in body.split(",") if x.strip()}
    for label in re.findall(r"label_values\(\s*[A-Za-z_:][A-Za-z0-9_:]*\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)", query):
        labels.add(label)
    return names, labels


def test_official_dcgm_exporter_dashboard_works_on_the_compat_output(tmp_path) -> None:
    queries = _promql(json.loads(DASHBOARD.read_text()))
    assert len(queries) >= 8
    used_names: set[str] = set()
    used_labels: set[str] = set()
    for query in queries:
        names, labels = _names_and_labels(query)
        used_names |= names
        used_labels |= labels
    assert {"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_FB_USED", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"} <= used_names
    probe = _sim_probe(tmp_path, ["--dcgm-exporter-compat"])
    try:
        fams = _parse(probe.metrics.render().decode())
    finally:
        probe.close(drain_timeout_s=0.0)
    missing = sorted(n for n in used_names if not fams.get(n, {}).get("samples"))
    assert missing == [], f"metrics the dashboard uses but the probe does not serve: {missing}"
    for name in used_names:
        served = set().union(*(set(labels) for _, labels, _ in fams[name]["samples"]))
        assert used_labels - PROMETHEUS_TARGET_LABELS <= served, (name, used_labels - served)


def test_served_over_http(recording) -> None:
    metrics = _nvml_metrics(recording)
    port = free_port()
    server = metrics.serve(port, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            kind = resp.headers["Content-Type"]
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    fams = _parse(text)
    assert kind.startswith("text/plain; version=0.0.4")
    assert "fleethealth_gpu_power_watts" in fams and "fleethealth_probe_bus_connected" in fams


def test_xid_and_clock_event_counters_start_at_zero_and_count_each_occurrence(recording) -> None:
    """Before any event every GPU has every rulebook Xid code and every clock-event reason at 0 (a
    series, not a blank); a repeated identical Xid raises the count, and the health rules report it
    once; a clock-event reason counts each time its bit is set anew, not each sample it stays set."""
    from fleethealth.detectors.health import HealthRules
    from fleethealth.schema import ClockReason
    from fleethealth.xid import XID_CATALOG

    source = NvmlSource("gpu-node-7", "r03", nvml=NvmlReplay(recording("nvml_h100_faults.json")), xid_events=False)
    source.open()
    first = source.sample(1.0).telemetry
    metrics = ProbeMetrics("gpu-node-7")
    metrics.observe(first)
    fams = _parse(metrics.render().decode())
    xid = {(s[1]["gpu"], s[1]["xid"]): s[2] for s in fams["fleethealth_gpu_xid_errors_total"]["samples"]}
    assert xid == {(g, str(c)): 0.0 for g in ("0", "1", "2", "3") for c in XID_CATALOG}
    clock = fams["fleethealth_gpu_clock_events_total"]
    assert clock["type"] == "counter"
    events = {(s[1]["gpu"], s[1]["reason"]): s[2] for s in clock["samples"]}
    assert set(events) == {(g, r.name.lower()) for g in ("0", "1", "2", "3") for r in ClockReason}
    braked = {k for k, v in events.items() if v}
    assert ("1", "hw_power_brake") in braked and events[("0", "sw_power_cap")] == 0.0  # the recording brakes GPU 1

    # the same Xid twice: counted twice, one finding
    xids = [Event(node="gpu-node-7", ts=ts, kind=EventKind.XID, gpu=2, code=79) for ts in (2.0, 3.0)]
    for e in xids:
        metrics.count_event(e)
    rules = HealthRules()
    found = rules.check([first], xids)
    assert [(f.kind.value, f.gpu, f.evidence["code"]) for f in found if f.kind.value == "xid"] == [("xid", 2, 79)]
    # GPU 0 power-capped for two samples, clear, then capped again: two clock events
    cap = float(ClockReason.SW_POWER_CAP)
    for ts, bits in ((4.0, cap), (5.0, cap), (6.0, 0.0), (7.0, cap)):
        reasons = first.columns["clock_reasons"].copy()
        reasons[0] = bits
        metrics.observe(first.__class__.from_columns(first.node, first.rack, ts, first.gpu,
                                                     **{**first.columns, "clock_reasons": reasons}))
    fams = _parse(metrics.render().decode())
    xid = {(s[1]["gpu"], s[1]["xid"]): s[2] for s in fams["fleethealth_gpu_xid_errors_total"]["samples"]}
    assert xid[("2", "79")] == 2.0 and xid[("3", "79")] == 0.0
    events = {(s[1]["gpu"], s[1]["reason"]): s[2] for s in fams["fleethealth_gpu_clock_events_total"]["samples"]}
    assert events[("0", "sw_power_cap")] == 2.0
