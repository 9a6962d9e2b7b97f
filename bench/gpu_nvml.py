"""Run the probe's NVML source on this machine's real GPUs and print what it read (one JSON object).

Takes a few samples through :class:`fleethealth.probe.nvml.NvmlSource` (the same code the probe
runs, with the Xid event-set thread on), reports every column per GPU with the clock-event bits
decoded, PCIe downtraining, pending remaps, how long a sample took, how many NVML calls a sample
made per GPU (the target is 10: one field batch and the calls no field covers), which columns the
GPU does not report and why, and the events seen. With
``--record FILE`` it also writes the NVML answers as a recording that
:class:`fleethealth.probe.recorded.NvmlReplay` replays (the format of ``tests/probe/recordings``).

``--replay FILE`` reads a recording instead of the driver, to check this script where no GPU exists.
Exit 2 with one line when NVML (the driver's libnvidia-ml.so.1, or the nvidia-ml-py package) is
absent. ``bench/gpu_check.sh nvml`` runs this.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

from fleethealth.errors import DeviceError
from fleethealth.probe.nvml import NvmlSource, load_pynvml
from fleethealth.schema import ClockReason


class _Counting:
    """Count the device calls made through an NVML module (or replay, or recorder)."""

    def __init__(self, lib) -> None:
        self._lib = lib
        self.calls = 0

    def __getattr__(self, name: str):
        target = getattr(self._lib, name)
        if not name.startswith("nvmlDevice") or not callable(target):
            return target

        def call(*args, **kwargs):
            self.calls += 1
            return target(*args, **kwargs)

        return call


def _clean(value: float) -> float | None:
    return None if math.isnan(value) else value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--record", metavar="FILE", help="also write the NVML answers as a recording")
    parser.add_argument("--replay", metavar="FILE", help="read a recording instead of the driver (checks this "
                                                         "script where no GPU exists)")
    args = parser.parse_args(argv)
    try:
        if args.replay:
            from fleethealth.probe.recorded import NvmlReplay

            nvml = NvmlReplay(args.replay)
        else:
            nvml = load_pynvml()
        recorder = None
        if args.record:
            from fleethealth.probe.recorded import NvmlRecorder

            recorder = nvml = NvmlRecorder(nvml, note="recorded by bench/gpu_nvml.py")
        counting = nvml = _Counting(nvml)
        source = NvmlSource("gpu-check", "r00", nvml=nvml)
        source.open()
    except DeviceError as exc:
        print(f"gpu_nvml: skipped: {exc}", file=sys.stderr)
        return 2
    durations, events, sample, calls = [], [], None, []
    try:
        for _ in range(args.samples):
            t0 = time.perf_counter()
            before = counting.calls
            sample = source.sample(time.time())
            durations.append(time.perf_counter() - t0)
            calls.append((counting.calls - before) / max(source.gpu_count, 1))
            events += [{"kind": e.kind.value, "gpu": e.gpu, "code": e.code, "message": e.message}
                       for e in sample.events]
            time.sleep(args.interval)
    finally:
        source.close()
    if recorder is not None:
        recorder.dump(args.record)
    tel = sample.telemetry
    gpus = []
    for i, gpu in enumerate(tel.gpu.tolist()):
        cols = {name: _clean(float(col[i])) for name, col in tel.columns.items()}
        reasons = cols["clock_reasons"]
        gen, gen_max, width, width_max = (cols[k] for k in ("pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max"))
        gpus.append({
            "gpu": gpu, "uuid": tel.uuid[i] if i < len(tel.uuid) else "", "columns": cols,
            "clock_reasons_decoded": None if reasons is None else
            [r.name for r in ClockReason if int(reasons) & r.value],
            "power_brake": None if reasons is None else bool(int(reasons) & ClockReason.HW_POWER_BRAKE),
            "pcie_downtrained": None if None in (gen, gen_max, width, width_max) else
            bool(gen < gen_max or width < width_max),
            "remap_pending": cols["remap_pending"],
            "columns_unsupported": sorted(k for k, v in cols.items() if v is None),
        })
    print(json.dumps({
        "bench": "gpu_nvml", "model": tel.model, "gpus": len(gpus),
        "sample_ms_median": round(1000 * statistics.median(durations), 2),
        "sample_ms_max": round(1000 * max(durations), 2), "samples": len(durations),
        "nvml_calls_per_gpu_first_sample": calls[0], "nvml_calls_per_gpu_per_sample": max(calls[1:] or calls),
        "nvml_calls_target": 10,
        "missing": {f"{gpu}:{column}": why for (gpu, column), why in sorted(source.missing.items())},
        "xid_thread_error": source.xid_thread_error, "events": events, "per_gpu": gpus,
        "recording": args.record,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
