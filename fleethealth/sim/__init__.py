"""Fleet simulator: racks × nodes × GPUs and one synchronous job, with fault injection, in event time."""

from fleethealth.sim.fleet import FleetSim, SimStep
from fleethealth.sim.scenario import FaultSpec, Scenario

__all__ = ["FleetSim", "SimStep", "Scenario", "FaultSpec"]
