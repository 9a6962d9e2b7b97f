"""The detection scorecard: each injected fault of a scenario against what the detectors concluded.

Ground truth is the scenario's fault list, read here and only after a run has finished: the
detectors and the policy never see it (``tests/report/test_scorecard.py`` checks that nothing on
their import path reaches :mod:`fleethealth.sim` or :mod:`fleethealth.scenarios`). For each fault
the scorecard names the first finding of the kind the fault should cause on the node (for a hot
aisle: on any node of the rack; for a fault of a job, one about that job or about no job — a node
fact such as a failure risk), its diagnosis, the latency in steps from the fault's start, the
recommendation made about it and that recommendation's guard; then every node that was flagged
although no fault touched it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleethealth.schema import Action, Finding, Recommendation

if TYPE_CHECKING:
    from fleethealth.sim import Scenario

__all__ = ["EXPECTED", "FaultScore", "Scorecard", "score"]

EXPECTED: dict[str, tuple[str, str | None]] = {
    "thermal_straggler": ("straggler", "NODE_THERMAL"),
    "hot_aisle": ("straggler", "ENVIRONMENTAL"),
    "nvlink_degraded": ("straggler", "NODE_LINK"),
    "nic_contention": ("straggler", "NETWORK_CONTENTION"),
    "ecc_precursor": ("failure_risk", None),
    "sdc_transient": ("sdc", None),
    "sdc_deterministic": ("sdc", None),
    "hang": ("hang", None),
    "xid": ("xid", None),
}
"""Fault kind -> (the finding kind it should cause, the diagnosis expected or None for any)."""


@dataclass(frozen=True)
class FaultScore:
    """One injected fault and what was concluded about it."""

    fault: str
    where: str
    start_step: int
    expected_kind: str
    expected_diagnosis: str | None
    found: bool
    kind: str | None = None
    diagnosis: str | None = None
    node: str | None = None
    step: int | None = None
    latency_steps: int | None = None
    action: str | None = None
    """The recommendations made about the finding, ``+``-joined (``quarantine+rollback``)."""
    guard: str | None = None
    job: str | None = None
    """The fault's job (a ``jobs`` scenario, or one that names it); the finding's job when found."""

    @property
    def correct(self) -> bool:
        """Found with the expected kind and, where one is expected, the expected diagnosis."""
        return self.found and (self.expected_diagnosis is None or self.diagnosis == self.expected_diagnosis)

    def to_obj(self) -> dict[str, Any]:
        return {"fault": self.fault, "where": self.where, "start_step": self.start_step,
                "expected_kind": self.expected_kind, "expected_diagnosis": self.expected_diagnosis,
                "found": self.found, "correct": self.correct, "kind": self.kind, "diagnosis": self.diagnosis,
                "node": self.node, "step": self.step, "latency_steps": self.latency_steps,
                "action": self.action, "guard": self.guard, "job": self.job}


@dataclass(frozen=True)
class Scorecard:
    """Every fault's :class:`FaultScore` and the healthy nodes that drew a finding."""

    scenario: str
    faults: tuple[FaultScore, ...]
    healthy_flagged: tuple[str, ...]

    @property
    def found(self) -> int:
        return sum(f.found for f in self.faults)

    @property
    def correct(self) -> int:
        return sum(f.correct for f in self.faults)

    def to_obj(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "faults": [f.to_obj() for f in self.faults], "found": self.found,
                "correct": self.correct, "injected": len(self.faults), "healthy_flagged": list(self.healthy_flagged)}

    def lines(self) -> list[str]:
        """The scorecard as a table, one line per fault, then the healthy nodes flagged."""
        out = [f"scorecard: {self.found}/{len(self.faults)} faults found, {self.correct} with the expected "
               f"kind and diagnosis; healthy nodes flagged: {', '.join(self.healthy_flagged) or 'none'}"]
        for f in self.faults:
            if not f.found:
                out.append(f"  MISSED {f.fault:18s} {f.where:8s} from step {f.start_step} "
                           f"(expected {f.expected_kind})")
                continue
            mark = "ok    " if f.correct else "WRONG "
            lat = "?" if f.latency_steps is None else f"{f.latency_steps:+d}"
            out.append(f"  {mark} {f.fault:18s} {f.where:8s} {f.kind}/{f.diagnosis or '-'} on {f.node} "
                       f"after {lat} steps -> {f.action or 'no action'}"
                       + ("" if f.guard is None else f" [{f.guard}]"))
        return out


_GUARD_ORDER = ("allowed", "rate_limited", "needs_human")
"""Guards from least to most restrictive: a fault's guard is the most restrictive of its recommendations'."""


def _step_of(f: Finding, scenario: Scenario, job: str | None = None) -> int:
    if f.step is not None:
        return int(f.step)
    if job is not None:  # counted in the fault's job's steps (an idle node's: its telemetry ticks)
        step_s = scenario.job_of(job).step_time_s
    else:
        step_s = scenario.idle_interval_s if scenario.jobs else scenario.job.step_time_s
    return int(round((f.ts - scenario.start_ts) / step_s))


def score(scenario: Scenario, findings: Sequence[Finding], recommendations: Sequence[Recommendation]) -> Scorecard:
    """Score a finished run's findings and recommendations against ``scenario``'s injected faults."""
    fleet = scenario.fleet
    rack_of = {fleet.node_name(i): fleet.rack_name(i // fleet.nodes_per_rack) for i in range(fleet.nodes)}
    acted = [r for r in recommendations if r.action is not Action.NONE]
    touched: set[str] = set()
    scores = []
    for fault in scenario.faults:
        expected_kind, expected_diag = EXPECTED[fault.kind]
        if fault.kind == "hot_aisle":
            where = fault["rack"]
            nodes = {n for n, r in rack_of.items() if r == where}
        else:
            where = fault["node"]
            nodes = {where}
        touched |= nodes
        start = int(fault.params.get("start_step", fault.params.get("step", 0)) or 0)
        mine = [f for f in findings if f.node in nodes and f.kind.value == expected_kind
                and (fault.job is None or f.job in (fault.job, None))]
        if expected_diag is not None:  # prefer the expected diagnosis: a rack's nodes may carry others too
            right = [f for f in mine if f.diagnosis is not None and f.diagnosis.value == expected_diag]
            mine = right or mine
        gpu = fault.params.get("gpu")
        if gpu is not None and any(f.gpu == gpu for f in mine):
            mine = [f for f in mine if f.gpu is None or f.gpu == gpu]
        if not mine:
            scores.append(FaultScore(fault.kind, where, start, expected_kind, expected_diag, found=False,
                                     job=fault.job))
            continue
        first = min(mine, key=lambda f: (f.ts, _step_of(f, scenario, fault.job)))
        step = _step_of(first, scenario, fault.job)
        recs = [r for r in acted if r.finding_id == first.id]
        if not recs:
            recs = [r for r in acted if r.node in nodes and r.ts >= first.ts][:1]
        scores.append(FaultScore(
            fault.kind, where, start, expected_kind, expected_diag, found=True, kind=first.kind.value,
            diagnosis=None if first.diagnosis is None else first.diagnosis.value, node=first.node, step=step,
            latency_steps=step - start,
            action="+".join(dict.fromkeys(r.action.value for r in recs)) or None,
            guard=max((r.guard.value for r in recs), key=_GUARD_ORDER.index, default=None),
            job=first.job if first.job is not None else fault.job))
    flagged = sorted({f.node for f in findings} - touched)
    return Scorecard(scenario=scenario.name, faults=tuple(scores), healthy_flagged=tuple(flagged))
