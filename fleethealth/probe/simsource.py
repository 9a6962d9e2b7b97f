"""The simulator source: one node of :class:`fleethealth.sim.FleetSim`, sampled like real hardware.

Each ``sample()`` advances the simulated fleet by one moment (a job step, or a telemetry tick
while the job stands still during a hang or restart) and returns this node's telemetry, the
events on this node (Xid, SDC check records, hang reports, interruptions) and this node's step
batches — the simulator plays the training job too, so ``--source sim`` exercises the whole
pipeline on a machine without GPUs. Everything is in the scenario's event time, not the probe's
clock. When the scenario's job ends it starts again, shifted in event time by the job's span,
so a long-running probe keeps producing data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fleethealth.errors import ConfigError
from fleethealth.probe.sources import Sample

__all__ = ["SimSource"]


class SimSource:
    """Node ``node`` of a simulated fleet.

    ``scenario`` is a :class:`fleethealth.sim.Scenario`, a path to a scenario file, or ``None``
    for :meth:`Scenario.default`; ``sim`` replaces the whole simulator (a shared ``FleetSim``).
    ``rack`` is taken from the simulated fleet (``rack_of(node)``); the argument is accepted for
    the common source signature and must agree when it is given.
    """

    name = "sim"
    driver_version = "sim"
    """What the ``DCGM_FI_DRIVER_VERSION`` label reads in dcgm-exporter compatibility mode."""

    def __init__(self, node: str, rack: str = "", *, scenario: Any = None, sim: Any = None) -> None:
        from fleethealth.sim import FleetSim, Scenario

        if sim is None:
            if scenario is None:
                scenario = Scenario.default()
            elif isinstance(scenario, str | Path):
                scenario = Scenario.load(scenario)
            sim = FleetSim(scenario)
        if node not in sim.node_index:
            names = sim.node_names
            shown = ", ".join(names[:4]) + (f", ... {names[-1]}" if len(names) > 4 else "")
            raise ConfigError(f"sim source: node {node!r} is not in the simulated fleet ({shown}); "
                              "pass --node with one of them")
        sim_rack = sim.rack_of(node)
        if rack and rack not in ("unknown", sim_rack):
            raise ConfigError(f"sim source: node {node} sits in rack {sim_rack} of the simulated fleet, not {rack!r}")
        self.node = node
        self.rack = sim_rack
        self.sim = sim.sim_of(node)  # with several jobs: the simulator of this node's job (or the idle nodes')
        self._steps: Iterator[Any] | None = None
        self._cycle = 0
        self._span = 0.0

    def open(self) -> None:
        self._steps = self.sim.run()

    def close(self) -> None:
        self._steps = None

    def sample(self, ts: float) -> Sample:
        """The next moment of the simulated fleet for this node (``ts`` is ignored: event time is the sim's)."""
        if self._steps is None:
            raise ConfigError("sim source: sample() before open()")
        moment = next(self._steps, None)
        if moment is None:  # the job ended: run it again, later in event time
            self._span = _job_span(self.sim)
            self._cycle += 1
            self._steps = self.sim.run()
            moment = next(self._steps)
        shift = self._cycle * self._span
        node = self.node
        telemetry = next(t for t in moment.telemetry if t.node == node)
        events = tuple(e for e in moment.events if e.node == node)
        batches = tuple(b for b in moment.batches if b.node == node)
        if shift:
            telemetry = dataclasses.replace(telemetry, ts=telemetry.ts + shift)
            events = tuple(dataclasses.replace(e, ts=e.ts + shift) for e in events)
            batches = tuple(dataclasses.replace(b, ts=b.ts + shift) for b in batches)
        return Sample(telemetry, events, batches)


def _job_span(sim: Any) -> float:
    """Event-time length of one run of the scenario's job (last step end − start + one step)."""
    last = sim.job.steps - 1
    return sim.step_ts(last) - sim.scenario.start_ts + sim.job.step_time_s
