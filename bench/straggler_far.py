"""False straggler findings per job-day on the real-fleet null model.

Feeds ``--rank-steps`` rank-steps (default 10⁹) of :class:`~fleethealth.detectors.synth.FleetSteps`
(2 % per-step noise, persistent per-GPU speed offsets σ 0.5 %, per-node temperature offsets,
pipeline-stage offsets, power-cap dips, heavy-tailed hiccups, whole-step drift, 1 % missing
samples; no straggler) through one :class:`~fleethealth.detectors.straggler.StragglerDetector`
for a ``--ranks`` job (default 16,384, four stages as comparison groups), from the job's first step
on, so the warm-up is included. Every finding is false.

A rate of one false finding per job-day is about 7·10⁻¹¹ per rank-step, so 10⁹ rank-steps see
it 0.07 times: a count of zero only bounds the rate (95 %: 3 findings in the rank-steps run, 42 a
job-day at 10⁹), and ten times the rank-steps would still bound it at 4. The rate is therefore
stated three ways, per CUSUM arm:

* ``design``: the detector's own budget, Siegmund's run length for standard normal scores at the
  arm's ``(k, h)`` (the thresholds are derived from it: ``StragglerDetector.false_rate``).
* ``empirical_exponent``: the same formula with the scores the detector actually saw. The bench
  keeps a histogram of each arm's increment ``x = clip(z, +-c) - k`` (the rank's change against
  its baseline over its own residual scale), alone and summed over blocks of ``BLOCK`` steps of a
  rank (dips last several steps, so increments are not independent); the root ``theta`` of
  ``log E exp(theta x) = 0`` (per step; the smaller of the two) replaces Siegmund's ``2k`` in
  ``rate = theta |E x| / (exp(theta (h + rho)) - theta (h + rho) - 1)``, ``rho = 1.166 sd(x)``.
* ``extrapolated``: how often an excursion of the arm's statistic (from leaving zero to returning)
  reached a share ``L`` of the threshold, for ``L`` from 0.3 to 0.9; for a CUSUM that tail is
  exponential in ``L``, and the fit, extrapolated to ``L = 1``, estimates how often the arm would
  cross its threshold.

Both estimates are of threshold crossings, an upper bound on findings (which also need the effect
gate).

Prints one JSON object: ``false_findings`` (change and persistent), ``false_findings_per_job_day``
at ``--steps-per-s`` (10) with a 95 % upper bound, ``per_job_day`` (the three estimates per arm and
in total), ``rank_steps`` and ``seconds``; ``target`` beside them: the false-alarm target (1 a
job-day) with whether each estimate and the counted upper bound meet it, and the latency targets
the median must meet (``bench/straggler_latency.py`` measures the median and 90th percentile
against them, the 90th within ``p90_slack`` of each bound).

    python bench/straggler_far.py [--ranks 16384] [--rank-steps 1000000000] [--seed 1] [--thresholds 56,23,9.5,6.5]
                                  [--drifts 0.2,0.5,1.25,2] [--sample-every 1] [--cap-frac 1.0]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from fleethealth.detectors.straggler import StragglerDetector, robust_z
from fleethealth.detectors.synth import FleetNoise, FleetSteps

LEVELS = np.array([0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
BLOCK = 4
"""Steps per block of a rank's summed increments (a power-cap dip lasts 2 on average, 8 at most)."""
BIN = 0.01
"""Histogram bin of an increment (z-units)."""


class _Increments:
    """Histograms of each arm's increments, single and summed over ``BLOCK`` steps of a rank."""

    def __init__(self, det: StragglerDetector, n: int) -> None:
        self.k, self.c = det.k_[:, 0], det.c_[:, 0]
        arms = self.k.size
        self.lo = -(self.c + self.k) * BLOCK  # the lowest block sum of each arm
        self.bins = np.ceil(2.0 * self.c * BLOCK / BIN).astype(np.int64) + 2
        self.single = [np.zeros(int(b), dtype=np.int64) for b in self.bins]
        self.blocks = [np.zeros(int(b), dtype=np.int64) for b in self.bins]
        self.acc = np.zeros((arms, n))
        self.cnt = np.zeros(n, dtype=np.int64)

    def add(self, det: StragglerDetector, ranks: np.ndarray, t: np.ndarray, groups: np.ndarray,
            base: np.ndarray, sig2: np.ndarray, mature: np.ndarray) -> None:
        """One step's increments from the state before the detector's update (``base``, ``sig2``)."""
        z, med, _ = robust_z(np.log(t), groups, min_group=det.min_group, min_scale=det.min_scale)
        keep = ~np.isnan(z) & mature[ranks]
        r = ranks[keep]
        lr = np.log(t[keep]) - med[keep]
        dz = (lr - base[r]) / np.sqrt(sig2[r])
        x = np.clip(dz, -self.c[:, None], self.c[:, None]) - self.k[:, None]
        self.acc[:, r] += x
        self.cnt[r] += 1
        full = r[self.cnt[r] == BLOCK]
        for i in range(self.k.size):
            self.single[i] += np.bincount(((x[i] - self.lo[i]) / BIN).astype(np.int64), minlength=int(self.bins[i]))
            if full.size:
                self.blocks[i] += np.bincount(((self.acc[i, full] - self.lo[i]) / BIN).astype(np.int64),
                                              minlength=int(self.bins[i]))
        self.acc[:, full] = 0.0
        self.cnt[full] = 0

    def rate(self, i: int, h: float) -> dict[str, float | None]:
        """Arm ``i``'s crossing rate per step by the empirical exponent (see the module docstring)."""
        centers = self.lo[i] + (np.arange(int(self.bins[i])) + 0.5) * BIN
        out: dict[str, float | None] = {}
        thetas = []
        for name, hist in (("single", self.single[i]), ("block", self.blocks[i])):
            total = hist.sum()
            if total == 0:
                out[f"theta_{name}"] = None
                continue
            p = hist / total
            use = p > 0
            xs, ps = centers[use], p[use]

            def cgf(theta: float, xs: np.ndarray = xs, ps: np.ndarray = ps) -> float:
                return float(np.log(np.sum(ps * np.exp(theta * xs))))

            lo, hi = 1e-6, 1.0
            while cgf(hi) < 0.0 and hi < 1e3:
                hi *= 2.0
            for _ in range(60):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if cgf(mid) < 0.0 else (lo, mid)
            thetas.append(hi)  # for independent steps E exp(theta S_m) = (E exp(theta x))^m: the same root
            out[f"theta_{name}"] = round(hi, 4)
            out[f"samples_{name}"] = int(total)
        single = self.single[i] / max(self.single[i].sum(), 1)
        mean = float(np.sum(single * centers))
        sd = float(np.sqrt(np.sum(single * (centers - mean) ** 2)))
        theta = min(thetas)
        b = theta * (h + 1.166 * sd)
        out["theta"] = round(theta, 4)
        out["gaussian_theta"] = round(2.0 * float(self.k[i]), 4)
        out["mean"], out["sd"] = round(mean, 4), round(sd, 4)
        out["rate"] = theta * abs(mean) / (math.exp(b) - b - 1.0)
        return out


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


FAR_TARGET_PER_JOB_DAY = 1.0
LATENCY_TARGETS = {0.20: 5, 0.05: 15, 0.02: 60, 0.01: 250}
"""The same as ``bench/straggler_latency.py`` ``TARGETS``: slowdown -> steps, met by the median."""
P90_SLACK = 1.25


def _targets(rates: dict[str, float | None]) -> dict[str, object]:
    """The false-alarm target beside each way the rate is stated, and the latency targets."""
    return {"false_findings_per_job_day": FAR_TARGET_PER_JOB_DAY,
            "meets": {way: None if r is None else r <= FAR_TARGET_PER_JOB_DAY for way, r in rates.items()},
            "latency_steps_median": {str(k): v for k, v in LATENCY_TARGETS.items()}, "p90_slack": P90_SLACK}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=16384)
    parser.add_argument("--rank-steps", type=int, default=1_000_000_000)
    parser.add_argument("--steps-per-s", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sample-every", type=int, default=1,
                        help="record the increments of every this many steps (after a rank's baseline)")
    parser.add_argument("--thresholds", type=str, default=None,
                        help="comma-separated CUSUM thresholds instead of the ones derived from the "
                             "false-alarm budget, e.g. 56,23,9.5,6.5")
    parser.add_argument("--drifts", type=str, default=None, help="comma-separated CUSUM drifts (z-units)")
    parser.add_argument("--cap-frac", type=float, default=None,
                        help="share of GPUs at their power limit (default the null's 0.1); 1.0 runs the "
                             "power-capped stratum alone, ten times the dips per rank-step")
    args = parser.parse_args()
    t0 = time.perf_counter()
    n = args.ranks
    noise = FleetNoise() if args.cap_frac is None else FleetNoise(cap_frac=args.cap_frac)
    gen = FleetSteps(np.random.default_rng(args.seed), n, noise)
    params: dict[str, tuple[float, ...]] = {}
    for key in ("thresholds", "drifts"):
        if getattr(args, key) is not None:
            params[key] = tuple(float(x) for x in getattr(args, key).split(","))
    det = StragglerDetector(**params)
    inc = None
    steps = -(-args.rank_steps // n)
    findings: list[dict[str, object]] = []
    exc = None
    counts = None
    p_peak = 0.0
    fed = 0
    for step in range(steps):
        ranks, t, groups = gen.draw()
        fed += ranks.size
        if inc is not None and step % args.sample_every == 0:  # the increments the update will score
            inc.add(det, ranks, t, groups, det.base_, det.sig2_, det.base_n_ >= det.baseline_steps)
        for f in det.check(step, ranks, t, groups):
            findings.append({"rank": f.rank, "step": f.step, "persistent": f.evidence["persistent"],
                             "slowdown": f.slowdown, "z": f.z})
        cur = det.stat_[:, :n] / det.h_
        if exc is None:
            inc = _Increments(det, n)
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
    ideal = det.rate_.tolist()
    empirical = [inc.rate(i, float(h[i])) for i in range(k.size)]
    emp_rate = [e["rate"] for e in empirical]
    out = {
        "bench": "straggler_far", "ranks": n, "steps": steps, "rank_steps": fed,
        "steps_per_s": args.steps_per_s, "job_days_simulated": round(fed / per_day, 4),
        "noise": {key: (list(v) if isinstance(v, tuple) else v) for key, v in vars(noise).items()},
        "false_findings": {"change": sum(not f["persistent"] for f in findings),
                           "persistent": sum(bool(f["persistent"]) for f in findings)},
        "false_findings_per_job_day": round(len(findings) / fed * per_day, 3),
        "upper95_per_job_day": round(_upper95(len(findings)) / fed * per_day, 3),
        "per_job_day": {
            "design": {"per_arm": [round(r * per_day, 4) for r in ideal], "total": round(sum(ideal) * per_day, 3)},
            "empirical_exponent": {"per_arm": [round(r * per_day, 4) for r in emp_rate],
                                   "total": round(sum(emp_rate) * per_day, 3)},
            "extrapolated": {"per_arm": [None if e is None else round(e * per_day, 4) for e in extrap],
                             "total": None if None in extrap else round(sum(extrap) * per_day, 3)}},
        "target": _targets({
            "design": sum(ideal) * per_day, "empirical_exponent": sum(emp_rate) * per_day,
            "extrapolated": None if None in extrap else sum(extrap) * per_day,
            "counted_upper95": _upper95(len(findings)) / fed * per_day}),
        "empirical_exponent": [{key: v for key, v in e.items() if key != "rate"} for e in empirical],
        "arms": {"drifts": k.tolist(), "thresholds": h.tolist(), "false_rate": det.false_rate},
        "excursions_reaching_level": {"levels": LEVELS.tolist(), "per_arm": counts.tolist()},
        "persistent_peak_over_threshold": round(p_peak, 3),
        "findings": findings[:20],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
