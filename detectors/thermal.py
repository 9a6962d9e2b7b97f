"""Each GPU's temperature against its load: the part of a temperature that load cannot explain.

A GPU's core temperature follows its power with a lag: once its heat sink has settled it runs at
about ``T_inlet + R * P``, with ``R`` the GPU's own thermal resistance (its slot, its fan, its paste).
Comparing a temperature with the node's average over the last half hour mixes load into it (a job
start "rises" by 25-35 °C); comparing it with what the GPU's own model predicts at its present
load does not. A rise of the residual is what the inlet air, or the GPU's cooling, adds.

:class:`ThermalModel` keeps, per GPU of one node (columnar, shape ``(g,)``):

* two exponential averages of the power draw, over ``fast_s`` and over ``slow_s``; the *load
  power* is the higher of the two. After a load step up the fast one follows at once, after a step
  down (a job end, a lower power cap) the slow one holds the earlier level: either way the
  expected temperature is at least what the GPU's settled state at its recent load would be, so a
  load step makes the residual fall, never rise, provided the GPU's own time constant lies between
  ``fast_s`` and ``slow_s``;
* a linear model ``T = a + b * P`` learned from *busy* (utilisation at least ``busy_util_pct``;
  where the source reports no utilisation, power at least ``busy_power_share`` of the enforced
  limit), *settled* (the two averages within ``settled_share`` of each other, and the GPU watched for
  ``slow_s`` at least, so a probe started in the middle of a load step teaches nothing) and not thermally
  throttled samples only, weighted exponentially over ``memory_s`` of event time, the slope held
  towards ``slope_c_per_w`` (a ridge prior worth ``prior_samples`` samples spread over
  ``prior_spread_w``: a GPU that always runs at one power learns its intercept and keeps the prior
  slope; one whose power cap changes learns its slope too). A sample whose residual is beyond
  ``learn_band_c`` is not learned (a hot aisle is not taught as normal); a lasting change is learned
  afresh once the old weight has faded below ``min_samples``;
* the residual ``T - (a + b * load power)`` of a busy GPU with at least ``min_samples`` of learned
  weight (NaN otherwise: an idle GPU, or one never seen busy and settled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fleethealth.params import check_number

__all__ = ["ThermalParams", "ThermalModel", "observe_many"]


@dataclass(frozen=True)
class ThermalParams:
    """The settings of :class:`ThermalModel` (see the module)."""

    fast_s: float = 10.0
    slow_s: float = 300.0
    memory_s: float = 21_600.0
    slope_c_per_w: float = 0.05
    prior_samples: float = 20.0
    prior_spread_w: float = 50.0
    busy_util_pct: float = 50.0
    busy_power_share: float = 0.5
    settled_share: float = 0.05
    min_samples: float = 10.0
    learn_band_c: float = 5.0

    def __post_init__(self) -> None:
        for name in ("fast_s", "slow_s", "memory_s", "prior_spread_w", "min_samples", "learn_band_c"):
            check_number(name, getattr(self, name), above=0, owner=self)
        for name in ("slope_c_per_w", "prior_samples", "busy_util_pct", "busy_power_share", "settled_share"):
            check_number(name, getattr(self, name), at_least=0, owner=self)
        if self.slow_s < self.fast_s:
            check_number("slow_s", self.slow_s, at_least=self.fast_s, owner=self)


class ThermalModel:
    """One node's GPUs' load power and thermal model (see the module); ``observe`` once per sample (a part of
    :class:`~fleethealth.detectors.nodestate.NodeStates`, whose state holds it: not a detector of its own).

    State (plain arrays, shape ``(g,)``): ``fast_`` / ``slow_`` the power averages, ``sums_`` the
    weighted sums ``(w, w*P, w*T, w*P*P, w*P*T)`` of the learned samples (shape ``(5, g)``), ``ts_``
    the last sample's time, ``since_`` when the averages started.
    """

    def __init__(self, params: ThermalParams = ThermalParams()) -> None:
        self.params = params
        self.ts_ = math.nan
        self.since_ = math.nan
        self.fast_ = np.zeros(0)
        self.slow_ = np.zeros(0)
        self.sums_ = np.zeros((5, 0))

    def observe(self, ts: float, temp_c: np.ndarray, power_w: np.ndarray, util_pct: np.ndarray,
               power_limit_w: np.ndarray, thermal: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Take one sample (per GPU arrays; ``thermal``: the GPU reports a thermal clock event) and
        return ``(load_power_w, residual_c)`` at it (NaN where unknown); ``fast_`` is then the power
        averaged over ``fast_s``."""
        p = self.params
        g = temp_c.shape[0]
        if self.fast_.shape[0] != g or not ts > self.ts_:  # first sample, new GPU set, or a clock step back
            self.fast_, self.slow_ = power_w.astype(np.float64).copy(), power_w.astype(np.float64).copy()
            if self.sums_.shape[1] != g:
                self.sums_ = np.zeros((5, g))
            self.since_ = ts
            dt = 0.0
        else:
            dt = ts - self.ts_
            have = np.isfinite(power_w)
            watts = np.where(have, power_w, 0.0)
            for avg, tau in ((self.fast_, p.fast_s), (self.slow_, p.slow_s)):
                alpha = 1.0 - math.exp(-dt / tau)
                np.copyto(avg, watts, where=have & np.isnan(avg))
                avg += np.where(have, alpha * (watts - avg), 0.0)
        self.ts_ = ts
        load = np.fmax(self.fast_, self.slow_)
        # comparisons with NaN are False: an unreported value is neither busy nor settled
        busy = np.where(np.isnan(util_pct), power_w >= p.busy_power_share * power_limit_w,
                        util_pct >= p.busy_util_pct)
        settled = np.abs(self.fast_ - self.slow_) <= p.settled_share * self.slow_
        if dt > 0:
            self.sums_ *= math.exp(-dt / p.memory_s)
        a, b, known = self.coefficients()
        expected = a + b * load
        residual = np.where(busy & known, temp_c - expected, np.nan)  # NaN where temp_c is
        if ts - self.since_ >= p.slow_s:
            learn = busy & settled & ~thermal & (~known | (np.abs(residual) <= p.learn_band_c))
            learn &= ~(np.isnan(temp_c) | np.isnan(load))
            if learn.any():
                x, y = load[learn], temp_c[learn]
                sums = self.sums_
                sums[0, learn] += 1.0
                sums[1, learn] += x
                sums[2, learn] += y
                sums[3, learn] += x * x
                sums[4, learn] += x * y
        return load, residual

    def coefficients(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(a, b, known)`` per GPU: intercept (°C), slope (°C/W), whether enough was learned."""
        return _fit(self.params, *self.sums_)


def _fit(p: ThermalParams, w: np.ndarray, sp: np.ndarray, st: np.ndarray, spp: np.ndarray,
         spt: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(a, b, known)`` from the decayed sums (weight, Σpower, Σtemp, Σpower², Σpower·temp), elementwise
    (one model's GPUs, or many models' stacked): the slope shrunk towards ``slope_c_per_w`` by the prior."""
    known = w >= p.min_samples
    n = np.where(known, w, 1.0)
    lam = p.prior_samples * p.prior_spread_w ** 2
    cpp = np.maximum(spp - sp * sp / n, 0.0)
    cpt = spt - sp * st / n
    b = np.maximum((cpt + lam * p.slope_c_per_w) / (cpp + lam), 0.0)
    a = st / n - b * sp / n
    return a, b, known


def observe_many(models: list[ThermalModel], ts: list[float], temp_c: np.ndarray, power_w: np.ndarray,
                 util_pct: np.ndarray, power_limit_w: np.ndarray,
                 thermal: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:meth:`ThermalModel.observe` of many nodes' models at once (one sample each; per GPU arrays of shape
    ``(k, g)``, one row a model, all of one ``params``): ``(power_w, load_power_w, residual_c)``, the first the
    fast power average after the sample. A model's first sample, a new GPU set or a clock step back is taken
    by its own :meth:`~ThermalModel.observe`; the rest in one NumPy pass over the stacked state, written back
    to each model. Each row equals what the model's own ``observe`` gives."""
    k, g = temp_c.shape
    power, load, residual = np.empty((k, g)), np.empty((k, g)), np.empty((k, g))
    alone = [j for j, m in enumerate(models) if m.fast_.shape[0] != g or not ts[j] > m.ts_]
    for j in alone:
        m = models[j]
        load[j], residual[j] = m.observe(ts[j], temp_c[j], power_w[j], util_pct[j], power_limit_w[j], thermal[j])
        power[j] = m.fast_
    rows = np.setdiff1d(np.arange(k), alone) if alone else np.arange(k)
    if not rows.size:
        return power, load, residual
    some = [models[j] for j in rows.tolist()]
    p = some[0].params
    if any(m.params != p for m in some):
        raise ValueError("observe_many: the models have different ThermalParams")
    at = [ts[j] for j in rows.tolist()]
    dt = [t - m.ts_ for t, m in zip(at, some, strict=True)]
    temp, watts_in, util, limit, hot = temp_c[rows], power_w[rows], util_pct[rows], power_limit_w[rows], thermal[rows]
    fast = np.concatenate([m.fast_ for m in some]).reshape(len(some), g)  # np.stack's rows, by one concatenation
    slow = np.concatenate([m.slow_ for m in some]).reshape(len(some), g)
    sums = np.concatenate([m.sums_ for m in some]).reshape(len(some), 5, g)
    have = np.isfinite(watts_in)
    watts = np.where(have, watts_in, 0.0)
    for avg, tau in ((fast, p.fast_s), (slow, p.slow_s)):
        alpha = np.array([1.0 - math.exp(-d / tau) for d in dt])[:, None]
        np.copyto(avg, watts, where=have & np.isnan(avg))
        avg += np.where(have, alpha * (watts - avg), 0.0)
    both = np.fmax(fast, slow)
    busy = np.where(np.isnan(util), watts_in >= p.busy_power_share * limit, util >= p.busy_util_pct)
    settled = np.abs(fast - slow) <= p.settled_share * slow
    sums *= np.array([math.exp(-d / p.memory_s) for d in dt])[:, None, None]  # dt > 0 on every row here
    a, b, known = _fit(p, *(sums[:, i] for i in range(5)))
    res = np.where(busy & known, temp - (a + b * both), np.nan)
    old = np.array([t - m.since_ >= p.slow_s for t, m in zip(at, some, strict=True)])[:, None]
    learn = old & busy & settled & ~hot & (~known | (np.abs(res) <= p.learn_band_c))
    learn &= ~(np.isnan(temp) | np.isnan(both))
    if learn.any():
        x, y = both[learn], temp[learn]
        sums[:, 0][learn] += 1.0
        sums[:, 1][learn] += x
        sums[:, 2][learn] += y
        sums[:, 3][learn] += x * x
        sums[:, 4][learn] += x * y
    for i, m in enumerate(some):
        m.ts_, m.fast_, m.slow_, m.sums_ = at[i], fast[i].copy(), slow[i].copy(), sums[i].copy()
    power[rows], load[rows], residual[rows] = fast, both, res
    return power, load, residual
