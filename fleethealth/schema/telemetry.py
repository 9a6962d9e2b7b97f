"""The wire contract: every message on the bus, as frozen dataclasses with a JSON codec.

One message type per topic (see :class:`Topic`). Messages are JSON objects (orjson) carrying
``"v"`` (:data:`SCHEMA_VERSION`), so ``kcat`` and ClickHouse's Kafka engine can read them.
Per-GPU and per-rank values travel as columnar arrays, never one message per rank.

``decode(cls, raw)`` validates everything it reads and raises :class:`SchemaError` naming the
field: wrong types, NaN or negative times, arrays of unequal length, unknown versions.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntFlag, StrEnum
from typing import Any, ClassVar, Self, TypeVar

import numpy as np
import orjson

from fleethealth.errors import SchemaError
from fleethealth.ids import digest as _digest
from fleethealth.ids import episode as _episode

__all__ = [
    "SCHEMA_VERSION",
    "MAX_COMPUTE_S",
    "MAX_TS",
    "MAX_MESSAGE_BYTES",
    "MAX_DATA_DEPTH",
    "MAX_BLOCK_STEPS",
    "MAX_TEXT_CHARS",
    "GPU_INDEX_MAX",
    "RANK_MAX",
    "GPU_FIELD_RANGES",
    "Topic",
    "FindingKind",
    "Diagnosis",
    "Action",
    "Guard",
    "EventKind",
    "ClockReason",
    "GPU_FIELDS",
    "NIC_FIELDS",
    "NicPorts",
    "Telemetry",
    "StepBatch",
    "StepBlock",
    "Event",
    "Finding",
    "Recommendation",
    "NodeState",
    "JOB_EVENT_KINDS",
    "is_job_event",
    "Message",
    "encode",
    "decode",
    "decode_many",
    "load_object",
    "TOPIC_TYPES",
]

SCHEMA_VERSION = 1
MAX_COMPUTE_S = 86_400.0
"""A compute time above a day is not a measurement; it is rejected as absurd."""
MAX_TS = 4_102_444_800.0
"""Event times are epoch seconds before 2100-01-01; anything later is a forged or broken clock."""
MAX_MESSAGE_BYTES = 512 * 1024
"""An input message larger than this is dead-lettered unread, so nothing derived from it (a finding
quoting it, a dead letter carrying it) can outgrow what a Kafka broker accepts (1 MiB by default)."""
MAX_DATA_DEPTH = 32
"""Nesting limit of an event's ``data`` object (what orjson can write back is 254 levels)."""
MAX_TEXT_CHARS = 16_384
"""Longest free-text ``message`` an event may carry."""
GPU_INDEX_MAX = int(np.iinfo(np.int16).max)
"""GPU indices are int16 on the wire and UInt16 in the store; one bound for both."""
RANK_MAX = int(np.iinfo(np.int32).max)
"""Ranks are int32 on the wire and UInt32 in the store; one bound for both."""


class Topic(StrEnum):
    TELEMETRY = "fh.telemetry"
    STEPS = "fh.steps"
    EVENTS = "fh.events"
    FINDINGS = "fh.findings"
    RECOMMENDATIONS = "fh.recommendations"
    DEADLETTER = "fh.deadletter"
    NODESTATE = "fh.nodestate"
    SNAPSHOTS = "fh.snapshots"


class FindingKind(StrEnum):
    STRAGGLER = "straggler"
    HANG = "hang"
    SDC = "sdc"
    FAILURE_RISK = "failure_risk"
    XID = "xid"
    ECC = "ecc"
    THERMAL = "thermal"
    POWER_BRAKE = "power_brake"
    LINK = "link"


class Diagnosis(StrEnum):
    """Why a straggler is slow (seed 000, revision R2)."""

    NODE_THERMAL = "NODE_THERMAL"
    ENVIRONMENTAL = "ENVIRONMENTAL"
    NODE_LINK = "NODE_LINK"
    NETWORK_CONTENTION = "NETWORK_CONTENTION"
    UNKNOWN = "UNKNOWN"


class Action(StrEnum):
    EVICT = "evict"
    DRAIN = "drain"
    QUARANTINE = "quarantine"
    ALERT_FACILITIES = "alert_facilities"
    PAGE = "page"
    ROLLBACK = "rollback"
    NONE = "none"


class Guard(StrEnum):
    ALLOWED = "allowed"
    RATE_LIMITED = "rate_limited"
    NEEDS_HUMAN = "needs_human"


class EventKind(StrEnum):
    XID = "xid"
    SDC_CHECK = "sdc_check"
    SELFTEST = "selftest"
    HANG_REPORT = "hang_report"
    HEALTH_WATCH = "health_watch"
    TELEMETRY_STALLED = "telemetry_stalled"
    GPU_LOST = "gpu_lost"
    PROBE_ERROR = "probe_error"
    SPOOL_DROPPED = "spool_dropped"  # a probe's spool overflowed in an outage: counts, bytes, topics, time range
    INTERRUPTION = "interruption"
    CHECKPOINT = "checkpoint"
    SCHEDULER_ACTION = "scheduler_action"
    JOB_START = "job_start"
    JOB_EXIT = "job_exit"
    JOB_PROGRESS = "job_progress"  # derived by the job stage: the event times of the steps it assembled
    JOB_END = "job_end"  # derived by the job stage: it forgot the job (idle past detect.pipeline.job_idle_s)


class ClockReason(IntFlag):
    """NVML clock-event reason bits (``nvmlClocksEventReason*``; DCGM field 112)."""

    GPU_IDLE = 0x1
    APPLICATIONS_CLOCKS = 0x2
    SW_POWER_CAP = 0x4
    HW_SLOWDOWN = 0x8
    SYNC_BOOST = 0x10
    SW_THERMAL = 0x20
    HW_THERMAL = 0x40
    HW_POWER_BRAKE = 0x80
    DISPLAY_CLOCK = 0x100

    @classmethod
    def thermal(cls) -> ClockReason:
        return cls.SW_THERMAL | cls.HW_THERMAL

    @classmethod
    def power(cls) -> ClockReason:
        return cls.SW_POWER_CAP | cls.HW_POWER_BRAKE


GPU_FIELDS: dict[str, str] = {
    "temp_c": "GPU core temperature, °C",
    "mem_temp_c": "HBM temperature, °C",
    "power_w": "power draw, W",
    "power_limit_w": "enforced power limit, W",
    "sm_clock_mhz": "SM clock, MHz",
    "sm_clock_max_mhz": "maximum SM clock, MHz",
    "mem_clock_mhz": "memory clock, MHz",
    "clock_reasons": "clock-event reason bitmask (ClockReason)",
    "util_pct": "GPU utilisation, %",
    "ecc_sbe_volatile": "corrected ECC errors since driver load",
    "ecc_dbe_volatile": "uncorrected ECC errors since driver load",
    "ecc_sbe_aggregate": "corrected ECC errors, lifetime",
    "ecc_dbe_aggregate": "uncorrected ECC errors, lifetime",
    "retired_sbe": "pages retired for corrected errors",
    "retired_dbe": "pages retired for uncorrected errors",
    "retired_pending": "1 when a page retirement waits for a reset",
    "remap_correctable": "rows remapped for corrected errors",
    "remap_uncorrectable": "rows remapped for uncorrected errors",
    "remap_pending": "1 when a row remap waits for a reset",
    "remap_failure": "1 when a row remap failed",
    "nvlink_links_up": "NVLink links active",
    "nvlink_links_max": "NVLink links the GPU has",
    "nvlink_crc_flit": "NVLink CRC flit errors, total over links",
    "nvlink_crc_data": "NVLink CRC data errors, total over links",
    "nvlink_replay": "NVLink replay errors, total over links",
    "nvlink_recovery": "NVLink recovery errors, total over links",
    "pcie_replay": "PCIe replay counter",
    "pcie_gen": "current PCIe link generation",
    "pcie_gen_max": "maximum PCIe link generation",
    "pcie_width": "current PCIe link width",
    "pcie_width_max": "maximum PCIe link width",
    "fb_used_mib": "framebuffer memory used, MiB",
    "fb_free_mib": "framebuffer memory free, MiB",
    "energy_mj": "energy consumed since the driver loaded, mJ",
    "tensor_active": "share of cycles the tensor pipes were active, 0-1",
    "slowdown_temp_c": "the GPU's own slowdown temperature, °C: above it the GPU throttles itself (NaN: not reported)",
}
"""Per-GPU telemetry columns (float64; NaN where a source does not report the field)."""

NIC_FIELDS: dict[str, str] = {
    "up": "1 while the port's link is up (InfiniBand state ACTIVE, Ethernet operstate up), else 0",
    "link_gbps": "link rate, Gb/s (InfiniBand ports/<p>/rate, Ethernet speed)",
    "tx_bytes": "bytes sent, counter (InfiniBand port_xmit_data x 4, Ethernet tx_bytes)",
    "rx_bytes": "bytes received, counter (InfiniBand port_rcv_data x 4, Ethernet rx_bytes)",
    "xmit_wait": "ticks the port had data to send but no credit to send it, counter (InfiniBand port_xmit_wait)",
    "rx_errors": "received packets with errors, counter (port_rcv_errors, Ethernet rx_errors)",
    "symbol_errors": "symbol errors on the link, counter (InfiniBand symbol_error)",
    "link_downed": "times the link went down, counter (link_downed, Ethernet carrier_down_count)",
    "link_recovery": "link error recoveries, counter (InfiniBand link_error_recovery)",
}
"""Per-port NIC columns (float64; NaN where the port does not have the counter). Counters are
monotonic totals as the probe read them (32-bit wraps and resets already folded in); rates are
taken between two samples by the consumer, as for the GPU counters."""

_COUNTER = (0.0, 2.0**64)
GPU_FIELD_RANGES: dict[str, tuple[float, float]] = {
    "temp_c": (-40.0, 200.0), "mem_temp_c": (-40.0, 200.0), "power_w": (0.0, 10_000.0),
    "power_limit_w": (0.0, 10_000.0), "sm_clock_mhz": (0.0, 20_000.0), "sm_clock_max_mhz": (0.0, 20_000.0),
    "mem_clock_mhz": (0.0, 50_000.0), "clock_reasons": (0.0, 2.0**64), "util_pct": (0.0, 100.0),
    "ecc_sbe_volatile": _COUNTER, "ecc_dbe_volatile": _COUNTER, "ecc_sbe_aggregate": _COUNTER,
    "ecc_dbe_aggregate": _COUNTER, "retired_sbe": (0.0, 1e6), "retired_dbe": (0.0, 1e6),
    "retired_pending": (0.0, 1.0), "remap_correctable": (0.0, 1e6), "remap_uncorrectable": (0.0, 1e6),
    "remap_pending": (0.0, 1.0), "remap_failure": (0.0, 1.0), "nvlink_links_up": (0.0, 64.0),
    "nvlink_links_max": (0.0, 64.0), "nvlink_crc_flit": _COUNTER, "nvlink_crc_data": _COUNTER,
    "nvlink_replay": _COUNTER, "nvlink_recovery": _COUNTER, "pcie_replay": _COUNTER, "pcie_gen": (0.0, 16.0),
    "pcie_gen_max": (0.0, 16.0), "pcie_width": (0.0, 64.0), "pcie_width_max": (0.0, 64.0),
    "fb_used_mib": (0.0, 2.0**24), "fb_free_mib": (0.0, 2.0**24), "energy_mj": _COUNTER, "tensor_active": (0.0, 1.0),
    "slowdown_temp_c": (0.0, 200.0),
}
"""Physical range of each telemetry field: a sample with a value outside it (a temperature of
1e308 °C, a utilisation of 250 %) is a broken or forged probe, and is dead-lettered naming the field."""


# ---------------------------------------------------------------- field readers
_INT_MAX = 2**63 - 1
"""Integers travel into Int64/UInt64 columns; anything larger is not a step, rank or code."""


def _req(obj: dict[str, Any], name: str) -> Any:
    if name not in obj:
        raise SchemaError(name, "missing")
    return obj[name]


def _str(obj: dict[str, Any], name: str, *, optional: bool = False) -> str | None:
    value = obj.get(name) if optional else _req(obj, name)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise SchemaError(name, f"expected a non-empty string, got {value!r}")
    return value


def _int(obj: dict[str, Any], name: str, *, optional: bool = False, minimum: int = 0,
         maximum: int = _INT_MAX) -> int | None:
    value = obj.get(name) if optional else _req(obj, name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(name, f"expected an integer, got {value!r}")
    if value < minimum:
        raise SchemaError(name, f"must be >= {minimum}, got {value}")
    if value > maximum:
        raise SchemaError(name, f"must be <= {maximum}, got {value}")
    return value


def _float(obj: dict[str, Any], name: str, *, optional: bool = False, minimum: float | None = 0.0,
           maximum: float | None = None) -> float | None:
    value = obj.get(name) if optional else _req(obj, name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchemaError(name, f"expected a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise SchemaError(name, f"must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise SchemaError(name, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SchemaError(name, f"must be <= {maximum}, got {value}")
    return value


def _ts(obj: dict[str, Any]) -> float:
    """An event time: finite epoch seconds in ``[0, MAX_TS)``."""
    return _float(obj, "ts", maximum=MAX_TS)  # type: ignore[return-value]


def _depth_ok(value: Any, limit: int) -> bool:
    """True when ``value`` nests no deeper than ``limit`` lists and objects (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return False
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return True


def _obj(obj: dict[str, Any], name: str) -> dict[str, Any]:
    value = obj.get(name, {})
    if not isinstance(value, dict):
        raise SchemaError(name, f"expected an object, got {type(value).__name__}")
    return value


def _enum(obj: dict[str, Any], name: str, enum: type[StrEnum], *, optional: bool = False) -> Any:
    value = obj.get(name) if optional else _req(obj, name)
    if value is None and optional:
        return None
    try:
        return enum(value)
    except ValueError:
        known = ", ".join(e.value for e in enum)
        raise SchemaError(name, f"unknown value {value!r} (known: {known})") from None


def _array(obj: dict[str, Any], name: str, dtype: type, *, length: int | None = None,
           nan_ok: bool = False, minimum: float | None = None, maximum: float | None = None) -> np.ndarray:
    value = _req(obj, name)
    if not isinstance(value, list):
        raise SchemaError(name, f"expected an array, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise SchemaError(name, f"expected {length} values, got {len(value)}")
    allowed = {int, float, type(None)} if nan_ok else {int, float}
    if np.dtype(dtype).kind == "i":
        allowed = {int}
    found = set(map(type, value)) - allowed
    if found:
        raise SchemaError(name, f"expected {'integers' if allowed == {int} else 'numbers'}, "
                                f"found {sorted(t.__name__ for t in found)}")
    try:
        arr = np.array(value, dtype=np.float64 if nan_ok else dtype)
    except (OverflowError, ValueError) as exc:
        raise SchemaError(name, f"value out of range for {np.dtype(dtype).name} ({exc})") from None
    if arr.dtype.kind == "f":
        bad = np.isinf(arr) if nan_ok else ~np.isfinite(arr)
        if bad.any():
            raise SchemaError(name, f"non-finite value at index {int(np.argmax(bad))}")
    finite = arr.size and not np.isnan(arr).all()
    if minimum is not None and finite and np.nanmin(arr) < minimum:
        raise SchemaError(name, f"values must be >= {minimum}, found {np.nanmin(arr)}")
    if maximum is not None and finite and np.nanmax(arr) > maximum:
        raise SchemaError(name, f"values must be <= {maximum}, found {np.nanmax(arr)}")
    return arr


_NUMBER_OR_NULL = {int, float, type(None)}


def _columns(cols: dict[str, Any], n: int) -> dict[str, np.ndarray]:
    """All telemetry columns in one NumPy conversion; the field-by-field readers name any error."""
    names = [name for name in GPU_FIELDS if name in cols]
    values = [cols[name] for name in names]
    matrix = None
    if all(isinstance(v, list) and len(v) == n for v in values) and \
            set(map(type, itertools.chain.from_iterable(values))) <= _NUMBER_OR_NULL:
        matrix = np.array(values, dtype=np.float64).reshape(len(names), n)
    if matrix is None or np.isinf(matrix).any():
        for name in names:  # slow path: raises SchemaError naming the field
            _array(cols, name, np.float64, length=n, nan_ok=True)
    out = dict(zip(names, matrix, strict=True))
    for name, col in out.items():
        low, high = GPU_FIELD_RANGES[name]
        wrong = (col < low) | (col > high)  # NaN compares False: "not reported" is fine
        if wrong.any():
            k = int(np.argmax(wrong))
            raise SchemaError(f"columns.{name}", f"value {col[k]!r} at index {k} is outside the physical range "
                                                 f"[{low:g}, {high:g}] ({GPU_FIELDS[name]})")
    return {name: out[name] if name in out else np.full(n, np.nan) for name in GPU_FIELDS}


def _jsonable(arr: np.ndarray) -> list[Any]:
    if arr.dtype.kind == "f" and np.isnan(arr).any():
        return [None if math.isnan(x) else x for x in arr.tolist()]
    return arr.tolist()


# ---------------------------------------------------------------- messages
@dataclass(frozen=True, eq=False)
class NicPorts:
    """One node's NIC ports at one moment, carried inside :class:`Telemetry` (``"nic"`` on the wire).

    ``port`` names each port (``mlx5_0/1`` for an InfiniBand or RoCE port, the interface name for
    Ethernet), shape ``(p,)``; ``kind`` is ``"ib"`` or ``"eth"`` per port; ``columns`` maps each name
    of :data:`NIC_FIELDS` to a float64 array of shape ``(p,)``, NaN where the port lacks it.
    """

    port: tuple[str, ...]
    kind: tuple[str, ...]
    columns: dict[str, np.ndarray]

    KINDS: ClassVar[tuple[str, ...]] = ("ib", "eth")

    @classmethod
    def from_columns(cls, port: Sequence[str], kind: Sequence[str], **columns: Any) -> NicPorts:
        """Build the ports; fields of :data:`NIC_FIELDS` not given are NaN. Unknown names raise."""
        port, kind = tuple(port), tuple(kind)
        if len(kind) != len(port):
            raise SchemaError("nic.kind", f"expected {len(port)} values, got {len(kind)}")
        bad = sorted(set(kind) - set(cls.KINDS))
        if bad:
            raise SchemaError("nic.kind", f"unknown port kind {bad[0]!r} (known: {', '.join(cls.KINDS)})")
        unknown = set(columns) - set(NIC_FIELDS)
        if unknown:
            raise SchemaError(f"nic.columns.{sorted(unknown)[0]}", "not a NIC field")
        full = {}
        for name in NIC_FIELDS:
            col = columns.get(name)
            full[name] = (np.full(len(port), np.nan) if col is None
                          else np.asarray(col, dtype=np.float64).reshape(len(port)))
        return cls(port=port, kind=kind, columns=full)

    def to_obj(self) -> dict[str, Any]:
        return {"port": list(self.port), "kind": list(self.kind),
                "columns": {k: _jsonable(v) for k, v in self.columns.items()}}

    @classmethod
    def from_obj(cls, obj: Any) -> NicPorts:
        if not isinstance(obj, dict):
            raise SchemaError("nic", f"expected an object, got {type(obj).__name__}")
        port, kind = obj.get("port"), obj.get("kind")
        for name, value in (("nic.port", port), ("nic.kind", kind)):
            if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
                raise SchemaError(name, "expected an array of non-empty strings")
        cols = _obj(obj, "columns")
        unknown = set(cols) - set(NIC_FIELDS)
        if unknown:
            raise SchemaError(f"nic.columns.{sorted(unknown)[0]}", "not a NIC field")
        arrays = {}
        for name in NIC_FIELDS:
            if name in cols:
                try:
                    arrays[name] = _array(cols, name, np.float64, length=len(port), nan_ok=True, minimum=0.0)
                except SchemaError as exc:
                    raise SchemaError(f"nic.columns.{name}", exc.problem) from None
        return cls.from_columns(port, kind, **arrays)


@dataclass(frozen=True, eq=False)
class Telemetry:
    """One node's sample of all its GPUs at event time ``ts`` (topic ``fh.telemetry``, key node).

    ``gpu`` holds GPU indices (shape ``(g,)``); ``columns`` maps each name of :data:`GPU_FIELDS`
    to a float64 array of shape ``(g,)``, NaN where the source does not report it.
    ``nic`` holds the node's NIC port counters (:class:`NicPorts`, ``None`` when no NIC was read);
    ``nic_util`` is a summary kept for older readers: the busiest up port's utilisation over the
    probe's last interval, in [0, 1] (NaN when unknown). ``pci_bus_id`` gives each GPU's PCI
    address (``()`` when the source does not say). Both are optional on the wire, so messages
    from older probes still decode.
    """

    node: str
    rack: str
    ts: float
    gpu: np.ndarray
    columns: dict[str, np.ndarray]
    nic_util: float = math.nan
    model: str = ""
    uuid: tuple[str, ...] = ()
    nic: NicPorts | None = None
    pci_bus_id: tuple[str, ...] = ()
    TOPIC: ClassVar[Topic] = Topic.TELEMETRY

    @classmethod
    def from_columns(cls, node: str, rack: str, ts: float, gpu: np.ndarray | list[int], *,
                     nic_util: float = math.nan, model: str = "", uuid: tuple[str, ...] = (),
                     nic: NicPorts | None = None, pci_bus_id: tuple[str, ...] = (),
                     **columns: np.ndarray | list[float]) -> Telemetry:
        """Build a sample; fields of :data:`GPU_FIELDS` not given are NaN. Unknown names raise."""
        gpu = np.asarray(gpu, dtype=np.int16)
        unknown = set(columns) - set(GPU_FIELDS)
        if unknown:
            raise SchemaError(sorted(unknown)[0], "not a GPU telemetry field")
        full = {}
        for name in GPU_FIELDS:
            col = columns.get(name)
            full[name] = (np.full(gpu.shape, np.nan) if col is None
                          else np.asarray(col, dtype=np.float64).reshape(gpu.shape))
        return cls(node=node, rack=rack, ts=float(ts), gpu=gpu, columns=full, nic_util=float(nic_util),
                   model=model, uuid=tuple(uuid), nic=nic, pci_bus_id=tuple(pci_bus_id))

    @property
    def key(self) -> str:
        return self.node

    def slowdown_limits(self, default: float) -> np.ndarray:
        """Each GPU's own slowdown temperature (``slowdown_temp_c``, from NVML's threshold or
        DCGM's field), ``default`` for a GPU that does not report one (an old driver or source)."""
        own = self.columns["slowdown_temp_c"]
        return np.where(np.isfinite(own), own, float(default))

    def to_obj(self) -> dict[str, Any]:
        obj = {
            "v": SCHEMA_VERSION, "node": self.node, "rack": self.rack, "ts": self.ts,
            "gpu": self.gpu.tolist(), "nic_util": None if math.isnan(self.nic_util) else self.nic_util,
            "model": self.model, "uuid": list(self.uuid),
            "columns": {k: _jsonable(v) for k, v in self.columns.items()},
        }
        if self.nic is not None:
            obj["nic"] = self.nic.to_obj()
        if self.pci_bus_id:
            obj["pci_bus_id"] = list(self.pci_bus_id)
        return obj

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        gpu = _array(obj, "gpu", np.int16, minimum=0)
        if np.unique(gpu).size != gpu.size:
            raise SchemaError("gpu", "duplicate GPU index in one sample")
        cols = _obj(obj, "columns")
        unknown = set(cols) - set(GPU_FIELDS)
        if unknown:
            raise SchemaError(f"columns.{sorted(unknown)[0]}", "not a GPU telemetry field")
        columns = _columns(cols, len(gpu))
        nic = obj.get("nic_util")
        uuid = obj.get("uuid", [])
        if not isinstance(uuid, list) or not all(isinstance(u, str) for u in uuid):
            raise SchemaError("uuid", "expected an array of strings")
        model = obj.get("model", "")
        if not isinstance(model, str):
            raise SchemaError("model", "expected a string")
        bus = obj.get("pci_bus_id", [])
        if not isinstance(bus, list) or not all(isinstance(b, str) for b in bus):
            raise SchemaError("pci_bus_id", "expected an array of strings")
        ports = obj.get("nic")
        return cls(node=_str(obj, "node"), rack=_str(obj, "rack"), ts=_ts(obj), gpu=gpu,
                   columns=columns, nic_util=math.nan if nic is None else _float(obj, "nic_util"),
                   model=model, uuid=tuple(uuid), nic=None if ports is None else NicPorts.from_obj(ports),
                   pci_bus_id=tuple(bus))


def _rank_columns(obj: dict[str, Any], what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A step record's ``ranks`` (at least one, distinct), ``gpus`` and optional ``groups``."""
    ranks = _array(obj, "ranks", np.int32, minimum=0)
    if ranks.size == 0:
        raise SchemaError("ranks", f"a step {what} needs at least one rank")
    if np.unique(ranks).size != ranks.size:
        raise SchemaError("ranks", f"duplicate rank in one {what}")
    gpus = _array(obj, "gpus", np.int16, length=ranks.size, minimum=0)
    groups = _array(obj, "groups", np.int32, length=ranks.size) if obj.get("groups") is not None else None
    return ranks, gpus, groups


@dataclass(frozen=True, eq=False)
class StepBatch:
    """Pre-collective compute times of one node's ranks for one step (topic ``fh.steps``, key job).

    ``ranks`` (int32), ``gpus`` (int16) and ``compute_s`` (float64, seconds, finite, >= 0) all have
    shape ``(r,)``. ``groups`` optionally labels comparable ranks (e.g. pipeline stage); straggler
    scores are computed within a group. ``ts`` is the event time at which the step completed.
    """

    job: str
    step: int
    node: str
    ts: float
    ranks: np.ndarray
    gpus: np.ndarray
    compute_s: np.ndarray
    groups: np.ndarray | None = None
    TOPIC: ClassVar[Topic] = Topic.STEPS

    @property
    def key(self) -> str:
        return self.job

    def to_obj(self) -> dict[str, Any]:
        obj = {"v": SCHEMA_VERSION, "job": self.job, "step": self.step, "node": self.node, "ts": self.ts,
               "ranks": self.ranks.tolist(), "gpus": self.gpus.tolist(), "compute_s": self.compute_s.tolist()}
        if self.groups is not None:
            obj["groups"] = self.groups.tolist()
        return obj

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        ranks, gpus, groups = _rank_columns(obj, "batch")
        compute = _array(obj, "compute_s", np.float64, length=ranks.size, minimum=0.0, maximum=MAX_COMPUTE_S)
        return cls(job=_str(obj, "job"), step=_int(obj, "step"), node=_str(obj, "node"), ts=_ts(obj),
                   ranks=ranks, gpus=gpus, compute_s=compute, groups=groups)


MAX_BLOCK_STEPS = 4096
"""Most steps one :class:`StepBlock` may carry (a 10-steps/s job sent every minute is 600)."""


@dataclass(frozen=True)
class StepBlock:
    """Several steps of one node's ranks in one message (topic ``fh.steps``, key job): every step a
    probe saw complete in one interval, columnar, with the same ranks in each.

    ``steps`` (int64) and ``step_ts`` (float64, each step's completion time) have shape ``(s,)``;
    ``ranks``, ``gpus`` and ``groups`` shape ``(r,)`` as in :class:`StepBatch`; ``compute_s`` shape
    ``(s, r)``. On the wire it is a step batch whose ``steps`` is an array and whose ``ts`` and
    ``compute_s`` are one value and one row per step. The consumer splits it into step batches
    (:meth:`split`); a bad value anywhere dead-letters the whole block, naming the field.
    """

    job: str
    node: str
    steps: np.ndarray
    step_ts: np.ndarray
    ranks: np.ndarray
    gpus: np.ndarray
    compute_s: np.ndarray
    groups: np.ndarray | None = None
    TOPIC: ClassVar[Topic] = Topic.STEPS

    @property
    def key(self) -> str:
        return self.job

    @functools.cached_property
    def ts(self) -> float:
        """The latest step's completion time (what a drop report or a record timestamp names)."""
        return float(self.step_ts.max())

    @classmethod
    def of(cls, batches: Sequence[StepBatch]) -> StepBlock:
        """Pack step batches of one job and node with the same ranks, GPUs and groups."""
        first = batches[0]
        return cls(job=first.job, node=first.node, steps=np.array([b.step for b in batches], dtype=np.int64),
                   step_ts=np.array([b.ts for b in batches], dtype=np.float64), ranks=first.ranks, gpus=first.gpus,
                   compute_s=np.stack([b.compute_s for b in batches]), groups=first.groups)

    def split(self) -> list[StepBatch]:
        """One :class:`StepBatch` per step (views of this block's arrays)."""
        return [StepBatch(job=self.job, step=step, node=self.node, ts=ts, ranks=self.ranks, gpus=self.gpus,
                          compute_s=row, groups=self.groups)
                for step, ts, row in zip(self.steps.tolist(), self.step_ts.tolist(), self.compute_s, strict=True)]

    def row(self, k: int) -> StepBatch:
        """Step ``k`` of this block (0-based row) as a :class:`StepBatch` (views of its arrays)."""
        return StepBatch(job=self.job, step=int(self.steps[k]), node=self.node, ts=float(self.step_ts[k]),
                         ranks=self.ranks, gpus=self.gpus, compute_s=self.compute_s[k], groups=self.groups)

    def take(self, rows: Sequence[int] | np.ndarray) -> StepBlock:
        """The block of the given rows only (e.g. the steps a detector accepted), in that order."""
        rows = np.asarray(rows, dtype=np.intp)
        return StepBlock(job=self.job, node=self.node, steps=self.steps[rows], step_ts=self.step_ts[rows],
                         ranks=self.ranks, gpus=self.gpus, compute_s=self.compute_s[rows], groups=self.groups)

    def to_obj(self) -> dict[str, Any]:
        obj = {"v": SCHEMA_VERSION, "job": self.job, "steps": self.steps.tolist(), "node": self.node,
               "ts": self.step_ts.tolist(), "ranks": self.ranks.tolist(), "gpus": self.gpus.tolist(),
               "compute_s": self.compute_s.tolist()}
        if self.groups is not None:
            obj["groups"] = self.groups.tolist()
        return obj

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        fast = cls._fast(obj)
        return fast if fast is not None else cls._checked(obj)

    @classmethod
    def _fast(cls, obj: dict[str, Any]) -> Self | None:
        """The block when every check passes in a few NumPy passes; None when any may fail (then
        :meth:`_checked` names the field)."""
        job, node, steps, ts = obj.get("job"), obj.get("node"), obj.get("steps"), obj.get("ts")
        ranks, gpus, rows, groups = obj.get("ranks"), obj.get("gpus"), obj.get("compute_s"), obj.get("groups")
        if type(job) is not str or not job or type(node) is not str or not node or groups is not None:
            return None
        if type(steps) is not list or type(ts) is not list or type(ranks) is not list or type(gpus) is not list \
                or type(rows) is not list:
            return None
        s, r = len(steps), len(ranks)
        if not 0 < s <= MAX_BLOCK_STEPS or r == 0 or len(ts) != s or len(gpus) != r or len(rows) != s:
            return None
        if any(type(row) is not list or len(row) != r for row in rows):
            return None
        if not set(map(type, itertools.chain(steps, ranks, gpus))) <= {int}:
            return None
        if not set(map(type, itertools.chain(ts, *rows))) <= {int, float}:
            return None
        try:
            steps_a = np.array(steps, dtype=np.int64)
            ranks_a = np.array(ranks, dtype=np.int64)
            gpus_a = np.array(gpus, dtype=np.int64)
        except OverflowError:
            return None
        ts_a = np.array(ts, dtype=np.float64)
        compute = np.array(rows, dtype=np.float64)
        if steps_a.min() < 0 or ranks_a.min() < 0 or ranks_a.max() > _I32.max or gpus_a.min() < 0 \
                or gpus_a.max() > _I16_MAX:
            return None
        if not (np.isfinite(ts_a).all() and ts_a.min() >= 0.0 and ts_a.max() < MAX_TS):
            return None
        if not (np.isfinite(compute).all() and compute.min() >= 0.0 and compute.max() <= MAX_COMPUTE_S):
            return None
        if np.unique(steps_a).size != s or np.unique(ranks_a).size != r:
            return None
        return cls(job=job, node=node, steps=steps_a, step_ts=ts_a, ranks=ranks_a.astype(np.int32),
                   gpus=gpus_a.astype(np.int16), compute_s=compute)

    @classmethod
    def _checked(cls, obj: dict[str, Any]) -> Self:
        steps = _array(obj, "steps", np.int64, minimum=0, maximum=_INT_MAX)
        if steps.size == 0:
            raise SchemaError("steps", "a step block needs at least one step")
        if steps.size > MAX_BLOCK_STEPS:
            raise SchemaError("steps", f"{steps.size} steps exceed {MAX_BLOCK_STEPS} in one block")
        if np.unique(steps).size != steps.size:
            raise SchemaError("steps", "duplicate step in one block")
        step_ts = _array(obj, "ts", np.float64, length=steps.size, minimum=0.0)
        if step_ts.max() >= MAX_TS:
            raise SchemaError("ts", f"event time {step_ts.max()} is after 2100-01-01")
        ranks, gpus, groups = _rank_columns(obj, "block")
        rows = _req(obj, "compute_s")
        if type(rows) is not list or len(rows) != steps.size:
            raise SchemaError("compute_s", f"expected {steps.size} rows, one per step")
        compute = np.empty((steps.size, ranks.size), dtype=np.float64)
        for k, row in enumerate(rows):
            try:
                compute[k] = _array({"compute_s": row}, "compute_s", np.float64, length=ranks.size, minimum=0.0,
                                    maximum=MAX_COMPUTE_S)
            except SchemaError as exc:
                raise SchemaError("compute_s", f"step {int(steps[k])}: {exc.problem}") from None
        return cls(job=_str(obj, "job"), node=_str(obj, "node"), steps=steps, step_ts=step_ts, ranks=ranks,
                   gpus=gpus, compute_s=compute, groups=groups)


JOB_EVENT_KINDS = frozenset({EventKind.SDC_CHECK, EventKind.HANG_REPORT, EventKind.CHECKPOINT, EventKind.JOB_START,
                             EventKind.JOB_EXIT, EventKind.INTERRUPTION, EventKind.JOB_PROGRESS,
                             EventKind.JOB_END})
"""Kinds a training job (or the detectors, for ``interruption``, ``job_progress`` and ``job_end``) sends
about itself: keyed by job when
they name one, so they share a partition number with the job's step batches."""


def is_job_event(event: Event) -> bool:
    """Whether ``event`` is about a job (keyed by it) rather than about its node."""
    return event.job is not None and event.kind in JOB_EVENT_KINDS


@dataclass(frozen=True)
class Event:
    """A discrete event (topic ``fh.events``): keyed by job for what a job reports about itself
    (:data:`JOB_EVENT_KINDS` with a job), by node for the rest.

    ``data`` is a JSON object whose keys depend on ``kind``: ``sdc_check`` carries ``check``
    (``selfcheck`` | ``replay``), ``passed``, ``classification``, ``digests``; ``hang_report``
    carries ``stacks`` and ``last_collective``; ``selftest`` carries one result record;
    ``xid`` uses ``code``.
    """

    node: str
    ts: float
    kind: EventKind
    job: str | None = None
    gpu: int | None = None
    rank: int | None = None
    step: int | None = None
    code: int | None = None
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    TOPIC: ClassVar[Topic] = Topic.EVENTS

    @property
    def key(self) -> str:
        return self.job if is_job_event(self) and self.job else self.node

    @property
    def id(self) -> str:
        """Stable across replays; two different events of one node at one instant (several self-test
        results, a result and its suite record) differ by message and data."""
        data = orjson.dumps(self.data, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY)
        return _digest(self.kind, self.node, self.ts, self.job, self.gpu, self.rank, self.step, self.code,
                       self.message, data.decode())

    def to_obj(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "node": self.node, "ts": self.ts, "kind": self.kind.value, "job": self.job,
                "gpu": self.gpu, "rank": self.rank, "step": self.step, "code": self.code,
                "message": self.message, "data": self.data}

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        message = obj.get("message", "")
        if not isinstance(message, str):
            raise SchemaError("message", "expected a string")
        if len(message) > MAX_TEXT_CHARS:
            raise SchemaError("message", f"{len(message)} characters exceed {MAX_TEXT_CHARS}")
        data = _obj(obj, "data")
        if not _depth_ok(data, MAX_DATA_DEPTH):
            raise SchemaError("data", f"nested deeper than {MAX_DATA_DEPTH} levels")
        return cls(node=_str(obj, "node"), ts=_ts(obj), kind=_enum(obj, "kind", EventKind),
                   job=_str(obj, "job", optional=True), gpu=_int(obj, "gpu", optional=True, maximum=GPU_INDEX_MAX),
                   rank=_int(obj, "rank", optional=True, maximum=RANK_MAX), step=_int(obj, "step", optional=True),
                   code=_int(obj, "code", optional=True), message=message, data=data)


@dataclass(frozen=True)
class Finding:
    """What a detector concluded (topic ``fh.findings``).

    ``z`` is the detector's score for the rank (robust z or sequential statistic: higher is more
    abnormal); ``slowdown`` is the estimated compute-time ratio to peers minus one (0.2 = 20 %
    slower). ``probability`` is a failure probability for ``failure_risk``. ``step`` is the first
    step at which the detector concluded, ``ts`` its event time. ``episode_ts`` is the event time
    the episode began (a straggler's first slow step, a hang's last progress, the sample or event
    that opened a health episode): ``id`` names the kind, detector, job, node, GPU, rank and the
    episode start — not when the detector concluded — so a restart or a replay that detects the same
    episode again, at another step or time, derives the same id (:func:`fleethealth.ids.episode`).
    Without ``episode_ts`` (a message from before it existed) the id names ``step`` and ``ts`` instead.
    """

    kind: FindingKind
    node: str
    ts: float
    job: str | None = None
    gpu: int | None = None
    rank: int | None = None
    step: int | None = None
    diagnosis: Diagnosis | None = None
    z: float | None = None
    slowdown: float | None = None
    probability: float | None = None
    detector: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    episode_ts: float | None = None
    TOPIC: ClassVar[Topic] = Topic.FINDINGS

    @property
    def key(self) -> str:
        return self.job or self.node

    @property
    def id(self) -> str:
        if self.episode_ts is None:
            return _digest(self.kind, self.detector, self.job, self.node, self.gpu, self.rank, self.step, self.ts)
        return _digest(self.kind, self.detector, self.job, self.node, self.gpu, self.rank, _episode(self.episode_ts))

    def to_obj(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "id": self.id, "kind": self.kind.value, "job": self.job, "node": self.node,
                "gpu": self.gpu, "rank": self.rank, "step": self.step, "ts": self.ts,
                "diagnosis": None if self.diagnosis is None else self.diagnosis.value,
                "z": self.z, "slowdown": self.slowdown, "probability": self.probability,
                "detector": self.detector, "evidence": self.evidence, "episode_ts": self.episode_ts}

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        detector = obj.get("detector", "")
        if not isinstance(detector, str):
            raise SchemaError("detector", "expected a string")
        return cls(kind=_enum(obj, "kind", FindingKind), node=_str(obj, "node"), ts=_ts(obj),
                   job=_str(obj, "job", optional=True), gpu=_int(obj, "gpu", optional=True, maximum=GPU_INDEX_MAX),
                   rank=_int(obj, "rank", optional=True, maximum=RANK_MAX), step=_int(obj, "step", optional=True),
                   diagnosis=_enum(obj, "diagnosis", Diagnosis, optional=True),
                   z=_float(obj, "z", optional=True, minimum=None),
                   slowdown=_float(obj, "slowdown", optional=True, minimum=None),
                   probability=_float(obj, "probability", optional=True),
                   detector=detector, evidence=_obj(obj, "evidence"),
                   episode_ts=_float(obj, "episode_ts", optional=True, maximum=MAX_TS))


@dataclass(frozen=True)
class Recommendation:
    """What a scheduler should do about a node (topic ``fh.recommendations``, key node).

    ``guard`` says whether the action may be taken automatically; ``reason`` says why in words,
    ``evidence`` in numbers (payback time, P(healthy), the guard that fired). ``id`` is derived
    from the finding and the action, so a replayed finding yields the same recommendation.
    """

    action: Action
    node: str
    ts: float
    reason: str
    guard: Guard = Guard.ALLOWED
    job: str | None = None
    finding_id: str | None = None
    dry_run: bool = False
    evidence: dict[str, Any] = field(default_factory=dict)
    TOPIC: ClassVar[Topic] = Topic.RECOMMENDATIONS

    @property
    def key(self) -> str:
        return self.node

    @property
    def id(self) -> str:
        return _digest(self.finding_id or self.ts, self.action, self.node, self.job)

    def to_obj(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "id": self.id, "action": self.action.value, "node": self.node,
                "job": self.job, "reason": self.reason, "guard": self.guard.value, "ts": self.ts,
                "finding_id": self.finding_id, "dry_run": self.dry_run, "evidence": self.evidence}

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        dry = obj.get("dry_run", False)
        if not isinstance(dry, bool):
            raise SchemaError("dry_run", "expected true or false")
        return cls(action=_enum(obj, "action", Action), node=_str(obj, "node"), ts=_ts(obj),
                   reason=_str(obj, "reason"), guard=_enum(obj, "guard", Guard),
                   job=_str(obj, "job", optional=True), finding_id=_str(obj, "finding_id", optional=True),
                   dry_run=dry, evidence=_obj(obj, "evidence"))


@dataclass(frozen=True, eq=False)
class NodeState:
    """What the node stage knows of one node that a straggler's diagnosis reads (topic
    ``fh.nodestate``, key node; a compacted topic, so it is also the table of every node's newest state).

    Derived from the node's newest :class:`Telemetry` sample and the one before it
    (``fleethealth/detectors/nodestate.py``): per GPU (shape ``(g,)``) ``temp_c``, its own
    ``slowdown_temp_c`` (NaN where the GPU does not say), ``clock_reasons`` (the reported bits, NaN
    unknown), ``nvlink_links_up`` / ``nvlink_links_max`` and ``reports`` (the GPU reports any field the
    diagnosis reads); per node the NVLink error rate between the two samples (its worst GPU's errors
    per minute, ``detectors/nodestate.py`` ``nvlink_errors``; NaN without a usable earlier sample), the
    NIC ports' utilisation, credit-wait share and whether each went down between the samples
    (``nic_port`` empty and ``has_nic`` false for a sample without NIC ports,
    then ``nic_util`` is the probe's summary). Per GPU from the node's thermal model
    (``fleethealth/detectors/thermal.py``): ``power_w``, its power draw (averaged over seconds), ``load_power_w``,
    the power its temperature follows, and
    ``residual_c``, its temperature above what its own model predicts at that power (NaN where
    unknown: an idle GPU, one never seen busy, a state from an older node stage). ``ts`` is the
    newest sample it reflects.
    """

    node: str
    rack: str
    ts: float
    gpu: np.ndarray
    temp_c: np.ndarray
    slowdown_temp_c: np.ndarray
    clock_reasons: np.ndarray
    nvlink_links_up: np.ndarray
    nvlink_links_max: np.ndarray
    reports: np.ndarray
    nvlink_errors_per_min: float = math.nan
    nic_util: float = math.nan
    has_nic: bool = False
    nic_port: tuple[str, ...] = ()
    nic_port_util: np.ndarray = field(default_factory=lambda: np.zeros(0))
    nic_port_wait: np.ndarray = field(default_factory=lambda: np.zeros(0))
    nic_port_down: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    power_w: np.ndarray = field(default_factory=lambda: np.zeros(0))
    load_power_w: np.ndarray = field(default_factory=lambda: np.zeros(0))
    residual_c: np.ndarray = field(default_factory=lambda: np.zeros(0))
    TOPIC: ClassVar[Topic] = Topic.NODESTATE

    GPU_ARRAYS: ClassVar[tuple[str, ...]] = ("temp_c", "slowdown_temp_c", "clock_reasons", "nvlink_links_up",
                                             "nvlink_links_max")
    THERMAL_ARRAYS: ClassVar[tuple[str, ...]] = ("power_w", "load_power_w", "residual_c")
    PORT_ARRAYS: ClassVar[tuple[str, ...]] = ("nic_port_util", "nic_port_wait")

    def __post_init__(self) -> None:
        for name in self.THERMAL_ARRAYS:  # not given (an older node stage): unknown for every GPU
            if getattr(self, name).shape != self.gpu.shape:
                object.__setattr__(self, name, np.full(self.gpu.shape, np.nan))

    @property
    def key(self) -> str:
        return self.node

    def slowdown_limits(self, default: float) -> np.ndarray:
        """Each GPU's own slowdown temperature, ``default`` where the GPU does not report one."""
        own = self.slowdown_temp_c
        return np.where(np.isfinite(own), own, float(default))

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"v": SCHEMA_VERSION, "node": self.node, "rack": self.rack, "ts": self.ts,
                               "gpu": self.gpu.tolist(), "reports": self.reports.astype(bool).tolist()}
        for name in (*self.GPU_ARRAYS, *self.THERMAL_ARRAYS):
            obj[name] = _jsonable(getattr(self, name))
        for name in ("nvlink_errors_per_min", "nic_util"):
            value = getattr(self, name)
            obj[name] = None if math.isnan(value) else value
        if self.has_nic:
            obj["nic"] = {"port": list(self.nic_port), "util": _jsonable(self.nic_port_util),
                          "wait": _jsonable(self.nic_port_wait), "down": self.nic_port_down.astype(bool).tolist()}
        return obj

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        gpu = _array(obj, "gpu", np.int16, minimum=0)
        if np.unique(gpu).size != gpu.size:
            raise SchemaError("gpu", "duplicate GPU index in one node state")
        arrays = {name: _array(obj, name, np.float64, length=gpu.size, nan_ok=True) for name in cls.GPU_ARRAYS}
        arrays.update({name: _array(obj, name, np.float64, length=gpu.size, nan_ok=True)
                       for name in cls.THERMAL_ARRAYS if name in obj})
        reports = _bools(obj, "reports", gpu.size)
        scalars = {name: (math.nan if obj.get(name) is None else _float(obj, name, minimum=None))
                   for name in ("nvlink_errors_per_min", "nic_util")}
        nic = obj.get("nic")
        ports: dict[str, Any] = {}
        if nic is not None:
            if not isinstance(nic, dict):
                raise SchemaError("nic", f"expected an object, got {type(nic).__name__}")
            port = nic.get("port")
            if not isinstance(port, list) or not all(isinstance(p, str) and p for p in port):
                raise SchemaError("nic.port", "expected an array of non-empty strings")
            try:
                ports = {"has_nic": True, "nic_port": tuple(port),
                         "nic_port_util": _array(nic, "util", np.float64, length=len(port), nan_ok=True, minimum=0.0),
                         "nic_port_wait": _array(nic, "wait", np.float64, length=len(port), nan_ok=True, minimum=0.0),
                         "nic_port_down": _bools(nic, "down", len(port))}
            except SchemaError as exc:
                raise SchemaError(f"nic.{exc.field}", exc.problem) from None
        return cls(node=_str(obj, "node"), rack=_str(obj, "rack"), ts=_ts(obj), gpu=gpu, reports=reports,
                   **arrays, **scalars, **ports)


def _bools(obj: dict[str, Any], name: str, length: int) -> np.ndarray:
    value = _req(obj, name)
    if not isinstance(value, list) or len(value) != length or not all(type(x) is bool for x in value):
        raise SchemaError(name, f"expected an array of {length} booleans")
    return np.array(value, dtype=bool)


_T = TypeVar("_T")

Message = Telemetry | StepBatch | StepBlock | Event | Finding | Recommendation | NodeState

TOPIC_TYPES: dict[Topic, type] = {
    Topic.TELEMETRY: Telemetry,
    Topic.STEPS: StepBatch,
    Topic.EVENTS: Event,
    Topic.FINDINGS: Finding,
    Topic.RECOMMENDATIONS: Recommendation,
    Topic.NODESTATE: NodeState,
}


def encode(msg: Message) -> bytes:
    """Serialise a message to JSON bytes (with ``"v"``)."""
    return orjson.dumps(msg.to_obj(), option=orjson.OPT_SERIALIZE_NUMPY)


def load_object(raw: bytes | str | dict[str, Any]) -> dict[str, Any]:
    """Parse one JSON object (a dict passes through); :class:`SchemaError` on anything else."""
    if isinstance(raw, dict):
        return raw
    if len(raw) > MAX_MESSAGE_BYTES:
        raise SchemaError("<message>", f"{len(raw)} bytes exceed the {MAX_MESSAGE_BYTES}-byte message limit")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SchemaError("<message>", f"not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise SchemaError("<message>", f"expected a JSON object, got {type(obj).__name__}")
    return obj


def decode(cls: type[_T], raw: bytes | str | dict[str, Any]) -> _T:
    """Parse and validate one message of type ``cls``; raise :class:`SchemaError` naming the field.

    ``fh.steps`` carries two forms: asked for a :class:`StepBatch`, a value whose ``steps`` is an
    array is a :class:`StepBlock` and is returned as one (:meth:`StepBlock.split` gives its batches).
    """
    obj = load_object(raw)
    version = obj.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:  # true == 1 in Python, not on the wire
        raise SchemaError("v", f"unknown schema version {version!r} (this build reads {SCHEMA_VERSION})")
    if cls is StepBatch and "steps" in obj:
        return StepBlock.from_obj(obj)  # type: ignore[return-value]
    return cls.from_obj(obj)  # type: ignore[attr-defined]


def decode_many(cls: type[_T], raws: Sequence[bytes | str]) -> list[_T | Exception]:
    """Decode many values of one message type (a poll's worth); one result per value, in order.

    Each result is the message, or the exception :func:`decode` raises for that value (a
    :class:`SchemaError` naming the field) — returned, not raised, so one bad value does not
    hide the rest. Results and errors are exactly :func:`decode`'s: step batches and step blocks are
    validated columnar over the whole poll (one NumPy pass for ranks, GPUs and compute times, one for
    the blocks' steps, times and rows), and any value that pass does not accept outright is decoded
    alone by :func:`decode`.
    """
    out: list[Any] = [None] * len(raws)
    fast: list[tuple[int, dict[str, Any]]] = []
    blocks: list[tuple[int, dict[str, Any]]] = []
    for i, raw in enumerate(raws):
        try:
            obj = orjson.loads(raw) if len(raw) <= MAX_MESSAGE_BYTES else None
        except (orjson.JSONDecodeError, TypeError):
            obj = None
        if cls is StepBatch and type(obj) is dict and "steps" in obj:
            if _block_shape_ok(obj):
                blocks.append((i, obj))
            else:
                out[i] = _decode_one(cls, obj)
        elif cls is StepBatch and type(obj) is dict and _step_shape_ok(obj):
            fast.append((i, obj))
        else:
            out[i] = _decode_one(cls, obj if type(obj) is dict else raw)
    if fast:
        for (i, obj), msg in zip(fast, _steps_columnar([obj for _, obj in fast]), strict=True):
            out[i] = msg if msg is not None else _decode_one(cls, obj)
    if blocks:
        for (i, obj), msg in zip(blocks, _blocks_columnar([obj for _, obj in blocks]), strict=True):
            out[i] = msg if msg is not None else _decode_one(cls, obj)
    return out


def _decode_one(cls: type[_T], raw: bytes | str | dict[str, Any]) -> _T | Exception:
    try:
        return decode(cls, raw)
    except Exception as exc:  # returned to the caller, which reports it per value
        return exc


def _step_shape_ok(obj: dict[str, Any]) -> bool:
    """The scalar fields of a step batch are valid and its arrays are lists of one length."""
    if type(obj.get("v")) is not int or obj.get("v") != SCHEMA_VERSION or "steps" in obj:
        return False  # a step block (``steps``) is decoded alone
    job, node, step, ts = obj.get("job"), obj.get("node"), obj.get("step"), obj.get("ts")
    if type(job) is not str or not job or type(node) is not str or not node:
        return False
    if type(step) is not int or not 0 <= step <= _INT_MAX:
        return False
    if type(ts) is float:
        if not 0.0 <= ts < MAX_TS:
            return False
    elif type(ts) is not int or not 0 <= ts < MAX_TS:
        return False
    ranks, gpus, compute, groups = obj.get("ranks"), obj.get("gpus"), obj.get("compute_s"), obj.get("groups")
    if type(ranks) is not list or type(gpus) is not list or type(compute) is not list:
        return False
    n = len(ranks)
    return n > 0 and len(gpus) == n and len(compute) == n and (
        groups is None or (type(groups) is list and len(groups) == n))


_I32 = np.iinfo(np.int32)
_I16_MAX = int(np.iinfo(np.int16).max)


def _column(lists: list[list[Any]], counts: np.ndarray, dtype: type, low: float,
            high: float) -> tuple[np.ndarray, np.ndarray] | None:
    """Concatenate ``lists`` (lengths ``counts``) into one array; also a per-list flag of lists with an
    element of the wrong type or outside ``[low, high]`` (or not finite). None when NumPy cannot
    convert them at all (then every list is decoded alone)."""
    allowed = {int} if dtype is np.int64 else {int, float}
    flat = list(itertools.chain.from_iterable(lists))
    bad = np.zeros(len(lists), dtype=bool)
    if not set(map(type, flat)) <= allowed:  # rare: find the lists at fault, zero them
        bad = np.fromiter((not set(map(type, x)) <= allowed for x in lists), dtype=bool, count=len(lists))
        flat = list(itertools.chain.from_iterable([0] * len(x) if b else x for x, b in zip(lists, bad, strict=True)))
    try:
        arr = np.array(flat, dtype=dtype)
    except (OverflowError, ValueError):
        return None
    wrong = (arr < low) | (arr > high)
    if dtype is np.float64:
        wrong |= ~np.isfinite(arr)
    if wrong.any():
        bad[np.repeat(np.arange(len(lists)), counts)[wrong]] = True
    return arr, bad



def _group_columns(objs: Sequence[dict[str, Any]], counts: np.ndarray,
                   bad: np.ndarray) -> list[np.ndarray | None] | None:
    """Each value's optional ``groups`` (int32, ``counts[k]`` long), read in one pass over those that
    have one, marking ``bad`` the values with an out-of-range group; None when the pass cannot read them."""
    groups: list[np.ndarray | None] = [None] * len(objs)
    with_groups = [k for k, o in enumerate(objs) if o.get("groups") is not None]
    if with_groups:
        got = _column([objs[k]["groups"] for k in with_groups], counts[with_groups], np.int64, _I32.min, _I32.max)
        if got is None:
            return None
        bad[with_groups] |= got[1]
        for k, g in zip(with_groups, _split(got[0].astype(np.int32), counts[with_groups]), strict=True):
            groups[k] = g
    return groups

def _split(flat: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """Views of ``flat`` cut into consecutive pieces of ``counts`` elements."""
    if counts.size and (counts == counts[0]).all():
        return list(flat.reshape(counts.size, int(counts[0])))  # the common case: one node size
    ends = np.cumsum(counts).tolist()
    return [flat[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def _steps_columnar(objs: list[dict[str, Any]]) -> list[StepBatch | None]:
    """Step batches from objects :func:`_step_shape_ok` accepted; None where one needs :func:`decode`."""
    m = len(objs)
    counts = np.fromiter((len(o["ranks"]) for o in objs), dtype=np.int64, count=m)
    bad = np.zeros(m, dtype=bool)
    columns = []
    for name, dtype, low, high in (("ranks", np.int64, 0, _I32.max), ("gpus", np.int64, 0, _I16_MAX),
                                   ("compute_s", np.float64, 0.0, MAX_COMPUTE_S)):
        got = _column([o[name] for o in objs], counts, dtype, low, high)
        if got is None:
            return [None] * m
        columns.append(got[0])
        bad |= got[1]
    ranks, gpus, compute = columns
    seg = np.repeat(np.arange(m), counts)
    order = np.lexsort((ranks, seg))
    same = (ranks[order][1:] == ranks[order][:-1]) & (seg[order][1:] == seg[order][:-1])
    bad[seg[order][1:][same]] = True
    groups = _group_columns(objs, counts, bad)
    if groups is None:
        return [None] * m
    parts = zip(_split(ranks.astype(np.int32), counts), _split(gpus.astype(np.int16), counts),
                _split(compute, counts), groups, strict=True)
    return [None if is_bad else  # decode() names the problem
            StepBatch(job=obj["job"], step=obj["step"], node=obj["node"], ts=float(obj["ts"]), ranks=r, gpus=g,
                      compute_s=c, groups=grp)
            for obj, is_bad, (r, g, c, grp) in zip(objs, bad.tolist(), parts, strict=True)]


def _block_shape_ok(obj: dict[str, Any]) -> bool:
    """The scalar fields of a step block are valid and its arrays are lists of matching lengths (the
    rows of ``compute_s`` one per step, each one value per rank)."""
    if type(obj.get("v")) is not int or obj.get("v") != SCHEMA_VERSION:
        return False
    job, node, steps, ts = obj.get("job"), obj.get("node"), obj.get("steps"), obj.get("ts")
    if type(job) is not str or not job or type(node) is not str or not node:
        return False
    ranks, gpus, rows, groups = obj.get("ranks"), obj.get("gpus"), obj.get("compute_s"), obj.get("groups")
    if type(steps) is not list or type(ts) is not list or type(ranks) is not list or type(gpus) is not list \
            or type(rows) is not list:
        return False
    s, r = len(steps), len(ranks)
    if not 0 < s <= MAX_BLOCK_STEPS or r == 0 or len(ts) != s or len(gpus) != r or len(rows) != s:
        return False
    if groups is not None and (type(groups) is not list or len(groups) != r):
        return False
    return set(map(type, rows)) == {list} and set(map(len, rows)) == {r}


def _distinct(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per segment (consecutive pieces of ``counts`` elements of ``values``): whether a value repeats."""
    m = counts.size
    seg = np.repeat(np.arange(m), counts)
    order = np.lexsort((values, seg))
    same = (values[order][1:] == values[order][:-1]) & (seg[order][1:] == seg[order][:-1])
    bad = np.zeros(m, dtype=bool)
    bad[seg[order][1:][same]] = True
    return bad


def _blocks_columnar(objs: list[dict[str, Any]]) -> list[StepBlock | None]:
    """Step blocks from objects :func:`_block_shape_ok` accepted, every check of
    :meth:`StepBlock.from_obj` done in one NumPy pass per column over all of them; None where one
    needs :func:`decode` (which names the problem)."""
    m = len(objs)
    s_counts = np.fromiter((len(o["steps"]) for o in objs), dtype=np.int64, count=m)
    r_counts = np.fromiter((len(o["ranks"]) for o in objs), dtype=np.int64, count=m)
    bad = np.zeros(m, dtype=bool)
    got = [_column([o[name] for o in objs], counts, dtype, low, high)
           for name, counts, dtype, low, high in (
               ("steps", s_counts, np.int64, 0, _INT_MAX), ("ts", s_counts, np.float64, 0.0, MAX_TS),
               ("ranks", r_counts, np.int64, 0, _I32.max), ("gpus", r_counts, np.int64, 0, _I16_MAX))]
    cells = s_counts * r_counts
    rows = _column([row for o in objs for row in o["compute_s"]], np.repeat(r_counts, s_counts), np.float64,
                   0.0, MAX_COMPUTE_S)
    if rows is None or any(g is None for g in got):
        return [None] * m
    (steps, b1), (ts, b2), (ranks, b3), (gpus, b4) = got  # type: ignore[misc]
    bad |= b1 | b2 | b3 | b4
    row_bad = rows[1]
    if row_bad.any():
        bad[np.repeat(np.arange(m), s_counts)[row_bad]] = True
    late = ts >= MAX_TS
    if late.any():
        bad[np.repeat(np.arange(m), s_counts)[late]] = True
    bad |= _distinct(steps, s_counts) | _distinct(ranks, r_counts)
    groups = _group_columns(objs, r_counts, bad)
    if groups is None:
        return [None] * m
    compute = rows[0]
    out: list[StepBlock | None] = []
    step_parts = _split(steps, s_counts)
    ts_parts = _split(ts, s_counts)
    rank_parts = _split(ranks.astype(np.int32), r_counts)
    gpu_parts = _split(gpus.astype(np.int16), r_counts)
    ends = np.cumsum(cells).tolist()
    starts = [0, *ends[:-1]]
    s_list, r_list = s_counts.tolist(), r_counts.tolist()
    for k, (obj, is_bad) in enumerate(zip(objs, bad.tolist(), strict=True)):
        if is_bad:
            out.append(None)
            continue
        out.append(StepBlock(job=obj["job"], node=obj["node"], steps=step_parts[k], step_ts=ts_parts[k],
                             ranks=rank_parts[k], gpus=gpu_parts[k],
                             compute_s=compute[starts[k]:ends[k]].reshape(s_list[k], r_list[k]), groups=groups[k]))
    return out
