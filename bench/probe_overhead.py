"""What the node probe costs its node, against a no-op process measured in the same run (one JSON object).

The probe runs as ``fleethealth probe --source sim`` for one node of 8 GPUs at 1 Hz against an
embedded broker (so delivery, compression and the spool are part of the cost), with its Unix
socket open, next to a baseline process that only sleeps for the same time. Both are sampled
from ``/proc/<pid>/stat`` after a warm-up (imports and start-up excluded from the steady state;
the whole-run figure is reported too) and their peak RSS is ``VmHWM``.

Targets: <= 1 % of one core and <= 150 MB peak RSS for the probe.

``nvml`` in the output is what the NVML source costs the driver: NVML calls per GPU per sample,
counted on the recorded 4-GPU H100 node (``tests/probe/recordings/nvml_h100_faults.json``,
replayed by :class:`fleethealth.probe.recorded.NvmlReplay`), against the target of 10 and the
count before the field batch (114, measured at commit 003a864 on the same recording: one call per
field and five per NVLink link).

    python bench/probe_overhead.py              # 60 s, as the issue asks
    python bench/probe_overhead.py --seconds 15 # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleethealth.broker import EmbeddedBroker
from fleethealth.bus import ensure_topics
from fleethealth.probe.nvml import NvmlSource
from fleethealth.probe.recorded import NvmlReplay

_SCENARIO = """seed: 1
fleet: {racks: 1, nodes_per_rack: 1, gpus_per_node: 8}
job: {id: bench-job, steps: 100000, step_time_s: 1.0, jitter: 0.02}
"""
_TICK = os.sysconf("SC_CLK_TCK")
CPU_TARGET_PCT = 1.0
RSS_TARGET_MB = 150.0
NVML_RECORDING = Path(__file__).resolve().parent.parent / "tests" / "probe" / "recordings" / "nvml_h100_faults.json"
NVML_CALLS_TARGET = 10
NVML_CALLS_BEFORE = 114
"""NVML calls per GPU per sample on NVML_RECORDING at commit 003a864, before the field batch."""


def nvml_calls(recording: Path = NVML_RECORDING, samples: int = 5) -> dict[str, object]:
    """NVML calls per GPU per sample of the NVML source on a recorded node (first and later samples)."""
    replay = NvmlReplay(recording)
    source = NvmlSource("bench", "r00", nvml=replay, xid_events=False)
    source.open()
    at_open = replay.calls / max(source.gpu_count, 1)
    per_sample = []
    try:
        for k in range(samples):
            before = replay.calls
            source.sample(float(k))
            per_sample.append((replay.calls - before) / source.gpu_count)
    finally:
        source.close()
    return {"recording": recording.name, "gpus": source.gpu_count, "calls_per_gpu_at_open": at_open,
            "calls_per_gpu_first_sample": per_sample[0], "calls_per_gpu_per_sample": max(per_sample[1:]),
            "calls_per_gpu_per_sample_before": NVML_CALLS_BEFORE, "target": NVML_CALLS_TARGET,
            "meets_target": max(per_sample) <= NVML_CALLS_TARGET}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def _peak_rss_mb(pid: int) -> float:
    match = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(match.group(1)) / 1024 if match else float("nan")


def _measure(procs: dict[str, subprocess.Popen], seconds: float, warmup: float) -> dict[str, dict[str, float]]:
    start = time.monotonic()
    time.sleep(warmup)
    cpu0 = {name: _cpu_s(p.pid) for name, p in procs.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    out = {}
    for name, p in procs.items():
        cpu = _cpu_s(p.pid)
        out[name] = {"cpu_pct_one_core": round(100 * (cpu - cpu0[name]) / elapsed, 3),
                     "cpu_pct_incl_startup": round(100 * cpu / (time.monotonic() - start), 3),
                     "peak_rss_mb": round(_peak_rss_mb(p.pid), 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="steady-state measurement time")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds excluded as start-up")
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker() as broker:
        ensure_topics(broker.dsn)
        scenario = Path(tmp) / "one-node.yaml"
        scenario.write_text(_SCENARIO)
        total = args.warmup + args.seconds + 30
        probe = subprocess.Popen(
            [sys.executable, "-m", "fleethealth", "probe", "--source", "sim", "--scenario", str(scenario),
             "--node", "n0000", "--kafka", broker.dsn, "--interval", "1.0", "--socket", f"{tmp}/probe.sock",
             "--spool-dir", f"{tmp}/spool", "--metrics-port", "0", "--duration", str(total)],
            env=env, stderr=subprocess.PIPE, text=True)
        baseline = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({total})"], env=env)
        try:
            result = _measure({"probe": probe, "baseline": baseline}, args.seconds, args.warmup)
        finally:
            probe.terminate()
            baseline.terminate()
            _, err = probe.communicate(timeout=60)
            baseline.wait(timeout=10)
    delivered = re.search(r"delivered (\d+)", err)
    p, b = result["probe"], result["baseline"]
    report = {
        "bench": "probe_overhead", "source": "sim", "gpus": 8, "interval_s": 1.0, "seconds": args.seconds,
        "probe": {**p, "records_delivered": int(delivered.group(1)) if delivered else None},
        "baseline_noop": b,
        "cpu_pct_over_baseline": round(p["cpu_pct_one_core"] - b["cpu_pct_one_core"], 3),
        "rss_ratio_to_baseline": round(p["peak_rss_mb"] / b["peak_rss_mb"], 2) if b["peak_rss_mb"] else None,
        "targets": {"cpu_pct_one_core": CPU_TARGET_PCT, "peak_rss_mb": RSS_TARGET_MB},
        "meets_targets": p["cpu_pct_one_core"] <= CPU_TARGET_PCT and p["peak_rss_mb"] <= RSS_TARGET_MB,
        "nvml": nvml_calls(),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
