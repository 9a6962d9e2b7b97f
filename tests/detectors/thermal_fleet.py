"""Telemetry from GPU physics written for these tests, independent of ``fleethealth.sim``.

Each GPU's core temperature relaxes towards ``inlet + R * P`` with a time constant ``tau_s``
(40 s), sampled every ``every_s``. ``R`` is each GPU's own thermal resistance (a spread around
0.065 °C/W: slots and silicon differ) and each GPU adds a fixed offset (its sensor and paste).
Power is ~70 W idle and ``min(cap, 620 W)`` busy with noise; a capped GPU dips by 10-30 % now and
then (power-cap dips). A GPU at its slowdown temperature (87 °C) sets ``HW_THERMAL`` and its power
falls to what holds it there. A rack's inlet is 25 °C, plus ``aisle_c`` for a hot aisle, plus
1.5 °C while a neighbouring rack is busy (recirculation).

``ThermalFleet(racks, nodes_per_rack, gpus)`` with data-centre names (``dc1-r07-gpu03``) and the
rack each node reports; ``timeline`` lists what changes when (a job's racks busy or idle, a power
cap, a hot aisle, a GPU's cooling failing); ``run(t0, t1)`` yields the samples in event time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from fleethealth.schema import ClockReason, Telemetry

SLOWDOWN_C = 87.0
IDLE_W = 70.0
BUSY_W = 620.0


@dataclass
class Change:
    """At ``ts``: ``busy`` racks start (True) or stop (False) work, ``cap_w`` the fleet's power cap,
    ``aisle`` {rack: extra inlet °C}, ``cooling`` {(node, gpu): factor on its R}."""

    ts: float
    busy: dict[str, bool] = field(default_factory=dict)
    cap_w: float | None = None
    aisle: dict[str, float] = field(default_factory=dict)
    cooling: dict[tuple[str, int], float] = field(default_factory=dict)


class ThermalFleet:
    def __init__(self, racks: int = 3, nodes_per_rack: int = 4, gpus: int = 4, *, seed: int = 7,
                 every_s: float = 4.0, tau_s: float = 40.0, dips: bool = True) -> None:
        self.rng = np.random.default_rng(seed)
        self.rack_names = [f"dc1-row2-rack{r + 11:02d}" for r in range(racks)]
        self.nodes = [f"dc1-r{r + 11:02d}-gpu{n:02d}.example.net" for r in range(racks) for n in range(nodes_per_rack)]
        self.rack_of = {node: self.rack_names[i // nodes_per_rack] for i, node in enumerate(self.nodes)}
        self.gpus = gpus
        self.every_s, self.tau_s, self.dips = every_s, tau_s, dips
        shape = (len(self.nodes), gpus)
        self.r = 0.065 + self.rng.normal(0.0, 0.004, shape)
        self.offset = self.rng.normal(0.0, 1.5, shape)
        self.busy = {r: False for r in self.rack_names}
        self.cap = 700.0
        self.aisle = {r: 0.0 for r in self.rack_names}
        self.cooling = np.ones(shape)
        self.temp = 25.0 + self.r * IDLE_W + self.offset
        self.dip = np.zeros(shape)
        self.timeline: list[Change] = []

    def node_index(self, node: str) -> int:
        return self.nodes.index(node)

    def _apply(self, ch: Change) -> None:
        self.busy.update(ch.busy)
        if ch.cap_w is not None:
            self.cap = ch.cap_w
        self.aisle.update(ch.aisle)
        for (node, gpu), factor in ch.cooling.items():
            self.cooling[self.node_index(node), gpu] = factor

    def run(self, t0: float, t1: float) -> Iterator[Telemetry]:
        """Samples of every node every ``every_s`` from ``t0`` to ``t1``, the timeline applied as it passes."""
        pending = sorted(self.timeline, key=lambda c: c.ts)
        decay = math.exp(-self.every_s / self.tau_s)
        n_racks = len(self.rack_names)
        per_rack = len(self.nodes) // n_racks
        for ts in np.arange(t0, t1, self.every_s).tolist():
            while pending and pending[0].ts <= ts:
                self._apply(pending.pop(0))
            rack_i = np.arange(len(self.nodes)) // per_rack
            busy = np.array([self.busy[self.rack_names[i]] for i in rack_i])[:, None] & np.ones(self.gpus, bool)
            neighbour = np.array([any(self.busy[self.rack_names[j]] for j in (i - 1, i + 1) if 0 <= j < n_racks)
                                  for i in rack_i])
            inlet = 25.0 + np.array([self.aisle[self.rack_names[i]] for i in rack_i]) + 1.5 * neighbour
            power = np.where(busy, np.minimum(self.cap, BUSY_W) + self.rng.normal(0.0, 6.0, busy.shape),
                             IDLE_W + self.rng.normal(0.0, 2.0, busy.shape))
            if self.dips:  # power-cap dips on busy GPUs
                start = busy & (self.dip == 0) & (self.rng.random(busy.shape) < 0.01)
                self.dip[start] = self.rng.integers(1, 4, int(start.sum()))
                dipping = self.dip > 0
                power[dipping] *= 0.8
                self.dip[dipping] -= 1
            r = self.r * self.cooling
            hold = (SLOWDOWN_C - inlet[:, None] - self.offset) / r  # the power that holds a GPU at its slowdown
            throttled = busy & (self.temp >= SLOWDOWN_C - 0.5) & (power > hold)
            power = np.where(throttled, np.maximum(hold, IDLE_W), power)
            steady = inlet[:, None] + r * power + self.offset
            self.temp = steady + (self.temp - steady) * decay
            util = np.where(busy, 97.0 + self.rng.normal(0.0, 1.0, busy.shape), 0.0)
            bits = np.where(throttled, float(ClockReason.HW_THERMAL | ClockReason.SW_THERMAL), 0.0)
            bits = np.where(busy & ~throttled & (power >= self.cap - 15.0), float(ClockReason.SW_POWER_CAP), bits)
            temp = np.round(self.temp)  # NVML reports whole degrees
            for i, node in enumerate(self.nodes):
                yield Telemetry.from_columns(
                    node, self.rack_of[node], ts, np.arange(self.gpus), temp_c=temp[i], power_w=power[i],
                    power_limit_w=np.full(self.gpus, self.cap), util_pct=np.clip(util[i], 0.0, 100.0),
                    clock_reasons=bits[i], slowdown_temp_c=np.full(self.gpus, SLOWDOWN_C),
                    nvlink_links_up=np.full(self.gpus, 18.0), nvlink_links_max=np.full(self.gpus, 18.0))
