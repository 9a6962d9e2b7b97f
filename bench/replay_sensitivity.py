"""How small a single-element error the cross-rank replay detects, by tensor size (prints one JSON object).

The replay compares fingerprints (:func:`fleethealth.injob.digest.fingerprint`: per tensor the sum,
the sum of squares, a key-signed sum and the count) with :func:`fingerprint_distance` against a
tolerance (at least ``MIN_REPLAY_TOLERANCE`` = 1e-6; that floor is what ranks that agree bit for bit
calibrate to). For one standard-normal float32 gradient of n elements, one element is moved by
``e x RMS`` and ``e`` is bisected (in log space) to the smallest value whose distance exceeds the
tolerance:

- ``per_tensor``: the fingerprint as the library computes it today, one row per tensor. Its
  distances are normalised by the tensor's own magnitude (about ``2 n RMS`` for the sums and
  ``2 n RMS^2`` for the sum of squares), so the smallest detectable error grows like ``sqrt(n)``;
- ``per_chunk``: the same fingerprint of the tensor's ``--chunk``-element pieces (one row per
  piece), which keeps the smallest detectable error at the chunk's value whatever n is.

    python bench/replay_sensitivity.py                        # n = 1e6, 1e7, 1e8 (~2 min, 1.2 GB)
    python bench/replay_sensitivity.py --sizes 1e5 1e6        # quick
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

from fleethealth.injob.digest import fingerprint, fingerprint_distance
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


def measure(n: int, chunk: int, tolerance: float, seed: int = 0) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen)
    rms = float(g.double().square().mean().sqrt())
    pos = int(torch.randint(0, n, (1,), generator=gen))
    original = float(g[pos])
    whole = fingerprint([g])
    pieces = list(g.split(chunk))
    rows = fingerprint(pieces)
    k = pos // chunk

    def moved(e: float) -> torch.Tensor:
        g[pos] = original + e * rms
        return g

    def per_tensor(e: float) -> float:
        d = fingerprint_distance(whole, fingerprint([moved(e)]))
        g[pos] = original
        return d

    def per_chunk(e: float) -> float:
        moved(e)
        changed = rows.copy()
        changed[k] = fingerprint([g.split(chunk)[k]])[0]  # only the piece holding the element changes
        g[pos] = original
        return fingerprint_distance(rows, changed)

    t0 = time.perf_counter()
    out = {"n": n, "per_tensor_min_error_rms": _smallest(per_tensor, tolerance),
           "per_chunk_min_error_rms": _smallest(per_chunk, tolerance)}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e6, 1e7, 1e8])
    ap.add_argument("--chunk", type=int, default=1 << 16, help="elements per fingerprint row in per_chunk")
    ap.add_argument("--tolerance", type=float, default=MIN_REPLAY_TOLERANCE)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [measure(int(n), args.chunk, args.tolerance) for n in args.sizes]
    for r in rows:
        for key in ("per_tensor_min_error_rms", "per_chunk_min_error_rms"):
            r[key] = float(np.format_float_positional(r[key], precision=3, fractional=False)) if math.isfinite(
                r[key]) else r[key]
    first = rows[0]
    print(json.dumps({
        "tolerance": args.tolerance, "chunk": args.chunk, "sizes": rows,
        "per_tensor_fade": round(rows[-1]["per_tensor_min_error_rms"] / first["per_tensor_min_error_rms"], 1),
        "per_chunk_fade": round(rows[-1]["per_chunk_min_error_rms"] / first["per_chunk_min_error_rms"], 2),
    }, indent=1))


if __name__ == "__main__":
    main()
