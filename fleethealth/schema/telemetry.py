"""A node's sample of its GPUs and NIC ports (``fh.telemetry``): the fields, their physical ranges, the codec."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntFlag
from typing import Any, ClassVar, Self

import numpy as np

from fleethealth.errors import SchemaError
from fleethealth.schema.fabric import Fabric
from fleethealth.schema.fields import (
    _I16_MAX,
    MAX_TS,
    SCHEMA_VERSION,
    Topic,
    _array,
    _contiguous,
    _float,
    _jsonable,
    _obj,
    _str,
    _ts,
)


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
    address (``()`` when the source does not say). ``fabric`` holds each GPU's NVLink fabric
    registration (:class:`~fleethealth.schema.fabric.Fabric`; ``None`` where no GPU of the node has
    one, as without NVSwitch). All three are optional on the wire, so messages from older probes
    still decode.
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
    fabric: Fabric | None = None
    TOPIC: ClassVar[Topic] = Topic.TELEMETRY

    @classmethod
    def from_columns(cls, node: str, rack: str, ts: float, gpu: np.ndarray | list[int], *,
                     nic_util: float = math.nan, model: str = "", uuid: tuple[str, ...] = (),
                     nic: NicPorts | None = None, pci_bus_id: tuple[str, ...] = (),
                     fabric: Fabric | None = None, **columns: np.ndarray | list[float]) -> Telemetry:
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
                   model=model, uuid=tuple(uuid), nic=nic, pci_bus_id=tuple(pci_bus_id), fabric=fabric)

    @property
    def key(self) -> str:
        return self.node

    def slowdown_limits(self, default: float) -> np.ndarray:
        """Each GPU's own slowdown temperature (``slowdown_temp_c``, from NVML's threshold or
        DCGM's field), ``default`` for a GPU that does not report one (an old driver or source)."""
        own = self.columns["slowdown_temp_c"]
        return np.where(np.isfinite(own), own, float(default))

    def to_obj(self, *, arrays: bool = False) -> dict[str, Any]:
        """The wire object; with ``arrays`` the columns stay NumPy arrays (contiguous float64), which
        :func:`~fleethealth.schema.codec.encode` writes as the same bytes (NaN as null) 2.6 times
        faster than as 36 Python lists a sample (``bench/telemetry_encode.py``)."""
        floats = _contiguous if arrays else _jsonable
        obj = {
            "v": SCHEMA_VERSION, "node": self.node, "rack": self.rack, "ts": self.ts,
            "gpu": self.gpu.tolist(), "nic_util": None if math.isnan(self.nic_util) else self.nic_util,
            "model": self.model, "uuid": list(self.uuid),
            "columns": {k: floats(v) for k, v in self.columns.items()},
        }
        if self.nic is not None:
            obj["nic"] = self.nic.to_obj()
        if self.pci_bus_id:
            obj["pci_bus_id"] = list(self.pci_bus_id)
        if self.fabric is not None:
            obj["fabric"] = self.fabric.to_obj()
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
        ts = _ts(obj)
        fabric = obj.get("fabric")
        return cls(node=_str(obj, "node"), rack=_str(obj, "rack"), ts=ts, gpu=gpu,
                   columns=columns, nic_util=math.nan if nic is None else _float(obj, "nic_util"),
                   model=model, uuid=tuple(uuid), nic=None if ports is None else NicPorts.from_obj(ports),
                   pci_bus_id=tuple(bus), fabric=None if fabric is None else Fabric.from_obj(fabric, len(gpu), ts))


# ---------------------------------------------------------------------------------------------- a poll at once
_GPU_NAMES = tuple(GPU_FIELDS)
_NIC_NAMES = tuple(NIC_FIELDS)
_GPU_SET = frozenset(_GPU_NAMES)
_GPU_GET = operator.itemgetter(*_GPU_NAMES)  # a value's columns in GPU_FIELDS order, in one call
_NIC_GET = operator.itemgetter(*_NIC_NAMES)
_NIC_SET = frozenset(_NIC_NAMES)
_GPU_LOW = np.array([GPU_FIELD_RANGES[n][0] for n in _GPU_NAMES])[None, :, None]
_GPU_HIGH = np.array([GPU_FIELD_RANGES[n][1] for n in _GPU_NAMES])[None, :, None]


def _strings(value: Any, *, nonempty: bool = False) -> bool:
    return type(value) is list and all(type(x) is str and (x or not nonempty) for x in value)


def _sample_shape(obj: Any) -> tuple[int, int] | None:
    """``(GPUs, NIC ports or -1)`` of a telemetry value whose scalar fields are valid and whose columns are
    every field of :data:`GPU_FIELDS` (and :data:`NIC_FIELDS`), as :meth:`Telemetry.to_obj` writes them; None
    for any other value (decoded alone by :meth:`Telemetry.from_obj`, which names a problem)."""
    if type(obj) is not dict or type(obj.get("v")) is not int or obj["v"] != SCHEMA_VERSION or "fabric" in obj:
        return None
    node, rack, ts, gpu, cols = obj.get("node"), obj.get("rack"), obj.get("ts"), obj.get("gpu"), obj.get("columns")
    if type(node) is not str or not node or type(rack) is not str or not rack:
        return None
    if type(ts) not in (float, int) or not 0.0 <= ts <= MAX_TS:
        return None
    util = obj.get("nic_util")
    if util is not None and (type(util) not in (float, int) or not 0.0 <= util < math.inf):
        return None
    if type(gpu) is not list or type(cols) is not dict or cols.keys() != _GPU_SET:
        return None
    if type(obj.get("model", "")) is not str or not _strings(obj.get("uuid", [])) \
            or not _strings(obj.get("pci_bus_id", [])):
        return None
    nic = obj.get("nic")
    if nic is None:
        return len(gpu), -1
    if type(nic) is not dict or type(nic.get("columns")) is not dict or nic["columns"].keys() != _NIC_SET:
        return None
    port, kind = nic.get("port"), nic.get("kind")
    if not _strings(port, nonempty=True) or not _strings(kind, nonempty=True) or len(kind) != len(port) \
            or not set(kind) <= set(NicPorts.KINDS):
        return None
    return len(gpu), len(port)


def _stack(lists: list[Any], width: int) -> np.ndarray | None:
    """``lists`` (numbers or nulls, ``width`` each) as one float64 array ``(len(lists), width)``; None when
    any is not such a list."""
    if not set(map(type, lists)) <= {list} or set(map(len, lists)) - {width}:
        return None
    flat = list(itertools.chain.from_iterable(lists))  # one flat list: NumPy converts it without shape discovery
    if not set(map(type, flat)) <= _NUMBER_OR_NULL:
        return None
    try:
        matrix = np.array(flat, dtype=np.float64)  # None becomes NaN
    except (OverflowError, TypeError, ValueError):
        return None
    return matrix.reshape(len(lists), width)


def _group(objs: list[dict[str, Any]], n: int, p: int) -> list[Telemetry | None]:
    """Samples of one shape (``n`` GPUs, ``p`` NIC ports, -1: none) validated in one NumPy pass per array."""
    m = len(objs)
    out: list[Telemetry | None] = [None] * m
    gpus = [o["gpu"] for o in objs]
    if n == 0 or not all(len(g) == n for g in gpus) or not set(map(type, itertools.chain.from_iterable(gpus))) <= {int}:
        return out
    gpu = np.array(gpus, dtype=np.float64).reshape(m, n)  # exact for int16's range, checked next
    good = ((gpu >= 0) & (gpu <= _I16_MAX)).all(axis=1)
    ordered = np.sort(gpu, axis=1)
    good &= (np.diff(ordered, axis=1) != 0).all(axis=1)  # no duplicate GPU index in one sample
    values = _stack(list(itertools.chain.from_iterable(map(_GPU_GET, (o["columns"] for o in objs)))), n)
    if values is None:
        return out
    matrix = values.reshape(m, len(_GPU_NAMES), n)
    good &= ~np.isinf(matrix).any(axis=(1, 2))
    good &= ~((matrix < _GPU_LOW) | (matrix > _GPU_HIGH)).any(axis=(1, 2))  # NaN compares False
    nic = None
    if p >= 0:
        nic_values = _stack(list(itertools.chain.from_iterable(map(_NIC_GET, (o["nic"]["columns"] for o in objs)))), p)
        if nic_values is None:
            return out
        nic = nic_values.reshape(m, len(_NIC_NAMES), p)
        good &= ~np.isinf(nic).any(axis=(1, 2)) & ~(nic < 0.0).any(axis=(1, 2))
    gpu16 = gpu.astype(np.int16)
    for i in np.flatnonzero(good).tolist():
        obj = objs[i]
        ports = None
        if nic is not None:
            ports = NicPorts(port=tuple(obj["nic"]["port"]), kind=tuple(obj["nic"]["kind"]),
                             columns=dict(zip(_NIC_NAMES, nic[i].copy(), strict=True)))
        util = obj.get("nic_util")
        out[i] = Telemetry(node=obj["node"], rack=obj["rack"], ts=float(obj["ts"]), gpu=gpu16[i].copy(),
                           columns=dict(zip(_GPU_NAMES, matrix[i].copy(), strict=True)),
                           nic_util=math.nan if util is None else float(util), model=obj.get("model", ""),
                           uuid=tuple(obj.get("uuid", [])), nic=ports, pci_bus_id=tuple(obj.get("pci_bus_id", [])))
    return out


def telemetry_columnar(objs: Sequence[Any]) -> list[Telemetry | None]:
    """A poll's telemetry values decoded at once: the values of one shape (GPUs, NIC ports) stacked into one
    array per part, type-checked, range-checked and split into samples in a few NumPy passes. Each result
    is the sample :meth:`Telemetry.from_obj` gives for that value, or None for a value this pass does not
    accept outright (an unusual shape, an error): decoded alone, which names the problem."""
    out: list[Telemetry | None] = [None] * len(objs)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, obj in enumerate(objs):
        shape = _sample_shape(obj)
        if shape is not None:
            groups.setdefault(shape, []).append(i)
    for (n, p), rows in groups.items():
        for i, msg in zip(rows, _group([objs[i] for i in rows], n, p), strict=True):
            out[i] = msg
    return out
