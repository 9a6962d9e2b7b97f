"""The node probe: the supervisor on each GPU node (telemetry sources, step aggregation, spool, metrics).

``fleethealth probe`` runs :class:`Probe`: a telemetry source (:mod:`.nvml`, :mod:`.dcgm` or the
simulator, :mod:`.simsource`, or none at all on a CPU box, :mod:`.nosource`, chosen by name through
:mod:`.sources`) sampled every interval under a stall guard (NVML: each GPU's reads on a thread of
its own, bounded together, :mod:`.gpureads`, so one stalled GPU costs only its own columns); the
training ranks' datagrams from the Unix socket (:mod:`.listener`: mode 0660, each sender's
credentials checked, sizes bounded) aggregated into one step batch per (job, step)
(:mod:`.aggregator`); everything written ahead to a bounded on-disk spool (:mod:`.spool`) and
delivered to Kafka from it (:mod:`.delivery`); the node's NIC port counters read from sysfs into
each telemetry sample (:mod:`.nic`); Prometheus ``/metrics`` under the probe's own names, or
dcgm-exporter's in its compatibility mode (:mod:`.metrics`, :mod:`.fields`); operator warnings and
log set-up (:mod:`.logs`). The probe shares only the wire format (:mod:`fleethealth.wire`) with the
in-job library. Names resolve lazily, so importing the package loads neither NVML, DCGM nor the
simulator.
"""

from __future__ import annotations

from fleethealth.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Probe": "daemon",
    "ProbeConfig": "daemon",
    "TickReport": "daemon",
    "make_source": "daemon",
    "Sample": "sources",
    "Source": "sources",
    "StallGuard": "sources",
    "GpuReads": "gpureads",
    "create_source": "sources",
    "register_source": "sources",
    "StepAggregator": "aggregator",
    "SocketLimits": "aggregator",
    "DatagramListener": "listener",
    "PeerPolicy": "listener",
    "NoSource": "nosource",
    "Spool": "spool",
    "Delivery": "delivery",
    "ProbeMetrics": "metrics",
    "ProbeHealth": "metrics",
    "NicReader": "nic",
    "ProbeWatch": "logs",
    "configure_logging": "logs",
    "NvmlSource": "nvml",
    "DcgmSource": "dcgm",
    "SimSource": "simsource",
    "NvmlReplay": "recorded",
    "NvmlRecorder": "recorded",
    "DcgmReplay": "recorded",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
