"""The closed loop: what acting on recommendations does to a simulated job's goodput.

:func:`account` replays a scenario's job step by step while a scheduler carries out a list of
:class:`Act` (node, action, step decided), the way seed 002 describes a restart:

* ``evict`` / ``drain`` / ``quarantine``: the node leaves at the next checkpoint; the job restarts
  there (no work lost) on a spare, paying the MTTR phases after detection (diagnosis, restart);
  the faults on that node stop with it. Spares come from outside the scenario's racks, so a hot
  aisle does not follow them. The node stays out for the rest of the run (no sweep passes within it).
* ``rollback`` (with a target step): the steps since the target are recomputed, then the job
  restarts; the SDC it answers stops corrupting work from then on.
* ``alert_facilities``: the rack's hot aisle clears ``facilities_delay_s`` later.

Faults that act on their own whatever the policy: a ``hang`` stalls the job for its
``duration_s`` then restarts it (``restart_s``) and recomputes since the last checkpoint; an
``xid`` or an ``ecc_precursor`` that reaches ``fail_step`` on a node still in the job crashes it
the same way (detection immediate: the job dies). An SDC makes every step it touches incorrect
until it is rolled back; without detection it is found only at ``diverge_step`` (the loss
diverges), if the scenario says when, and then rolled back to the last checkpoint before it began.

Step wall time is ``step_time_s × (1 − COMPUTE_SHARE + COMPUTE_SHARE × (1 + worst slowdown))`` as
in :class:`~fleethealth.sim.FleetSim`. Of the results: ``goodput`` = steps × nominal step time /
wallclock; ``ettr`` = time the job moved forward (steps that were kept) / wallclock; ``correct work
per charged accelerator-hour`` = correct steps / (wallclock × world size / 3600) (seed 003).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleethealth.sim.fleet import COMPUTE_SHARE
from fleethealth.sim.scenario import Scenario

__all__ = ["Act", "LoopParams", "LoopResult", "account", "seed_rule_acts", "acts_from", "STRAGGLER_FAULTS"]

STRAGGLER_FAULTS = ("thermal_straggler", "nvlink_degraded", "nic_contention")
_REMOVE = ("evict", "drain", "quarantine")


@dataclass(frozen=True)
class Act:
    """A scheduler action on ``node`` decided at ``step`` (``target_step`` for a rollback)."""

    step: int
    node: str
    action: str
    target_step: int | None = None


@dataclass(frozen=True)
class LoopParams:
    """Restart costs (seconds; seed 002's phases after detection) and the facilities' delay.

    Defaults: the simulator's 600 s restart, split 0.4 isolation & scheduling ("diagnosis"), 0.3
    reconfiguration, 0.3 reload (:data:`fleethealth.sim.fleet.RELOAD_SHARE`, the share after the
    restarted run's ``job_start``)."""

    diagnosis_s: float = 240.0
    restart_s: float = 360.0
    facilities_delay_s: float = 1800.0

    @property
    def mttr_s(self) -> float:
        return self.diagnosis_s + self.restart_s


@dataclass
class LoopResult:
    """One policy's run: wallclock and its split, steps kept and correct, and ``evictions``: the
    nodes the scheduler took out (evict, drain or quarantine)."""

    policy: str
    steps: int
    world: int
    nominal_step_s: float
    wall_s: float = 0.0
    forward_s: float = 0.0
    restart_s: float = 0.0
    recompute_s: float = 0.0
    stall_s: float = 0.0
    correct_steps: int = 0
    evictions: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.steps * self.nominal_step_s / self.wall_s if self.wall_s else math.nan

    @property
    def ettr(self) -> float:
        return self.forward_s / self.wall_s if self.wall_s else math.nan

    @property
    def correct_per_accel_hour(self) -> float:
        return self.correct_steps / (self.wall_s * self.world / 3600.0) if self.wall_s else math.nan

    def to_obj(self) -> dict[str, Any]:
        return {"policy": self.policy, "goodput": self.goodput, "ettr": self.ettr,
                "correct_steps_per_accelerator_hour": self.correct_per_accel_hour, "evictions": self.evictions,
                "wall_s": self.wall_s, "forward_s": self.forward_s, "restart_s": self.restart_s,
                "recompute_s": self.recompute_s, "stall_s": self.stall_s, "correct_steps": self.correct_steps,
                "steps": self.steps, "notes": list(self.notes)}


def _next_checkpoint(step: int, every: int) -> int:
    return -(-step // every) * every


def account(scenario: Scenario, acts: Iterable[Act], *, policy: str, params: LoopParams | None = None,
            detect_sdc: bool = True) -> LoopResult:
    """Run ``scenario``'s job with ``acts`` carried out; ``detect_sdc=False`` leaves an SDC to be
    found at its ``diverge_step`` only."""
    p = params or LoopParams()
    job, fleet, every = scenario.job, scenario.fleet, scenario.checks.checkpoint_every
    rack_of = {fleet.node_name(i): fleet.rack_name(i // fleet.nodes_per_rack) for i in range(fleet.nodes)}
    out = LoopResult(policy=policy, steps=job.steps, world=fleet.world_size, nominal_step_s=job.step_time_s)
    planned: dict[str, int] = {}             # node -> the checkpoint at which the scheduler takes it out
    removed_at: dict[str, int] = {}          # node -> step from which it is out of the job
    rollbacks: list[tuple[int, int, str]] = []  # (at step, target step, node)
    alerts: dict[str, int] = {}              # rack -> step at which facilities were alerted
    acts_list = sorted(acts, key=lambda a: (a.step, a.node, a.action))
    for a in acts_list:
        if a.action in _REMOVE and a.node not in planned:
            planned[a.node] = _next_checkpoint(a.step, every)
        elif a.action == "rollback" and a.target_step is not None:
            rollbacks.append((a.step, a.target_step, a.node))
        elif a.action == "alert_facilities":
            rack = rack_of.get(a.node, "")
            alerts[rack] = min(alerts.get(rack, a.step), a.step)
    if not detect_sdc:
        rollbacks = []
        for f in scenario.faults:
            if f.kind.startswith("sdc_") and f.params.get("diverge_step") is not None:
                start = int(f["start_step"])
                rollbacks.append((int(f["diverge_step"]), (start - 1) // every * every, f["node"]))
    sdc_nodes = sorted({f["node"] for f in scenario.faults if f.kind.startswith("sdc_")})
    corrupt = {n: np.zeros(job.steps, dtype=bool) for n in sdc_nodes}  # steps whose kept result the node's SDC touched
    clear_at: dict[str, float] = {}          # rack -> wallclock at which the hot aisle clears
    crashes = {}
    for f in scenario.faults:
        if f.kind == "xid":
            crashes[int(f["step"])] = f["node"]
        elif f.kind == "ecc_precursor":
            crashes[int(f["fail_step"])] = f["node"]
    hangs = {int(f["step"]): f for f in scenario.faults if f.kind == "hang"}
    rollback_at = {at: (target, node) for at, target, node in rollbacks}

    def stop(seconds: float, bucket: str) -> None:
        out.wall_s += seconds
        setattr(out, bucket, getattr(out, bucket) + seconds)

    def in_job(node: str, step: int) -> bool:
        return not (node in removed_at and step >= removed_at[node])

    def recompute(last: int, step: int) -> None:
        stop((step - last) * job.step_time_s, "recompute_s")

    for s in range(job.steps):
        leaving = [n for n, at in planned.items() if at == s and in_job(n, s)]
        restarted = bool(leaving)
        if leaving:  # one restart at the checkpoint for every node that leaves there
            stop(p.mttr_s, "restart_s")
            out.evictions += len(leaving)
            for n in leaving:
                removed_at[n] = s
        for rack, step in list(alerts.items()):
            if rack not in clear_at and s >= step:
                clear_at[rack] = out.wall_s + p.facilities_delay_s
        worst = 0.0
        for f in scenario.faults:
            prm = f.params
            if "slowdown" not in prm or s < prm["start_step"] or (prm.get("end_step") is not None
                                                                  and s >= prm["end_step"]):
                continue
            if f.kind == "hot_aisle":
                rack = prm["rack"]
                if rack in clear_at and out.wall_s >= clear_at[rack]:
                    continue
                if all(not in_job(n, s) for n, r in rack_of.items() if r == rack):
                    continue
            elif not in_job(f["node"], s):
                continue
            worst = max(worst, float(prm["slowdown"]))
        wall = job.step_time_s * (1.0 - COMPUTE_SHARE + COMPUTE_SHARE * (1.0 + worst))
        out.wall_s += wall
        out.forward_s += wall
        for f in scenario.faults:
            if f.kind.startswith("sdc_") and s >= f["start_step"] and in_job(f["node"], s):
                corrupt[f["node"]][s] = True
        if s in hangs:
            h = hangs[s]
            stop(float(h["duration_s"]), "stall_s")
            stop(float(h["restart_s"]), "restart_s")
            recompute(s // every * every, s)
        if s in crashes and in_job(crashes[s], s):
            stop(p.mttr_s, "restart_s")
            recompute(s // every * every, s)
            removed_at.setdefault(crashes[s], s + 1)  # replaced by a spare on restart
        if s in rollback_at:
            target, node = rollback_at[s]
            recompute(target, s + 1)           # the steps since the target, done again on a spare
            if node in corrupt:  # redone on a spare: clean of this node's SDC (another one still in the job
                corrupt[node][target:s + 1] = False  # corrupts the redone steps again: its marks stay)
            if not restarted:  # a node that left at this step's checkpoint already paid the restart
                stop(p.mttr_s, "restart_s")
            removed_at.setdefault(node, s + 1)
    touched = np.zeros(job.steps, dtype=bool)
    for marks in corrupt.values():
        touched |= marks
    out.correct_steps = int(job.steps - touched.sum())
    return out


def seed_rule_acts(scenario: Scenario, *, window: int = 100) -> list[Act]:
    """Seed 000's rule alone: a rank slow enough for z > 3 for ``window`` steps is evicted; it cannot
    tell a hot aisle from a bad node, so every node of a hot rack goes. A slowdown of ``s`` scores
    z ≈ 0.8·s / jitter (the compute share over the jitter's spread)."""
    fleet, jitter = scenario.fleet, scenario.job.jitter
    acts = []
    for f in scenario.faults:
        prm = f.params
        if "slowdown" not in prm or COMPUTE_SHARE * float(prm["slowdown"]) / max(jitter, 1e-9) <= 3.0:
            continue
        step = int(prm["start_step"]) + window
        if prm.get("end_step") is not None and step >= prm["end_step"]:
            continue
        if f.kind == "hot_aisle":
            nodes = [fleet.node_name(i) for i in range(fleet.nodes)
                     if fleet.rack_name(i // fleet.nodes_per_rack) == prm["rack"]]
        else:
            nodes = [f["node"]]
        acts += [Act(step=step, node=n, action="evict") for n in nodes]
    return acts


def acts_from(recommendations: Sequence[Any], finding_steps: dict[str, int], *,
              automatic: tuple[str, ...] = ("allowed",)) -> list[Act]:
    """The acts a scheduler carries out from ``recommendations`` (schema records): those whose guard
    is in ``automatic``, at the step of the finding each answers (``finding_steps`` by finding id)."""
    acts = []
    for r in recommendations:
        if r.action.value == "none" or r.guard.value not in automatic:
            continue
        step = finding_steps.get(r.finding_id or "")
        if step is None:
            continue
        target = r.evidence.get("target_step") if r.action.value == "rollback" else None
        acts.append(Act(step=int(step), node=r.node, action=r.action.value,
                        target_step=None if target is None else int(target)))
    return acts
