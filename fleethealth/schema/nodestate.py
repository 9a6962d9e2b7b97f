"""What the node stage knows of one node for a straggler's diagnosis (``fh.nodestate``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import numpy as np
import orjson

from fleethealth.errors import SchemaError
from fleethealth.schema.fields import SCHEMA_VERSION, Topic, _array, _bools, _contiguous, _float, _jsonable, _str, _ts


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

    def to_obj(self, *, arrays: bool = False) -> dict[str, Any]:
        """The wire object; with ``arrays``, the float arrays stay NumPy arrays (contiguous float64), which
        :func:`~fleethealth.schema.codec.encode` serialises to the same bytes (NaN as null) without a
        Python list per array."""
        obj: dict[str, Any] = {"v": SCHEMA_VERSION, "node": self.node, "rack": self.rack, "ts": self.ts,
                               "gpu": self.gpu.tolist(), "reports": self.reports.astype(bool).tolist()}
        floats = _contiguous if arrays else _jsonable
        for name in (*self.GPU_ARRAYS, *self.THERMAL_ARRAYS):
            obj[name] = floats(getattr(self, name))
        for name in ("nvlink_errors_per_min", "nic_util"):
            value = getattr(self, name)
            obj[name] = None if math.isnan(value) else value
        if self.has_nic:
            obj["nic"] = {"port": list(self.nic_port), "util": floats(self.nic_port_util),
                          "wait": floats(self.nic_port_wait), "down": self.nic_port_down.astype(bool).tolist()}
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


_FLOAT_ARRAYS = (*NodeState.GPU_ARRAYS, *NodeState.THERMAL_ARRAYS)


def encode_states(states: Sequence[NodeState]) -> list[bytes]:
    """Each state's wire bytes (``codec.encode``'s, byte for byte), a poll's at once: the states of one
    shape (GPUs, NIC ports) have each array stacked and turned into Python numbers by one NumPy call
    per field, so a state costs one dict and one ``orjson.dumps``, not a NumPy call per array."""
    out: list[bytes] = [b""] * len(states)
    shapes: dict[tuple[int, int, bool], list[int]] = {}
    for i, s in enumerate(states):
        shapes.setdefault((s.gpu.size, len(s.nic_port), s.has_nic), []).append(i)
    for (n, p, has_nic), rows in shapes.items():
        part = [states[i] for i in rows]
        gpus = _flat([s.gpu for s in part], np.int64)
        reports = _flat([s.reports for s in part], np.bool_)
        floats = [_flat([getattr(s, name) for s in part], np.float64) for name in _FLOAT_ARRAYS]
        utils = _flat([s.nic_port_util for s in part], np.float64)
        waits = _flat([s.nic_port_wait for s in part], np.float64)
        downs = _flat([s.nic_port_down for s in part], np.bool_)
        m = len(part)
        if any(len(x) != m * n for x in (gpus, reports, *floats)) \
                or any(len(x) != m * p for x in (utils, waits, downs)):  # an array of another length: one by one
            for i, s in zip(rows, part, strict=True):
                out[i] = orjson.dumps(s.to_obj(arrays=True), option=orjson.OPT_SERIALIZE_NUMPY)
            continue
        for j, (i, s) in enumerate(zip(rows, part, strict=True)):
            a, b = j * n, (j + 1) * n
            obj: dict[str, Any] = {"v": SCHEMA_VERSION, "node": s.node, "rack": s.rack, "ts": s.ts,
                                   "gpu": gpus[a:b], "reports": reports[a:b]}
            for name, values in zip(_FLOAT_ARRAYS, floats, strict=True):
                obj[name] = values[a:b]
            rate, util = s.nvlink_errors_per_min, s.nic_util
            obj["nvlink_errors_per_min"] = None if math.isnan(rate) else rate
            obj["nic_util"] = None if math.isnan(util) else util
            if has_nic:
                c, d = j * p, (j + 1) * p
                obj["nic"] = {"port": list(s.nic_port), "util": utils[c:d], "wait": waits[c:d], "down": downs[c:d]}
            out[i] = orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)
    return out


def _flat(arrays: list[np.ndarray], dtype: type) -> list[Any]:
    """Arrays of one length, concatenated as Python numbers (NaN stays a float, which orjson writes as null)."""
    return np.concatenate(arrays).astype(dtype, copy=False).tolist()
