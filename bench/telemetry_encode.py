"""Encoding telemetry samples for the bus: ``schema.encode`` (the columns handed to orjson as arrays)
against the baseline of the same samples as Python lists (``orjson.dumps(sample.to_obj())``, what
``encode`` did before), measured in the same run on the same samples, whose bytes must be equal.

The samples are the default demo scenario's first ``--samples`` (8 GPUs a node, every field
populated, faults included). Prints one JSON object: microseconds a sample for each path (best of
``--repeat``), ``ratio`` (baseline over arrays) and ``same_bytes``.

    python bench/telemetry_encode.py [--samples 20000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import orjson

from fleethealth.schema import Telemetry
from fleethealth.schema.codec import encode
from fleethealth.sim import FleetSim, Scenario


def _samples(count: int) -> list[Telemetry]:
    out: list[Telemetry] = []
    for tick in FleetSim(Scenario.default()).run():
        out += tick.telemetry
        if len(out) >= count:
            break
    return out[:count]


def _best_us(fn: Callable[[Telemetry], bytes], samples: list[Telemetry], repeat: int) -> tuple[float, list[bytes]]:
    best, raw = float("inf"), []
    for _ in range(repeat):
        t = time.process_time()
        raw = [fn(s) for s in samples]
        best = min(best, time.process_time() - t)
    return best / len(samples) * 1e6, raw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    samples = _samples(args.samples)
    base_us, base = _best_us(lambda s: orjson.dumps(s.to_obj()), samples, args.repeat)
    arrays_us, arrays = _best_us(encode, samples, args.repeat)
    print(json.dumps({"samples": len(samples), "gpus_per_sample": int(samples[0].gpu.size),
                      "bytes_per_sample": round(sum(map(len, arrays)) / len(arrays), 1),
                      "baseline_lists_us_per_sample": round(base_us, 2), "encode_us_per_sample": round(arrays_us, 2),
                      "ratio": round(base_us / arrays_us, 2), "same_bytes": arrays == base}))
    return 0 if arrays == base else 1


if __name__ == "__main__":
    raise SystemExit(main())
