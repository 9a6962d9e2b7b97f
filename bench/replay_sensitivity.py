"""How small a single-element error the cross-rank replay detects, by tensor size (prints one JSON object).

The replay compares fingerprints (:func:`fleethealth.injob.digest.fingerprint`: per tensor the sum,
the sum of squares, a key-signed sum and the count) with :func:`fingerprint_distance` against a
tolerance (at least ``MIN_REPLAY_TOLERANCE`` = 1e-6; that floor is what ranks that agree bit for bit
calibrate to). For one standard-normal float32 gradient of n elements, one element is moved by
``e x RMS`` and ``e`` is bisected (in log space) to the smallest value whose distance exceeds the
tolerance, at 4 random elements; ``_worst`` is the largest of the 4 (the guarantee), ``_median`` the
middle one (an element far from zero also moves the sum of squares, which helps):

- ``per_chunk``: the library's fingerprint, one row per :data:`FINGERPRINT_ROW` (65,536) elements,
  each compared on its own: the smallest detectable error stays at the row's value whatever n is;
- ``per_tensor``: the same sums added up into one row per tensor (what the replay compared before
  rows of a fixed size). Its distance is normalised by the whole tensor's magnitude (about
  ``n x RMS`` for the sums), so the smallest detectable error grows like n.

Only the chunk holding the moved element is recomputed for each trial (the others cannot change).

    python bench/replay_sensitivity.py                        # n = 1e6, 1e7, 1e8 (~1 min, 0.4 GB)
    python bench/replay_sensitivity.py --sizes 1e5 1e6        # quick
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

from fleethealth.injob.digest import CHUNK, FINGERPRINT_ROW, fingerprint, fingerprint_distance
from fleethealth.injob.replay import MIN_REPLAY_TOLERANCE


def _smallest(distance_at: object, tolerance: float, lo: float = 1e-4, hi: float = 1e5, steps: int = 12) -> float:
    """Smallest e in [lo, hi] with distance_at(e) > tolerance (bisection in log space); inf if none."""
    if distance_at(hi) <= tolerance:  # type: ignore[operator]
        return math.inf
    if distance_at(lo) > tolerance:  # type: ignore[operator]
        return lo
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        if distance_at(mid) > tolerance:  # type: ignore[operator]
            hi = mid
        else:
            lo = mid
    return hi


def measure(n: int, tolerance: float, positions: int = 4, seed: int = 0) -> dict[str, float]:
    """The largest (worst) and the median over ``positions`` random elements of the smallest error found."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen)
    rms = float(g.double().square().mean().sqrt())
    t0 = time.perf_counter()
    rows = fingerprint([g])
    whole = rows.sum(axis=0, keepdims=True)
    found: dict[str, list[float]] = {"per_chunk": [], "per_tensor": []}
    for pos in torch.randint(0, n, (positions,), generator=gen).tolist():
        original = float(g[pos])
        c = pos // CHUNK  # rows restart their position key at every chunk: recompute the element's chunk
        first_row = c * (CHUNK // FINGERPRINT_ROW)
        piece = g[c * CHUNK:(c + 1) * CHUNK]

        def changed(e: float, pos: int = pos, original: float = original, piece: torch.Tensor = piece,
                    first_row: int = first_row) -> np.ndarray:
            g[pos] = original + e * rms
            part = fingerprint([piece])
            g[pos] = original
            out = rows.copy()
            out[first_row:first_row + len(part)] = part
            return out

        found["per_chunk"].append(_smallest(lambda e: fingerprint_distance(rows, changed(e)), tolerance))
        found["per_tensor"].append(_smallest(
            lambda e: fingerprint_distance(whole, changed(e).sum(axis=0, keepdims=True)), tolerance))
    out: dict[str, float] = {"n": n}
    for name, values in found.items():
        out[f"{name}_min_error_rms_worst"] = max(values)
        out[f"{name}_min_error_rms_median"] = float(np.median(values))
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7, 1e8])
    ap.add_argument("--tolerance", type=float, default=MIN_REPLAY_TOLERANCE)
    args = ap.parse_args()
    rows = [measure(int(n), args.tolerance) for n in args.sizes]
    for r in rows:
        for key in [k for k in r if k.endswith(("_worst", "_median"))]:
            r[key] = float(np.format_float_positional(r[key], precision=3, fractional=False)) if math.isfinite(
                r[key]) else r[key]
    first = rows[0]
    print(json.dumps({
        "tolerance": args.tolerance, "row": FINGERPRINT_ROW, "sizes": rows,
        **{f"{name}_fade": round(rows[-1][f"{name}_min_error_rms_worst"] / first[f"{name}_min_error_rms_worst"], 2)
           for name in ("per_tensor", "per_chunk")},
    }, indent=1))


if __name__ == "__main__":
    main()
