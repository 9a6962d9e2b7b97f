"""/metrics in dcgm-exporter's names and labels, parsed with prometheus-client's own parser.

The GPU values come from a recorded NVML answer set (these machines have no GPU).
"""

from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleethealth.broker import free_port
from fleethealth.probe.metrics import ProbeHealth, ProbeMetrics
from fleethealth.probe.nvml import NvmlSource
from fleethealth.probe.recorded import NvmlReplay
from fleethealth.schema import Event, EventKind


def _families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _metrics(recording) -> ProbeMetrics:
    source = NvmlSource("gpu-node-7", "r03", nvml=NvmlReplay(recording("nvml_h100_faults.json")), xid_events=False)
    source.open()
    metrics = ProbeMetrics("gpu-node-7", health=lambda: ProbeHealth(samples_total=12, datagrams_garbage_total=3,
                                                                     spool_records=5, bus_connected=1))
    metrics.observe(source.sample(1.0).telemetry)
    return metrics


def test_gpu_gauges_use_dcgm_exporter_names_and_labels(recording) -> None:
    fams = _families(generate_latest(_metrics(recording).registry).decode())
    temp = fams["DCGM_FI_DEV_GPU_TEMP"]
    assert temp.type == "gauge"
    by_gpu = {s.labels["gpu"]: s for s in temp.samples}
    assert set(by_gpu) == {"0", "1", "2", "3"}
    assert by_gpu["1"].value == 47.0 and by_gpu["1"].labels["Hostname"] == "gpu-node-7"
    assert by_gpu["1"].labels["UUID"] == "GPU-7a2e9c51-0b4f-6d1a-8e3c-5b7f9a2c4d22"
    reasons = {s.labels["gpu"]: s.value for s in fams["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"].samples}
    assert int(reasons["1"]) & 0x80
    gen = {s.labels["gpu"]: s.value for s in fams["DCGM_FI_DEV_PCIE_LINK_GEN"].samples}
    gen_max = {s.labels["gpu"]: s.value for s in fams["DCGM_FI_DEV_PCIE_MAX_LINK_GEN"].samples}
    assert gen["2"] == 3 and gen_max["2"] == 5
    pending = {s.labels["gpu"]: s.value for s in fams["DCGM_FI_DEV_ROW_REMAP_PENDING"].samples}
    assert pending == {"0": 0, "1": 0, "2": 0, "3": 1}
    # NaN (retired pages unsupported on Hopper) is left out, not exported as NaN
    assert fams["DCGM_FI_DEV_RETIRED_SBE"].samples == []


def test_xid_is_a_counter_per_code_and_probe_health_counters_end_in_total(recording) -> None:
    metrics = _metrics(recording)
    for code in (79, 79, 48):
        metrics.count_event(Event(node="gpu-node-7", ts=1.0, kind=EventKind.XID, gpu=3, code=code))
    metrics.count_event(Event(node="gpu-node-7", ts=1.0, kind=EventKind.GPU_LOST, gpu=3))
    text = generate_latest(metrics.registry).decode()
    fams = _families(text)
    xid = fams["fleethealth_gpu_xid_errors"]
    assert xid.type == "counter"
    counts = {(s.labels["xid"], s.labels["gpu"]): s.value for s in xid.samples if s.name.endswith("_total")}
    assert counts == {("79", "3"): 2.0, ("48", "3"): 1.0}
    assert all(s.labels["UUID"].startswith("GPU-e09a4b6c") for s in xid.samples if s.name.endswith("_total"))
    assert "fleethealth_probe_samples_total 12.0" in text
    assert "fleethealth_probe_datagrams_garbage_total 3.0" in text
    assert fams["fleethealth_probe_spool_records"].type == "gauge"
    for fam in fams.values():
        if fam.name.startswith("fleethealth_probe_") and fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples)


def test_served_over_http(recording) -> None:
    metrics = _metrics(recording)
    port = free_port()
    server = metrics.serve(port, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    fams = _families(text)
    assert "DCGM_FI_DEV_POWER_USAGE" in fams and "fleethealth_probe_bus_connected" in fams
