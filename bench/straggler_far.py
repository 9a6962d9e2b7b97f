"""False straggler findings per job-day on the real-fleet null model.

Feeds ``--rank-steps`` rank-steps (default 10⁹) of :class:`~fleethealth.detectors.synth.FleetSteps`
(2 % per-step noise, persistent per-GPU speed offsets σ 0.5 %, per-node temperature offsets,
pipeline-stage offsets, power-cap dips, heavy-tailed hiccups, whole-step drift, 1 % missing
samples; no straggler) through one :class:`~fleethealth.detectors.straggler.StragglerDetector`
for a ``--ranks`` job (default 16,384, four stages as comparison groups), from the job's first step
on, so the warm-up is included. Every finding is false.

A rate of one false finding per job-day is about 7·10⁻¹¹ per rank-step, so 10⁹ rank-steps see
it 0.07 times: the count alone can only bound the rate. The bench therefore also records, per
CUSUM arm, how often an excursion of its statistic (from leaving zero to returning) reached a
share ``L`` of the threshold, for ``L`` from 0.3 to 0.9. For a CUSUM that tail is exponential in
``L``; the fit, extrapolated to ``L = 1``, estimates how often the arm would cross its threshold
(an upper bound on findings, which also need the effect gate). Siegmund's ideal-Gaussian rate of
each arm is printed beside it.

Prints one JSON object: ``false_findings`` (change and persistent), ``false_findings_per_job_day``
at ``--steps-per-s`` (10) with a 95 % upper bound, ``extrapolated_per_job_day`` per arm and in
total, ``siegmund_gaussian_per_job_day``, ``rank_steps`` and ``seconds``.

    python bench/straggler_far.py [--ranks 16384] [--rank-steps 1000000000] [--seed 1] [--thresholds 56,23,9.5,6.5]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from fleethealth.detectors.straggler import StragglerDetector
from fleethealth.detectors.synth import FleetNoise, FleetSteps

LEVELS = np.array([0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])


def _siegmund_rate(k: float, h: float) -> float:
    """Ideal-Gaussian false-alarm rate per rank-step of one arm (1 / Siegmund's ARL0)."""
    b = 2.0 * k * (h + 1.166)
    return 2.0 * k * k / (math.exp(b) - b - 1.0)


def _upper95(count: int) -> float:
    """95 % one-sided Poisson upper bound on a count (Wilson-Hilferty)."""
    c = count + 1
    return c * (1.0 - 1.0 / (9.0 * c) + 1.645 / (3.0 * math.sqrt(c))) ** 3


def _extrapolate(counts: np.ndarray, rank_steps: int) -> float | None:
    """Fit log(rate) linear in level over levels < 1 with at least 10 excursions; the rate at 1."""
    use = (LEVELS < 1.0) & (counts >= 10)
    if use.sum() < 2:
        return None
    slope, icept = np.polyfit(LEVELS[use], np.log(counts[use] / rank_steps), 1)
    return float(math.exp(icept + slope))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=16384)
    parser.add_argument("--rank-steps", type=int, default=1_000_000_000)
    parser.add_argument("--steps-per-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--thresholds", type=str, default=None,
                        help="comma-separated CUSUM thresholds instead of the defaults, e.g. 56,23,9.5,6.5")
    args = parser.parse_args()
    t0 = time.perf_counter()
    n = args.ranks
    gen = FleetSteps(np.random.default_rng(args.seed), n, FleetNoise())
    det = (StragglerDetector() if args.thresholds is None
           else StragglerDetector(thresholds=tuple(float(x) for x in args.thresholds.split(","))))
    steps = -(-args.rank_steps // n)
    findings: list[dict[str, object]] = []
    exc = None
    counts = None
    p_peak = 0.0
    fed = 0
    for step in range(steps):
        ranks, t, groups = gen.draw()
        fed += ranks.size
        for f in det.update(step, ranks, t, groups):
            findings.append({"rank": f.rank, "step": f.step, "persistent": f.evidence["persistent"],
                             "slowdown": f.slowdown, "z": f.z})
        cur = det.stat_[:, :n] / det.h_
        if exc is None:
            exc = np.zeros_like(cur)
            counts = np.zeros((cur.shape[0], LEVELS.size), dtype=np.int64)
        np.maximum(exc, cur, out=exc)
        ended = cur == 0.0
        hit = ended & (exc >= LEVELS[0])
        if hit.any():
            arm, _ = np.nonzero(hit)
            counts += np.stack([np.bincount(arm[exc[hit] >= lv], minlength=cur.shape[0]) for lv in LEVELS], axis=1)
        exc[ended] = 0.0
        p_peak = max(p_peak, float(det.pstat_[:n].max()) / det.persistent_threshold)
        if step and step % 5000 == 0:
            print(f"step {step}/{steps} findings {len(findings)} {time.perf_counter() - t0:.0f}s",
                  file=sys.stderr, flush=True)
    per_day = n * args.steps_per_s * 86400.0  # rank-steps in one job-day
    k, h = det.k_[:, 0], det.h_[:, 0]
    extrap = [_extrapolate(counts[i], fed) for i in range(k.size)]
    ideal = [_siegmund_rate(float(a), float(b)) for a, b in zip(k, h, strict=True)]
    out = {
        "bench": "straggler_far", "ranks": n, "steps": steps, "rank_steps": fed,
        "steps_per_s": args.steps_per_s, "job_days_simulated": round(fed / per_day, 4),
        "noise": {key: (list(v) if isinstance(v, tuple) else v) for key, v in vars(FleetNoise()).items()},
        "false_findings": {"change": sum(not f["persistent"] for f in findings),
                           "persistent": sum(bool(f["persistent"]) for f in findings)},
        "false_findings_per_job_day": round(len(findings) / fed * per_day, 3),
        "upper95_per_job_day": round(_upper95(len(findings)) / fed * per_day, 3),
        "extrapolated_per_job_day": {
            "per_arm": [None if e is None else round(e * per_day, 4) for e in extrap],
            "total": None if None in extrap else round(sum(extrap) * per_day, 3)},
        "siegmund_gaussian_per_job_day": {
            "per_arm": [round(r * per_day, 4) for r in ideal], "total": round(sum(ideal) * per_day, 3)},
        "arms": {"drifts": k.tolist(), "thresholds": h.tolist()},
        "excursions_reaching_level": {"levels": LEVELS.tolist(), "per_arm": counts.tolist()},
        "persistent_peak_over_threshold": round(p_peak, 3),
        "findings": findings[:20],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
