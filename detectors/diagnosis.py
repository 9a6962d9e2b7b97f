"""Why is a straggler slow? Seed 000 revision R2's ``diagnose_straggler`` on node telemetry.

Classify before evicting (R2): evicting a symptom whose cause is the aisle just moves it.
:func:`diagnose_straggler` is a pure function of the straggler node's latest
:class:`~fleethealth.schema.Telemetry` (and the one before it, for counter rates) and its rack
peers' latest samples. The branches, in R2's order:

1. **Thermal or power cap** — the GPU's temperature above *its own* slowdown temperature (the
   ``slowdown_temp_c`` the GPU reports through NVML or DCGM; ``thermal_limit_c`` only where it does
   not say), a thermal clock-event bit (``SW_THERMAL``/``HW_THERMAL``) or the hardware power brake.
   Then the rack decides, by its temperature distribution rather than only by who crossed a line:
   it is ``ENVIRONMENTAL`` (alert facilities, evicting will not help) when the peers' median
   temperature is above their own limits, or at least ``peer_throttle_share`` of the peers throttle
   too, or the rack's median rise over each node's own baseline (:class:`Diagnoser` keeps a slow
   baseline per node) is at least ``rack_rise_c`` — a hot aisle in which only part of the rack has
   crossed its limit is still one cause. Else ``NODE_THERMAL`` (a fan or paste problem: evict).
   With no rack peer that has telemetry the node and its environment cannot be told apart: that is
   ``UNKNOWN``, with the reason in the evidence. ``SW_POWER_CAP`` alone does not count: a busy GPU
   sits at its power limit in normal operation.
2. **Links** — fewer NVLink links up than the GPU has, or CRC / replay / recovery counters rising
   faster than ``nvlink_errors_per_s`` between the two samples, or a NIC port that went down
   between them (up before, down now, or its ``link_downed`` counter rose) → ``NODE_LINK``.
3. **NIC** — from the NIC port counters of the two samples (:class:`~fleethealth.schema.NicPorts`,
   real sysfs counters on a node, the same counters from the simulator): a port that waited for
   credit (``port_xmit_wait`` ticks × ``nic_bytes_per_tick`` over what the link could send in the
   interval) more than ``nic_xmit_wait_band`` of the time, or sent or received above
   ``nic_util_band`` of its link rate → ``NETWORK_CONTENTION``. A sample without NIC ports (from
   a probe older than its NIC source) falls back to its ``nic_util`` summary against
   ``nic_util_band``.
4. Otherwise ``UNKNOWN``. Missing evidence gives ``UNKNOWN`` with ``evidence["reason"]``, never a
   confident wrong class: a node with no telemetry, telemetry older than ``max_age_s`` at the
   straggler's time, or a sample that reports none of the fields a branch reads.

The evidence (values, thresholds, peers) is a JSON-ready dict that goes into the finding.
:class:`Diagnoser` is the small stateful helper a runner keeps: it remembers the latest two
samples of every node and answers ``diagnose(node, gpu)``. :class:`RackEpisodes` folds many
``ENVIRONMENTAL`` stragglers of one rack into one finding per rack episode, not 64.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleethealth.detectors.nodestate import THROTTLE_BITS, NodeStates, StateRule, node_state
from fleethealth.detectors.state import Stateful
from fleethealth.errors import SchemaError
from fleethealth.params import check_number
from fleethealth.schema import ClockReason, Diagnosis, Finding, FindingKind, NodeState, Telemetry

__all__ = ["DiagnosisThresholds", "DiagnosisResult", "diagnose_straggler", "diagnose_state", "Diagnoser",
           "RackEpisodes"]


@dataclass(frozen=True)
class DiagnosisThresholds:
    """Limits of :func:`diagnose_straggler` (defaults suit H100-class GPUs)."""

    thermal_limit_c: float = 85.0
    """GPU core temperature taken as the slowdown point where the GPU does not report its own
    (``slowdown_temp_c`` NaN: an old driver, a source without the field)."""
    peer_throttle_share: float = 0.5
    """Share of rack peers throttling too that makes the cause environmental."""
    nvlink_errors_per_s: float = 1.0
    """NVLink CRC + replay + recovery errors per second, summed over the node, still in band."""
    nic_util_band: float = 0.85
    """Share of a NIC port's link rate, sent or received, above which the network is contended."""
    nic_xmit_wait_band: float = 0.10
    """Share of the interval a NIC port waited for credit (``port_xmit_wait``) above which it is contended."""
    nic_bytes_per_tick: float = 8.0
    """Bytes one ``port_xmit_wait`` tick stands for (8 on NVIDIA Quantum-class hardware, per ibdiagnet)."""
    rack_rise_c: float = 5.0
    """Median rise of a rack's node temperatures over their own baselines that makes the cause environmental."""
    max_age_s: float = 120.0
    """Telemetry older than this at the straggler's time is no evidence (a node whose probe went quiet)."""

    def __post_init__(self) -> None:
        check_number("thermal_limit_c", self.thermal_limit_c, at_least=-273.0, owner=self)
        check_number("peer_throttle_share", self.peer_throttle_share, above=0, at_most=1.0, owner=self)
        check_number("nvlink_errors_per_s", self.nvlink_errors_per_s, at_least=0, owner=self)
        check_number("nic_util_band", self.nic_util_band, at_least=0, at_most=1.0, owner=self)
        check_number("nic_xmit_wait_band", self.nic_xmit_wait_band, at_least=0, at_most=1.0, owner=self)
        check_number("nic_bytes_per_tick", self.nic_bytes_per_tick, above=0, owner=self)
        check_number("rack_rise_c", self.rack_rise_c, above=0, owner=self)
        check_number("max_age_s", self.max_age_s, above=0, owner=self)

    def state_rule(self, heartbeat_s: float = 5.0) -> StateRule:
        """When a node state is republished, with these bands (see :mod:`fleethealth.detectors.nodestate`)."""
        return StateRule(heartbeat_s=heartbeat_s, nvlink_errors_per_s=self.nvlink_errors_per_s,
                         nic_util_band=self.nic_util_band, nic_xmit_wait_band=self.nic_xmit_wait_band)


@dataclass(frozen=True)
class DiagnosisResult:
    """A diagnosis and the numbers behind it (``evidence`` is JSON-ready)."""

    diagnosis: Diagnosis
    evidence: dict[str, Any]


def _num(x: float) -> float | None:
    return None if not math.isfinite(x) else round(float(x), 4)


def _rows(state: NodeState, gpu: int | None) -> np.ndarray:
    if gpu is None:
        return np.ones(state.gpu.shape, dtype=bool)
    rows = state.gpu == gpu
    return rows if rows.any() else np.ones(state.gpu.shape, dtype=bool)


def _throttled(state: NodeState) -> np.ndarray:
    bits = np.nan_to_num(state.clock_reasons, nan=0.0).astype(np.int64)
    return (bits & THROTTLE_BITS) != 0


def _node_temp(state: NodeState) -> float:
    temps = state.temp_c
    return float(np.nanmedian(temps)) if np.isfinite(temps).any() else math.nan


def _over_limit(state: NodeState, default: float) -> float:
    """The node's median temperature minus its GPUs' median limit (NaN without temperatures)."""
    temps = state.temp_c
    if not np.isfinite(temps).any():
        return math.nan
    return float(np.nanmedian(temps) - np.median(state.slowdown_limits(default)))


def diagnose_straggler(sample: Telemetry, peers: Sequence[Telemetry] = (), *, gpu: int | None = None,
                       previous: Telemetry | None = None,
                       thresholds: DiagnosisThresholds = DiagnosisThresholds(),
                       baselines: dict[str, float] | None = None) -> DiagnosisResult:
    """Classify a straggler on ``sample.node`` (GPU ``gpu``, or the whole node when None).

    ``peers`` are the latest samples of the other nodes in the rack (the node itself is skipped
    if present); ``previous`` is the node's sample before ``sample`` (for counter rates);
    ``baselines`` maps nodes to their usual median temperature (see :class:`Diagnoser`). The same
    as :func:`diagnose_state` on the states :func:`~fleethealth.detectors.nodestate.node_state` derives.
    """
    base = baselines or {}
    tick = thresholds.nic_bytes_per_tick

    def state(s: Telemetry, before: Telemetry | None = None) -> NodeState:
        return node_state(s, before, baseline_temp_c=base.get(s.node, math.nan), nic_bytes_per_tick=tick)

    return diagnose_state(state(sample, previous), [state(p) for p in peers], gpu=gpu, thresholds=thresholds)


def diagnose_state(state: NodeState, peers: Sequence[NodeState] = (), *, gpu: int | None = None,
                   thresholds: DiagnosisThresholds = DiagnosisThresholds()) -> DiagnosisResult:
    """Classify a straggler on ``state.node`` from its :class:`~fleethealth.schema.NodeState` and its
    rack peers' (the node itself is skipped if present); see the module for the branches."""
    th = thresholds
    rows = _rows(state, gpu)
    temps = state.temp_c[rows]
    limits = state.slowdown_limits(th.thermal_limit_c)[rows]
    over = temps - limits
    k = int(np.nanargmax(over)) if np.isfinite(over).any() else -1
    temp = float(temps[k]) if k >= 0 else math.nan
    limit = float(limits[k]) if k >= 0 else float(np.median(limits)) if limits.size else th.thermal_limit_c
    reasons = int(np.bitwise_or.reduce(np.nan_to_num(state.clock_reasons[rows], nan=0.0).astype(np.int64)))
    evidence: dict[str, Any] = {
        "node": state.node, "rack": state.rack, "gpu": gpu, "sample_ts": state.ts,
        "temp_c": _num(temp), "thermal_limit_c": _num(limit),
        "thermal_limit_source": "gpu" if np.isfinite(state.slowdown_temp_c[rows]).all() else "default",
        "clock_reasons": [r.name for r in ClockReason if r & reasons],
    }
    hot = temp > limit or bool(reasons & THROTTLE_BITS)
    if hot:
        others = [p for p in peers if p.node != state.node]
        over_limit = np.array([_over_limit(p, th.thermal_limit_c) for p in others])
        peer_temps = np.array([_node_temp(p) for p in others])
        finite = np.isfinite(peer_temps)
        median = float(np.median(peer_temps[finite])) if finite.any() else math.nan
        median_over = float(np.median(over_limit[finite])) if finite.any() else math.nan
        share = float(np.mean([_throttled(p).any() for p in others])) if others else 0.0
        rises = np.array([peer_temps[i] - p.baseline_temp_c for i, p in enumerate(others)
                          if finite[i] and math.isfinite(p.baseline_temp_c)])
        rise = float(np.median(rises)) if rises.size else math.nan
        evidence.update(peers=len(others), peers_with_telemetry=int(finite.sum()), peer_median_temp_c=_num(median),
                        peer_median_over_limit_c=_num(median_over), peer_throttle_share=round(share, 4),
                        peer_throttle_share_limit=th.peer_throttle_share, rack_rise_c=_num(rise),
                        rack_rise_limit_c=th.rack_rise_c)
        if not finite.any():
            evidence["reason"] = "no rack peer with telemetry: the node cannot be told from its environment"
            return DiagnosisResult(Diagnosis.UNKNOWN, evidence)
        rack_hot = median_over > 0 or share >= th.peer_throttle_share or rise >= th.rack_rise_c
        return DiagnosisResult(Diagnosis.ENVIRONMENTAL if rack_hot else Diagnosis.NODE_THERMAL, evidence)
    if not state.reports[rows].any() and not state.has_nic and not math.isfinite(state.nic_util):
        evidence["reason"] = "the sample reports none of the fields the diagnosis reads"
        return DiagnosisResult(Diagnosis.UNKNOWN, evidence)
    up, top = state.nvlink_links_up, state.nvlink_links_max
    down = np.isfinite(up) & np.isfinite(top) & (up < top)
    rate = state.nvlink_errors_per_s
    ports_down = [p for p, d in zip(state.nic_port, state.nic_port_down, strict=True) if d]
    evidence.update(nvlink_links_up=_num(float(np.nansum(up))) if np.isfinite(up).any() else None,
                    nvlink_links_max=_num(float(np.nansum(top))) if np.isfinite(top).any() else None,
                    nvlink_gpus_degraded=state.gpu[down].tolist(), nvlink_errors_per_s=_num(rate),
                    nvlink_errors_per_s_band=th.nvlink_errors_per_s, nic_ports_down=ports_down)
    if down.any() or rate > th.nvlink_errors_per_s or ports_down:
        return DiagnosisResult(Diagnosis.NODE_LINK, evidence)
    evidence.update(nic_util_band=th.nic_util_band)
    if not state.has_nic:  # an older probe: only the node's utilisation summary
        evidence.update(nic_source="nic_util", nic_util=_num(state.nic_util))
        contended = state.nic_util > th.nic_util_band
    else:
        util_, wait_ = state.nic_port_util, state.nic_port_wait
        util = float(np.nanmax(util_)) if np.isfinite(util_).any() else math.nan
        wait = float(np.nanmax(wait_)) if np.isfinite(wait_).any() else math.nan
        evidence.update(nic_source="port_counters", nic_util=_num(util), nic_xmit_wait_share=_num(wait),
                        nic_xmit_wait_band=th.nic_xmit_wait_band,
                        nic_ports=[{"port": p, "util": _num(u), "xmit_wait_share": _num(w)}
                                   for p, u, w in zip(state.nic_port, util_, wait_, strict=True)])
        contended = util > th.nic_util_band or wait > th.nic_xmit_wait_band
    if contended:
        return DiagnosisResult(Diagnosis.NETWORK_CONTENTION, evidence)
    return DiagnosisResult(Diagnosis.UNKNOWN, evidence)


class Diagnoser(Stateful):
    """Diagnoses stragglers on demand from the table of node states (:class:`NodeStates`).

    ``observe(samples)`` feeds telemetry (a single runner, or a node stage): the table derives each
    node's state and publishes it when it changed or its heartbeat is due, and returns what it
    published; ``apply(states)`` feeds published states (a job stage reading ``fh.nodestate``).
    ``diagnose(node, gpu)`` runs :func:`diagnose_state` on the node's published state against its
    rack peers'. A node never seen gives ``UNKNOWN`` with ``evidence["telemetry"] = "missing"``.
    ``heartbeat_s`` is how often a node's state is republished unchanged (event time).
    """

    def __init__(self, *, thresholds: DiagnosisThresholds = DiagnosisThresholds(), baseline_s: float = 1800.0,
                 heartbeat_s: float = 5.0) -> None:
        self.thresholds = thresholds
        self.baseline_s = baseline_s
        self.heartbeat_s = heartbeat_s
        self.states = NodeStates(rule=thresholds.state_rule(heartbeat_s), baseline_s=baseline_s,
                                 nic_bytes_per_tick=thresholds.nic_bytes_per_tick)

    @property
    def latest_(self) -> dict[str, NodeState]:
        """Each node's published state."""
        return self.states.published_

    @property
    def racks_(self) -> dict[str, set[str]]:
        return self.states.racks_

    @property
    def stale_total_(self) -> int:
        """Samples or states older than (or as old as) the node's newest, ignored."""
        return self.states.stale_total_

    def observe(self, samples: Iterable[Telemetry]) -> list[NodeState]:
        return self.states.observe(samples)

    def apply(self, states: Iterable[NodeState]) -> None:
        self.states.apply(states)

    def forget(self, gone: Iterable[str]) -> None:
        self.states.forget(gone)

    def rack_of(self, node: str) -> str | None:
        state = self.states.published_.get(node)
        return None if state is None else state.rack

    def diagnose(self, node: str, gpu: int | None = None, *, at: float | None = None) -> DiagnosisResult:
        """Diagnose a straggler on ``node`` found at event time ``at`` (a state older than
        ``thresholds.max_age_s`` then is no evidence; peers that old are left out)."""
        table = self.states.published_
        state = table.get(node)
        if state is None:
            return DiagnosisResult(Diagnosis.UNKNOWN, {"node": node, "gpu": gpu, "telemetry": "missing",
                                                       "reason": "no telemetry from the node"})
        max_age = self.thresholds.max_age_s
        if at is not None and at - state.ts > max_age:
            return DiagnosisResult(Diagnosis.UNKNOWN, {
                "node": node, "gpu": gpu, "telemetry": "stale", "sample_ts": state.ts,
                "reason": f"the node's newest telemetry is {at - state.ts:.0f} s older than the straggler"})
        peers = [table[n] for n in sorted(self.states.racks_.get(state.rack, ())) if n != node
                 and (at is None or at - table[n].ts <= max_age)]
        return diagnose_state(state, peers, gpu=gpu, thresholds=self.thresholds)


class RackEpisodes(Stateful):
    """Fold ``ENVIRONMENTAL`` stragglers of one rack into one finding per (job, rack) episode.

    ``update(findings, rack_of)`` passes every other finding through unchanged. The first
    ``ENVIRONMENTAL`` straggler of a rack opens an episode and is replaced by one rack finding
    (``detector="straggler.rack"``, ``rank``/``gpu`` None, ``evidence["rack"]``, the first
    straggler's rank, node and diagnosis evidence). Later ones in the same rack are absorbed
    (counted in ``episodes_``) until ``quiet_s`` of event time passes without one; then the next
    opens a new episode. Findings whose rack is unknown pass through; a non-finite ``ts`` raises
    :class:`~fleethealth.errors.SchemaError`.
    """

    name = "straggler.rack"

    def __init__(self, *, quiet_s: float = 1800.0) -> None:
        self.quiet_s = quiet_s

    def update(self, findings: Sequence[Finding], rack_of: Callable[[str], str | None]) -> list[Finding]:
        if not hasattr(self, "episodes_"):
            check_number("quiet_s", self.quiet_s, above=0, owner=self)
            self.episodes_: dict[tuple[str | None, str], dict[str, Any]] = {}
        out = []
        for f in findings:
            if not math.isfinite(f.ts):
                raise SchemaError("ts", f"finding {f.id} has a non-finite event time {f.ts!r}")
            rack = rack_of(f.node) if f.node else None
            if f.kind is not FindingKind.STRAGGLER or f.diagnosis is not Diagnosis.ENVIRONMENTAL or rack is None:
                out.append(f)
                continue
            key = (f.job, rack)
            ep = self.episodes_.get(key)
            if ep is not None and f.ts - ep["last_ts"] <= self.quiet_s:
                ep["last_ts"] = max(ep["last_ts"], f.ts)
                ep["nodes"].add(f.node)
                ep["stragglers"] += 1
                continue
            self.episodes_[key] = {"opened_ts": f.ts, "last_ts": f.ts, "nodes": {f.node}, "stragglers": 1}
            evidence = {"rack": rack, "first_rank": f.rank, "first_node": f.node, "first_gpu": f.gpu,
                        "first_slowdown": f.slowdown, "straggler": dict(f.evidence)}
            out.append(dataclasses.replace(f, rank=None, gpu=None, detector=self.name, evidence=evidence))
        return out

    def open_episodes(self) -> dict[str, int]:
        """Stragglers absorbed so far per rack (all jobs), for metrics and tests."""
        counts: dict[str, int] = {}
        for (_, rack), ep in getattr(self, "episodes_", {}).items():
            counts[rack] = counts.get(rack, 0) + ep["stragglers"]
        return counts
