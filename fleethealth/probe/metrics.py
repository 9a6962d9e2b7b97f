"""The probe's Prometheus endpoint (default port 9402; dcgm-exporter keeps 9400).

Two ways to name the GPU metrics (the table is :data:`fleethealth.probe.fields.FIELDS`):

- **default** — the probe's own names, ``fleethealth_gpu_<name>_<unit>`` in base units (counters
  end in ``_total``) with labels ``gpu, UUID, pci_bus_id, device, modelName, Hostname``. They
  never collide with dcgm-exporter, which GPU Operator deploys on every GPU node, so Prometheus
  does not hold two series per GPU under one name and the official dashboard's sums do not double.
  Xid errors are a *counter* per GPU and code, ``fleethealth_gpu_xid_errors_total{xid="79"}``:
  dcgm-exporter's Xid gauge holds the last code, so a second Xid 79 is invisible there. Clock
  events are a counter per GPU and reason, ``fleethealth_gpu_clock_events_total{reason="sw_power_cap"}``:
  how many times the reason's bit went from clear to set between samples (set in the first sample
  counts once). Both start at 0 for every GPU the probe reports — every code of the Xid rulebook
  (:data:`fleethealth.xid.XID_CATALOG`) and every :class:`~fleethealth.schema.ClockReason` — so
  a rate or an alert on them never reads a blank series before the first event.
- **dcgm-exporter compatibility** (``compat=True``; ``--dcgm-exporter-compat``) — for fleets that
  run the probe *instead of* dcgm-exporter: its ``DCGM_FI_*`` names, values in its units, its
  Prometheus types (counters as counters, without a ``_total`` suffix) and its label set
  ``gpu, UUID, pci_bus_id, device, modelName, Hostname`` plus ``DCGM_FI_DRIVER_VERSION``
  (dcgm-exporter's ``label`` field), and ``DCGM_FI_DEV_XID_ERRORS``: the last Xid code per GPU
  (0 before any) with ``err_code`` and ``err_msg``. dcgm-exporter 4.x releases spell the host
  label ``Hostname``; its main branch renamed it ``hostname`` in May 2026, after its 4.6 release.

``device`` is ``nvidia<gpu index>`` as dcgm-exporter writes it. A field the source does not report
(NaN) is left out rather than exported as NaN. The probe's own health is ``fleethealth_probe_*``
in both modes (counters end in ``_total``); NIC ports are ``fleethealth_nic_*`` with labels
``port, kind, Hostname``.

The text is rendered here (Prometheus text format 0.0.4) rather than by ``prometheus_client``,
whose counters always gain a ``_total`` suffix that dcgm-exporter's counters do not have.
:meth:`ProbeMetrics.render` returns the page and :meth:`ProbeMetrics.serve` serves it, with
``/healthz`` beside it (:mod:`fleethealth.endpoints`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from http.server import ThreadingHTTPServer

import numpy as np

from fleethealth import buildinfo
from fleethealth.endpoints import Endpoints
from fleethealth.probe.fields import DCGM_XID_METRIC, FIELDS, XID_METRIC
from fleethealth.schema import NIC_FIELDS, ClockReason, Event, EventKind, Telemetry
from fleethealth.xid import XID_CATALOG

__all__ = ["ProbeMetrics", "ProbeHealth", "MetricFamily", "DEFAULT_PORT", "GPU_LABELS", "CONTENT_TYPE",
           "XID_MESSAGES"]

DEFAULT_PORT = 9402
GPU_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname")
"""Labels of every per-GPU series, in dcgm-exporter's order."""
DRIVER_LABEL = "DCGM_FI_DRIVER_VERSION"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
XID_MESSAGES: dict[int, str] = {
    0: "No Error", 13: "Graphics Engine Exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
    48: "Double Bit ECC Error", 61: "Internal micro-controller breakpoint/warning",
    62: "Internal micro-controller halt", 63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure", 74: "NVLINK Error",
    79: "GPU has fallen off the bus", 92: "High single-bit ECC error rate", 94: "Contained ECC error",
    95: "Uncontained ECC error", 119: "GSP RPC Timeout", 120: "GSP Error",
}
"""``err_msg`` of dcgm-exporter's Xid series for the Xids a training fleet meets; others read ``Unknown Error``."""
CLOCK_EVENTS_METRIC = "fleethealth_gpu_clock_events_total"
_REASONS: tuple[ClockReason, ...] = tuple(ClockReason)
_REASON_BITS = np.array([int(r) for r in _REASONS], dtype=np.int64)

_NIC_METRICS: dict[str, tuple[str, bool, float]] = {
    "up": ("fleethealth_nic_up", False, 1.0),
    "link_gbps": ("fleethealth_nic_link_speed_bytes_per_second", False, 1e9 / 8),
    "tx_bytes": ("fleethealth_nic_transmit_bytes_total", True, 1.0),
    "rx_bytes": ("fleethealth_nic_receive_bytes_total", True, 1.0),
    "xmit_wait": ("fleethealth_nic_transmit_wait_ticks_total", True, 1.0),
    "rx_errors": ("fleethealth_nic_receive_errors_total", True, 1.0),
    "symbol_errors": ("fleethealth_nic_symbol_errors_total", True, 1.0),
    "link_downed": ("fleethealth_nic_link_downed_total", True, 1.0),
    "link_recovery": ("fleethealth_nic_link_recoveries_total", True, 1.0),
}


@dataclass(frozen=True, slots=True)
class ProbeHealth:
    """A snapshot of the probe's own counters (``*_total``) and gauges, rendered as ``fleethealth_probe_*``."""

    samples_total: int = 0
    sample_errors_total: int = 0
    stalls_total: int = 0
    stalled: int = 0
    sample_duration_seconds: float = math.nan
    datagrams_total: int = 0
    datagrams_garbage_total: int = 0
    datagrams_late_total: int = 0
    step_batches_total: int = 0
    step_batches_incomplete_total: int = 0
    events_total: int = 0
    spool_records: int = 0
    spool_bytes: int = 0
    spool_dropped_total: int = 0
    spool_dropped_bytes_total: int = 0
    delivered_total: int = 0
    delivery_failures_total: int = 0
    bus_connected: int = 0
    datagrams_refused_total: int = 0
    datagrams_oversize_total: int = 0
    events_limited_total: int = 0
    ranks_limited_total: int = 0
    gpu_stalls_total: int = 0
    gpus_stalled: int = 0


_HELP = {
    "samples_total": "telemetry samples taken",
    "sample_errors_total": "sample calls that raised",
    "stalls_total": "times a telemetry source did not answer within the stall timeout",
    "stalled": "1 while the telemetry source is stalled",
    "sample_duration_seconds": "duration of the last sample call",
    "datagrams_total": "datagrams received from training processes",
    "datagrams_garbage_total": "datagrams dropped as malformed",
    "datagrams_late_total": "datagrams for a step already emitted",
    "step_batches_total": "step batches emitted",
    "step_batches_incomplete_total": "step batches emitted at the completeness timeout",
    "events_total": "events accepted for delivery",
    "spool_records": "records waiting in the spool",
    "spool_bytes": "bytes waiting in the spool",
    "spool_dropped_total": "records dropped (oldest first) beyond the spool bound",
    "spool_dropped_bytes_total": "bytes dropped beyond the spool bound",
    "delivered_total": "records acknowledged by the broker",
    "delivery_failures_total": "failed delivery attempts (broker unreachable or refusing)",
    "bus_connected": "1 while a producer is connected to the broker",
    "datagrams_refused_total": "datagrams refused for their sender's credentials (uid and gid not admitted)",
    "datagrams_oversize_total": "datagrams dropped unread beyond probe.socket_max_bytes",
    "events_limited_total": "event datagrams dropped beyond a job's (or the node's) event rate limit",
    "ranks_limited_total": "step datagrams dropped beyond probe.socket_max_ranks ranks in one step",
    "gpu_stalls_total": "times one GPU's driver calls did not answer within probe.gpu_timeout_s (its siblings kept "
                        "reporting)",
    "gpus_stalled": "GPUs whose driver call is stuck now, left out of the samples until it returns",
}


@dataclass(slots=True)
class MetricFamily:
    """One metric: its exact ``name``, Prometheus ``type`` (``gauge`` or ``counter``), help text and
    samples as ``(labels, value)``. The sample name is the family name, suffix and all."""

    name: str
    type: str
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def render(self) -> str:
        lines = [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.type}"]
        for labels, value in self.samples:
            body = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
            lines.append(f"{self.name}{{{body}}} {_number(value)}" if body else f"{self.name} {_number(value)}")
        return "\n".join(lines) + "\n"


class ProbeMetrics:
    """Prometheus view of one node: the latest telemetry, Xid counts, NIC ports and the probe's health.

    ``compat`` selects dcgm-exporter's names and types (see the module docstring);
    ``driver_version`` fills its ``DCGM_FI_DRIVER_VERSION`` label.
    """

    def __init__(self, hostname: str, *, health: Callable[[], ProbeHealth] | None = None, compat: bool = False,
                 driver_version: str = "") -> None:
        self.hostname = hostname
        self.compat = compat
        self.driver_version = driver_version
        self._health = health or ProbeHealth
        self._lock = threading.Lock()
        self._latest: Telemetry | None = None
        self._xid: dict[tuple[str, str], int] = {}  # (gpu, code) -> Xids seen
        self._last_xid: dict[int, int] = {}
        self._clock_bits: dict[int, int] = {}  # gpu -> its clock-event reason bits in the last sample
        self._clock_events: dict[int, np.ndarray] = {}  # gpu -> times each reason was set, per _REASONS

    def set_health(self, health: Callable[[], ProbeHealth]) -> None:
        self._health = health

    def observe(self, telemetry: Telemetry) -> None:
        raw = telemetry.columns["clock_reasons"]
        known = ~np.isnan(raw)
        bits = np.where(known, raw, 0.0).astype(np.int64)
        with self._lock:
            self._latest = telemetry
            prev = np.array([self._clock_bits.get(int(g), 0) for g in telemetry.gpu.tolist()], dtype=np.int64)
            rising = (bits[:, None] & ~prev[:, None] & _REASON_BITS[None, :]) != 0  # (gpus, reasons)
            for i, g in enumerate(telemetry.gpu.tolist()):
                counts = self._clock_events.setdefault(int(g), np.zeros(len(_REASONS), dtype=np.int64))
                if known[i]:  # an unread field says nothing: the GPU keeps its last bits
                    counts += rising[i]
                    self._clock_bits[int(g)] = int(bits[i])

    def count_event(self, event: Event) -> None:
        if event.kind is not EventKind.XID or event.code is None:
            return
        key = ("" if event.gpu is None else str(event.gpu), str(event.code))
        with self._lock:
            self._xid[key] = self._xid.get(key, 0) + 1
            if event.gpu is not None:
                self._last_xid[event.gpu] = int(event.code)

    # ------------------------------------------------------------ rendering
    def families(self) -> list[MetricFamily]:
        """Every metric of the page, in order: GPU fields, Xid, NIC ports, probe health."""
        with self._lock:
            latest = self._latest
            xid = dict(self._xid)
            last_xid = dict(self._last_xid)
            clock_events = {g: c.copy() for g, c in self._clock_events.items()}
        out: list[MetricFamily] = []
        gpu_labels: list[dict[str, str]] = []
        if latest is not None:
            gpu_labels = [self._gpu_labels(latest, i) for i in range(latest.gpu.size)]
            for spec in FIELDS:
                if self.compat and spec.dcgm_metric is None:
                    continue
                if self.compat:
                    family = MetricFamily(spec.dcgm_metric or "", spec.dcgm_type, spec.help)
                    scale = 1.0
                else:
                    family = MetricFamily(spec.metric, "counter" if spec.counter else "gauge", spec.help)
                    scale = spec.scale
                for i, value in enumerate(latest.columns[spec.column]):
                    if not math.isnan(value):
                        family.samples.append((gpu_labels[i], float(value) * scale))
                out.append(family)
        if self.compat:
            family = MetricFamily(DCGM_XID_METRIC, "gauge", "Value of the last XID error encountered.")
            if latest is not None:
                for i, g in enumerate(latest.gpu.tolist()):
                    code = last_xid.get(int(g), 0)
                    labels = {**gpu_labels[i], "err_code": str(code),
                              "err_msg": XID_MESSAGES.get(code, "Unknown Error")}
                    family.samples.append((labels, float(code)))
            out.append(family)
        else:
            out.extend(self._counter_families(latest, gpu_labels, xid, clock_events))
        if latest is not None and latest.nic is not None:
            out.extend(self._nic_families(latest))
        health = self._health()
        for f in fields(health):
            value = getattr(health, f.name)
            name = f"fleethealth_probe_{f.name}"
            if f.name.endswith("_total"):
                out.append(MetricFamily(name, "counter", _HELP[f.name], [({}, float(value))]))
            elif not (isinstance(value, float) and math.isnan(value)):
                out.append(MetricFamily(name, "gauge", _HELP[f.name], [({}, float(value))]))
        return out

    def render(self) -> bytes:
        """The whole page in the Prometheus text format, ``fleethealth_build_info`` last."""
        return ("".join(f.render() for f in self.families()) + buildinfo.render()).encode()

    def degraded(self) -> list[str]:
        """Why the probe is degraded now (empty when healthy): ``/healthz`` answers 503 with these."""
        h = self._health()
        reasons = []
        if h.stalled:
            reasons.append("the telemetry source is stalled (a GPU not answering its driver calls)")
        if h.gpus_stalled:
            reasons.append(f"{h.gpus_stalled} GPU(s) not answering their driver calls, left out of the samples")
        if not h.bus_connected:
            reasons.append(f"not connected to the broker: {h.spool_records} records spooled")
        return reasons

    def serve(self, port: int = DEFAULT_PORT, addr: str = "0.0.0.0") -> ThreadingHTTPServer:
        """Serve ``/metrics`` and ``/healthz`` (200, or 503 with :meth:`degraded`'s reasons) from a
        daemon thread; returns the server (``shutdown()`` stops it)."""
        return Endpoints(metrics=self.render, health=self.degraded, name="fh-probe-metrics",
                         content_type=CONTENT_TYPE).serve(port, addr)

    # ------------------------------------------------------------ internals
    def _gpu_labels(self, latest: Telemetry, i: int) -> dict[str, str]:
        gpu = int(latest.gpu[i])
        labels = {"gpu": str(gpu), "UUID": latest.uuid[i] if i < len(latest.uuid) else "",
                  "pci_bus_id": latest.pci_bus_id[i] if i < len(latest.pci_bus_id) else "",
                  "device": f"nvidia{gpu}", "modelName": latest.model, "Hostname": self.hostname}
        if self.compat:
            labels[DRIVER_LABEL] = self.driver_version
        return labels

    def _counter_families(self, latest: Telemetry | None, gpu_labels: list[dict[str, str]],
                          xid: dict[tuple[str, str], int],
                          clock_events: dict[int, np.ndarray]) -> Iterable[MetricFamily]:
        """Xid and clock-event counters: every GPU of the latest sample with every code and reason, 0
        until it happens; an Xid of a GPU no sample named (or of no GPU) beside them."""
        uuid = {} if latest is None else {str(int(g)): latest.uuid[i] if i < len(latest.uuid) else ""
                                          for i, g in enumerate(latest.gpu.tolist())}
        counts = dict.fromkeys(((g, str(c)) for g in uuid for c in XID_CATALOG), 0) | xid
        family = MetricFamily(XID_METRIC + "_total", "counter", "Xid errors seen, per GPU and code")
        for (gpu, code), count in sorted(counts.items(), key=lambda kv: (kv[0][0], int(kv[0][1]))):
            family.samples.append(({"gpu": gpu, "UUID": uuid.get(gpu, ""), "Hostname": self.hostname, "xid": code},
                                   float(count)))
        yield family
        family = MetricFamily(CLOCK_EVENTS_METRIC, "counter",
                              "times a clock-event reason became active, per GPU and reason")
        if latest is not None:
            for i, g in enumerate(latest.gpu.tolist()):
                seen = clock_events.get(int(g), np.zeros(len(_REASONS), dtype=np.int64))
                for reason, n in zip(_REASONS, seen.tolist(), strict=True):
                    family.samples.append(({**gpu_labels[i], "reason": (reason.name or "").lower()}, float(n)))
        yield family

    def _nic_families(self, latest: Telemetry) -> Iterable[MetricFamily]:
        nic = latest.nic
        if nic is None:
            return
        labels = [{"port": p, "kind": k, "Hostname": self.hostname} for p, k in zip(nic.port, nic.kind, strict=True)]
        for column, (name, counter, scale) in _NIC_METRICS.items():
            family = MetricFamily(name, "counter" if counter else "gauge", NIC_FIELDS[column])
            for i, value in enumerate(nic.columns[column]):
                if not math.isnan(value):
                    family.samples.append((labels[i], float(value) * scale))
            yield family


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)
