"""Straggler diagnosis across load steps, against the rule it replaced, on independent GPU physics.

For each moment of ``tests/detectors/test_diagnosis_load.py`` (a job's start, its end, a
neighbouring job starting, a power-cap change; four racks of three nodes with four GPUs, data-centre
names, a sample every 8 s, per-GPU thermal offsets and power-cap dips) and ``--seeds`` seeds, every
GPU that runs hot (at its slowdown temperature or throttling thermally) in the moment's window is
diagnosed at every sample, as a straggler on it would be, by

* ``thermal_model``: :class:`~fleethealth.detectors.diagnosis.Diagnoser` (the GPU against its rack
  peers at the same power, the rack's thermal residual);
* ``baseline_rise`` (the baseline, computed in this run): the rule before it — ``ENVIRONMENTAL`` when
  the peers' median is over their limits, half the peers throttle, or the rack's median rise over
  each node's own 30-minute exponential average of its median temperature is 5 °C or more, else
  ``NODE_THERMAL``.

Prints one JSON object: per rule, the share of diagnoses that were right for the failing GPUs
(``NODE_THERMAL``), for the hot aisle's other GPUs (``ENVIRONMENTAL``) and for the second failing
GPU inside the aisle a minute after it failed (``NODE_THERMAL``), and on the fleets with no fault the
largest rack residual and GPU excess seen (with their limits) and any GPU flagged.

    python bench/diagnosis_load.py [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleethealth.detectors.diagnosis import Diagnoser  # noqa: E402
from fleethealth.schema import Diagnosis  # noqa: E402
from tests.detectors import test_diagnosis_load as scenarios  # noqa: E402
from tests.detectors.thermal_fleet import SLOWDOWN_C  # noqa: E402

MOMENTS = scenarios.MOMENTS


class BaselineRise:
    """The replaced rule's rack rise: each node's median temperature over a 1,800 s exponential average."""

    def __init__(self, tau_s: float = 1800.0) -> None:
        self.tau_s = tau_s
        self.base: dict[str, float] = {}
        self.ts: dict[str, float] = {}
        self.temp: dict[str, float] = {}

    def observe(self, s) -> None:
        temp = float(np.nanmedian(s.columns["temp_c"]))
        if s.node in self.base:
            w = 1.0 - math.exp(-(s.ts - self.ts[s.node]) / self.tau_s)
            self.base[s.node] += w * (temp - self.base[s.node])
        else:
            self.base[s.node] = temp
        self.ts[s.node], self.temp[s.node] = s.ts, temp

    def diagnose(self, node: str, peers: list[str], latest: dict) -> Diagnosis:
        temps = np.array([self.temp[p] for p in peers])
        rise = float(np.median(temps - np.array([self.base[p] for p in peers])))
        share = float(np.mean([(latest[p].columns["clock_reasons"].astype(np.int64) & 0x60).any() for p in peers]))
        hot_rack = float(np.median(temps)) > SLOWDOWN_C or share >= 0.5 or rise >= 5.0
        return Diagnosis.ENVIRONMENTAL if hot_rack else Diagnosis.NODE_THERMAL


def run(moment: str, seed: int, faults_on: bool) -> dict[str, list]:
    fleet, faults, (w0, w1) = scenarios._fleet(moment, seed)
    if not faults_on:
        for ch in fleet.timeline:
            ch.aisle, ch.cooling = {}, {}
        w0 = 600.0
    diag, old = Diagnoser(), BaselineRise()
    latest: dict = {}
    out: dict[str, list] = {"hot": [], "aisle": [], "second": [], "flagged": []}
    worst = {"rack_residual_c": -np.inf, "excess_c": -np.inf}
    batch: list = []

    def settle(batch: list) -> None:
        diag.observe(batch)
        for s in batch:
            old.observe(s)
            latest[s.node] = s
        ts = batch[0].ts
        if ts < w0:
            return
        for s in batch:
            peers = [n for n in fleet.nodes if fleet.rack_of[n] == fleet.rack_of[s.node] and n != s.node]
            if not faults_on and s.node in fleet.nodes[::3]:
                ev = diag.diagnose(s.node, None, at=ts).evidence
                worst["excess_c"] = max(worst["excess_c"], ev["excess_c"])
                if ev["rack_residual_c"] is not None:
                    worst["rack_residual_c"] = max(worst["rack_residual_c"], ev["rack_residual_c"])
            hot = (s.columns["temp_c"] >= s.columns["slowdown_temp_c"]) | \
                  (s.columns["clock_reasons"].astype(np.int64) & 0x60 != 0)
            for g in np.flatnonzero(hot).tolist():
                new = diag.diagnose(s.node, g, at=ts).diagnosis
                was = old.diagnose(s.node, peers, latest)
                key = (s.node, g)
                if not faults_on:
                    out["flagged"].append((new, was))
                elif key == faults["hot"] or key == faults.get("also_hot"):
                    out["hot"].append((new, was))
                elif key == faults["second"]:
                    if ts >= faults["second_ts"] + 60.0:
                        out["second"].append((new, was))
                elif fleet.rack_of[s.node] == faults["aisle"]:
                    out["aisle"].append((new, was))

    for sample in fleet.run(0.0, w1 + 8.0):
        if batch and sample.ts != batch[0].ts:
            settle(batch)
            batch = []
        batch.append(sample)
    settle(batch)
    out["worst"] = [worst]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    expected = {"hot": Diagnosis.NODE_THERMAL, "aisle": Diagnosis.ENVIRONMENTAL, "second": Diagnosis.NODE_THERMAL}
    result: dict[str, dict] = {}
    for moment in MOMENTS:
        tallies = {k: [0, 0, 0] for k in expected}  # right (new), right (old), total
        flagged, worst = 0, {"rack_residual_c": -np.inf, "excess_c": -np.inf}
        for seed in range(args.seeds):
            got = run(moment, seed, True)
            for k, want in expected.items():
                for new, was in got[k]:
                    tallies[k][0] += new is want
                    tallies[k][1] += was is want
                    tallies[k][2] += 1
            null = run(moment, seed, False)
            flagged += len(null["flagged"])
            for name in worst:
                worst[name] = max(worst[name], null["worst"][0][name])
        result[moment] = {
            "thermal_model": {k: round(v[0] / v[2], 3) if v[2] else None for k, v in tallies.items()},
            "baseline_rise": {k: round(v[1] / v[2], 3) if v[2] else None for k, v in tallies.items()},
            "diagnoses": {k: v[2] for k, v in tallies.items()},
            "null": {"gpus_flagged": flagged, "max_rack_residual_c": round(worst["rack_residual_c"], 2),
                     "max_excess_c": round(worst["excess_c"], 2)},
        }
    th = Diagnoser().thresholds
    print(json.dumps({"moments": result, "limits": {"rack_residual_c": th.rack_residual_c,
                                                    "node_excess_c": th.node_excess_c},
                      "seeds": args.seeds, "seconds": round(time.perf_counter() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()
