"""The probe's Prometheus endpoint (default port 9402; dcgm-exporter keeps 9400).

GPU gauges carry dcgm-exporter's names (``DCGM_FI_DEV_GPU_TEMP``, ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS``,
``DCGM_FI_DEV_PCIE_LINK_GEN``, ...; the table is :data:`fleethealth.probe.fields.FIELDS`) and its
labels ``gpu``, ``UUID``, ``Hostname`` (plus ``modelName``), so existing Grafana dashboards work
unchanged. A field the source does not report (NaN) is left out rather than exported as NaN.

Xid errors are a *counter* per GPU and code, ``fleethealth_gpu_xid_errors_total{xid="79"}``:
dcgm-exporter's Xid gauge holds the last code and never resets, so a second Xid 79 is invisible.

The probe's own health is ``fleethealth_probe_*`` (counters end in ``_total``): samples, sample
errors and stalls, datagrams received / garbage / late, step batches (and incomplete ones), events,
spool records / bytes / dropped, delivered records, delivery failures, and whether the bus is up.

:class:`ProbeMetrics` is a custom collector that renders the latest sample at scrape time; it
registers in its own :class:`prometheus_client.CollectorRegistry` unless one is passed.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fleethealth.probe.fields import FIELDS, XID_METRIC
from fleethealth.schema import Event, EventKind, Telemetry

__all__ = ["ProbeMetrics", "ProbeHealth", "DEFAULT_PORT"]

DEFAULT_PORT = 9402
_GPU_LABELS = ("gpu", "UUID", "Hostname", "modelName")


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
}


class ProbeMetrics:
    """Prometheus view of one node: the latest telemetry, Xid counts, and the probe's health."""

    def __init__(self, hostname: str, *, registry: CollectorRegistry | None = None,
                 health: Callable[[], ProbeHealth] | None = None) -> None:
        self.hostname = hostname
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self._health = health or ProbeHealth
        self._lock = threading.Lock()
        self._latest: Telemetry | None = None
        self._xid: dict[tuple[str, str, str], int] = {}
        self.registry.register(self)

    def set_health(self, health: Callable[[], ProbeHealth]) -> None:
        self._health = health

    def observe(self, telemetry: Telemetry) -> None:
        with self._lock:
            self._latest = telemetry

    def count_event(self, event: Event) -> None:
        if event.kind is not EventKind.XID or event.code is None:
            return
        gpu = "" if event.gpu is None else str(event.gpu)
        uuid = ""
        latest = self._latest
        if latest is not None and event.gpu is not None and latest.uuid:
            idx = [int(g) for g in latest.gpu].index(event.gpu) if event.gpu in latest.gpu else -1
            uuid = latest.uuid[idx] if 0 <= idx < len(latest.uuid) else ""
        key = (gpu, uuid, str(event.code))
        with self._lock:
            self._xid[key] = self._xid.get(key, 0) + 1

    def serve(self, port: int = DEFAULT_PORT, addr: str = "0.0.0.0") -> object:
        """Start the HTTP endpoint in a daemon thread; returns the server (``shutdown()`` stops it)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            latest = self._latest
            xid = dict(self._xid)
        if latest is not None:
            labels = [[str(int(g)), latest.uuid[i] if i < len(latest.uuid) else "", self.hostname, latest.model]
                      for i, g in enumerate(latest.gpu)]
            for spec in FIELDS:
                family = GaugeMetricFamily(spec.metric, spec.help, labels=_GPU_LABELS)
                for i, value in enumerate(latest.columns[spec.column]):
                    if not math.isnan(value):
                        family.add_metric(labels[i], float(value))
                yield family
        xids = CounterMetricFamily(XID_METRIC, "Xid errors seen, per GPU and code",
                                   labels=("gpu", "UUID", "Hostname", "xid"))
        for (gpu, uuid, code), count in sorted(xid.items()):
            xids.add_metric([gpu, uuid, self.hostname, code], count)
        yield xids
        health = self._health()
        for f in fields(health):
            value = getattr(health, f.name)
            if f.name.endswith("_total"):
                yield CounterMetricFamily(f"fleethealth_probe_{f.name.removesuffix('_total')}", _HELP[f.name],
                                          value=value)
            elif not (isinstance(value, float) and math.isnan(value)):
                yield GaugeMetricFamily(f"fleethealth_probe_{f.name}", _HELP[f.name], value=value)
