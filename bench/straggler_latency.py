"""Straggler detection latency and false alarms: StragglerDetector (CUSUM bank) beside SeedRule.

Both detectors see the same generated steps (``fleethealth.detectors.synth``): 4,096 ranks, 2 %
lognormal jitter, a few stragglers per slowdown starting at step 0, placed on different nodes.
Latency is the number of straggling steps until the first finding (inclusive). The false-alarm
run feeds ``--null-rank-steps`` rank-steps of the heavy null model (node-correlated noise,
whole-step drift, 0.1 % hiccups) with no straggler and counts flagged ranks.

Prints one JSON object: per slowdown the issue's bound (``target_steps``), both detectors'
latency and false ranks, and the seed rule's latency over the CUSUM's (``null``: the heavy-null
false-alarm run, with each CUSUM arm's peak statistic over its threshold).

    python bench/straggler_latency.py [--ranks 4096] [--steps 400] [--null-rank-steps 10000000]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from fleethealth.detectors.straggler import SeedRule, StragglerDetector
from fleethealth.detectors.synth import StepNoise, step_times

TARGETS = {0.20: 5, 0.05: 15, 0.02: 60, 0.01: 250}


def _latency(n_ranks: int, steps: int, slowdown: float, seed: int, n_slow: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    slow_ranks = (np.arange(n_slow) * (n_ranks // n_slow) + 3) % n_ranks
    slow = np.zeros(n_ranks)
    slow[slow_ranks] = slowdown
    ranks = np.arange(n_ranks)
    dets = {"cusum": StragglerDetector(), "seed_rule": SeedRule()}
    first: dict[str, dict[int, int]] = {name: {} for name in dets}
    noise = StepNoise.plain()
    drift = 0.0
    elapsed = dict.fromkeys(dets, 0.0)
    for step in range(steps):
        t, drift = step_times(rng, n_ranks, noise, drift=drift, slowdown=slow)
        for name, det in dets.items():
            t0 = time.perf_counter()
            found = det.update(step, ranks, t)
            elapsed[name] += time.perf_counter() - t0
            for f in found:
                first[name].setdefault(int(f.rank), step + 1)
    out: dict[str, object] = {}
    for name in dets:
        lat = [first[name].get(int(r)) for r in slow_ranks]
        caught = [x for x in lat if x is not None]
        false = sorted(set(first[name]) - set(slow_ranks.tolist()))
        out[name] = {"caught": len(caught), "of": n_slow,
                     "median_steps": float(np.median(caught)) if caught else None,
                     "max_steps": max(caught) if len(caught) == n_slow else None,
                     "false_ranks": len(false), "ms_per_step": round(1e3 * elapsed[name] / steps, 3)}
    return out


def _false_alarms(n_ranks: int, rank_steps: int, seed: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    ranks = np.arange(n_ranks)
    dets = {"cusum": StragglerDetector(), "seed_rule": SeedRule()}
    flagged: dict[str, set[int]] = {name: set() for name in dets}
    noise = StepNoise()
    drift = 0.0
    steps = -(-rank_steps // n_ranks)
    cusum = dets["cusum"]
    peak = None
    for step in range(steps):
        t, drift = step_times(rng, n_ranks, noise, drift=drift)
        for name, det in dets.items():
            flagged[name].update(int(f.rank) for f in det.update(step, ranks, t))
        now = cusum.stat_.max(axis=1) / cusum.h_[:, 0]
        peak = now if peak is None else np.maximum(peak, now)
    return {"rank_steps": steps * n_ranks, "noise": vars(noise),
            "false_ranks": {name: len(v) for name, v in flagged.items()},
            "cusum_peak_stat_over_threshold_per_arm": np.round(peak, 3).tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--stragglers", type=int, default=8)
    parser.add_argument("--null-rank-steps", type=int, default=10_000_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = []
    for i, (slowdown, target) in enumerate(TARGETS.items()):
        res = _latency(args.ranks, args.steps, slowdown, args.seed + i, args.stragglers)
        cusum = res["cusum"]
        met = (cusum["max_steps"] is not None and cusum["max_steps"] <= target and cusum["false_ranks"] == 0)
        seed = res["seed_rule"]
        ratio = (round(seed["median_steps"] / cusum["median_steps"], 2)
                 if seed["median_steps"] and cusum["median_steps"] else None)
        rows.append({"slowdown": slowdown, "target_steps": target, "cusum_meets_target": met,
                     "seed_over_cusum_latency": ratio, **res})
    null = _false_alarms(args.ranks, args.null_rank_steps, args.seed + 100)
    print(json.dumps({"bench": "straggler_latency", "ranks": args.ranks, "jitter": 0.02, "latency": rows,
                      "null": null, "seconds": round(time.perf_counter() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()
