"""Straggler detection latency: StragglerDetector (baseline + CUSUM bank) beside SeedRule.

Both detectors see the same generated steps of the real-fleet null model
(``fleethealth.detectors.synth.FleetSteps``: 2 % per-step noise, persistent per-GPU speed and
per-node temperature offsets, pipeline-stage offsets, power-cap dips, heavy-tailed hiccups,
whole-step drift, 1 % missing samples), 4,096 ranks in four stages (passed as the comparison
groups). A few stragglers per slowdown, on different nodes, slow down after ``--warmup`` steps
(the detector's baseline needs them; see ``StragglerDetector``). They are drawn from the ranks at
or above their stage's median speed: a rank that slows by 1 % while it was 1.4 % faster than its
peers is still faster than them, and by definition not a straggler. Latency is the number of steps
from the onset until the first finding (inclusive). Any finding on another rank, or on a
straggler before its onset, is a false rank.

Prints one JSON object: per slowdown the bound (``target_steps``), both detectors' latency
(median, 90th percentile, max, and the share of stragglers found within the bound) and false
ranks, and the seed rule's latency over the detector's. Beside each target the detector's verdicts:
``median_meets_target`` (median <= bound: the latency table is met by the median) and
``p90_within_slack`` (90th percentile <= ``P90_SLACK`` x bound; ``p90_over_target`` is the ratio).
``false_alarm`` states the run's own false-alarm rate: false ranks over the rank-steps fed (the
warm-up included), per job-day at 16,384 ranks and 10 steps/s, with a 95 % upper bound; so few
rank-steps bound it loosely, and ``bench/straggler_far.py`` measures it against its target
(``FAR_TARGET_PER_JOB_DAY``). ``--seeds N`` repeats each row on N generated fleets and pools the
stragglers (8 per fleet are too few for a tail).

    python bench/straggler_latency.py [--ranks 4096] [--warmup 4096] [--stragglers 8] [--seed 1] [--seeds 1]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from fleethealth.detectors.straggler import SeedRule, StragglerDetector
from fleethealth.detectors.synth import FleetNoise, FleetSteps

TARGETS = {0.20: 5, 0.05: 15, 0.02: 60, 0.01: 250}
"""Slowdown -> the latency bound in steps, met by the median."""
P90_SLACK = 1.25
"""The 90th percentile may reach this multiple of each bound (Lorden's bound makes the slowest slower)."""
FAR_TARGET_PER_JOB_DAY = 1.0
"""False findings a job-day of 16,384 ranks at 10 steps/s (``bench/straggler_far.py``)."""
JOB_DAY_RANK_STEPS = 16_384 * 10 * 86_400


def _latency(n_ranks: int, warmup: int, slowdown: float, target: int, seed: int, n_slow: int
             ) -> dict[str, dict[str, object]]:
    gen = FleetSteps(np.random.default_rng(seed), n_ranks, FleetNoise())
    candidates = np.flatnonzero(gen.peer_offset() >= 0.0)
    slow_ranks = candidates[(np.arange(n_slow) * (candidates.size // n_slow) + 3) % candidates.size]
    slow = np.zeros(n_ranks)
    dets = {"cusum": StragglerDetector(), "seed_rule": SeedRule()}
    first: dict[str, dict[int, int]] = {name: {} for name in dets}
    false: dict[str, set[int]] = {name: set() for name in dets}
    elapsed = dict.fromkeys(dets, 0.0)
    steps = warmup + max(2 * target, 120)
    for step in range(steps):
        if step == warmup:
            slow[slow_ranks] = slowdown
        ranks, t, groups = gen.draw(slow)
        for name, det in dets.items():
            t0 = time.perf_counter()
            found = det.check(step, ranks, t, groups)
            elapsed[name] += time.perf_counter() - t0
            for f in found:
                if step >= warmup and f.rank in slow_ranks:
                    first[name].setdefault(int(f.rank), step - warmup + 1)
                else:
                    false[name].add(int(f.rank))
    return {name: {"latency": [first[name].get(int(r)) for r in slow_ranks], "false_ranks": len(false[name]),
                   "seconds": elapsed[name], "steps": steps} for name in dets}


def _summary(runs: list[dict[str, object]], target: int) -> dict[str, object]:
    lat = [x for run in runs for x in run["latency"]]  # type: ignore[attr-defined]
    caught = [x for x in lat if x is not None]
    return {"caught": len(caught), "of": len(lat),
            "median_steps": float(np.median(caught)) if caught else None,
            "p90_steps": round(float(np.percentile(caught, 90)), 1) if caught else None,
            "max_steps": max(caught) if len(caught) == len(lat) else None,
            "within_target": round(sum(x <= target for x in caught) / len(lat), 3),
            "false_ranks": sum(int(run["false_ranks"]) for run in runs),  # type: ignore[call-overload]
            "ms_per_step": round(1e3 * sum(float(run["seconds"]) for run in runs)  # type: ignore[arg-type]
                                 / sum(int(run["steps"]) for run in runs), 3)}  # type: ignore[call-overload]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=4096)
    parser.add_argument("--stragglers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=1, help="fleets per slowdown, pooled")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = []
    fed = 0
    for i, (slowdown, target) in enumerate(TARGETS.items()):
        runs = [_latency(args.ranks, args.warmup, slowdown, target, args.seed + i + 100 * j, args.stragglers)
                for j in range(args.seeds)]
        res = {name: _summary([run[name] for run in runs], target) for name in ("cusum", "seed_rule")}
        cusum = res["cusum"]
        met = (cusum["max_steps"] is not None and cusum["max_steps"] <= target and cusum["false_ranks"] == 0)
        seed = res["seed_rule"]
        ratio = (round(seed["median_steps"] / cusum["median_steps"], 2)
                 if seed["median_steps"] and cusum["median_steps"] else None)
        median, p90 = cusum["median_steps"], cusum["p90_steps"]
        rows.append({"slowdown": slowdown, "target_steps": target, "median_steps": median, "p90_steps": p90,
                     "median_meets_target": median is not None and median <= target,
                     "p90_over_target": None if p90 is None else round(p90 / target, 3),
                     "p90_within_slack": p90 is not None and p90 <= P90_SLACK * target,
                     "cusum_meets_target": met, "seed_over_cusum_latency": ratio, **res})
        fed += sum(int(run["cusum"]["steps"]) for run in runs) * args.ranks  # type: ignore[call-overload]
    false = sum(int(row["cusum"]["false_ranks"]) for row in rows)  # type: ignore[index]
    c = false + 1  # 95 % one-sided Poisson upper bound (Wilson-Hilferty), as bench/straggler_far.py
    upper = c * (1.0 - 1.0 / (9.0 * c) + 1.645 / (3.0 * c ** 0.5)) ** 3
    far = {"false_ranks": false, "rank_steps": fed,
           "per_job_day": round(false / fed * JOB_DAY_RANK_STEPS, 3), "upper95_per_job_day":
           round(upper / fed * JOB_DAY_RANK_STEPS, 3), "target_per_job_day": FAR_TARGET_PER_JOB_DAY}
    print(json.dumps({"bench": "straggler_latency", "ranks": args.ranks, "warmup_steps": args.warmup,
                      "fleets_per_row": args.seeds, "p90_slack": P90_SLACK,
                      "median_meets_every_target": all(row["median_meets_target"] for row in rows),
                      "p90_within_slack_everywhere": all(row["p90_within_slack"] for row in rows),
                      "false_alarm": far,
                      "noise": vars(FleetNoise()), "latency": rows,
                      "seconds": round(time.perf_counter() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()
