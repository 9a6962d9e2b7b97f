"""Fleet simulator: racks × nodes × GPUs running one synchronous job or several (``jobs``), with fault
injection, in event time."""

from fleethealth.sim.fleet import FleetSim, SimStep
from fleethealth.sim.scenario import FaultSpec, Scenario

__all__ = ["FleetSim", "SimStep", "Scenario", "FaultSpec"]
