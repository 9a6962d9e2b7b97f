"""A node's state for diagnosis: derived from its telemetry, published when it changes.

The node stage reads every telemetry sample; the job stage, which diagnoses stragglers, reads only
:class:`~fleethealth.schema.NodeState` records (``fh.nodestate``, compacted, key node). This module
is the one place that turns samples into states and decides when a state has changed enough to be
published, so a single runner (which sees the samples itself) and the two stages diagnose from the
same states.

* :func:`node_state` — a pure function of a node's newest sample, the one before it (for counter
  rates: NVLink errors (:func:`nvlink_errors`, the worst GPU's per minute), NIC bytes and credit
  waits, ports gone down) and its GPUs' load power and thermal residual
  (:mod:`fleethealth.detectors.thermal`).
* :func:`changed` — whether a new state differs from the last published one in anything the
  diagnosis compares against a threshold: any GPU's temperature by ``temp_step_c`` or more (NVML
  reports whole degrees), its limit, its thermal, power-cap or power-brake clock bits, NVLink links up,
  the NVLink error rate crossing its band or moving by a tenth of it, a NIC port's utilisation or
  credit-wait share by ``share_step`` or crossing its band, a port going down, a GPU's thermal
  residual by ``temp_step_c`` or its power or load power by ``power_step_w``, the rack, the GPUs or ports present.
* :class:`NodeStates` — the table of published states, fed either with samples (a node stage or a
  single runner: it derives, publishes what changed and a heartbeat every ``heartbeat_s`` of event
  time per node) or with the published states themselves (a job stage reading ``fh.nodestate``).
  It keeps each node's power-cap history over ``power_cap_window_s`` (from the states it
  publishes or is given, which a power-cap change republishes; a new GPU set starts it again):
  :meth:`NodeStates.power_cap_share`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fleethealth.detectors.batch import Batch, expect
from fleethealth.detectors.state import StateError, Stateful, names
from fleethealth.detectors.thermal import ThermalModel, ThermalParams, observe_many
from fleethealth.detectors.window import TimeRows
from fleethealth.nodename import known_rack
from fleethealth.params import check_number
from fleethealth.schema import ClockReason, NodeState, Telemetry

__all__ = ["node_state", "changed", "changed_many", "StateRule", "NodeStates", "THERMAL_BITS", "STATE_BITS",
           "NVLINK_COUNTERS", "nvlink_errors", "zeroed", "stacked"]

THERMAL_BITS = int(ClockReason.thermal())
"""The clock-event bits that mean heat: a thermal diagnosis reads these and no others. The hardware
power brake is an external signal (a PSU or the rack's power controller), not a temperature."""
POWER_CAP_BIT = int(ClockReason.SW_POWER_CAP)
STATE_BITS = THERMAL_BITS | int(ClockReason.HW_POWER_BRAKE) | POWER_CAP_BIT
"""The bits whose change republishes a node's state (the diagnosis reports the brake and the power
cap in its evidence)."""
NVLINK_COUNTERS = ("nvlink_crc_flit", "nvlink_crc_data", "nvlink_replay", "nvlink_recovery")
_REPORTED = ("temp_c", "clock_reasons", "nvlink_links_up", "nvlink_replay")
_STACKED = tuple(dict.fromkeys((*_REPORTED, *NVLINK_COUNTERS, "power_w", "util_pct", "power_limit_w")))
"""The columns a poll's states stack, one row a sample: what a GPU reports, its NVLink errors, its clock bits."""


def zeroed(x: np.ndarray, nan: float = 0.0) -> np.ndarray:
    """``np.nan_to_num(x, nan=nan)`` of a float array, without that function's per-call look-ups of the
    float limits (the node stage calls it several times a sample): NaN becomes ``nan``; an infinity (which
    no decoded sample holds) takes :func:`numpy.nan_to_num`'s own path."""
    out = np.where(np.isnan(x), nan, x)
    return np.nan_to_num(x, nan=nan) if np.isinf(out).any() else out


def stacked(arrays: list[np.ndarray]) -> np.ndarray:
    """Arrays of one shape as the rows of one array (``np.stack``'s result, by one concatenation)."""
    return np.concatenate(arrays).reshape(len(arrays), *arrays[0].shape)


def nvlink_errors(columns: dict[str, np.ndarray]) -> np.ndarray:
    """Each GPU's NVLink error count: its CRC flit, CRC data, replay and recovery counters summed (a
    counter not reported counts 0). The one NVLink error measure: its growth per GPU per minute is
    the NVLink error rate the health rule (over its window), the diagnosis (between two samples)
    and, per hour, the failure predictor read."""
    total = np.zeros(np.shape(columns[NVLINK_COUNTERS[0]]))
    for name in NVLINK_COUNTERS:
        total += zeroed(columns[name])
    return total


def _nvlink_rate(sample: Telemetry, previous: Telemetry | None) -> float:
    """The node's worst GPU's NVLink errors per minute between the two samples (NaN without a usable
    earlier sample)."""
    if previous is None or previous.ts >= sample.ts or previous.gpu.shape != sample.gpu.shape:
        return math.nan
    delta = nvlink_errors(sample.columns) - nvlink_errors(previous.columns)
    grown = np.clip(delta, 0.0, None)  # a counter reset is not a negative rate
    return float(grown.max(initial=0.0)) * 60.0 / (sample.ts - previous.ts)


def _nvlink_rates(part: list[tuple[int, Telemetry, Telemetry | None]], cols: dict[str, np.ndarray]) -> np.ndarray:
    """:func:`_nvlink_rate` of each ``(index, sample, previous)`` of one GPU count at once (``cols``: the
    samples' columns stacked, one row a sample)."""
    rates = np.full(len(part), np.nan)
    have = [j for j, (_, s, p) in enumerate(part) if p is not None and p.ts < s.ts and p.gpu.shape == s.gpu.shape]
    if not have:
        return rates
    now = nvlink_errors(cols)[have]
    before = nvlink_errors({name: stacked([part[j][2].columns[name] for j in have])  # type: ignore[union-attr]
                            for name in NVLINK_COUNTERS})
    grown = np.clip(now - before, 0.0, None)  # a counter reset is not a negative rate
    dt = np.array([part[j][1].ts - part[j][2].ts for j in have])  # type: ignore[union-attr]
    rates[have] = grown.max(axis=1, initial=0.0) * 60.0 / dt
    return rates


_NIC_READ = ("tx_bytes", "rx_bytes", "xmit_wait", "link_downed", "up")


def _nics(part: list[tuple[int, Telemetry, Telemetry | None]],
          bytes_per_tick: float) -> list[tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray] | None]:
    """:func:`_nic` of each ``(index, sample, previous)`` at once where both samples have the same NIC ports
    (the usual case), grouped by port count; None for the rest (derived alone)."""
    out: list[tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray] | None] = [None] * len(part)
    groups: dict[int, list[int]] = {}
    for j, (_, s, p) in enumerate(part):
        if s.nic is not None and p is not None and p.nic is not None and p.ts < s.ts and p.nic.port == s.nic.port:
            groups.setdefault(len(s.nic.port), []).append(j)
    for rows in groups.values():
        now = {name: stacked([part[j][1].nic.columns[name] for j in rows])  # type: ignore[union-attr]
               for name in (*_NIC_READ, "link_gbps")}
        before = {name: stacked([part[j][2].nic.columns[name] for j in rows])  # type: ignore[union-attr]
                  for name in _NIC_READ}
        dt = np.array([part[j][1].ts - part[j][2].ts for j in rows])[:, None]  # type: ignore[union-attr]

        def delta(name: str) -> np.ndarray:
            d = now[name] - before[name]  # noqa: B023 — used within the iteration
            return np.where(d >= 0, d, np.nan)

        link = now["link_gbps"] * 1e9 / 8
        with np.errstate(invalid="ignore", divide="ignore"):
            util = np.fmax(delta("tx_bytes"), delta("rx_bytes")) / (link * dt)
            wait = delta("xmit_wait") * bytes_per_tick / (link * dt)
        util = np.where(link > 0, util, np.nan)
        wait = np.where(link > 0, np.minimum(wait, 1.0), np.nan)
        down = ((before["up"] == 1.0) & (now["up"] == 0.0)) | (delta("link_downed") > 0)
        for k, j in enumerate(rows):
            out[j] = (tuple(part[j][1].nic.port), util[k], wait[k], down[k])  # type: ignore[union-attr]
    return out


def _nic(sample: Telemetry, previous: Telemetry | None,
         bytes_per_tick: float) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]:
    """Per port: utilisation, credit-wait share and gone down between ``previous`` and ``sample``
    (NaN where a counter is missing or stepped back, e.g. after a probe restart)."""
    nic = sample.nic
    assert nic is not None
    ports = tuple(nic.port)
    before = previous.nic if previous is not None else None
    if before is None or previous is None or previous.ts >= sample.ts:
        n = len(ports)
        return ports, np.full(n, np.nan), np.full(n, np.nan), np.zeros(n, dtype=bool)
    dt = sample.ts - previous.ts
    index = {p: i for i, p in enumerate(before.port)}
    rows = [index.get(p, -1) for p in ports]
    have = np.array([r >= 0 for r in rows], dtype=bool)
    take = np.array([max(r, 0) for r in rows], dtype=np.int64)

    def delta(name: str) -> np.ndarray:
        d = nic.columns[name] - before.columns[name][take]
        return np.where(have & (d >= 0), d, np.nan)

    link = nic.columns["link_gbps"] * 1e9 / 8
    with np.errstate(invalid="ignore", divide="ignore"):
        util = np.fmax(delta("tx_bytes"), delta("rx_bytes")) / (link * dt)
        wait = delta("xmit_wait") * bytes_per_tick / (link * dt)
    util = np.where(link > 0, util, np.nan)
    wait = np.where(link > 0, np.minimum(wait, 1.0), np.nan)
    up_now, up_before = nic.columns["up"], before.columns["up"][take]
    went_down = have & (((up_before == 1.0) & (up_now == 0.0)) | (delta("link_downed") > 0))
    return ports, util, wait, went_down


def node_state(sample: Telemetry, previous: Telemetry | None = None, *, power_w: np.ndarray | None = None,
               load_power_w: np.ndarray | None = None, residual_c: np.ndarray | None = None,
               nic_bytes_per_tick: float = 8.0, reports: np.ndarray | None = None,
               nvlink_rate: float | None = None,
               nic_ports: tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray] | None = None) -> NodeState:
    """The state of ``sample.node`` at ``sample.ts``; ``previous`` is its sample before (for rates);
    ``power_w`` / ``load_power_w`` / ``residual_c`` its GPUs' power over the thermal model's fast
    average, load power and thermal residual (:class:`ThermalModel`; the sample's power and NaN when
    not given). ``reports`` (what each GPU reports), ``nvlink_rate`` (:func:`nvlink_errors`' rate
    against ``previous``) and ``nic_ports`` (each port's utilisation, credit-wait share and going down) are
    derived here unless given (a poll's are derived at once: :class:`NodeStates`)."""
    cols = sample.columns
    if reports is None:
        reports = np.zeros(sample.gpu.shape, dtype=bool)
        for name in _REPORTED:
            reports |= np.isfinite(cols[name])
    nic: dict[str, object] = {}
    if sample.nic is not None:
        port, util, wait, down = nic_ports if nic_ports is not None else _nic(sample, previous, nic_bytes_per_tick)
        nic = {"has_nic": True, "nic_port": port, "nic_port_util": util, "nic_port_wait": wait, "nic_port_down": down}
    return NodeState(node=sample.node, rack=sample.rack, ts=sample.ts, gpu=sample.gpu, temp_c=cols["temp_c"],
                     slowdown_temp_c=cols["slowdown_temp_c"], clock_reasons=cols["clock_reasons"],
                     nvlink_links_up=cols["nvlink_links_up"], nvlink_links_max=cols["nvlink_links_max"],
                     reports=reports, nic_util=sample.nic_util,
                     nvlink_errors_per_min=_nvlink_rate(sample, previous) if nvlink_rate is None else nvlink_rate,
                     power_w=cols["power_w"] if power_w is None else power_w,
                     load_power_w=cols["power_w"] if load_power_w is None else load_power_w,
                     residual_c=np.full(sample.gpu.shape, np.nan) if residual_c is None else residual_c,
                     **nic)  # type: ignore[arg-type]


@dataclass(frozen=True)
class StateRule:
    """When a node's state is published (:func:`changed`) and how often regardless (``heartbeat_s``)."""

    heartbeat_s: float = 5.0
    temp_step_c: float = 1.0
    power_step_w: float = 20.0
    share_step: float = 0.05
    nvlink_errors_per_min: float = 10.0
    """The diagnosis's NVLink band (``DiagnosisThresholds.nvlink_errors_per_min``)."""
    nic_util_band: float = 0.85
    nic_xmit_wait_band: float = 0.10

    def __post_init__(self) -> None:
        check_number("heartbeat_s", self.heartbeat_s, above=0, owner=self)
        for name in ("temp_step_c", "power_step_w", "share_step"):
            check_number(name, getattr(self, name), above=0, owner=self)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))


def _moved(a: np.ndarray, b: np.ndarray, step: float) -> bool:
    """Some value appeared, disappeared or moved by ``step`` or more."""
    fa, fb = np.isfinite(a), np.isfinite(b)
    if not np.array_equal(fa, fb):
        return True
    both = fa & fb
    return bool((np.abs(a[both] - b[both]) >= step).any())


def _crossed(a: np.ndarray, b: np.ndarray, band: float) -> bool:
    return not np.array_equal(zeroed(a, -1.0) > band, zeroed(b, -1.0) > band)


def _bits(reasons: np.ndarray) -> np.ndarray:
    return zeroed(reasons).astype(np.int64) & STATE_BITS


def changed(old: NodeState | None, new: NodeState, rule: StateRule = StateRule()) -> bool:
    """Whether ``new`` differs from the published ``old`` in anything the diagnosis reads (see the module)."""
    if old is None:
        return True
    if old.rack != new.rack or not _same(old.gpu, new.gpu) or old.nic_port != new.nic_port \
            or old.has_nic != new.has_nic or not _same(old.reports, new.reports):
        return True
    if _moved(old.temp_c, new.temp_c, rule.temp_step_c) or not _same(old.slowdown_temp_c, new.slowdown_temp_c) \
            or not _same(_bits(old.clock_reasons), _bits(new.clock_reasons)) \
            or not _same(old.nvlink_links_up, new.nvlink_links_up) \
            or not _same(old.nvlink_links_max, new.nvlink_links_max):
        return True
    rates = np.array([old.nvlink_errors_per_min]), np.array([new.nvlink_errors_per_min])
    if _crossed(*rates, rule.nvlink_errors_per_min) or _moved(*rates, 0.1 * rule.nvlink_errors_per_min):
        return True
    if _moved(old.residual_c, new.residual_c, rule.temp_step_c) \
            or _moved(old.load_power_w, new.load_power_w, rule.power_step_w) \
            or _moved(old.power_w, new.power_w, rule.power_step_w):
        return True
    utils = np.array([old.nic_util, *old.nic_port_util]), np.array([new.nic_util, *new.nic_port_util])
    waits = old.nic_port_wait, new.nic_port_wait
    return (_moved(*utils, rule.share_step) or _crossed(*utils, rule.nic_util_band)
            or _moved(*waits, rule.share_step) or _crossed(*waits, rule.nic_xmit_wait_band)
            or not _same(old.nic_port_down, new.nic_port_down))


class _Ragged(Exception):
    """Arrays of one field that do not all have the shape the pairs share (judged one pair at a time)."""


def _rows(states: list[NodeState], name: str, width: int) -> np.ndarray:
    arrays = [getattr(s, name) for s in states]
    if {a.shape for a in arrays} != {(width,)}:
        raise _Ragged(name)
    return stacked(arrays)


def _same_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """:func:`_same` of each row pair (rows of one shape)."""
    eq = a == b
    if a.dtype.kind == "f":
        eq |= np.isnan(a) & np.isnan(b)
    return eq.all(axis=1)


def _moved_rows(a: np.ndarray, b: np.ndarray, step: float) -> np.ndarray:
    """:func:`_moved` of each row pair."""
    fa, fb = np.isfinite(a), np.isfinite(b)
    with np.errstate(invalid="ignore"):
        far = np.abs(a - b) >= step
    return (fa != fb).any(axis=1) | (far & fa & fb).any(axis=1)


def _crossed_rows(a: np.ndarray, b: np.ndarray, band: float) -> np.ndarray:
    return ((zeroed(a, -1.0) > band) != (zeroed(b, -1.0) > band)).any(axis=1)


def changed_many(olds: list[NodeState], news: list[NodeState], rule: StateRule = StateRule()) -> np.ndarray:
    """:func:`changed` of each ``(old, new)`` pair, in NumPy passes over the stacked arrays of the pairs of one
    GPU count and one port count (a pair whose two states differ in either, has no ``old``, or has an array of
    another length is judged by :func:`changed` itself). One bool a pair, each what :func:`changed` gives."""
    out = np.ones(len(news), dtype=bool)
    shapes: dict[tuple[int, int], list[int]] = {}
    alone: list[int] = []
    for j, (o, s) in enumerate(zip(olds, news, strict=True)):
        if o is None or o.gpu.size != s.gpu.size or len(o.nic_port) != len(s.nic_port):
            alone.append(j)
        else:
            shapes.setdefault((s.gpu.size, len(s.nic_port)), []).append(j)
    for (n, p), rows in shapes.items():
        try:
            out[rows] = _changed_rows([olds[j] for j in rows], [news[j] for j in rows], n, p, rule)
        except _Ragged:
            alone += rows
    for j in alone:
        out[j] = changed(olds[j], news[j], rule)
    return out


def _changed_rows(old: list[NodeState], new: list[NodeState], n: int, p: int, rule: StateRule) -> np.ndarray:
    """:func:`changed` of pairs whose states have ``n`` GPUs and ``p`` ports (raises :class:`_Ragged` on an
    array of another length)."""
    def rows(name: str) -> tuple[np.ndarray, np.ndarray]:
        width = p if name.startswith("nic_port") else n
        return _rows(old, name, width), _rows(new, name, width)

    same = np.fromiter((o.rack == s.rack and o.nic_port == s.nic_port and o.has_nic == s.has_nic
                        for o, s in zip(old, new, strict=True)), dtype=bool, count=len(new))
    for name in ("gpu", "reports", "slowdown_temp_c", "nvlink_links_up", "nvlink_links_max", "nic_port_down"):
        same &= _same_rows(*rows(name))
    same &= _same_rows(*map(_bits, rows("clock_reasons")))
    moved = _moved_rows(*rows("temp_c"), rule.temp_step_c)
    rates = (np.array([o.nvlink_errors_per_min for o in old], dtype=np.float64)[:, None],
             np.array([s.nvlink_errors_per_min for s in new], dtype=np.float64)[:, None])
    moved |= _crossed_rows(*rates, rule.nvlink_errors_per_min) | _moved_rows(*rates, 0.1 * rule.nvlink_errors_per_min)
    moved |= _moved_rows(*rows("residual_c"), rule.temp_step_c)
    moved |= _moved_rows(*rows("load_power_w"), rule.power_step_w) | _moved_rows(*rows("power_w"), rule.power_step_w)
    port_utils = rows("nic_port_util")
    utils = tuple(np.concatenate([np.array([x.nic_util for x in side], dtype=np.float64)[:, None], ports], axis=1)
                  for side, ports in zip((old, new), port_utils, strict=True))
    waits = rows("nic_port_wait")
    moved |= _moved_rows(*utils, rule.share_step) | _crossed_rows(*utils, rule.nic_util_band)
    moved |= _moved_rows(*waits, rule.share_step) | _crossed_rows(*waits, rule.nic_xmit_wait_band)
    return ~same | moved


class NodeStates(Stateful):
    """The table of published node states, and the per-node telemetry bookkeeping that derives them.

    ``observe(samples)`` (a node stage or a single runner): each sample newer than the node's last is
    turned into a state (:func:`node_state`, against the sample before it and the node's baseline);
    the state is published — kept in ``published_`` and returned — when it :func:`changed` or
    ``rule.heartbeat_s`` of event time passed since the node's last one. Older or repeated samples are
    counted in ``stale_total_`` and ignored. ``apply(states)`` (a job stage): take published states
    as they come from ``fh.nodestate`` (an older one than the node's is ignored).

    ``thermal`` sets each node's :class:`~fleethealth.detectors.thermal.ThermalModel` (kept in
    ``thermal_``), which gives every state its GPUs' load power and thermal residual. ``racks_``
    groups the nodes by the rack they report; a node whose rack is unknown
    (:func:`~fleethealth.nodename.known_rack`) is in no group: it has no rack peers.
    """

    def __init__(self, *, rule: StateRule | None = None, thermal: ThermalParams | None = None,
                 nic_bytes_per_tick: float = 8.0, power_cap_window_s: float = 600.0) -> None:
        self.rule = rule if rule is not None else StateRule()
        self.thermal = thermal if thermal is not None else ThermalParams()
        self.nic_bytes_per_tick = nic_bytes_per_tick
        self.power_cap_window_s = check_number("power_cap_window_s", power_cap_window_s, above=0)
        # node -> power-capped per GPU of its states, from the last before the window on, and its GPU ids (a
        # new GPU set starts the window again)
        self.power_cap_: dict[str, TimeRows] = {}
        self.power_cap_gpu_: dict[str, np.ndarray] = {}
        self.published_: dict[str, NodeState] = {}
        self.racks_: dict[str, set[str]] = {}
        self.latest_: dict[str, Telemetry] = {}
        self.thermal_: dict[str, ThermalModel] = {}
        self.stale_total_ = 0
        self.samples_total_ = 0
        self.published_total_ = 0

    def update(self, batch: Batch, now: float) -> list[NodeState]:
        """:meth:`observe` of ``batch.telemetry`` (returns the states it published), then :meth:`apply` of
        ``batch.states`` (a state already in the table — the same object, as the job-stage pipelines of
        one replica share the table — is not news and is skipped). ``now`` is not read."""
        batch = expect(batch, self)
        out = self.observe(batch.telemetry) if batch.telemetry else []
        if batch.states:
            table = self.published_
            self.apply([s for s in batch.states if table.get(s.node) is not s])
        return out

    def observe(self, samples: Iterable[Telemetry]) -> list[NodeState]:
        """Derive the states of ``samples`` (in event-time order) and return those published, in order.

        One sample is derived alone (:func:`node_state`, :func:`changed`); a poll's are derived a wave at
        a time — the first sample of each node in the poll, then the second, ... — with the per-GPU parts
        (what the GPUs report, the NVLink error rate, the thermal clock bits) computed in one NumPy pass
        over the wave's samples of one GPU count. Both give the same states."""
        samples = samples if isinstance(samples, list | tuple) else list(samples)
        if len(samples) < 2:
            return [state for state in map(self._observe_one, samples) if state is not None]
        waves: list[list[tuple[int, Telemetry, Telemetry | None]]] = []
        depth: dict[str, int] = {}
        latest = self.latest_
        for i, sample in enumerate(samples):
            last = latest.get(sample.node)
            if last is not None and sample.ts <= last.ts:
                self.stale_total_ += 1
                continue
            self.samples_total_ += 1
            latest[sample.node] = sample
            k = depth[sample.node] = depth.get(sample.node, -1) + 1
            if k == len(waves):
                waves.append([])
            waves[k].append((i, sample, last))
        out: list[tuple[int, NodeState]] = []
        for wave in waves:
            out += self._wave(wave)
        out.sort(key=lambda pair: pair[0])
        return [state for _, state in out]

    def _observe_one(self, sample: Telemetry) -> NodeState | None:
        last = self.latest_.get(sample.node)
        if last is not None and sample.ts <= last.ts:
            self.stale_total_ += 1
            return None
        self.samples_total_ += 1
        self.latest_[sample.node] = sample
        power, load, residual = self._thermal(sample)
        state = node_state(sample, last, power_w=power, load_power_w=load, residual_c=residual,
                           nic_bytes_per_tick=self.nic_bytes_per_tick)
        return self._publish(state)

    def _publish(self, state: NodeState) -> NodeState | None:
        """Publish ``state`` when it :func:`changed` or its node's heartbeat is due."""
        old = self.published_.get(state.node)
        if old is None or state.ts - old.ts >= self.rule.heartbeat_s or changed(old, state, self.rule):
            self._put(state)
            return state
        return None

    def _wave(self, wave: list[tuple[int, Telemetry, Telemetry | None]]) -> list[tuple[int, NodeState]]:
        """Samples of distinct nodes (``(index, sample, the node's sample before)``), derived columnar per
        GPU count: :func:`node_state`'s per-GPU parts in one pass over the stacked columns."""
        shapes: dict[tuple[int, ...], list[int]] = {}
        for j, (_, sample, _) in enumerate(wave):
            shapes.setdefault(sample.gpu.shape, []).append(j)
        out: list[tuple[int, NodeState]] = []
        for rows in shapes.values():
            part = [wave[j] for j in rows]
            samples = [sample for _, sample, _ in part]
            cols = {name: stacked([s.columns[name] for s in samples]) for name in _STACKED}
            reports = np.zeros(cols["temp_c"].shape, dtype=bool)
            for name in _REPORTED:
                reports |= np.isfinite(cols[name])
            thermal = (zeroed(cols["clock_reasons"]).astype(np.int64) & THERMAL_BITS) != 0
            rates = _nvlink_rates(part, cols)
            models = [self._model(s.node) for s in samples]
            power, load, residual = observe_many(models, [s.ts for s in samples], cols["temp_c"], cols["power_w"],
                                                 cols["util_pct"], cols["power_limit_w"], thermal)
            nics = _nics(part, self.nic_bytes_per_tick)
            states = [node_state(sample, last, power_w=power[j], load_power_w=load[j], residual_c=residual[j],
                                 nic_bytes_per_tick=self.nic_bytes_per_tick, reports=reports[j],
                                 nvlink_rate=float(rates[j]), nic_ports=nics[j])
                      for j, (_, sample, last) in enumerate(part)]
            # published when new, due (heartbeat) or changed: the changes judged for the wave at once
            olds = [self.published_.get(state.node) for state in states]
            beat = self.rule.heartbeat_s
            publish = [old is None or state.ts - old.ts >= beat for old, state in zip(olds, states, strict=True)]
            judge = [j for j, due in enumerate(publish) if not due]
            if judge:
                for j, moved in zip(judge, changed_many([olds[j] for j in judge], [states[j] for j in judge],
                                                        self.rule).tolist(), strict=True):
                    publish[j] = moved
            capped = (zeroed(cols["clock_reasons"]).astype(np.int64) & POWER_CAP_BIT) != 0
            for j, ((i, _, _), state) in enumerate(zip(part, states, strict=True)):
                if publish[j]:
                    self._put(state, capped[j].copy())
                    out.append((i, state))
        return out

    def apply(self, states: Iterable[NodeState]) -> None:
        for state in states:
            old = self.published_.get(state.node)
            if old is not None and state.ts <= old.ts:
                self.stale_total_ += 1
                continue
            self._put(state)

    def _put(self, state: NodeState, capped: np.ndarray | None = None) -> None:
        """Keep ``state`` as its node's published one; ``capped``: its GPUs' power-cap bits (a wave's are
        computed at once)."""
        old = self.published_.get(state.node)
        if old is not None and old.rack != state.rack:
            self._leave(state.node, old.rack)
        self.published_[state.node] = state
        if capped is None:
            capped = (zeroed(state.clock_reasons).astype(np.int64) & POWER_CAP_BIT) != 0
        hist = self.power_cap_.get(state.node)
        gpus = self.power_cap_gpu_.get(state.node)
        if hist is None or gpus is None or gpus.dtype != state.gpu.dtype or gpus.tobytes() != state.gpu.tobytes():
            hist = self.power_cap_[state.node] = TimeRows(state.gpu.shape, dtype=bool)
            self.power_cap_gpu_[state.node] = state.gpu.copy()
        hist.append(float(state.ts), capped)
        hist.keep_covering(state.ts - self.power_cap_window_s)
        rack = known_rack(state.rack)
        if rack is not None:
            self.racks_.setdefault(rack, set()).add(state.node)
        self.published_total_ += 1

    def _leave(self, node: str, rack: str) -> None:
        peers = self.racks_.get(rack)
        if peers is not None:
            peers.discard(node)
            if not peers:
                del self.racks_[rack]

    def _model(self, node: str) -> ThermalModel:
        model = self.thermal_.get(node)
        if model is None:
            model = self.thermal_[node] = ThermalModel(self.thermal)
        return model

    def _thermal(self, sample: Telemetry,
                 thermal: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        model = self._model(sample.node)
        cols = sample.columns
        if thermal is None:  # each GPU's thermal clock bits (a poll's are computed at once)
            thermal = (zeroed(cols["clock_reasons"]).astype(np.int64) & THERMAL_BITS) != 0
        load, residual = model.observe(sample.ts, cols["temp_c"], cols["power_w"], cols["util_pct"],
                                      cols["power_limit_w"], thermal)
        return model.fast_.copy(), load, residual

    def _state_restored(self, like: object) -> None:
        for node, rows in getattr(self, "power_cap_", {}).items():
            gpus = getattr(self, "power_cap_gpu_", {}).get(node)
            if not isinstance(rows, TimeRows) or not isinstance(gpus, np.ndarray) or rows.shape != gpus.shape:
                raise StateError(f"node states: the power-cap window of {node!r} does not fit its GPUs")

    def power_cap_share(self, node: str, gpu: int | None, at: float) -> float | None:
        """The share of the ``power_cap_window_s`` before event time ``at`` in which ``gpu`` of ``node``
        (any of its GPUs when None) had its power-cap clock-event bit set, each state holding until the
        next; None when no state of the node covers any of the window."""
        hist = self.power_cap_.get(node)
        if hist is None or not len(hist):
            return None
        ts = hist.ts
        ends = np.append(ts[1:], at)
        width = np.clip(np.minimum(ends, at) - np.maximum(ts, at - self.power_cap_window_s), 0.0, None)
        rows = hist.rows if gpu is None else hist.rows[:, self.power_cap_gpu_[node] == gpu]
        # summed in order (cumsum), as one state after another
        covered = float(np.cumsum(width)[-1])
        capped = float(np.cumsum(width * rows.any(axis=1))[-1])
        return None if covered <= 0 else capped / covered

    def forget(self, jobs: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        """Drop every trace of ``nodes`` (a node's state names no job)."""
        names("jobs", jobs)
        for node in names("nodes", nodes):
            self.power_cap_.pop(node, None)
            self.power_cap_gpu_.pop(node, None)
            self.latest_.pop(node, None)
            self.thermal_.pop(node, None)
            state = self.published_.pop(node, None)
            if state is not None:
                self._leave(node, state.rack)
