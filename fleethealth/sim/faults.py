"""Fault signatures: what each injected fault does to compute times, telemetry and events.

Each kind is one function ``(fault, frame) -> None`` that edits a :class:`Frame` — the whole
fleet's state at one step as ``(nodes, gpus)`` arrays — in place. The signatures follow what
operators see on real fleets:

- ``thermal_straggler``: that GPU runs hot (≈ +26 °C), SW/HW thermal clock-event bits, SM clock
  down in proportion to the slowdown, compute slower.
- ``hot_aisle``: every GPU of the rack is ``temp_rise_c`` hotter, the hottest set the SW thermal
  bit, all of the rack's ranks mildly slower (between 60 % and 100 % of ``slowdown``).
- ``nvlink_degraded``: links down (12 of 18 active), CRC flit / replay / recovery counters
  climbing every step, the node's ranks slower.
- ``nic_contention``: the node's NIC port near saturation and waiting for credit
  (``port_xmit_wait`` climbing by :data:`CONTENDED_WAIT_SHARE` of the interval, the bytes sent by
  :data:`CONTENDED_UTIL` of the link rate; :class:`fleethealth.sim.FleetSim` integrates the
  counters), its ranks slower.
- ``ecc_precursor``: corrected-error rate rising, rows remapped (or, on a GPU that retires pages,
  pages retired), a remap (retirement) pending, then uncorrectable errors with Xid 63 / 48 / 64,
  the GPU lost (Xid 79) at ``fail_step`` and the job interrupted; the replacement GPU starts
  clean. The fault writes both repair mechanisms; the fleet then blanks (NaN) the one its GPU
  model does not have (:mod:`fleethealth.sim.gpus`: the default H100 retires no pages).
- ``hang``: the node's ranks stop reporting at ``step``; every rank's watchdog reports stacks;
  after ``duration_s`` the job is interrupted and restarts (``restart_s``).
- ``xid``: one Xid event.
- ``sdc_transient`` / ``sdc_deterministic``: failing in-job check records (the self-check sees
  the transient one; only the cross-rank replay sees the deterministic one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fleethealth.schema import ClockReason, Event, EventKind
from fleethealth.sim.scenario import FaultSpec

__all__ = ["Frame", "EFFECTS", "active", "sdc_failures", "CONTENDED_UTIL", "CONTENDED_WAIT_SHARE"]

CONTENDED_UTIL = 0.97
"""Share of the link rate a contended NIC port sends at."""
CONTENDED_WAIT_SHARE = 0.30
"""Share of the interval a contended port spends waiting for credit (``port_xmit_wait``)."""


@dataclass
class Frame:
    """The fleet at one step: everything a fault may change, as columnar arrays."""

    step: int
    ts: float
    job: str
    node_names: list[str]
    node_index: dict[str, int]
    rack_nodes: dict[str, np.ndarray]
    factor: np.ndarray  # (nodes, gpus) compute-time multiplier
    cols: dict[str, np.ndarray]  # GPU_FIELDS -> (nodes, gpus)
    nic: np.ndarray  # (nodes,)
    silent: np.ndarray  # (nodes, gpus) bool: rank does not report this step
    events: list[Event] = field(default_factory=list)
    rng: np.random.Generator = field(default_factory=np.random.default_rng)

    def gpus_of(self, fault: FaultSpec) -> tuple[int, slice | int]:
        gpu = fault.params.get("gpu")
        return self.node_index[fault["node"]], slice(None) if gpu is None else gpu


def active(fault: FaultSpec, step: int) -> bool:
    start = fault.params.get("start_step", fault.params.get("step", 0))
    end = fault.params.get("end_step")
    return step >= start and (end is None or step < end)


def _throttle(frame: Frame, where: tuple, slowdown: float, bits: ClockReason) -> None:
    frame.cols["clock_reasons"][where] = frame.cols["clock_reasons"][where].astype(np.int64) | int(bits)
    frame.cols["sm_clock_mhz"][where] = frame.cols["sm_clock_max_mhz"][where] / (1.0 + slowdown)


def _thermal_straggler(fault: FaultSpec, frame: Frame) -> None:
    if not active(fault, frame.step):
        return
    where = frame.gpus_of(fault)
    frame.factor[where] *= 1.0 + fault["slowdown"]
    frame.cols["temp_c"][where] += 26.0
    frame.cols["mem_temp_c"][where] += 18.0
    frame.cols["power_w"][where] *= 0.85
    _throttle(frame, where, fault["slowdown"], ClockReason.SW_THERMAL | ClockReason.HW_THERMAL)


def _hot_aisle(fault: FaultSpec, frame: Frame) -> None:
    if not active(fault, frame.step):
        return
    nodes = frame.rack_nodes[fault["rack"]]
    frame.cols["temp_c"][nodes] += fault["temp_rise_c"]
    frame.cols["mem_temp_c"][nodes] += fault["temp_rise_c"]
    share = frame.rng.uniform(0.6, 1.0, size=(len(nodes), frame.factor.shape[1]))
    slow = fault["slowdown"] * share
    frame.factor[nodes] *= 1.0 + slow
    bits = frame.cols["clock_reasons"][nodes].astype(np.int64) | int(ClockReason.SW_THERMAL)
    frame.cols["clock_reasons"][nodes] = bits
    frame.cols["sm_clock_mhz"][nodes] = frame.cols["sm_clock_max_mhz"][nodes] / (1.0 + slow)


def _nvlink_degraded(fault: FaultSpec, frame: Frame) -> None:
    if not active(fault, frame.step):
        return
    node, gpu = frame.gpus_of(fault)
    since = frame.step - fault["start_step"] + 1
    frame.factor[node, :] *= 1.0 + fault["slowdown"]
    frame.cols["nvlink_links_up"][node, gpu] = 12.0
    frame.cols["nvlink_crc_flit"][node, gpu] += 40.0 * since
    frame.cols["nvlink_replay"][node, gpu] += 15.0 * since
    frame.cols["nvlink_recovery"][node, gpu] += since // 10


def _nic_contention(fault: FaultSpec, frame: Frame) -> None:
    if not active(fault, frame.step):
        return
    node = frame.node_index[fault["node"]]
    frame.nic[node] = CONTENDED_UTIL
    frame.factor[node, :] *= 1.0 + fault["slowdown"]


def _ecc_precursor(fault: FaultSpec, frame: Frame) -> None:
    start, fail, step = fault["start_step"], fault["fail_step"], frame.step
    if not start <= step <= fail:
        return
    node, gpu = frame.gpus_of(fault)
    x = (step - start) / (fail - start)
    cols = frame.cols
    cols["ecc_sbe_volatile"][node, gpu] += np.floor(2000.0 * x**2)
    cols["ecc_sbe_aggregate"][node, gpu] += np.floor(2000.0 * x**2)
    cols["retired_sbe"][node, gpu] += np.floor(8.0 * x**2)
    cols["remap_correctable"][node, gpu] += np.floor(6.0 * x**1.5)
    cols["remap_pending"][node, gpu] = 1.0 if x > 0.6 else 0.0
    cols["retired_pending"][node, gpu] = 1.0 if x > 0.6 else 0.0
    if x > 0.85:
        dbe = np.floor(1 + 4.0 * (x - 0.85) / 0.15)
        cols["ecc_dbe_volatile"][node, gpu] += dbe
        cols["ecc_dbe_aggregate"][node, gpu] += dbe
        cols["retired_dbe"][node, gpu] += dbe
        cols["remap_uncorrectable"][node, gpu] += dbe
    prev = (step - 1 - start) / (fail - start)
    for threshold, code, text in ((0.7, 63, "row remapping event"), (0.88, 48, "double-bit ECC error"),
                                  (0.95, 64, "row remapping failure")):
        if prev < threshold <= x:
            frame.events.append(Event(node=fault["node"], ts=frame.ts, kind=EventKind.XID, job=frame.job,
                                      gpu=gpu, step=step, code=code, message=text))
    if step == fail:
        cols["remap_failure"][node, gpu] = 1.0
        frame.silent[node, gpu] = True
        frame.events.append(Event(node=fault["node"], ts=frame.ts, kind=EventKind.XID, job=frame.job, gpu=gpu,
                                  step=step, code=79, message="GPU has fallen off the bus"))


def _hang(fault: FaultSpec, frame: Frame) -> None:
    if frame.step == fault["step"]:
        frame.silent[frame.gpus_of(fault)] = True


def _xid(fault: FaultSpec, frame: Frame) -> None:
    if frame.step == fault["step"]:
        frame.events.append(Event(node=fault["node"], ts=frame.ts, kind=EventKind.XID, job=frame.job,
                                  gpu=fault["gpu"], step=frame.step, code=fault["code"],
                                  message=f"Xid {fault['code']}"))


def _none(fault: FaultSpec, frame: Frame) -> None:
    """SDC kinds change no telemetry: only the in-job checks see them (see :func:`sdc_failures`)."""


EFFECTS: dict[str, Callable[[FaultSpec, Frame], None]] = {
    "thermal_straggler": _thermal_straggler,
    "hot_aisle": _hot_aisle,
    "nvlink_degraded": _nvlink_degraded,
    "nic_contention": _nic_contention,
    "ecc_precursor": _ecc_precursor,
    "hang": _hang,
    "xid": _xid,
    "sdc_transient": _none,
    "sdc_deterministic": _none,
}


def sdc_failures(fault: FaultSpec, step: int, selfcheck_every: int, replay_every: int) -> str | None:
    """Which check fails at ``step`` for an SDC fault: ``"selfcheck"``, ``"replay"`` or None.

    A transient fault corrupts one computation: the first self-check at or after ``start_step``
    sees it, later ones pass. A deterministic fault computes the same wrong answer every time:
    self-checks pass (both runs agree) and every replay from ``start_step`` on fails.
    """
    if not fault.kind.startswith("sdc_"):
        return None
    start = fault["start_step"]
    if fault.kind == "sdc_transient" and step % selfcheck_every == 0:
        first = -(-start // selfcheck_every) * selfcheck_every
        return "selfcheck" if step == first else None
    if fault.kind == "sdc_deterministic" and step % replay_every == 0 and step >= start:
        return "replay"
    return None
