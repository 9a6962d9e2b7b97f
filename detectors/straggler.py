"""Straggler detectors on per-rank pre-collective compute times.

Both detectors share one contract, used as is by the runner and the benchmarks::

    det.update(step, ranks, compute_s, groups=None, *, placement=None) -> list[Finding]

``ranks`` (int, shape ``(r,)``), ``compute_s`` (float seconds, shape ``(r,)``) and optional
``groups`` (int labels of comparable ranks, e.g. pipeline stage, shape ``(r,)``) hold one step of
a job, all ranks at once. Scores are computed within a group, so a stage that is always slower
is not a straggler. Findings have kind ``straggler``, ``rank``, ``step`` (the first step at which
the detector concluded), ``z`` (how abnormal; higher is worse), ``slowdown`` (estimated
compute-time ratio to the group's peers minus one: 0.2 means 20 % slower). With a ``placement``
(a :class:`Placement`: the pipeline passes its assembled step) each finding is built complete —
job, node, GPU and the step's event time — and only waits for its diagnosis; without one (a
detector used alone knows ranks, not nodes) ``node`` is ``""`` and ``ts`` is ``0.0``.

* :class:`SeedRule` is seed 000 §7's rule (robust z > 3 for 100 consecutive steps), kept as the
  baseline every benchmark compares against.
* :class:`StragglerDetector` is the default: a bank of one-sided CUSUM tests on the winsorised
  robust z of log compute time. See its docstring for the calibration.

Defined behaviour on bad input (tested in ``tests/detectors``):

* NaN, infinite, zero, negative or absurd (> :data:`~fleethealth.schema.MAX_COMPUTE_S`) times:
  those ranks are left out of that step (no statistics, no state update) and counted in
  ``rejected_total_``.
* A group with fewer than ``min_group`` valid ranks (e.g. a one-rank step) is not scored.
* A rank whose step is not newer than the last step it reported (duplicate or out-of-order
  delivery) is left out and counted in ``stale_total_``.
* Mismatched array lengths, duplicate ranks within one call, negative or huge rank ids, a
  negative step: :class:`~fleethealth.errors.SchemaError` naming the argument.
* Bad parameters: :class:`~fleethealth.errors.ConfigError` on the first ``update``.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from fleethealth.errors import ConfigError, SchemaError
from fleethealth.params import check_int, check_number
from fleethealth.schema import MAX_COMPUTE_S, Finding, FindingKind


class Placement(Protocol):
    """Where one step's ranks ran (``AssembledStep`` is one): rank ``ranks[i]`` on node ``nodes[i]``,
    GPU ``gpus[i]``, for job ``job`` at event time ``ts``."""

    job: str
    ts: float
    ranks: np.ndarray
    nodes: np.ndarray
    gpus: np.ndarray

__all__ = ["SeedRule", "StragglerDetector", "robust_z", "MAD_SCALE"]

MAD_SCALE = 1.4826
"""Scale turning a median absolute deviation into a Gaussian standard deviation."""


# ---------------------------------------------------------------- columnar robust statistics
def _group_index(groups: np.ndarray | None, n: int) -> tuple[np.ndarray, int]:
    if groups is None:
        return np.zeros(n, dtype=np.intp), 1
    _, inv = np.unique(groups, return_inverse=True)
    return inv.reshape(-1).astype(np.intp, copy=False), int(inv.max()) + 1 if n else 0


def _group_median(x: np.ndarray, inv: np.ndarray, n_groups: int, counts: np.ndarray) -> np.ndarray:
    """Median of ``x`` within each group (every group non-empty), without a loop over groups."""
    if n_groups == 1:
        return np.array([np.median(x)])
    xs = x[np.lexsort((x, inv))]
    starts = np.cumsum(counts) - counts
    return 0.5 * (xs[starts + (counts - 1) // 2] + xs[starts + counts // 2])


def robust_z(values: np.ndarray, groups: np.ndarray | None = None, *, min_group: int = 3,
             min_scale: float = 0.0, min_rel_scale: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Robust z of each value within its group: ``(x - median) / scale``.

    ``scale = max(1.4826 * MAD, min_scale, min_rel_scale * |median|)``, so identical values do not
    divide by zero.

    Returns ``(z, median, scale)``, each of shape ``(n,)`` (the group's median and scale repeated
    per value). Values in groups with fewer than ``min_group`` members get ``z = NaN``.
    """
    x = np.asarray(values, dtype=np.float64)
    inv, n_groups = _group_index(groups, x.size)
    if x.size == 0:
        empty = np.empty(0)
        return empty, empty, empty
    counts = np.bincount(inv, minlength=n_groups)
    med = _group_median(x, inv, n_groups, counts)
    dev = np.abs(x - med[inv])
    mad = _group_median(dev, inv, n_groups, counts)
    scale = np.maximum(np.maximum(MAD_SCALE * mad, min_scale), min_rel_scale * np.abs(med))
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (x - med[inv]) / scale[inv]
    z[(counts < min_group)[inv] | ~np.isfinite(z)] = np.nan
    return z, med[inv], scale[inv]


def _as_index(r: np.ndarray) -> np.ndarray | slice:
    """A slice when ``r`` is a run of consecutive ranks (the usual case: views, not gathers)."""
    if r.size and int(r[-1]) - int(r[0]) + 1 == r.size and (r.size == 1 or bool((np.diff(r) == 1).all())):
        return slice(int(r[0]), int(r[-1]) + 1)
    return r


# ---------------------------------------------------------------- shared input handling
class _StepDetector:
    """Input validation and per-rank state growth shared by the straggler detectors."""

    name = "straggler"
    max_rank: int

    def _reset(self) -> None:
        self.capacity_ = 0
        self.last_step_ = np.empty(0, dtype=np.int64)
        self.rejected_total_ = 0
        self.stale_total_ = 0
        self.steps_seen_ = 0

    def _grow(self, top: int) -> None:
        if top < self.capacity_:
            return
        new = max(top + 1, 2 * self.capacity_, 64)
        for attr, fill in self._state_arrays().items():
            old = getattr(self, attr)
            arr = np.full(old.shape[:-1] + (new,), fill, dtype=old.dtype)
            arr[..., : old.shape[-1]] = old
            setattr(self, attr, arr)
        self.capacity_ = new

    def _state_arrays(self) -> dict[str, Any]:
        return {"last_step_": -1}

    def _prepare(self, step: int, ranks: np.ndarray, compute_s: np.ndarray, groups: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Validate one step; return the fresh, valid ``(ranks, compute_s, groups)`` (copies)."""
        if not hasattr(self, "capacity_"):
            self._validate_params()
            self._reset()
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise SchemaError("step", f"expected a non-negative integer, got {step!r}")
        r = np.asarray(ranks)
        t = np.asarray(compute_s)
        if r.ndim != 1 or (r.size and r.dtype.kind not in "iu"):
            raise SchemaError("ranks", f"expected a 1-D integer array, got dtype {r.dtype} shape {r.shape}")
        if t.shape != r.shape or (t.size and t.dtype.kind not in "iuf"):
            raise SchemaError("compute_s", f"expected {r.size} numbers to match ranks, got shape {t.shape}")
        g = None
        if groups is not None:
            g = np.asarray(groups)
            if g.shape != r.shape or (g.size and g.dtype.kind not in "iu"):
                raise SchemaError("groups", f"expected {r.size} integer labels to match ranks, "
                                            f"got shape {g.shape}")
        if r.size == 0:
            return r.astype(np.int64), t.astype(np.float64), g
        r = r.astype(np.int64)
        lo, hi = int(r.min()), int(r.max())
        if lo < 0 or hi > self.max_rank:
            raise SchemaError("ranks", f"rank ids must lie in [0, {self.max_rank}], got [{lo}, {hi}]")
        self._grow(hi)
        if r.size > 1 and np.bincount(r, minlength=0).max() > 1:
            raise SchemaError("ranks", "duplicate rank in one step")
        t = t.astype(np.float64)
        valid = np.isfinite(t) & (t > 0.0) & (t <= MAX_COMPUTE_S)
        self.rejected_total_ += int(r.size - np.count_nonzero(valid))
        fresh = self.last_step_[r] < step
        self.stale_total_ += int(np.count_nonzero(valid & ~fresh))
        keep = valid & fresh
        self.last_step_[r[keep]] = step
        self.steps_seen_ += 1
        return r[keep], t[keep], None if g is None else g[keep]

    def _validate_params(self) -> None:
        check_int("max_rank", self.max_rank, at_least=0, owner=self)

    def _finding(self, rank: int, step: int, z: float, slowdown: float, evidence: dict[str, Any],
                 placement: Placement | None) -> Finding:
        node, gpu, job, ts = "", None, None, 0.0
        if placement is not None:
            i = int(np.flatnonzero(placement.ranks == rank)[0])
            node, gpu, job, ts = str(placement.nodes[i]), int(placement.gpus[i]), placement.job, float(placement.ts)
        return Finding(kind=FindingKind.STRAGGLER, node=node, ts=ts, job=job, gpu=gpu, rank=int(rank),
                       step=int(step), z=round(float(z), 4), slowdown=round(float(slowdown), 5),
                       detector=self.name, evidence=evidence)

    def flagged(self) -> np.ndarray:
        """Ranks currently inside a straggler episode (sorted)."""
        if not hasattr(self, "flagged_"):
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(self.flagged_)


# ---------------------------------------------------------------- seed rule
class SeedRule(_StepDetector):
    """Seed 000 §7: flag a rank whose robust z exceeds ``z`` for ``consecutive`` steps in a row.

    Per step and group, ``z = (t - median) / (1.4826 * MAD)`` on linear compute time (the scale is
    floored at ``min_rel_scale * median`` so identical times do not divide by zero). A rank is
    flagged once when its run of ``z > threshold`` reaches ``consecutive``; the episode clears the
    first step its z is back at or below the threshold. ``slowdown`` is the mean ratio to the
    group median over the run, minus one; ``z`` is the run's mean z.
    """

    name = "straggler.seed"

    def __init__(self, *, z: float = 3.0, consecutive: int = 100, min_group: int = 3,
                 min_rel_scale: float = 1e-4, max_rank: int = 1 << 22) -> None:
        self.z = z
        self.consecutive = consecutive
        self.min_group = min_group
        self.min_rel_scale = min_rel_scale
        self.max_rank = max_rank

    def _validate_params(self) -> None:
        super()._validate_params()
        check_number("z", self.z, above=0, owner=self)
        check_int("consecutive", self.consecutive, at_least=1, owner=self)
        check_int("min_group", self.min_group, at_least=2, owner=self)
        check_number("min_rel_scale", self.min_rel_scale, at_least=0, owner=self)

    def _state_arrays(self) -> dict[str, Any]:
        return {**super()._state_arrays(), "run_": 0, "run_ratio_": 0.0, "run_z_": 0.0, "flagged_": False}

    def _reset(self) -> None:
        self.run_ = np.empty(0, dtype=np.int64)
        self.run_ratio_ = np.empty(0)
        self.run_z_ = np.empty(0)
        self.flagged_ = np.empty(0, dtype=bool)
        super()._reset()

    def update(self, step: int, ranks: np.ndarray, compute_s: np.ndarray,
               groups: np.ndarray | None = None, *, placement: Placement | None = None) -> list[Finding]:
        """Score one step (all ranks at once); return findings for ranks that just crossed."""
        r, t, g = self._prepare(step, ranks, compute_s, groups)
        if r.size == 0:
            return []
        # Linear-time scale floor relative to each group's median.
        zf, med, _ = robust_z(t, g, min_group=self.min_group, min_rel_scale=self.min_rel_scale)
        scored = ~np.isnan(zf)
        r, zf, ratio = r[scored], zf[scored], (t / med)[scored]
        over = zf > self.z
        self.run_[r] = np.where(over, self.run_[r] + 1, 0)
        self.run_ratio_[r] = np.where(over, self.run_ratio_[r] + ratio, 0.0)
        self.run_z_[r] = np.where(over, self.run_z_[r] + zf, 0.0)
        self.flagged_[r[~over]] = False
        hit = r[(self.run_[r] >= self.consecutive) & ~self.flagged_[r]]
        self.flagged_[hit] = True
        out = []
        for rank in hit.tolist():
            n = int(self.run_[rank])
            out.append(self._finding(rank, step, self.run_z_[rank] / n, self.run_ratio_[rank] / n - 1.0,
                                     {"run_steps": n, "z_threshold": float(self.z),
                                      "consecutive": int(self.consecutive)}, placement))
        return out


# ---------------------------------------------------------------- sequential test
class StragglerDetector(_StepDetector):
    """Bank of one-sided CUSUM tests on the winsorised robust z of log compute time.

    Per step and group, ``z = (log t - median) / max(1.4826 * MAD, min_scale)`` (median and MAD of
    log t within the group, so whole-step drift and slower stages cancel), clipped to ``clip``
    (winsorising, so one OS hiccup adds at most ``clip - k``). Each arm ``i`` keeps
    ``S_i = max(0, S_i + z - drifts[i])`` per rank and alarms when ``S_i > thresholds[i]``. Small
    drifts catch small slowdowns slowly, large drifts catch large ones in a few steps.

    Calibration (defaults): the arm for a shift of ``delta`` z-units uses ``k = delta / 2``; each
    threshold ``h`` is set from Siegmund's approximation of the in-control run length,
    ``ARL0 ~ (exp(2k(h+1.166)) - 2k(h+1.166) - 1) / (2k^2)``, to ``ARL0 >= 1e9`` rank-steps per arm
    under Gaussian z, and raised so that no arm can be tripped by fewer than three consecutive
    clipped hiccups. The stated target is **no false rank in 10^7 rank-steps** under 2 % lognormal
    jitter plus node-correlated noise, whole-step drift and heavy-tailed hiccups (0.1 % of
    rank-steps 1.5-10x slow); ``tests/detectors/test_straggler.py`` and
    ``bench/straggler_latency.py`` check it on generated data.

    A rank is reported once per episode: on alarm its statistics are capped at the threshold and
    the episode clears when every arm has returned to zero (the rank ran at its peers' pace long
    enough to undo the evidence). ``z`` in a finding is the mean clipped z over the alarming arm's
    window (steps since its statistic last left zero); ``slowdown`` is ``exp(mean log ratio) - 1``
    over that window.
    """

    name = "straggler.cusum"

    def __init__(self, *, drifts: tuple[float, ...] = (0.25, 0.5, 1.25, 2.0),
                 thresholds: tuple[float, ...] = (36.0, 20.0, 9.0, 5.5), clip: float = 4.0,
                 min_group: int = 8, min_scale: float = 0.002, max_rank: int = 1 << 22) -> None:
        self.drifts = drifts
        self.thresholds = thresholds
        self.clip = clip
        self.min_group = min_group
        self.min_scale = min_scale
        self.max_rank = max_rank

    def _validate_params(self) -> None:
        super()._validate_params()
        name = type(self).__name__
        try:
            k = np.asarray(self.drifts, dtype=np.float64)
            h = np.asarray(self.thresholds, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{name}: drifts and thresholds must be sequences of numbers") from exc
        if k.ndim != 1 or k.size == 0 or k.shape != h.shape:
            raise ConfigError(f"{name}: drifts and thresholds must be non-empty and of equal length")
        if not (np.all(np.isfinite(k)) and np.all(k > 0) and np.all(np.isfinite(h)) and np.all(h > 0)):
            raise ConfigError(f"{name}: drifts and thresholds must be finite and > 0")
        check_number("clip", self.clip, above=float(k.max()), owner=self)
        check_int("min_group", self.min_group, at_least=3, owner=self)
        check_number("min_scale", self.min_scale, above=0, owner=self)
        self.k_ = k[:, None]
        self.h_ = h[:, None]

    def _state_arrays(self) -> dict[str, Any]:
        return {**super()._state_arrays(), "stat_": 0.0, "win_n_": 0, "win_lr_": 0.0, "win_z_": 0.0,
                "flagged_": False}

    def _reset(self) -> None:
        arms = self.k_.shape[0]
        self.stat_ = np.empty((arms, 0))
        self.win_n_ = np.empty((arms, 0), dtype=np.int64)
        self.win_lr_ = np.empty((arms, 0))
        self.win_z_ = np.empty((arms, 0))
        self.flagged_ = np.empty(0, dtype=bool)
        super()._reset()

    def update(self, step: int, ranks: np.ndarray, compute_s: np.ndarray,
               groups: np.ndarray | None = None, *, placement: Placement | None = None) -> list[Finding]:
        """Score one step (all ranks at once); return findings for ranks that just alarmed."""
        r, t, g = self._prepare(step, ranks, compute_s, groups)
        if r.size == 0:
            return []
        x = np.log(t)
        z, med, scale = robust_z(x, g, min_group=self.min_group, min_scale=self.min_scale)
        scored = ~np.isnan(z)
        r, lr, zc = r[scored], (x - med)[scored], np.clip(z[scored], -self.clip, self.clip)
        if r.size == 0:
            return []
        idx = _as_index(r)
        s = self.stat_[:, idx] + zc - self.k_
        live = s > 0.0
        s *= live
        n = (self.win_n_[:, idx] + 1) * live
        wlr = (self.win_lr_[:, idx] + lr) * live
        wz = (self.win_z_[:, idx] + zc) * live
        flagged = self.flagged_[idx].copy()
        alarm = (s > self.h_).any(axis=0) & ~flagged
        capped = flagged | alarm
        if capped.any():  # inside an episode the evidence is capped, so recovery takes bounded time
            s[:, capped] = np.minimum(s[:, capped], self.h_)
        self.stat_[:, idx], self.win_n_[:, idx], self.win_lr_[:, idx], self.win_z_[:, idx] = s, n, wlr, wz
        self.flagged_[r[flagged & ~live.any(axis=0)]] = False
        self.flagged_[r[alarm]] = True
        out = []
        for j in np.flatnonzero(alarm).tolist():
            arm = int(np.argmax(s[:, j] / self.h_[:, 0]))
            m = max(int(n[arm, j]), 1)
            out.append(self._finding(
                int(r[j]), step, wz[arm, j] / m, math.expm1(wlr[arm, j] / m),
                {"arm": arm, "drift": float(self.k_[arm, 0]), "threshold": float(self.h_[arm, 0]),
                 "window_steps": m, "median_s": round(float(math.exp(med[scored][j])), 6),
                 "scale_log": round(float(scale[scored][j]), 6)}, placement))
        return out
