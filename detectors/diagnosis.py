"""Why is a straggler slow? Seed 000 revision R2's ``diagnose_straggler`` on node telemetry.

Classify before evicting (R2): evicting a symptom whose cause is the aisle just moves it.
:func:`diagnose_straggler` is a pure function of the straggler node's latest
:class:`~fleethealth.schema.Telemetry` (and the one before it, for counter rates) and its rack
peers' latest samples. The branches, in R2's order:

1. **Thermal** — the GPU's temperature at or above *its own* slowdown temperature (the
   ``slowdown_temp_c`` the GPU reports through NVML or DCGM; ``thermal_limit_c`` only where it does
   not say) or a thermal clock-event bit (``SW_THERMAL``/``HW_THERMAL``). Neither the power cap
   (a busy GPU sits at its limit in normal operation) nor the hardware power brake (an external
   signal: the health rules' ``power_brake`` finding) is a thermal cause; a braked GPU says so in
   the evidence (``power_brake``) and goes on to the other branches. Then, judged on what load
   cannot explain (:mod:`fleethealth.detectors.thermal`):

   * **the GPU against its rack peers at the same power** — ``excess_c``, its temperature minus the
     median of the peer GPUs' temperatures each moved to its power draw (averaged over
     ``thermal_fast_s``, so a brief power-cap dip does not count) along ``slope_c_per_w`` (a rack's
     GPUs share their load steps, so the comparison needs no model). At
     least ``node_excess_c`` is a node signature: ``NODE_THERMAL`` (a fan or paste problem: evict),
     whatever the rack does, so a hot aisle never hides a failing GPU in it;
   * **the rack against its own thermal models** — ``rack_residual_c``, the median over the peer
     nodes of their busy GPUs' residuals (temperature above what each GPU's own model predicts at its
     load power). A job start, a job end, a neighbouring job or a power-cap change moves load, which
     the models account for; an aisle that runs hot does not. ``ENVIRONMENTAL`` (alert facilities,
     evicting will not help) when it is at least ``rack_residual_c``, or when the peers' median
     temperature is above their own limits, or at least ``peer_throttle_share`` of the peers throttle
     thermally too; a hot aisle in which only part of the rack has crossed its limit is still one cause.
   * Else ``NODE_THERMAL``. With no rack peer that has telemetry (a node whose rack is unknown
     has none) the node and its environment cannot be told apart: that is ``UNKNOWN``, with the
     reason in the evidence.

   The quantities compared are in the evidence of every diagnosis with rack peers: the GPU's
   temperature, power, load power and residual, the peers' median temperature and power, the peers'
   temperature at the GPU's power, the excess and the rack's residual, with their limits.
2. **Links** — fewer NVLink links up than the GPU has, or a GPU's NVLink errors (CRC, replay,
   recovery) rising faster than ``nvlink_errors_per_min`` between the two samples, or a NIC port that went down
   between them (up before, down now, or its ``link_downed`` counter rose) → ``NODE_LINK``.
3. **NIC** — from the NIC port counters of the two samples (:class:`~fleethealth.schema.NicPorts`,
   real sysfs counters on a node, the same counters from the simulator): a port that waited for
   credit (``port_xmit_wait`` ticks × ``nic_bytes_per_tick`` over what the link could send in the
   interval) more than ``nic_xmit_wait_band`` of the time, or sent or received above
   ``nic_util_band`` of its link rate → ``NETWORK_CONTENTION``. A sample without NIC ports (from
   a probe older than its NIC source) falls back to its ``nic_util`` summary against
   ``nic_util_band``.
4. Otherwise ``UNKNOWN``. Whatever the class, :class:`Diagnoser` adds the straggler GPU's power
   cap over the ``power_cap_window_s`` before the straggler (``power_cap_share``: the share of that
   window its ``SW_POWER_CAP`` clock-event bit was set) and, when that share is at least
   ``power_capped_share``, ``power_capped: true`` — and an ``UNKNOWN`` straggler that is power-capped
   gets ``cause: "power cap"``: a node power fault (its power limit or supply), which the policy
   evicts for only when persistent and material. Missing evidence gives ``UNKNOWN`` with ``evidence["reason"]``, never a
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

from fleethealth.detectors.batch import Batch, expect
from fleethealth.detectors.nodestate import THERMAL_BITS, NodeStates, StateRule, node_state
from fleethealth.detectors.state import Stateful, names
from fleethealth.detectors.thermal import ThermalParams
from fleethealth.errors import SchemaError
from fleethealth.nodename import known_rack
from fleethealth.params import check_number
from fleethealth.schema import ClockReason, Diagnosis, Finding, FindingKind, NodeState, Telemetry

__all__ = ["DiagnosisThresholds", "DiagnosisResult", "diagnose_straggler", "diagnose_state", "Diagnoser",
           "RackEpisodes"]


@dataclass(frozen=True)
class DiagnosisThresholds:
    """Settings of the diagnosis (defaults suit H100-class GPUs): its limits, and what the node stage
    derives for it — when a node state is republished (:class:`StateRule`) and each GPU's thermal
    model (:class:`~fleethealth.detectors.thermal.ThermalParams`). Every field is a config key
    ``detect.diagnosis.<name>``."""

    thermal_limit_c: float = 85.0
    """GPU core temperature taken as the slowdown point where the GPU does not report its own
    (``slowdown_temp_c`` NaN: an old driver, a source without the field)."""
    peer_throttle_share: float = 0.5
    """Share of rack peers throttling thermally too that makes the cause environmental."""
    nvlink_errors_per_min: float = 10.0
    """NVLink errors per GPU per minute (:func:`~fleethealth.detectors.nodestate.nvlink_errors`, the
    node's worst GPU) still in band: the same rate and default as the health rule's."""
    nic_util_band: float = 0.85
    """Share of a NIC port's link rate, sent or received, above which the network is contended."""
    nic_xmit_wait_band: float = 0.10
    """Share of the interval a NIC port waited for credit (``port_xmit_wait``) above which it is contended."""
    nic_bytes_per_tick: float = 8.0
    """Bytes one ``port_xmit_wait`` tick stands for (8 on NVIDIA Quantum-class hardware, per ibdiagnet)."""
    node_excess_c: float = 10.0
    """How much hotter than its rack peers at the same power a GPU must run to be a node signature."""
    rack_residual_c: float = 5.0
    """Median thermal residual of a rack's other nodes (what load does not explain) that makes the
    cause environmental; also the band beyond which a GPU's thermal model does not learn a sample."""
    max_age_s: float = 120.0
    """Telemetry older than this at the straggler's time is no evidence (a node whose probe went quiet)."""
    heartbeat_s: float = 5.0
    """A node's state is republished at least this often (event time), changed or not."""
    temp_step_c: float = 1.0
    """A GPU temperature or thermal residual moving by this much republishes the node's state."""
    power_step_w: float = 20.0
    """A GPU's power or load power moving by this much republishes the node's state."""
    share_step: float = 0.05
    """A NIC port's utilisation or credit-wait share moving by this much republishes the node's state."""
    slope_c_per_w: float = 0.05
    """°C per W: how the peers' temperatures are moved to the GPU's power, and the thermal models'
    prior slope."""
    thermal_fast_s: float = 10.0
    """Time constant of the fast power average (at most a GPU's own thermal time constant)."""
    thermal_slow_s: float = 300.0
    """Time constant of the slow power average (at least a GPU's own thermal time constant)."""
    thermal_memory_s: float = 21_600.0
    """Event time over which a thermal model forgets what it learned."""
    thermal_prior_samples: float = 20.0
    """Weight of the prior slope, in samples spread over ``thermal_prior_spread_w``."""
    thermal_prior_spread_w: float = 50.0
    """Power spread the prior slope's weight stands for."""
    busy_util_pct: float = 50.0
    """Utilisation from which a GPU is busy (its samples teach its thermal model; its residual counts)."""
    busy_power_share: float = 0.5
    """Share of the power limit from which a GPU that reports no utilisation is busy."""
    settled_share: float = 0.05
    """The fast and slow power averages within this share of each other: the load is settled."""
    thermal_min_samples: float = 10.0
    """Learned weight (samples) before a GPU's thermal model gives a residual."""
    power_cap_window_s: float = 600.0
    """Event time before a straggler over which its GPU's power-cap clock events are measured."""
    power_capped_share: float = 0.5
    """Share of ``power_cap_window_s`` with the power-cap bit set from which a straggler is power-capped."""

    def __post_init__(self) -> None:
        check_number("thermal_limit_c", self.thermal_limit_c, at_least=-273.0, owner=self)
        check_number("peer_throttle_share", self.peer_throttle_share, above=0, at_most=1.0, owner=self)
        check_number("nvlink_errors_per_min", self.nvlink_errors_per_min, at_least=0, owner=self)
        check_number("nic_util_band", self.nic_util_band, at_least=0, at_most=1.0, owner=self)
        check_number("nic_xmit_wait_band", self.nic_xmit_wait_band, at_least=0, at_most=1.0, owner=self)
        check_number("nic_bytes_per_tick", self.nic_bytes_per_tick, above=0, owner=self)
        check_number("node_excess_c", self.node_excess_c, above=0, owner=self)
        check_number("rack_residual_c", self.rack_residual_c, above=0, owner=self)
        check_number("max_age_s", self.max_age_s, above=0, owner=self)
        check_number("power_cap_window_s", self.power_cap_window_s, above=0, owner=self)
        check_number("power_capped_share", self.power_capped_share, above=0, at_most=1.0, owner=self)
        self.state_rule()
        self.thermal()

    def state_rule(self) -> StateRule:
        """When a node state is republished, with these bands (see :mod:`fleethealth.detectors.nodestate`)."""
        return StateRule(heartbeat_s=self.heartbeat_s, temp_step_c=self.temp_step_c, power_step_w=self.power_step_w,
                         share_step=self.share_step, nvlink_errors_per_min=self.nvlink_errors_per_min,
                         nic_util_band=self.nic_util_band, nic_xmit_wait_band=self.nic_xmit_wait_band)

    def thermal(self) -> ThermalParams:
        """Each GPU's thermal model (see :mod:`fleethealth.detectors.thermal`)."""
        return ThermalParams(fast_s=self.thermal_fast_s, slow_s=self.thermal_slow_s, memory_s=self.thermal_memory_s,
                             slope_c_per_w=self.slope_c_per_w, prior_samples=self.thermal_prior_samples,
                             prior_spread_w=self.thermal_prior_spread_w, busy_util_pct=self.busy_util_pct,
                             busy_power_share=self.busy_power_share, settled_share=self.settled_share,
                             min_samples=self.thermal_min_samples, learn_band_c=self.rack_residual_c)


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
    return (bits & THERMAL_BITS) != 0


def _node_temp(state: NodeState) -> float:
    temps = state.temp_c
    return float(np.nanmedian(temps)) if np.isfinite(temps).any() else math.nan


def _over_limit(state: NodeState, default: float) -> float:
    """The node's median temperature minus its GPUs' median limit (NaN without temperatures)."""
    temps = state.temp_c
    if not np.isfinite(temps).any():
        return math.nan
    return float(np.nanmedian(temps) - np.median(state.slowdown_limits(default)))


def _median(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(np.median(x)) if x.size else math.nan


def _thermal_comparison(state: NodeState, k: int, rows: np.ndarray, others: Sequence[NodeState],
                        th: DiagnosisThresholds) -> dict[str, Any]:
    """The GPU (row ``k`` of ``rows``) against its rack peers at the same power, and the rack's residual."""
    temp = float(state.temp_c[rows][k]) if k >= 0 else math.nan
    power = float(state.power_w[rows][k]) if k >= 0 else math.nan
    load = float(state.load_power_w[rows][k]) if k >= 0 else math.nan
    own = float(state.residual_c[rows][k]) if k >= 0 else math.nan
    if others:
        peer_t = np.concatenate([p.temp_c for p in others])
        peer_p = np.concatenate([p.power_w for p in others])
        moved = np.where(np.isfinite(peer_p) & math.isfinite(power), peer_t + th.slope_c_per_w * (power - peer_p),
                         peer_t)
        node_res = np.array([_median(p.residual_c) for p in others])
    else:
        peer_t = peer_p = moved = node_res = np.zeros(0)
    at_power = _median(moved)
    rack_residual = _median(node_res)
    return {"gpu_power_w": _num(power), "gpu_load_power_w": _num(load), "gpu_residual_c": _num(own),
            "peer_median_power_w": _num(_median(peer_p)), "peer_temp_at_power_c": _num(at_power),
            "excess_c": _num(temp - at_power), "node_excess_limit_c": th.node_excess_c,
            "rack_residual_c": _num(rack_residual), "rack_residual_limit_c": th.rack_residual_c,
            "rack_nodes_with_residual": int(np.isfinite(node_res).sum()), "slope_c_per_w": th.slope_c_per_w}


def diagnose_straggler(sample: Telemetry, peers: Sequence[Telemetry] = (), *, gpu: int | None = None,
                       previous: Telemetry | None = None,
                       thresholds: DiagnosisThresholds = DiagnosisThresholds()) -> DiagnosisResult:
    """Classify a straggler on ``sample.node`` (GPU ``gpu``, or the whole node when None).

    ``peers`` are the latest samples of the other nodes in the rack (the node itself is skipped
    if present); ``previous`` is the node's sample before ``sample`` (for counter rates). The same
    as :func:`diagnose_state` on the states :func:`~fleethealth.detectors.nodestate.node_state`
    derives from single samples: the load power is the sample's power and no thermal model is
    known (:class:`Diagnoser` keeps them).
    """
    tick = thresholds.nic_bytes_per_tick

    def state(s: Telemetry, before: Telemetry | None = None) -> NodeState:
        return node_state(s, before, nic_bytes_per_tick=tick)

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
        "node": state.node, "rack": known_rack(state.rack), "gpu": gpu, "sample_ts": state.ts,
        "temp_c": _num(temp), "thermal_limit_c": _num(limit),
        "thermal_limit_source": "gpu" if np.isfinite(state.slowdown_temp_c[rows]).all() else "default",
        "clock_reasons": [r.name for r in ClockReason if r & reasons],
        "power_brake": bool(reasons & ClockReason.HW_POWER_BRAKE),
    }
    others = [p for p in peers if p.node != state.node]
    if others:
        evidence.update(_thermal_comparison(state, k, rows, others, th))
    hot = temp >= limit or bool(reasons & THERMAL_BITS)  # a GPU at its slowdown point is held there
    if hot:
        over_limit = np.array([_over_limit(p, th.thermal_limit_c) for p in others])
        peer_temps = np.array([_node_temp(p) for p in others])
        finite = np.isfinite(peer_temps)
        median = float(np.median(peer_temps[finite])) if finite.any() else math.nan
        median_over = float(np.median(over_limit[finite])) if finite.any() else math.nan
        share = float(np.mean([_throttled(p).any() for p in others])) if others else 0.0
        evidence.update(peers=len(others), peers_with_telemetry=int(finite.sum()), peer_median_temp_c=_num(median),
                        peer_median_over_limit_c=_num(median_over), peer_throttle_share=round(share, 4),
                        peer_throttle_share_limit=th.peer_throttle_share)
        if not finite.any():
            evidence["reason"] = ("no rack peer with telemetry: the node cannot be told from its environment"
                                  if known_rack(state.rack) is not None else
                                  "the node reports no rack: the node cannot be told from its environment")
            return DiagnosisResult(Diagnosis.UNKNOWN, evidence)
        excess = evidence["excess_c"]
        if excess is not None and excess >= th.node_excess_c:
            evidence["cause"] = "hotter than its rack peers at the same power"
            return DiagnosisResult(Diagnosis.NODE_THERMAL, evidence)
        residual = evidence["rack_residual_c"]
        rack_hot = (median_over > 0 or share >= th.peer_throttle_share
                    or (residual is not None and residual >= th.rack_residual_c))
        if rack_hot:
            evidence["cause"] = ("rack over its limits" if median_over > 0 else
                                 "rack throttling" if share >= th.peer_throttle_share else
                                 "rack hotter than its load explains")
            return DiagnosisResult(Diagnosis.ENVIRONMENTAL, evidence)
        evidence["cause"] = "hot while its rack runs as its load explains"
        return DiagnosisResult(Diagnosis.NODE_THERMAL, evidence)
    if not state.reports[rows].any() and not state.has_nic and not math.isfinite(state.nic_util):
        evidence["reason"] = "the sample reports none of the fields the diagnosis reads"
        return DiagnosisResult(Diagnosis.UNKNOWN, evidence)
    up, top = state.nvlink_links_up, state.nvlink_links_max
    down = np.isfinite(up) & np.isfinite(top) & (up < top)
    rate = state.nvlink_errors_per_min
    ports_down = [p for p, d in zip(state.nic_port, state.nic_port_down, strict=True) if d]
    evidence.update(nvlink_links_up=_num(float(np.nansum(up))) if np.isfinite(up).any() else None,
                    nvlink_links_max=_num(float(np.nansum(top))) if np.isfinite(top).any() else None,
                    nvlink_gpus_degraded=state.gpu[down].tolist(), nvlink_errors_per_min=_num(rate),
                    nvlink_errors_per_min_band=th.nvlink_errors_per_min, nic_ports_down=ports_down)
    if down.any() or rate > th.nvlink_errors_per_min or ports_down:
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
    if evidence["power_brake"]:
        evidence["reason"] = "hardware power brake: an external power signal, not a thermal cause"
    return DiagnosisResult(Diagnosis.UNKNOWN, evidence)


class Diagnoser(Stateful):
    """Diagnoses stragglers on demand from the table of node states (:class:`NodeStates`).

    ``observe(samples)`` feeds telemetry (a single runner, or a node stage): the table derives each
    node's state and publishes it when it changed or its heartbeat is due, and returns what it
    published; ``apply(states)`` feeds published states (a job stage reading ``fh.nodestate``).
    ``diagnose(node, gpu)`` runs :func:`diagnose_state` on the node's published state against its
    rack peers'. A node never seen gives ``UNKNOWN`` with ``evidence["telemetry"] = "missing"``.
    ``thresholds`` also sets how often a node's state is republished and each GPU's thermal model.
    """

    def __init__(self, *, thresholds: DiagnosisThresholds = DiagnosisThresholds()) -> None:
        self.thresholds = thresholds
        self.states = NodeStates(rule=thresholds.state_rule(), thermal=thresholds.thermal(),
                                 nic_bytes_per_tick=thresholds.nic_bytes_per_tick,
                                 power_cap_window_s=thresholds.power_cap_window_s)

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

    def update(self, batch: Batch, now: float) -> list[NodeState]:
        """The table's :meth:`NodeStates.update`: ``batch.telemetry`` observed, ``batch.states`` applied;
        returns the states published."""
        return self.states.update(expect(batch, self), now)

    def observe(self, samples: Iterable[Telemetry]) -> list[NodeState]:
        return self.states.observe(samples)

    def apply(self, states: Iterable[NodeState]) -> None:
        self.states.apply(states)

    def forget(self, jobs: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        """Drop the states of ``nodes`` (a node's state names no job)."""
        self.states.forget(jobs, nodes)

    def rack_of(self, node: str) -> str | None:
        """The rack ``node`` reports (None when unknown, or the node was never seen)."""
        state = self.states.published_.get(node)
        return None if state is None else known_rack(state.rack)

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
        rack = known_rack(state.rack)
        peers = [table[n] for n in sorted(self.states.racks_.get(rack, ()) if rack is not None else ()) if n != node
                 and (at is None or at - table[n].ts <= max_age)]
        result = diagnose_state(state, peers, gpu=gpu, thresholds=self.thresholds)
        share = self.states.power_cap_share(node, gpu, state.ts if at is None else at)
        if share is None:
            return result
        capped = share >= self.thresholds.power_capped_share
        result.evidence.update(power_cap_share=round(share, 4), power_cap_window_s=self.thresholds.power_cap_window_s,
                               power_capped=capped)
        if capped and result.diagnosis is Diagnosis.UNKNOWN:
            result.evidence["cause"] = "power cap"
            result.evidence["reason"] = (f"GPU held at its power cap {share:.0%} of the "
                                         f"{self.thresholds.power_cap_window_s:.0f} s before: a node power fault")
        return result


class RackEpisodes(Stateful):
    """Fold ``ENVIRONMENTAL`` stragglers of one rack into one finding per (job, rack) episode.

    ``update(Batch(findings=…, rack_of=…), now)`` (or ``check(findings, rack_of)``) passes every other
    finding through unchanged. The first
    ``ENVIRONMENTAL`` straggler of a rack opens an episode and is replaced by one rack finding
    (``detector="straggler.rack"``, ``rank``/``gpu`` None, ``evidence["rack"]``, the first
    straggler's rank, node and diagnosis evidence). Later ones in the same rack are absorbed
    (counted in ``episodes_``) until ``quiet_s`` of event time passes without one; then the next
    opens a new episode. Only ``ENVIRONMENTAL`` stragglers fold: one whose GPU has a node signature
    (hotter than its rack peers at the same power) is ``NODE_THERMAL`` and stays its own finding,
    whatever episode its rack is in. Findings whose rack is unknown pass through; a non-finite ``ts`` raises
    :class:`~fleethealth.errors.SchemaError`.
    """

    name = "straggler.rack"

    def __init__(self, *, quiet_s: float = 1800.0) -> None:
        self.quiet_s = quiet_s

    def update(self, batch: Batch, now: float) -> list[Finding]:
        """:meth:`check` of ``batch.findings`` with ``batch.rack_of`` (required; ``now`` is not read)."""
        batch = expect(batch, self)
        if batch.rack_of is None:
            if not batch.findings:
                return []
            raise TypeError("RackEpisodes.update needs Batch.rack_of: the rack each finding's node reports")
        return self.check(batch.findings, batch.rack_of)

    def check(self, findings: Sequence[Finding], rack_of: Callable[[str], str | None]) -> list[Finding]:
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

    def forget(self, jobs: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        """Close the episodes of ``jobs``, and drop ``nodes`` from the nodes each open episode lists."""
        gone_jobs, gone_nodes = names("jobs", jobs), names("nodes", nodes)
        if not getattr(self, "episodes_", None):
            return
        if gone_jobs:
            self.episodes_ = {k: v for k, v in self.episodes_.items() if k[0] not in gone_jobs}
        if gone_nodes:
            for ep in self.episodes_.values():
                ep["nodes"] -= gone_nodes

    def open_episodes(self) -> dict[str, int]:
        """Stragglers absorbed so far per rack (all jobs), for metrics and tests."""
        counts: dict[str, int] = {}
        for (_, rack), ep in getattr(self, "episodes_", {}).items():
            counts[rack] = counts.get(rack, 0) + ep["stragglers"]
        return counts
