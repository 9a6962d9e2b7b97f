"""The simulated fleet: one synchronous job across racks × nodes × GPUs, in event time.

``FleetSim(scenario).run()`` yields one :class:`SimStep` per job step — per-node
:class:`StepBatch` (pre-collective compute times), per-node :class:`Telemetry`, and events —
plus telemetry-only ticks while the job stands still (a hang, a restart). Everything derives
from the scenario's seed and the step number, so ``step(s)`` is random access and a replay is
identical.

Compute time of rank *r* at step *s* is ``step_time_s × 0.8 × f_r × e^{jitter·N(0,1)}``, times a
node-correlated factor and a whole-step drift (both smaller than the jitter), where ``f_r`` is
the product of the active faults' slowdowns on that rank. A step ends when its slowest rank
finishes plus a fixed collective time; that is the event time of its batches.

Each node has one InfiniBand port (:data:`NIC_PORT`, :data:`NIC_LINK_GBPS`) whose counters are
what sysfs would show — bytes sent and received, ``port_xmit_wait`` ticks — as monotonic totals
integrated over event time from the node's base utilisation and any ``nic_contention`` window, so
the detectors judge contention from counter deltas exactly as they do on a real node.

The job's life is reported as the in-job library reports it (:mod:`fleethealth.payloads.job`,
from rank 0's node): ``job_start`` before step 0, ``job_exit`` ``completed`` after the last step,
and around each stop a ``failed`` exit — a hang when its ``duration_s`` is up, a lost GPU at the
first tick after its Xid 79 — then the restarted run's ``job_start``, resumed from the newest
checkpoint at or before the stop, :data:`RELOAD_SHARE` of the restart before the next step (the
checkpoint load). The simulator writes no ``interruption``: the detectors derive it
(:mod:`fleethealth.detectors.lifecycle`). Its step numbers are its timeline, so a run resumed from
a checkpoint before the stop does not repeat the steps in between; the ``job_start`` still names
that checkpoint, so the lost steps are counted as for a real job.

A scenario with ``jobs`` runs each job as above on its own nodes (ranks numbered from 0 within
the job, its records from its first node, its steps keyed by its id) with a noise stream of its
own, and its idle nodes report telemetry only, at idle levels (no utilisation, cooler, a fraction
of the power), every :attr:`Scenario.idle_interval_s`; ``run()`` merges all of it in event time,
and :attr:`FleetSim.jobs` holds each job's own simulator (``sim.jobs["pretrain"].step(s)``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from fleethealth.payloads.checkpoint import checkpoint_event
from fleethealth.payloads.checkpoint_cost import checkpoint_cost_event
from fleethealth.payloads.hang_report import hang_report_event
from fleethealth.payloads.job import ExitStatus, job_exit_event, job_start_event
from fleethealth.payloads.sdc_check import sdc_check_event
from fleethealth.schema import GPU_FIELDS, Event, NicPorts, StepBatch, Telemetry
from fleethealth.sim.faults import CONTENDED_UTIL, CONTENDED_WAIT_SHARE, EFFECTS, Frame, sdc_failures
from fleethealth.sim.gpus import GPU_MODELS
from fleethealth.sim.scenario import JobSpec, PlacedJob, Scenario

__all__ = ["FleetSim", "SimStep", "COMPUTE_SHARE", "THERMAL_SLOWDOWN_C", "NIC_PORT", "NIC_LINK_GBPS",
           "NIC_BYTES_PER_TICK", "RELOAD_SHARE", "GPU_LOSS_RESTART_S"]

COMPUTE_SHARE = 0.8
"""Share of a nominal step spent in pre-collective compute; the rest is the collective."""
THERMAL_SLOWDOWN_C = 85.0
"""The simulated GPUs' thermal slowdown temperature."""
SLOWDOWN_TEMP_C = 85.0
"""The simulated GPUs' own slowdown temperature (each sample carries it, as NVML and DCGM report it)."""
NIC_PORT = "mlx5_0/1"
NIC_LINK_GBPS = 400.0
NIC_BYTES_PER_TICK = 8.0
"""Bytes a ``port_xmit_wait`` tick stands for (the diagnosis default, Quantum-class hardware)."""
RELOAD_SHARE = 0.3
"""Share of a simulated restart spent loading the checkpoint, after the new run's ``job_start``
(the rest is finding a replacement and relaunching: before it)."""
GPU_LOSS_RESTART_S = 600.0
"""Restart after a lost GPU (``ecc_precursor``'s ``fail_step``), seconds."""
_PLACEMENT_MAX_RANKS = 4096
"""A ``job_start`` lists each rank's node up to this many ranks (a larger job's list would crowd the event)."""
_BASE_WAIT_SHARE = 0.004
_FB_TOTAL_MIB = 81559.0

@dataclass(frozen=True)
class SimStep:
    """What the fleet emits at one moment: a job step, or (``step is None``) a telemetry tick."""

    step: int | None
    ts: float
    telemetry: list[Telemetry]
    batches: list[StepBatch]
    events: list[Event]
    job: str | None = None
    """The job whose step (or stall tick) this is; None for the idle nodes' ticks."""


class FleetSim:
    """Generate a scenario's telemetry, step batches and events; deterministic for its seed."""

    def __init__(self, scenario: Scenario, *, job: JobSpec | None = None, idle: bool = False,
                 salt: int | None = None) -> None:
        self.scenario = scenario
        fleet = scenario.fleet
        self.jobs: dict[str, FleetSim] = {}
        """A ``jobs`` scenario: each job's own simulator (empty otherwise, and in those)."""
        self._idle: FleetSim | None = None
        if scenario.jobs and job is None and not idle:
            self.jobs = {j.id: FleetSim(scenario, job=j, salt=i) for i, j in enumerate(scenario.jobs)}
            if scenario.idle_nodes:
                self._idle = FleetSim(scenario, idle=True, salt=len(scenario.jobs))
        self.idle = idle
        if idle:
            job = PlacedJob(id="", steps=scenario.idle_ticks, step_time_s=scenario.idle_interval_s,
                            nodes=scenario.idle_nodes)
        if self.jobs:  # this one is a view of the whole fleet: its jobs and idle nodes emit everything
            job = JobSpec(**{f.name: getattr(scenario.job, f.name) for f in dataclasses.fields(JobSpec)})
        self.job = job = job or scenario.job
        self._salt = salt
        nodes = np.array(job.node_indices(fleet), dtype=np.int64)
        mine = set(nodes.tolist())
        if not scenario.jobs:
            self.faults = scenario.faults
        elif self.jobs:
            self.faults = ()
        else:  # the faults on this job's (the idle) nodes; a jobs scenario has no rack-wide ones
            self.faults = tuple(f for f in scenario.faults if int(f["node"][1:]) in mine)
        self.n_nodes, self.gpus = len(nodes), fleet.gpus_per_node
        self.node_names = [fleet.node_name(int(i)) for i in nodes]
        self.rack_names = [fleet.rack_name(i) for i in range(fleet.racks)]
        self.node_index = {n: i for i, n in enumerate(self.node_names)}
        self.node_rack = nodes // fleet.nodes_per_rack
        self.rack_nodes = {r: np.flatnonzero(self.node_rack == i) for i, r in enumerate(self.rack_names)}
        world = self.n_nodes * self.gpus
        self.rank_node = np.arange(world) // self.gpus
        self.rank_gpu = np.arange(world) % self.gpus
        self.gpu_model = GPU_MODELS[fleet.gpu_model]
        rng = np.random.default_rng([scenario.seed, 0])
        shape = (fleet.nodes, self.gpus)
        self._base_temp = 66.0 + rng.normal(0.0, 2.0, shape)
        self._base_power = 560.0 + rng.normal(0.0, 15.0, shape)
        self._base_nic = np.clip(0.35 + rng.normal(0.0, 0.04, fleet.nodes), 0.05, 0.8)
        # healthy counters rise a little: a few GPUs see a corrected error or link replay now and then
        self._sbe_rate = np.where(rng.random(shape) < 0.05, rng.uniform(0.002, 0.02, shape), 0.0)
        self._replay_rate = np.where(rng.random(shape) < 0.05, rng.uniform(0.002, 0.02, shape), 0.0)
        self._sbe_lifetime = rng.integers(0, 20, shape).astype(np.float64)
        self._retired_sbe = rng.integers(0, 3, shape).astype(np.float64)
        self._uuid = [tuple(f"GPU-{scenario.seed:04x}{n:04x}-{g:04x}" for g in range(self.gpus))
                      for n in nodes.tolist()]
        self._pci_bus_id = tuple(f"00000000:{0x18 + 0x11 * g:02X}:00.0" for g in range(self.gpus))
        self._fb_used = rng.uniform(60_000.0, 72_000.0, shape)
        # drawn for the whole fleet, in the same order whatever the jobs, then each simulator's own nodes
        for name in ("_base_temp", "_base_power", "_base_nic", "_sbe_rate", "_replay_rate", "_sbe_lifetime",
                     "_retired_sbe", "_fb_used"):
            setattr(self, name, getattr(self, name)[nodes])
        if idle:
            self._base_temp = self._base_temp - 30.0
            self._base_power = self._base_power * 0.15
            self._base_nic = np.full(self.n_nodes, 0.01)
            self._fb_used = np.full_like(self._fb_used, 600.0)
            self._durations = np.full(job.steps, job.step_time_s)
            self._gaps = np.zeros(job.steps)
        else:
            self._durations, self._gaps = self._timeline(job.steps)
        ends = scenario.start_ts + np.cumsum(self._durations + np.concatenate([[0.0], self._gaps[:-1]]))
        self._step_end = ends
        self._nic_windows = [(self.node_index[f["node"]],
                              self.step_ts(f["start_step"] - 1) if f["start_step"] > 0 else scenario.start_ts,
                              self.step_ts(f["end_step"] - 1) if f.params.get("end_step") else math.inf)
                             for f in self.faults if f.kind == "nic_contention"]

    # ------------------------------------------------------------------ placement
    @property
    def placement(self) -> tuple[np.ndarray, np.ndarray]:
        """``(rank -> node index, rank -> GPU index)``, both of shape ``(world_size,)``."""
        return self.rank_node, self.rank_gpu

    def rack_of(self, node: str) -> str:
        return self.rack_names[self.node_rack[self.node_index[node]]]

    def sim_of(self, node: str) -> FleetSim:
        """The simulator whose ticks carry ``node``'s telemetry: its job's, the idle nodes', or (one
        job) this one."""
        for sim in (*self.jobs.values(), *([self._idle] if self._idle else [])):
            if node in sim.node_index:
                return sim
        if node not in self.node_index:
            raise KeyError(node)
        return self

    # ------------------------------------------------------------------ timeline
    def _timeline(self, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-step wall duration (nominal × the slowest active slowdown) and the gap after each."""
        job = self.job
        idx = np.arange(steps)
        worst = np.zeros(steps)
        gaps = np.zeros(steps)
        for fault in self.faults:
            p = fault.params
            if "slowdown" in p:
                end = p["end_step"] if p.get("end_step") is not None else steps
                live = (idx >= p["start_step"]) & (idx < end)
                worst = np.maximum(worst, np.where(live, p["slowdown"], 0.0))
            if fault.kind == "hang":
                gaps[p["step"]] += p["duration_s"] + p["restart_s"]
            if fault.kind == "ecc_precursor":
                gaps[p["fail_step"]] += GPU_LOSS_RESTART_S
        nominal = job.step_time_s * (COMPUTE_SHARE * (1.0 + worst) + (1.0 - COMPUTE_SHARE))
        return nominal, gaps

    def step_ts(self, step: int) -> float:
        """Event time at which ``step``'s compute reports arrive."""
        return float(self._step_end[step])

    # ------------------------------------------------------------------ generation
    def run(self) -> Iterator[SimStep]:
        """Every step in order, with telemetry ticks (every ``step_time_s``) inside stalls; with
        ``jobs``, every job's and the idle nodes' ticks merged in event time."""
        if self.jobs:
            parts = [sim.run() for sim in self.jobs.values()] + ([self._idle.run()] if self._idle else [])
            yield from heapq.merge(*parts, key=lambda tick: tick.ts)
            return
        if self.idle:
            for k in range(self.job.steps):
                ts = self.step_ts(k)
                frame = self._frame(k, ts)
                yield SimStep(step=None, ts=ts, telemetry=frame.telemetry(self), batches=[], events=frame.events)
            return
        interval = self.job.step_time_s
        job = None if not self.scenario.jobs else self.job.id
        for s in range(self.job.steps):
            yield self.step(s)
            gap = self._gaps[s]
            t = self.step_ts(s) + interval
            while gap > 0 and t < self.step_ts(s) + gap:
                yield SimStep(step=None, ts=t, telemetry=self._frame(s, t).telemetry(self), batches=[],
                              events=self._stall_events(s, t), job=job)
                t += interval

    def step(self, step: int) -> SimStep:
        """The batches, telemetry and events of one job step (random access)."""
        if self.jobs or self.idle:
            raise TypeError("a scenario with several jobs has no one step: use sim.jobs[job].step(s)")
        if not 0 <= step < self.job.steps:
            raise IndexError(f"step {step} outside the job (0..{self.job.steps - 1})")
        ts = self.step_ts(step)
        frame = self._frame(step, ts)
        job = self.job
        rng = frame.rng
        noise = np.exp(job.jitter * rng.standard_normal(frame.factor.shape))
        node_noise = np.exp(job.jitter / 4 * rng.standard_normal((self.n_nodes, 1)))
        drift = math.exp(job.jitter / 2 * rng.standard_normal())
        compute = job.step_time_s * COMPUTE_SHARE * frame.factor * noise * node_noise * drift
        batches = []
        gpu_ids = np.arange(self.gpus, dtype=np.int16)
        for n in range(self.n_nodes):
            keep = ~frame.silent[n]
            if not keep.any():
                continue
            batches.append(StepBatch(job=job.id, step=step, node=self.node_names[n], ts=ts,
                                     ranks=(n * self.gpus + gpu_ids[keep]).astype(np.int32), gpus=gpu_ids[keep],
                                     compute_s=compute[n, keep]))
        events = frame.events + self._check_events(step, ts) + self._life_events(step, ts)
        return SimStep(step=step, ts=ts, telemetry=frame.telemetry(self), batches=batches, events=events,
                       job=None if not self.scenario.jobs else job.id)

    def _frame(self, step: int, ts: float) -> _SimFrame:
        seed = [self.scenario.seed, 1, step, int(ts * 1000) % (1 << 31)]
        rng = np.random.default_rng(seed if self._salt is None else [*seed, self._salt])
        shape = (self.n_nodes, self.gpus)
        s = float(step)
        cols = {name: np.full(shape, np.nan) for name in GPU_FIELDS}
        cols["temp_c"] = self._base_temp + rng.normal(0.0, 0.5, shape)
        cols["mem_temp_c"] = cols["temp_c"] + 6.0
        cols["power_w"] = self._base_power + rng.normal(0.0, 5.0, shape)
        cols["power_limit_w"] = np.full(shape, 700.0)
        cols["slowdown_temp_c"] = np.full(shape, SLOWDOWN_TEMP_C)  # what NVML reports as the GPU's throttle point
        cols["sm_clock_max_mhz"] = np.full(shape, 1980.0)
        cols["sm_clock_mhz"] = np.full(shape, 1980.0)
        cols["mem_clock_mhz"] = np.full(shape, 2619.0)
        benign = rng.random(shape) < 0.002  # brief power-cap events with no slowdown
        cols["clock_reasons"] = np.where(benign, 0x4, 0).astype(np.float64)
        cols["util_pct"] = np.clip(97.0 + rng.normal(0.0, 1.5, shape), 0, 100)
        cols["ecc_sbe_volatile"] = np.floor(self._sbe_rate * s)
        cols["ecc_sbe_aggregate"] = self._sbe_lifetime + cols["ecc_sbe_volatile"]
        for name in ("ecc_dbe_volatile", "ecc_dbe_aggregate", "retired_dbe", "retired_pending",
                     "remap_uncorrectable", "remap_pending", "remap_failure", "nvlink_crc_data",
                     "nvlink_recovery", "nvlink_crc_flit"):
            cols[name] = np.zeros(shape)
        cols["retired_sbe"] = self._retired_sbe.copy()
        cols["remap_correctable"] = np.zeros(shape)
        cols["nvlink_links_up"] = np.full(shape, 18.0)
        cols["nvlink_links_max"] = np.full(shape, 18.0)
        cols["nvlink_replay"] = np.floor(self._replay_rate * s)
        cols["pcie_replay"] = np.floor(self._replay_rate * s / 2)
        cols["pcie_gen"] = cols["pcie_gen_max"] = np.full(shape, 5.0)
        cols["pcie_width"] = cols["pcie_width_max"] = np.full(shape, 16.0)
        cols["fb_used_mib"] = self._fb_used
        cols["fb_free_mib"] = _FB_TOTAL_MIB - self._fb_used
        cols["energy_mj"] = self._base_power * 1000.0 * max(ts - self.scenario.start_ts, 0.0)
        cols["tensor_active"] = np.clip(0.62 + rng.normal(0.0, 0.02, shape), 0.0, 1.0)
        nic = self._base_nic + rng.normal(0.0, 0.01, self.n_nodes)
        if self.idle:  # no work: no utilisation, idle clocks' power; the base arrays are already cooler
            cols["util_pct"] = np.zeros(shape)
            cols["tensor_active"] = np.zeros(shape)
            cols["mem_temp_c"] = cols["temp_c"] + 3.0
            nic = np.clip(nic, 0.0, 1.0)
        frame = _SimFrame(step=step, ts=ts, job=None if self.idle else self.job.id, node_names=self.node_names,
                          node_index=self.node_index, rack_nodes=self.rack_nodes, factor=np.ones(shape), cols=cols,
                          nic=nic,
                          silent=np.zeros(shape, dtype=bool), rng=rng)
        for fault in self.faults:
            EFFECTS[fault.kind](fault, frame)
        self.gpu_model.mask(cols)  # what this GPU model does not report is NaN (Hopper: retired pages)
        frame.nic_counters = self._nic_counters(ts)
        return frame

    def _nic_counters(self, ts: float) -> dict[str, np.ndarray]:
        """Each node's port counters at event time ``ts``: the integral of its send rate and
        credit-wait share since the scenario's start (so they only grow, whatever the step)."""
        elapsed = max(ts - self.scenario.start_ts, 0.0)
        busy = self._base_nic * elapsed
        wait = np.full(self.n_nodes, _BASE_WAIT_SHARE * elapsed)
        for node, on, off in self._nic_windows:
            overlap = max(min(ts, off) - on, 0.0)
            busy[node] += (CONTENDED_UTIL - self._base_nic[node]) * overlap
            wait[node] += (CONTENDED_WAIT_SHARE - _BASE_WAIT_SHARE) * overlap
        link = NIC_LINK_GBPS * 1e9 / 8
        return {"tx_bytes": np.floor(busy * link), "rx_bytes": np.floor(busy * link * 0.98),
                "xmit_wait": np.floor(wait * link / NIC_BYTES_PER_TICK)}

    # ------------------------------------------------------------------ events
    def _check_events(self, step: int, ts: float) -> list[Event]:
        """In-job check records: self-checks, replays and checkpoints with their watermark."""
        checks, job = self.scenario.checks, self.job
        events: list[Event] = []
        check = ("replay" if step % checks.replay_every == 0 else
                 "selfcheck" if step % checks.selfcheck_every == 0 else None)
        if step > 0 and check is not None:
            failing = {}
            for fault in self.faults:
                kind = sdc_failures(fault, step, checks.selfcheck_every, checks.replay_every)
                if kind is not None:
                    failing[self.node_index[fault["node"]] * self.gpus + fault["gpu"]] = kind
            world = self.n_nodes * self.gpus
            for rank in range(world):
                failed = failing.get(rank)
                kind = failed or check
                culprit = rank if failed == "replay" else None
                events.append(sdc_check_event(
                    ts=ts, check=kind, passed=failed is None, node=self.node_names[rank // self.gpus], job=job.id,
                    rank=rank, gpu=rank % self.gpus, step=step, culprit_rank=culprit,
                    peer_ranks=[] if kind == "selfcheck" else [(rank + world // 2) % world, (rank + 1) % world],
                    tolerance=None if kind == "selfcheck" else 5.0,
                    classification=None if failed is None else "transient" if failed == "selfcheck" else "persistent"))
        if step > 0 and step % checks.checkpoint_every == 0:
            verified, replayed = self._marks(step)
            uri = f"ckpt://{job.id}/step-{step:08d}"
            events.append(checkpoint_event(ts=ts, step=step, uri=uri,
                                           last_verified_step=verified, last_replay_step=replayed,
                                           node=self.node_names[0], job=job.id))
            events.append(checkpoint_cost_event(
                ts=ts + checks.checkpoint_blocking_s + checks.checkpoint_write_s, step=step, uri=uri,
                blocking_s=checks.checkpoint_blocking_s, write_s=checks.checkpoint_write_s,
                node=self.node_names[0], job=job.id, rank=0))
        return events

    def _marks(self, step: int) -> tuple[int | None, int | None]:
        """The two verification marks at ``step`` (the in-job watermark's): the newest check step of
        either kind that passed, and the newest replay step that passed, both before any failing check."""
        checks = self.scenario.checks
        failures = [s for f in self.faults if f.kind.startswith("sdc_")
                    for s in range(f["start_step"], step + 1)
                    if sdc_failures(f, s, checks.selfcheck_every, checks.replay_every)]
        limit = min(failures) - 1 if failures else step
        replayed = (limit // checks.replay_every) * checks.replay_every
        verified = max((limit // checks.selfcheck_every) * checks.selfcheck_every, replayed)
        return (verified if verified > 0 else None), (replayed if replayed > 0 else None)

    def _life_events(self, step: int, ts: float) -> list[Event]:
        """The run's ``job_start`` before step 0 and its ``completed`` exit after the last step."""
        job, world = self.job, self.n_nodes * self.gpus
        events = []
        if step == 0:
            placement = ([self.node_names[n] for n in self.rank_node.tolist()] if world <= _PLACEMENT_MAX_RANKS
                         else [])
            events.append(job_start_event(ts=self.scenario.start_ts, world=world, placement=placement,
                                          node=self.node_names[0], job=job.id, rank=0))
        if step == job.steps - 1:
            events.append(job_exit_event(ts=ts, status=ExitStatus.COMPLETED, last_step=step, node=self.node_names[0],
                                         job=job.id, rank=0))
        return events

    def _restart(self, step: int, ts: float) -> Event:
        """The restarted run's ``job_start``: resumed from the newest checkpoint at or before ``step``."""
        job, every = self.job, self.scenario.checks.checkpoint_every
        ckpt = (step // every) * every
        return job_start_event(ts=ts, world=self.n_nodes * self.gpus, first_step=ckpt + 1 if ckpt > 0 else 0,
                               resumed_from=f"ckpt://{job.id}/step-{ckpt:08d}" if ckpt > 0 else None,
                               node=self.node_names[0], job=job.id, rank=0)

    def _stall_events(self, step: int, ts: float) -> list[Event]:
        """Hang reports once the watchdogs time out; the failed exit and the restarted run's start
        around each stop (a hang, a lost GPU), at their own event times inside the tick that holds them."""
        interval = self.job.step_time_s
        job, events = self.job, []
        start = self.step_ts(step)

        def within(at: float) -> bool:
            return at <= ts < at + interval

        for fault in self.faults:
            if fault.kind == "hang" and fault["step"] == step:
                watchdog = min(90.0, 0.75 * fault["duration_s"])
                hung_node = self.node_index[fault["node"]]
                if within(start + watchdog):
                    gpus = range(self.gpus) if fault.params.get("gpu") is None else [fault["gpu"]]
                    for g in gpus:
                        events.append(_hang_event(fault["node"], ts, job.id, hung_node * self.gpus + g, g, step,
                                                  watchdog, stuck_in="compute"))
                    events.append(_hang_event(self.node_names[0], ts, job.id, 0, 0, step, watchdog,
                                              stuck_in="all_reduce"))
                stopped = start + fault["duration_s"]
                if within(stopped):
                    events.append(job_exit_event(
                        ts=stopped, status=ExitStatus.FAILED, last_step=step, node=self.node_names[0], job=job.id,
                        rank=0, reason=f"DistNetworkError: all_reduce timed out after {fault['duration_s']:g} s"))
                restarted = stopped + (1.0 - RELOAD_SHARE) * fault["restart_s"]
                if within(restarted):
                    events.append(self._restart(step, restarted))
            if fault.kind == "ecc_precursor" and fault["fail_step"] == step:
                if within(start + interval):
                    events.append(job_exit_event(
                        ts=start + interval, status=ExitStatus.FAILED, last_step=step, node=self.node_names[0],
                        job=job.id, rank=0, reason="RuntimeError: NCCL error: unhandled cuda error (CUDA error: "
                                                   "GPU is lost)"))
                restarted = start + interval + (1.0 - RELOAD_SHARE) * GPU_LOSS_RESTART_S
                if within(restarted):
                    events.append(self._restart(step, restarted))
        return events


class _SimFrame(Frame):
    nic_counters: dict[str, np.ndarray]

    def telemetry(self, sim: FleetSim) -> list[Telemetry]:
        out = []
        counters = self.nic_counters
        zeros = np.zeros(1)
        for n, node in enumerate(self.node_names):
            nic = NicPorts(port=(NIC_PORT,), kind=("ib",),
                           columns={"up": np.ones(1), "link_gbps": np.full(1, NIC_LINK_GBPS),
                                    **{name: counters[name][n:n + 1] for name in ("tx_bytes", "rx_bytes", "xmit_wait")},
                                    "rx_errors": zeros,
                                    "symbol_errors": zeros, "link_downed": zeros, "link_recovery": zeros})
            out.append(Telemetry(node=node, rack=sim.rack_names[sim.node_rack[n]], ts=self.ts,
                                 gpu=np.arange(sim.gpus, dtype=np.int16),
                                 columns={k: v[n] for k, v in self.cols.items()}, nic_util=float(self.nic[n]),
                                 model=sim.gpu_model.name, uuid=sim._uuid[n], nic=nic,
                                 pci_bus_id=sim._pci_bus_id))
        return out


_STACKS = {"compute": 'File "train.py", line 88 in forward\n  cudaStreamSynchronize (GPU not responding)',
           "all_reduce": 'File "torch/distributed/distributed_c10d.py", line 2501 in all_reduce'}


def _hang_event(node: str, ts: float, job: str, rank: int, gpu: int, step: int, timeout: float,
                stuck_in: str) -> Event:
    return hang_report_event(ts=ts, stacks=f"Thread 0x7f00 (most recent call first):\n  {_STACKS[stuck_in]}",
                             timeout_s=timeout, last_collective="all_reduce" if stuck_in == "all_reduce" else None,
                             node=node, job=job, rank=rank, gpu=gpu, step=step)
