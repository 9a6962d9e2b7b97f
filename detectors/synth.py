"""Synthetic per-rank compute times for calibrating and testing the straggler detectors.

:class:`StepNoise` describes the null model the default detector is calibrated against (seed 000
§7 jitter plus the nuisances a real fleet adds); :func:`step_times` draws one step for all ranks,
columnar, reproducible from a :class:`numpy.random.Generator`.

Null model, per step ``s`` and rank ``r`` on node ``r // gpus_per_node``::

    t = base * exp(drift_s + node_{s, node} + jitter_{s, r}) * hiccup_{s, r} * (1 + slowdown_r)

``jitter ~ N(0, jitter)`` (lognormal jitter), ``node ~ N(0, node_sigma)`` shared by a node's ranks,
``drift_s`` a random walk shared by every rank (whole-step drift), and with probability
``hiccup_p`` a rank-step is 1.5-10x slower (an OS hiccup: the heavy tail).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["StepNoise", "step_times"]


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
