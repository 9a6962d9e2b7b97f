"""Straggler detectors on per-rank pre-collective compute times.

Both detectors share one contract, used as is by the runner and the benchmarks::

    det.update(Batch(assembled=steps), now) -> list[Finding]   # one job's assembled steps
    det.check(step, ranks, compute_s, groups=None, *, placement=None) -> list[Finding]   # one step

``ranks`` (int, shape ``(r,)``), ``compute_s`` (float seconds, shape ``(r,)``) and optional
``groups`` (int labels of comparable ranks, e.g. pipeline stage, shape ``(r,)``) hold one step of
a job, all ranks at once. Scores are computed within a group, so a stage that is always slower
is not a straggler. Findings have kind ``straggler``, ``rank``, ``step`` (the first step at which
the detector concluded), ``z`` (how abnormal; higher is worse), ``slowdown`` (estimated
compute-time ratio to the group's peers minus one: 0.2 means 20 % slower). With a ``placement``
(a :class:`Placement`: the pipeline passes its assembled step) each finding is built complete —
job, node, GPU and the step's event time — and only waits for its diagnosis; without one (a
detector used alone knows ranks, not nodes) ``node`` is ``""`` and ``ts`` is ``0.0``.

**What a straggler is** (:class:`StragglerDetector`): a rank that has become slower than it was
(a change against its own recent baseline) and is slower than its comparable peers, by at least
a minimum effect (0.5 %). A GPU that has always been 0.7 % slower is not one. A rank much slower
from the start, with no faster baseline to change from, is reported only when it is at least
3 % slower than its peers, and flagged ``evidence["persistent"] = True`` (``False`` on a change).

* :class:`SeedRule` is seed 000 §7's rule (robust z > 3 for 100 consecutive steps), kept as the
  baseline every benchmark compares against.
* :class:`StragglerDetector` is the default: a per-rank baseline and residual scale, a bank of
  one-sided CUSUM tests on the winsorised change against it with thresholds derived from a
  false-alarm budget (:func:`siegmund_threshold`), and a persistent test. See its docstring for
  the calibration, the warm-up it needs, its false-alarm rate and what no test can do better.

Defined behaviour on bad input (tested in ``tests/detectors``):

* NaN, infinite, zero, negative or absurd (> :data:`~fleethealth.schema.MAX_COMPUTE_S`) times:
  those ranks are left out of that step (no statistics, no state update) and counted in
  ``rejected_total_``.
* A group with fewer than ``min_group`` valid ranks (e.g. a one-rank step, or a job of fewer than
  eight ranks) is not scored: no peer median and spread can be trusted on so few (a robust z needs
  its MAD). Its rank-steps are counted in ``unscored_small_total_`` and the largest such group in
  ``unscored_group_`` (``scored_steps_`` counts the steps that were scored); a job with steps left
  out and none scored is listed as not scored by the pipeline (``Pipeline.unscored_jobs_``), the
  runner logs it once and counts it (``fleethealth_detect_unscored_jobs``), and the job's report
  says so. Such a job is reported as not scored rather than scored against a calibration that
  does not hold for it.
* A rank whose step is not newer than the last step it reported (duplicate or out-of-order
  delivery) is left out and counted in ``stale_total_``.
* Mismatched array lengths, duplicate ranks within one call, negative or huge rank ids, a
  negative step: :class:`~fleethealth.errors.SchemaError` naming the argument.
* Bad parameters: :class:`~fleethealth.errors.ConfigError` on the first ``update`` / ``check``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

from fleethealth.detectors.batch import Batch, expect
from fleethealth.detectors.state import Stateful, names
from fleethealth.errors import ConfigError, SchemaError
from fleethealth.evidence import MIN_COMPARABLE_RANKS
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

__all__ = ["SeedRule", "StragglerDetector", "robust_z", "siegmund_rate", "siegmund_threshold", "MAD_SCALE"]

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
    # one float sort instead of a two-key lexsort: offset each group by more than the data's range
    lo = float(x.min())
    width = float(x.max()) - lo + 1.0
    xs = x[np.argsort(inv * width + (x - lo))]
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
class _StepDetector(Stateful):
    """Input validation and per-rank state growth shared by the straggler detectors."""

    name = "straggler"
    max_rank: int

    def _reset(self) -> None:
        self.capacity_ = 0
        self.last_step_ = np.empty(0, dtype=np.int64)
        self.rejected_total_ = 0
        self.stale_total_ = 0
        self.steps_seen_ = 0
        self.unscored_small_total_ = 0
        self.unscored_group_ = 0
        self.scored_steps_ = 0

    def update(self, batch: Batch, now: float) -> list[Finding]:
        """Score ``batch.assembled`` (one job's assembled steps, in order, each its own placement); return
        the findings of ranks that just alarmed. A run of steps on the same ranks without groups goes to
        ``check_many`` at once (columnar over the run), any other step to ``check``; ``now`` is not read
        (a step's time is its own)."""
        steps = expect(batch, self).assembled
        many = getattr(self, "check_many", None)
        if len(steps) > 1 and many is not None:
            first = steps[0]
            if first.groups is None and all(a.ranks is first.ranks and a.groups is None for a in steps):
                return many([a.step for a in steps], first.ranks, np.stack([a.compute_s for a in steps]),
                            placements=list(steps))
        return [f for a in steps for f in self.check(a.step, a.ranks, a.compute_s, a.groups,  # type: ignore[attr-defined]
                                                          placement=a)]

    def forget(self, jobs: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        """Nothing to drop: one detector serves one job and its state is indexed by rank (the pipeline
        drops the detector with its job); a rank that moves to another node keeps its statistics."""
        names("jobs", jobs)
        names("nodes", nodes)

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

    def _small(self, groups: np.ndarray | None, left: np.ndarray) -> None:
        """Count the ranks ``left`` out of a step (mask) because their group is below ``min_group``
        (a NaN z also comes from a non-finite time, already rejected before, so only the group size)."""
        n = int(np.count_nonzero(left))
        self.unscored_small_total_ += n
        size = n if groups is None else int(np.bincount(np.unique(groups[left], return_inverse=True)[1]).max())
        self.unscored_group_ = max(self.unscored_group_, size)

    def _finding(self, rank: int, step: int, z: float, slowdown: float, evidence: dict[str, Any],
                 placement: Placement | None, since: float = math.nan) -> Finding:
        """One finding; ``since`` is the event time of the step the rank's episode began (NaN unknown)."""
        node, gpu, job, ts = "", None, None, 0.0
        if placement is not None:
            i = int(np.flatnonzero(placement.ranks == rank)[0])
            node, gpu, job, ts = str(placement.nodes[i]), int(placement.gpus[i]), placement.job, float(placement.ts)
        return Finding(kind=FindingKind.STRAGGLER, node=node, ts=ts, job=job, gpu=gpu, rank=int(rank),
                       step=int(step), z=round(float(z), 4), slowdown=round(float(slowdown), 5),
                       detector=self.name, evidence=evidence,
                       episode_ts=float(since) if placement is not None and math.isfinite(since) else None)

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
        return {**super()._state_arrays(), "run_": 0, "run_ratio_": 0.0, "run_z_": 0.0, "flagged_": False,
                "run_ts_": math.nan}

    def _reset(self) -> None:
        self.run_ts_ = np.empty(0)
        self.run_ = np.empty(0, dtype=np.int64)
        self.run_ratio_ = np.empty(0)
        self.run_z_ = np.empty(0)
        self.flagged_ = np.empty(0, dtype=bool)
        super()._reset()

    def check(self, step: int, ranks: np.ndarray, compute_s: np.ndarray,
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
        now = float(placement.ts) if placement is not None else math.nan
        self.run_ts_[r] = np.where(over, np.where(self.run_[r] == 1, now, self.run_ts_[r]), math.nan)
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
                                      "consecutive": int(self.consecutive)}, placement,
                                     float(self.run_ts_[rank])))
        return out


# ---------------------------------------------------------------- sequential test
_SIEGMUND = 1.166
"""Siegmund's overshoot correction: a CUSUM with threshold ``h`` behaves like one at ``h + 1.166``."""


def siegmund_rate(k: float, h: float) -> float:
    """False alarms per step of a one-sided CUSUM ``S = max(0, S + z - k) > h`` on i.i.d. standard
    normal ``z``: one over Siegmund's in-control run length
    ``ARL0 = (exp(b) - b - 1) / (2 k^2)``, ``b = 2 k (h + 1.166)``."""
    b = 2.0 * k * (h + _SIEGMUND)
    if b > 700.0:
        return 0.0
    return 2.0 * k * k / (math.exp(b) - b - 1.0)


def siegmund_threshold(k: float, arl: float) -> float:
    """The threshold ``h`` at which a CUSUM of drift ``k`` has Siegmund's run length ``arl`` steps."""
    lo, hi = 0.0, 1.0
    while siegmund_rate(k, hi) * arl > 1.0:
        hi *= 2.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if siegmund_rate(k, mid) * arl > 1.0 else (lo, mid)
    return round(hi, 3)


class StragglerDetector(_StepDetector):
    """Stragglers against each rank's own baseline: a CUSUM bank on the change, a persistent test.

    **Definition.** A *straggler* is a rank that has become slower than it was -- a change against
    its own recent baseline -- and is slower than its comparable peers, both by at least
    ``min_effect`` (0.5 %). A GPU that has always been 0.7 % slower (a speed bin, a warmer slot) is
    not a straggler. A rank that is much slower from the start, so has no faster baseline to change
    from, is reported as a *persistent* straggler (``evidence["persistent"] = True``) only when
    its effect is material: at least ``persistent_min`` (3 %) slower than its peers. Every finding
    carries ``evidence["persistent"]``, so the policy can treat the two kinds differently.

    **Peer-relative time.** Per step and group (comparable ranks, e.g. a pipeline stage),
    ``lr = log t - median`` of log t within the group: whole-step drift and slower stages cancel.
    The group's spread ``peer_scale = max(1.4826 * MAD, min_scale)`` (which includes the ranks'
    persistent offsets) scales the persistent test and is each rank's scale until it has its own.

    **Baseline and own scale.** Each rank keeps ``b``, its own level of ``lr``: the median of its
    first ``init_steps`` steps, then a running mean that becomes an EWMA with memory
    ``baseline_steps`` steps; and ``sigma``, its own residual scale, the root of a running mean
    (then EWMA) of ``(lr - b)^2`` that starts from ``peer_scale^2`` with ``sigma_prior_steps``
    steps' weight, floored at ``min_scale``. Each update is winsorised to ``+-clip * sigma``, so a
    hiccup moves either little. Both are frozen while the rank is accumulating evidence (any arm's
    statistic above ``freeze_at`` of its threshold) and during an episode, so a real change is not
    absorbed before it is reported. Scoring a rank on its own residual scale, not on its peers'
    spread, makes its z standard normal whatever its persistent offset or its own jitter: a rank
    twice as noisy as its peers does not alarm twice as often, and a quiet one is found sooner.

    **Change test.** On ``d_i = clip((lr - b) / sigma, +-c_i)``, winsorised per arm at
    ``c_i = min(k_i + clip_margin, clip)`` (one hiccup adds at most ``c_i - k_i``, 2.25 z-units,
    while an arm's target shift ``2 k_i`` is barely clipped), each arm ``i`` keeps
    ``S_i = max(0, S_i + d_i - k_i - H_i * v)`` per rank, where
    ``v`` is the variance of ``b`` in z units (``1/n`` while young, about ``1/(2 * baseline_steps)``
    later) and ``H_i = h_i + 1.166``. The ``H_i * v`` term compensates, in Siegmund's exponent,
    for a baseline that is itself uncertain: a young baseline cannot alarm the slow arms, large
    changes are seen within a few dozen steps of a rank's start, and the full sensitivity (1 %
    in <= 250 steps at 2 % jitter) needs a baseline. **Warm-up** (steps a rank has reported before
    the change, measured on the real-fleet null): about 200 for 20 % and 5 % changes, 1,000 for
    2 % (its median latency reaches the table at 2,000), 4,000 for 1 % (7 minutes at 10 steps/s).
    Before that a rank at least ``persistent_min`` slower is still reported, as persistent. An arm
    alarms when ``S_i > h_i`` *and* over that arm's window (steps since ``S_i`` left zero) the mean
    change ``mean(lr - b)`` is at least ``log(1 + min_effect)`` and the rank is slower than its
    peers, ``mean(lr) > log(1 + min_peer_effect)`` (default: slower than their median; a rank that
    slows by 1 % while 1.4 % faster than its peers is not a straggler). Single hiccups, and storms
    of them up to one step in twenty, drain away at ``k_i`` per step and do not add up; power-cap
    dips (0.5-3 % for up to 8 steps) are too short to carry the 1 % and 2 % arms to their
    thresholds and too shallow for the 20 % arm; the 5 % arm is the one they can feed (below).

    **Persistent test.** ``P = max(0, P + clip((lr - log(1 + persistent_min)) / peer_scale, +-clip))``
    (no baseline needed: a rank exactly ``persistent_min`` slow is a random walk) alarms when
    ``P > persistent_threshold``, the rank has its ``init_steps`` and its baseline ``b`` is at
    least ``log(1 + persistent_min)``; both the sustained statistic and the long-run level must
    agree, so a rank of 2.5 % is not reported and a 30 % one is within ``init_steps`` steps.

    **Calibration: a false-alarm budget.** ``k = (0.2, 0.5, 1.25, 2.0)`` z-units aim at 1 %, 2 %,
    5 % and 20 % at 2 % jitter. The thresholds are not tuned: each arm gets a share ``shares`` of
    the budget ``false_rate`` (threshold crossings per rank-step; the default 3.5e-11 is 0.5 a
    job-day for a 16,384-rank job at 10 steps/s) and ``h_i`` is where Siegmund's in-control run
    length for standard normal z, ``ARL0 = (exp(b) - b - 1) / (2 k^2)``, ``b = 2k(h + 1.166)``,
    equals ``1 / (false_rate * share_i)`` (:func:`siegmund_threshold`; ``rate_`` holds each arm's
    rate). ``thresholds`` overrides the budget. The 1 % and 2 % arms get almost all of it (h about
    54.5 and 22.9): on the real-fleet null their scores are standard normal to within a few per cent
    (``bench/straggler_far.py`` measures the exponent ``theta`` at 1.03 ``2k``). The 5 % arm gets a
    thousandth (h about 11.6): power-cap dips, a few % for up to 8 steps and sometimes two in a
    row, are the one nuisance its drift sits under, and on the power-capped stratum its measured
    excursion tail falls as ``exp(-1.6 h)`` instead of ``exp(-2.5 h)``, so its real rate is that of
    its Gaussian share times a few hundred. The 20 % arm (h 6.5) needs four consecutive clipped
    hiccups. Measured numbers (latency and false findings a job-day) are in the README.

    **What cannot be had.** By Lorden's bound, a test with run length ``ARL0`` between false
    alarms needs about ``2 log(ARL0) / delta^2`` steps to find a shift of ``delta`` sigmas: at one
    false finding per job-day on 16,384 ranks (``ARL0 = 1.4e10``) that is about 47 steps for 2 %
    (``delta = 1`` at 2 % jitter) and 190 for 1 %, and the first-passage spread around that
    puts the 90th percentile near 65 and 240 steps. So the median meets the latency table with
    room and the slowest of eight 2 % stragglers passes 60 steps in most runs, whatever the test
    (an ideal CUSUM with the whole budget on the 2 % arm: all eight within 60 in 43 % of runs; a
    CUSUM candidate confirmed over a fresh window, 15 %). Likewise a 5 % straggler cannot be told
    within 15 steps from two back-to-back 3 % power-cap dips with unlucky noise: such a chain
    (8 steps at 2.6 %, one normal step, 5 at 2.7 %, a 13-step window of 4.6 %) is a false finding
    at any threshold that keeps the 5 % row. The 5 % arm's small share trades one step of its
    latency tail for a thinner excursion tail; it does not remove those chains
    (``shares=(0.45, 0.45, 0.09, 0.01)`` puts the 5 % arm back at h 9.9).

    A rank is reported once per episode: on alarm its statistics are capped at the threshold and
    the episode clears when every arm has returned to zero (a persistent flag clears when ``P``
    has); the baseline resumes afterwards. In a change finding ``z`` is the mean clipped ``d_i``
    over the alarming arm's window and ``slowdown`` is ``exp(mean lr) - 1`` (peer-relative);
    ``evidence["change"]`` is ``exp(mean(lr - b)) - 1`` and ``evidence["baseline"]`` is
    ``exp(b) - 1``, ``evidence["scale_log"]`` the rank's own ``sigma`` and
    ``evidence["peer_scale_log"]`` its group's. In a persistent finding ``slowdown`` is
    ``exp(b) - 1``, ``z`` is ``b / peer_scale`` and ``scale_log`` is ``peer_scale``.
    """

    name = "straggler.cusum"

    def __init__(self, *, drifts: tuple[float, ...] = (0.2, 0.5, 1.25, 2.0),
                 false_rate: float = 3.5e-11, shares: tuple[float, ...] = (0.45, 0.45, 0.001, 0.01),
                 thresholds: tuple[float, ...] | None = None, clip: float = 4.0,
                 clip_margin: float = 2.25, sigma_prior_steps: int = 64,
                 min_group: int = MIN_COMPARABLE_RANKS, min_scale: float = 0.002, min_effect: float = 0.005,
                 min_peer_effect: float = 0.0,
                 baseline_steps: int = 4096, init_steps: int = 5, freeze_at: float = 0.5,
                 persistent_min: float = 0.03, persistent_threshold: float = 15.0,
                 max_rank: int = 1 << 22) -> None:
        self.drifts = drifts
        self.false_rate = false_rate
        self.shares = shares
        self.thresholds = thresholds
        self.clip = clip
        self.clip_margin = clip_margin
        self.sigma_prior_steps = sigma_prior_steps
        self.min_group = min_group
        self.min_scale = min_scale
        self.min_effect = min_effect
        self.min_peer_effect = min_peer_effect
        self.baseline_steps = baseline_steps
        self.init_steps = init_steps
        self.freeze_at = freeze_at
        self.persistent_min = persistent_min
        self.persistent_threshold = persistent_threshold
        self.max_rank = max_rank

    def _validate_params(self) -> None:
        super()._validate_params()
        name = type(self).__name__
        check_number("false_rate", self.false_rate, above=0, at_most=0.01, owner=self)
        try:
            k = np.asarray(self.drifts, dtype=np.float64)
            w = np.asarray(self.shares, dtype=np.float64)
            h = None if self.thresholds is None else np.asarray(self.thresholds, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{name}: drifts, shares and thresholds must be sequences of numbers") from exc
        if k.ndim != 1 or k.size == 0 or k.shape != w.shape or (h is not None and k.shape != h.shape):
            raise ConfigError(f"{name}: drifts, shares and thresholds must be non-empty and of equal length")
        if not (np.all(np.isfinite(k)) and np.all(k > 0) and np.all(np.isfinite(w)) and np.all(w > 0)):
            raise ConfigError(f"{name}: drifts and shares must be finite and > 0")
        if h is not None and not (np.all(np.isfinite(h)) and np.all(h > 0)):
            raise ConfigError(f"{name}: thresholds must be finite and > 0")
        if h is None:  # each arm's share of the false-alarm budget, by Siegmund's run length
            w = w / w.sum()
            h = np.array([siegmund_threshold(float(ki), 1.0 / (self.false_rate * float(wi)))
                          for ki, wi in zip(k, w, strict=True)])
        check_number("clip", self.clip, above=float(k.max()), owner=self)
        check_int("min_group", self.min_group, at_least=3, owner=self)
        check_number("clip_margin", self.clip_margin, above=0, owner=self)
        check_int("sigma_prior_steps", self.sigma_prior_steps, at_least=1, owner=self)
        check_number("min_scale", self.min_scale, above=0, owner=self)
        check_number("min_effect", self.min_effect, at_least=0, at_most=1.0, owner=self)
        check_number("min_peer_effect", self.min_peer_effect, at_least=0, at_most=1.0, owner=self)
        check_int("baseline_steps", self.baseline_steps, at_least=1, owner=self)
        check_int("init_steps", self.init_steps, at_least=1, owner=self)
        check_number("freeze_at", self.freeze_at, above=0, at_most=1.0, owner=self)
        check_number("persistent_min", self.persistent_min, above=0, owner=self)
        check_number("persistent_threshold", self.persistent_threshold, above=0, owner=self)
        self.k_ = k[:, None]
        self.h_ = h[:, None]
        self.rate_ = np.array([siegmund_rate(float(ki), float(hi)) for ki, hi in zip(k, h, strict=True)])
        self.H_ = self.h_ + _SIEGMUND
        self.c_ = np.minimum(self.k_ + self.clip_margin, self.clip)
        self.log_effect_ = math.log1p(self.min_effect)
        self.log_peer_effect_ = math.log1p(self.min_peer_effect)
        self.log_persistent_ = math.log1p(self.persistent_min)
        self.min_scale2_ = self.min_scale * self.min_scale

    def _state_arrays(self) -> dict[str, Any]:
        return {**super()._state_arrays(), "stat_": 0.0, "win_n_": 0, "win_d_": 0.0, "win_z_": 0.0,
                "flagged_": False, "base_": 0.0, "base_var_": _YOUNG_VAR, "base_n_": 0, "init_": 0.0,
                "sig2_": 0.0,
                "pstat_": 0.0, "persistent_": False, "start_": math.nan, "pstart_": math.nan}

    def _reset(self) -> None:
        arms = self.k_.shape[0]
        self.stat_ = np.empty((arms, 0))
        self.win_n_ = np.empty((arms, 0), dtype=np.int64)
        self.win_d_ = np.empty((arms, 0))
        self.win_z_ = np.empty((arms, 0))
        self.flagged_ = np.empty(0, dtype=bool)
        self.base_ = np.empty(0)
        self.base_var_ = np.empty(0)
        self.base_n_ = np.empty(0, dtype=np.int64)
        self.sig2_ = np.empty(0)
        self.init_ = np.empty((self.init_steps, 0))
        self.pstat_ = np.empty(0)
        self.persistent_ = np.empty(0, dtype=bool)
        self.start_ = np.empty((arms, 0))   # event time each arm's current excursion began (NaN: none)
        self.pstart_ = np.empty(0)          # the same for the persistent test
        super()._reset()

    def flagged(self) -> np.ndarray:
        """Ranks currently inside a straggler episode, change or persistent (sorted)."""
        if not hasattr(self, "flagged_"):
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(self.flagged_ | self.persistent_)

    def check(self, step: int, ranks: np.ndarray, compute_s: np.ndarray,
               groups: np.ndarray | None = None, *, placement: Placement | None = None) -> list[Finding]:
        """Score one step (all ranks at once); return findings for ranks that just alarmed."""
        r, t, g = self._prepare(step, ranks, compute_s, groups)
        if r.size == 0:
            return []
        x = np.log(t)
        z, med, xscale = robust_z(x, g, min_group=self.min_group, min_scale=self.min_scale)
        scored = ~np.isnan(z)
        if not scored.all():
            self._small(g, ~scored)
        r, lr, med, xscale = r[scored], (x - med)[scored], med[scored], xscale[scored]
        if r.size == 0:
            return []
        self.scored_steps_ += 1
        return self._score(step, r, _as_index(r), lr, med, xscale, placement)

    def check_many(self, steps: list[int], ranks: np.ndarray, compute_s: np.ndarray,
                    groups: np.ndarray | None = None, *, placements: list[Placement] | None = None) -> list[Finding]:
        """:meth:`check` of each row of ``compute_s`` (shape ``(s, r)``, one row a step of ``steps``, all
        on the same ``ranks``), in order, with ``placements[k]`` for row ``k``. When the rows need none
        of :meth:`check`'s per-step care (no groups, every time valid, the steps increasing and new to
        every rank) the checks and the robust statistics are computed over the whole matrix at once and
        only the sequential tests run step by step; otherwise each row goes through :meth:`check`."""
        places = placements if placements is not None else [None] * len(steps)
        t = np.asarray(compute_s)
        r = np.asarray(ranks)
        n = len(steps)
        fast = (hasattr(self, "capacity_") and groups is None and t.ndim == 2 and t.shape == (n, r.size)
                and r.ndim == 1 and r.size >= self.min_group and r.dtype.kind in "iu" and t.dtype.kind == "f"
                and all(type(k) is int for k in steps) and steps[0] >= 0
                and all(a < b for a, b in zip(steps, steps[1:], strict=False)))
        if fast:
            lo, hi = int(r.min()), int(r.max())
            fast = lo >= 0 and hi <= self.max_rank
        if fast:
            self._grow(hi)
            r = r.astype(np.int64)
            fast = (bool(np.bincount(r).max() == 1) and bool((self.last_step_[r] < steps[0]).all())
                    and bool((np.isfinite(t) & (t > 0.0) & (t <= MAX_COMPUTE_S)).all()))
        if not fast:
            return [f for k, step in enumerate(steps)
                    for f in self.check(step, ranks, t[k], groups, placement=places[k])]
        self.last_step_[r] = steps[-1]
        self.steps_seen_ += n
        self.scored_steps_ += n
        x = np.log(t.astype(np.float64))
        med = np.median(x, axis=1)
        mad = np.median(np.abs(x - med[:, None]), axis=1)
        scale = np.maximum(MAD_SCALE * mad, self.min_scale)
        out: list[Finding] = []
        idx = _as_index(r)
        for k, step in enumerate(steps):  # every rank scored: its time and the step's scale are finite and > 0
            out += self._score(step, r, idx, x[k] - med[k], np.broadcast_to(med[k], r.shape),
                               np.broadcast_to(scale[k], r.shape), places[k])
        return out

    def _score(self, step: int, r: np.ndarray, idx: np.ndarray | slice, lr: np.ndarray, med: np.ndarray,
               xscale: np.ndarray, placement: Placement | None) -> list[Finding]:
        """The sequential tests of one step on its scored ranks ``r`` (state index ``idx``), given each
        rank's log time against its group's median (``lr``), the median and the group's scale."""
        b, v, nb = self.base_[idx], self.base_var_[idx], self.base_n_[idx]
        # each rank's own residual variance; a young rank borrows its group's spread
        young = nb < self.init_steps
        any_young = bool(young.any())
        sig2 = np.where(young, xscale * xscale, self.sig2_[idx]) if any_young else self.sig2_[idx]
        scale = np.sqrt(sig2)
        # change test against the rank's own baseline (predictive: b before this step)
        dlog = lr - b
        dz = np.clip(dlog / scale, -self.c_, self.c_)  # (arms, r): each arm's own winsorising
        s = self.stat_[:, idx] + (dz - self.k_ - self.H_ * v)
        live = s > 0.0
        s *= live
        n = (self.win_n_[:, idx] + 1) * live
        wd = (self.win_d_[:, idx] + dlog) * live
        wz = (self.win_z_[:, idx] + dz) * live
        flagged = self.flagged_[idx].copy()
        over = s > self.h_
        alarm = np.zeros(r.size, dtype=bool)
        cand = np.flatnonzero(over.any(axis=0) & ~flagged)
        if cand.size:  # effect gate on the few ranks over a threshold
            mean_d = wd[:, cand] / np.maximum(n[:, cand], 1)
            ok = over[:, cand] & (mean_d >= self.log_effect_) & (mean_d + b[cand] > self.log_peer_effect_)
            alarm[cand] = ok.any(axis=0)
        capped = flagged | over.any(axis=0)
        if capped.any():  # inside an episode the evidence is capped, so recovery takes bounded time
            s[:, capped] = np.minimum(s[:, capped], self.h_)
        self.stat_[:, idx], self.win_n_[:, idx], self.win_d_[:, idx], self.win_z_[:, idx] = s, n, wd, wz
        now = float(placement.ts) if placement is not None else math.nan
        start = np.where(live, np.where(n == 1, now, self.start_[:, idx]), math.nan)
        self.start_[:, idx] = start
        self.flagged_[r[flagged & ~live.any(axis=0)]] = False
        self.flagged_[r[alarm]] = True
        # baseline and residual variance: young ranks collect their first steps, then winsorised
        # running means / EWMAs, frozen while accumulating evidence or inside an episode
        quiet = ~self.flagged_[idx] & ~young & (s <= self.freeze_at * self.h_).all(axis=0)
        a = np.maximum(1.0 / (nb + 1), 1.0 / self.baseline_steps) * quiet
        lim = self.clip * scale
        b_now = b + a * np.clip(dlog, -lim, lim)
        self.base_[idx] = b_now
        self.base_var_[idx] = (1.0 - a) ** 2 * v + a * a
        self.base_n_[idx] = nb + quiet
        a2 = np.maximum(1.0 / (nb + (1 + self.sigma_prior_steps - self.init_steps)),
                        1.0 / self.baseline_steps) * quiet
        self.sig2_[idx] = np.maximum(sig2 + a2 * (np.minimum(dlog * dlog, lim * lim) - sig2), self.min_scale2_)
        if any_young:
            ry, ny = r[young], nb[young]
            self.init_[ny, ry] = lr[young]
            self.base_n_[ry] = ny + 1
            done = ny + 1 == self.init_steps
            if done.any():
                rd = ry[done]
                b_now[np.flatnonzero(young)[done]] = self.base_[rd] = np.median(self.init_[:, rd], axis=0)
                self.base_var_[rd] = 0.5 * math.pi / self.init_steps
        # persistent test: sustained slowness beyond persistent_min, and a baseline that agrees
        p_before = self.pstat_[idx]
        p = p_before + np.clip((lr - self.log_persistent_) / xscale, -self.clip, self.clip)
        p = np.maximum(p, 0.0)
        pstart = np.where(p > 0.0, np.where(p_before > 0.0, self.pstart_[idx], now), math.nan)
        self.pstart_[idx] = pstart
        pers = self.persistent_[idx].copy()
        p_alarm = ((p > self.persistent_threshold) & ~pers & ~self.flagged_[idx]
                   & (self.base_n_[idx] >= self.init_steps) & (b_now >= self.log_persistent_))
        pcap = pers | p_alarm | (p > self.persistent_threshold)
        p[pcap] = np.minimum(p[pcap], self.persistent_threshold)
        self.pstat_[idx] = p
        self.persistent_[r[pers & (p == 0.0)]] = False
        self.persistent_[r[p_alarm]] = True
        out = []
        for j in np.flatnonzero(alarm).tolist():
            ratio = np.where(over[:, j], s[:, j] / self.h_[:, 0], -1.0)
            arm = int(np.argmax(ratio))
            m = max(int(n[arm, j]), 1)
            mean_d = wd[arm, j] / m
            out.append(self._finding(
                int(r[j]), step, wz[arm, j] / m, math.expm1(mean_d + b[j]),
                {"persistent": False, "arm": arm, "drift": float(self.k_[arm, 0]),
                 "threshold": float(self.h_[arm, 0]), "window_steps": m,
                 "change": round(math.expm1(mean_d), 5), "baseline": round(math.expm1(float(b[j])), 5),
                 "baseline_steps": int(nb[j]), "median_s": round(float(math.exp(med[j])), 6),
                 "scale_log": round(float(scale[j]), 6), "peer_scale_log": round(float(xscale[j]), 6)},
                placement, float(start[arm, j])))
        for j in np.flatnonzero(p_alarm).tolist():
            bj = float(b_now[j])
            out.append(self._finding(
                int(r[j]), step, bj / float(xscale[j]), math.expm1(bj),
                {"persistent": True, "threshold": float(self.persistent_threshold),
                 "persistent_min": float(self.persistent_min), "baseline": round(math.expm1(bj), 5),
                 "baseline_steps": int(self.base_n_[r[j]]), "median_s": round(float(math.exp(med[j])), 6),
                 "scale_log": round(float(xscale[j]), 6)}, placement, float(pstart[j])))
        return out


_YOUNG_VAR = 1e6
"""Baseline variance of a rank with no baseline yet: its change test cannot accumulate."""
