"""Cross-rank replay planning, voting and its stored calibration (seed 000 R3, second layer; torch-free).

A deterministically wrong GPU computes the same wrong answer twice and passes its self-check. The
replay catches it: two ranks in different failure domains compute the *same* microbatch and compare
fingerprints at a tolerance measured on known-good hardware; on a mismatch a third rank, in a third
failure domain where one exists, computes it too and the majority names the rank that lies.

Pairing: rank ``r`` of the lower half is paired with ``r + world // 2`` (seed R1's failure-domain rule:
"r + world_size/2 rather than r+1"), so with the usual placement the two sit on different nodes and,
for jobs larger than a rack, in different racks. In a synchronous job every rank waits for the
slowest, so all pairs replay at once for the wall time of one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fleethealth.errors import ConfigError

__all__ = ["ReplayCalibration", "Vote", "replay_pairs", "choose_judge", "vote", "MIN_REPLAY_TOLERANCE"]

MIN_REPLAY_TOLERANCE = 1e-6
"""The least replay tolerance a start-up calibration sets (a relative fingerprint distance). Ranks
that were bitwise equal at start-up may later differ in the last bits (another kernel choice, a
different microbatch shape); one part in a million of a tensor's sums is far below a corruption the
replay is for, which the bitwise self-check does not already catch."""


@dataclass(frozen=True)
class ReplayCalibration:
    """The healthy rank-to-rank spread of the replay distance, and the tolerance derived from it.

    ``tolerance = max(floor, center + sigmas x spread)``: ``center`` / ``spread`` are the mean and
    standard deviation of healthy distances (or, with ``robust``, the median and 1.4826 x MAD, so one
    bad device among the calibration ranks cannot widen the band). Stored as JSON with :meth:`save`.
    """

    center: float
    spread: float
    samples: int
    sigmas: float = 5.0
    floor: float = 0.0

    @property
    def tolerance(self) -> float:
        return max(self.floor, self.center + self.sigmas * self.spread)

    @classmethod
    def from_distances(cls, distances: Sequence[float] | np.ndarray, *, sigmas: float = 5.0,
                       floor: float = 0.0, robust: bool = False) -> ReplayCalibration:
        d = np.asarray(distances, dtype=np.float64).ravel()
        if d.size == 0:
            raise ConfigError("a replay calibration needs at least one healthy distance")
        if not np.isfinite(d).all() or (d < 0).any():
            raise ConfigError("replay calibration distances must be finite and non-negative")
        if robust:
            center = float(np.median(d))
            spread = 1.4826 * float(np.median(np.abs(d - center)))
        else:
            center, spread = float(d.mean()), float(d.std())
        return cls(center=center, spread=spread, samples=int(d.size), sigmas=sigmas, floor=floor)

    @classmethod
    def from_pair_distances(cls, distances: Sequence[float] | np.ndarray, *, sigmas: float = 5.0,
                            margin: float = 10.0, floor: float = MIN_REPLAY_TOLERANCE) -> ReplayCalibration:
        """The start-up calibration: ``distances`` are healthy replay pairs' own distances (each pair's
        two ranks computing the same microbatch, exactly what the replay compares). Robust statistics,
        with the floor raised to ``margin x`` the largest healthy distance: with one pair (two ranks)
        the spread is 0, and when most pairs are bitwise equal the median and MAD are 0, so without it
        every replay of a pair that differs healthily would be a false alarm."""
        d = np.asarray(distances, dtype=np.float64).ravel()
        high = float(d.max()) if d.size and np.isfinite(d).all() else 0.0
        return cls.from_distances(d, sigmas=sigmas, floor=max(floor, margin * high), robust=True)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ReplayCalibration:
        try:
            obj = json.loads(Path(path).read_text())
            cal = cls(center=float(obj["center"]), spread=float(obj["spread"]), samples=int(obj["samples"]),
                      sigmas=float(obj.get("sigmas", 5.0)), floor=float(obj.get("floor", 0.0)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot read replay calibration {path}: {exc}") from exc
        if not all(math.isfinite(v) and v >= 0 for v in (cal.center, cal.spread, cal.sigmas, cal.floor)):
            raise ConfigError(f"replay calibration {path} holds negative or non-finite values")
        return cal


def replay_pairs(world: int) -> list[tuple[int, int]]:
    """``(source, partner)`` pairs: ``r`` with ``r + world // 2``; with an odd world the last rank
    replays rank 0's microbatch as well, so every rank is covered."""
    if world < 2:
        return []
    half = world // 2
    pairs = [(r, r + half) for r in range(half)]
    if world % 2:
        pairs.append((0, world - 1))
    return pairs


def choose_judge(a: int, b: int, world: int, domains: Sequence[int] | None = None) -> int | None:
    """A third rank for the pair ``(a, b)``: the first rank after ``a`` whose failure domain differs
    from both (any other rank when no such domain exists); ``None`` when the world has two ranks."""
    if world < 3:
        return None
    others = [(a + k) % world for k in range(1, world)]
    others = [r for r in others if r != b]
    if domains is not None:
        if len(domains) != world:
            raise ConfigError(f"{len(domains)} failure domains for {world} ranks")
        apart = [r for r in others if domains[r] != domains[a] and domains[r] != domains[b]]
        if apart:
            return apart[0]
    return others[0]


@dataclass(frozen=True)
class Vote:
    """The outcome of a three-way replay: ``culprit`` is the rank the majority names (``None`` when
    the judge agrees with neither, or when no judge exists); the distances are to the judge."""

    culprit: int | None
    distance_a: float
    distance_b: float
    tolerance: float


def vote(a: int, b: int, distance_a: float, distance_b: float, tolerance: float) -> Vote:
    """Name the liar of pair ``(a, b)`` from each one's distance to the judge's answer.

    Exactly one agreeing with the judge (distance <= tolerance) names the other. Both agreeing
    (possible when the pair's gap sits near the tolerance) names the farther one. Neither agreeing
    means no majority: ``culprit`` is ``None``.
    """
    agree_a, agree_b = distance_a <= tolerance, distance_b <= tolerance
    if agree_a and not agree_b:
        culprit: int | None = b
    elif agree_b and not agree_a:
        culprit = a
    elif agree_a and agree_b:
        culprit = b if distance_b > distance_a else a if distance_a > distance_b else None
    else:
        culprit = None
    return Vote(culprit=culprit, distance_a=distance_a, distance_b=distance_b, tolerance=tolerance)
