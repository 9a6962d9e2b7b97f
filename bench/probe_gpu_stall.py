"""One GPU of eight wedged in its driver calls: what the NVML source still reports (one JSON object).

An 8-GPU HGX H100 node replayed from ``tests/probe/fixtures/nvml_fabric_h100x8_healthy.json``
(:class:`fleethealth.probe.recorded.NvmlReplay`, no GPU needed), sampled ``--samples`` times while
every driver call of GPU 5 blocks, then released. Measured in the same run:

- ``per_gpu``: the NVML source as it is (each GPU on its own reader thread, ``--gpu-timeout``): the
  share of the 7 healthy GPUs' values present in each sample, sample wall times (the one that
  began the stall, and the rest), reader threads, events;
- ``whole_source`` (the baseline): the same source behind the whole-source
  :class:`~fleethealth.probe.sources.StallGuard` alone (``--gpu-timeout`` set past the guard's
  timeout, as a reader of all GPUs in one call behaves): what share of samples arrive at all.

    python bench/probe_gpu_stall.py               # 20 samples
    python bench/probe_gpu_stall.py --samples 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from fleethealth.probe.nvml import NvmlSource
from fleethealth.probe.recorded import NvmlReplay
from fleethealth.probe.sources import StallGuard
from fleethealth.schema import EventKind

FIXTURE = Path(__file__).parents[1] / "tests" / "probe" / "fixtures" / "nvml_fabric_h100x8_healthy.json"
STUCK = 5


def _run(samples: int, gpu_timeout_s: float, guard_timeout_s: float) -> dict[str, object]:
    replay = NvmlReplay(FIXTURE)
    source = NvmlSource("bench", "rack-1", nvml=replay, xid_events=False, gpu_timeout_s=gpu_timeout_s)
    before = set(threading.enumerate())
    source.open()
    guard = StallGuard(source, node="bench", timeout_s=guard_timeout_s)
    healthy_s = []
    for k in range(samples):
        t0 = time.perf_counter()
        guard.sample(float(k))
        healthy_s.append(time.perf_counter() - t0)
    replay.block("*", gpu=STUCK)
    walls, present, arrived, events = [], [], 0, 0
    try:
        for k in range(samples):
            t0 = time.perf_counter()
            result = guard.sample(float(samples + k))
            walls.append(time.perf_counter() - t0)
            events += len(result.events)
            if result.sample is not None:
                arrived += 1
                events += sum(e.kind is EventKind.TELEMETRY_STALLED for e in result.sample.events)
                temp = np.delete(result.sample.telemetry.columns["temp_c"], STUCK)
                present.append(float(np.isfinite(temp).mean()))
            else:
                present.append(0.0)
        readers = [t for t in threading.enumerate() if t.name.startswith("fh-gpu-read-") and t not in before]
    finally:
        replay.release()
        guard.close()
        source.close()
    return {"samples_arrived_share": arrived / samples, "healthy_gpus_present_share": statistics.mean(present),
            "first_stalled_sample_s": round(walls[0], 4),
            "later_samples_median_s": round(statistics.median(walls[1:]), 4) if samples > 1 else None,
            "healthy_sample_median_s": round(statistics.median(healthy_s), 4),
            "stall_events": events, "reader_threads": len(readers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--gpu-timeout", type=float, default=0.5)
    parser.add_argument("--stall-timeout", type=float, default=1.0, help="the whole-source guard's timeout")
    args = parser.parse_args()
    out = {"gpus": 8, "stuck_gpu": STUCK, "samples": args.samples, "gpu_timeout_s": args.gpu_timeout,
           "stall_timeout_s": args.stall_timeout,
           "per_gpu": _run(args.samples, args.gpu_timeout, args.stall_timeout),
           "whole_source": _run(args.samples, args.stall_timeout * 4, args.stall_timeout)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
