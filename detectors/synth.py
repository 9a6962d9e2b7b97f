"""Synthetic per-rank compute times for calibrating and testing the straggler detectors.

:class:`StepNoise` describes the null model the default detector is calibrated against (seed 000
§7 jitter plus the nuisances a real fleet adds); :func:`step_times` draws one step for all ranks,
columnar, reproducible from a :class:`numpy.random.Generator`.

Null model, per step ``s`` and rank ``r`` on node ``r // gpus_per_node``::

    t = base * exp(drift_s + node_{s, node} + jitter_{s, r}) * hiccup_{s, r} * (1 + slowdown_r)

``jitter ~ N(0, jitter)`` (lognormal jitter), ``node ~ N(0, node_sigma)`` shared by a node's ranks,
``drift_s`` a random walk shared by every rank (whole-step drift), and with probability
``hiccup_p`` a rank-step is 1.5-10x slower (an OS hiccup: the heavy tail).

:class:`FleetNoise` and :class:`FleetSteps` are the null model with a real fleet's spread, the one
the default detector's false-alarm rate is stated against (``bench/straggler_far.py``). On top of
the per-step noise above, each rank carries state across steps::

    t = base * exp(drift_s + node_{s,node} + jitter_{s,r} + speed_r + temp_node + stage_g)
          * hiccup_{s,r} * (1 - dip_{s,r})^-1 * (1 + slowdown_r)

* per step, rank jitter (1.94 %) and node noise (0.5 %) together make 2 % of lognormal noise;
* ``speed_r ~ N(0, speed_sigma)``: the persistent speed of each GPU's silicon (speed bins);
* ``temp_node ~ N(0, node_temp_sigma)``: a warmer or cooler slot, shared by a node's GPUs;
* ``stage_g ~ N(0, stage_sigma)``: pipeline stages that are always slower or faster (the
  detector is given the stage as its comparison group);
* power-cap dips: a share ``cap_frac`` of GPUs run at their power limit; each of them starts a
  dip with probability ``cap_rate`` per step, losing ``cap_depth`` (uniform, 0.5-3 %) for a
  geometric number of steps (mean ``cap_mean_steps``, at most ``cap_max_steps``);
* hiccups with a heavy (Pareto, tail index 1) excess: ``1 + 0.02 * (1 + Pareto(1))``, at most
  10x, with probability ``hiccup_p`` per rank-step;
* missing samples: each rank-step is absent with probability ``missing_p``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["StepNoise", "step_times", "FleetNoise", "FleetSteps"]


@dataclass(frozen=True)
class StepNoise:
    """Parameters of the synthetic step-time model (see the module docstring)."""

    base_s: float = 2.0
    jitter: float = 0.02
    node_sigma: float = 0.01
    drift_sigma: float = 0.005
    hiccup_p: float = 1e-3
    gpus_per_node: int = 8

    @classmethod
    def plain(cls, jitter: float = 0.02) -> StepNoise:
        """Lognormal jitter only: the issue's latency-target setting."""
        return cls(jitter=jitter, node_sigma=0.0, drift_sigma=0.0, hiccup_p=0.0)


def step_times(rng: np.random.Generator, n_ranks: int, noise: StepNoise, *, drift: float = 0.0,
               slowdown: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Draw one step's compute times (shape ``(n_ranks,)``) and the next whole-step drift.

    ``drift`` is the current log drift (carry the returned value into the next call);
    ``slowdown`` (shape ``(n_ranks,)``, 0.2 = 20 % slower) marks stragglers.
    """
    drift = drift + noise.drift_sigma * rng.standard_normal()
    n_nodes = -(-n_ranks // noise.gpus_per_node)
    node = noise.node_sigma * rng.standard_normal(n_nodes)
    shared = drift + np.repeat(node, noise.gpus_per_node)[:n_ranks]
    log_t = shared + noise.jitter * rng.standard_normal(n_ranks)
    t = noise.base_s * np.exp(log_t)
    if noise.hiccup_p > 0:
        hit = rng.random(n_ranks) < noise.hiccup_p
        t[hit] *= np.exp(rng.uniform(np.log(1.5), np.log(10.0), int(hit.sum())))
    if slowdown is not None:
        t *= 1.0 + slowdown
    return t, drift


@dataclass(frozen=True)
class FleetNoise:
    """Parameters of the real-fleet null model (see the module docstring); fractions are shares."""

    base_s: float = 2.0
    jitter: float = 0.0194
    node_sigma: float = 0.005
    drift_sigma: float = 0.005
    hiccup_p: float = 1e-3
    speed_sigma: float = 0.005
    node_temp_sigma: float = 0.003
    stages: int = 4
    stage_sigma: float = 0.03
    cap_frac: float = 0.1
    cap_rate: float = 0.005
    cap_mean_steps: float = 2.0
    cap_max_steps: int = 8
    cap_depth: tuple[float, float] = (0.005, 0.03)
    missing_p: float = 0.01
    gpus_per_node: int = 8


class FleetSteps:
    """Stateful generator of one job's steps under :class:`FleetNoise` (all ranks at once).

    ``FleetSteps(rng, n_ranks, noise).draw(slowdown)`` returns ``(ranks, compute_s, groups)`` of
    one step: the ranks present (missing samples left out), their compute times and their
    pipeline stage (contiguous blocks of ranks). ``slowdown`` (shape ``(n_ranks,)``) marks
    stragglers as in :func:`step_times`. ``offset_`` holds each rank's persistent log offset.
    """

    def __init__(self, rng: np.random.Generator, n_ranks: int, noise: FleetNoise | None = None) -> None:
        self.rng = rng
        self.n_ranks = n_ranks
        self.noise = noise = noise or FleetNoise()
        n_nodes = -(-n_ranks // noise.gpus_per_node)
        node_of = np.arange(n_ranks) // noise.gpus_per_node
        self.node_of_ = node_of
        self.groups_ = (np.arange(n_ranks) * noise.stages // n_ranks).astype(np.int32)
        stage = noise.stage_sigma * rng.standard_normal(noise.stages)
        self.offset_ = (noise.speed_sigma * rng.standard_normal(n_ranks)
                        + (noise.node_temp_sigma * rng.standard_normal(n_nodes))[node_of] + stage[self.groups_])
        self.capped_ = rng.random(n_ranks) < noise.cap_frac
        self.dip_left_ = np.zeros(n_ranks, dtype=np.int64)
        self.dip_depth_ = np.zeros(n_ranks)
        self.drift_ = 0.0
        self.ranks_ = np.arange(n_ranks)

    def peer_offset(self) -> np.ndarray:
        """Each rank's persistent log offset relative to its stage's median (its speed among peers)."""
        out = np.empty(self.n_ranks)
        for g in np.unique(self.groups_):  # a handful of stages
            m = self.groups_ == g
            out[m] = self.offset_[m] - np.median(self.offset_[m])
        return out

    def draw(self, slowdown: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One step: ``(ranks, compute_s, groups)`` of the ranks that reported."""
        rng, noise, n = self.rng, self.noise, self.n_ranks
        self.drift_ += noise.drift_sigma * rng.standard_normal()
        node = noise.node_sigma * rng.standard_normal(int(self.node_of_[-1]) + 1)
        log_t = self.drift_ + self.offset_ + node[self.node_of_] + noise.jitter * rng.standard_normal(n)
        # power-cap dips: new dips on capped GPUs that are not in one, then everyone's dip ages
        start = self.capped_ & (self.dip_left_ == 0) & (rng.random(n) < noise.cap_rate)
        k = int(start.sum())
        if k:
            self.dip_left_[start] = np.minimum(rng.geometric(1.0 / noise.cap_mean_steps, k), noise.cap_max_steps)
            self.dip_depth_[start] = rng.uniform(*noise.cap_depth, k)
        dipping = self.dip_left_ > 0
        log_t[dipping] -= np.log1p(-self.dip_depth_[dipping])
        self.dip_left_[dipping] -= 1
        t = noise.base_s * np.exp(log_t)
        if noise.hiccup_p > 0:
            hit = rng.random(n) < noise.hiccup_p
            t[hit] *= np.minimum(1.0 + 0.02 * (1.0 + rng.pareto(1.0, int(hit.sum()))), 10.0)
        if slowdown is not None:
            t *= 1.0 + slowdown
        if noise.missing_p > 0:
            keep = rng.random(n) >= noise.missing_p
            return self.ranks_[keep], t[keep], self.groups_[keep]
        return self.ranks_, t, self.groups_
