"""DCGM telemetry source: the same columns as the NVML source, read from ``nv-hostengine`` by field id.

The Python bindings (``pydcgm``, ``dcgm_fields``, ``dcgm_structs``, ``DcgmReader``) ship with the
DCGM install, not on PyPI; :func:`find_bindings` looks in ``$DCGM_BINDINGS``, then
``/usr/share/datacenter-gpu-manager-4/bindings/python3`` and ``/usr/local/dcgm/bindings/python3``.

Per GPU the source watches every field of :data:`fleethealth.probe.fields.FIELDS` that has a DCGM
id, plus Xid (230) and the GPU recovery action (1523), and reads them each interval with
``DcgmReader.GetAllGpuValuesAsFieldIdDictSinceLastCall()``: the newest value of each field becomes
the column (DCGM's blank / not-supported sentinels become NaN), and *every* Xid value since the
last call becomes one ``xid`` event, so a repeated Xid is not lost. A recovery action other than
``none`` becomes a ``health_watch`` event when it changes. DCGM health watches
(``health.Set(DCGM_HEALTH_WATCH_ALL)``; ``health.Check()`` each interval) turn each new incident
into a ``health_watch`` event naming the system (PCIe, NVLink, memory, thermal, power, ...).

The reader and the health object are injected (``reader=``, ``health=``): production passes
nothing and connects to the host engine; tests pass recorded values with the same call surface,
since these machines have neither a GPU nor DCGM.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fleethealth.errors import DeviceError
from fleethealth.probe.fields import DCGM_GPU_RECOVERY_ACTION, DCGM_XID_ERRORS, FIELDS, RECOVERY_ACTIONS
from fleethealth.probe.sources import Sample
from fleethealth.schema import GPU_FIELDS, Event, EventKind, Telemetry

__all__ = ["DcgmSource", "find_bindings", "BINDING_DIRS", "WATCHED_FIELDS", "HEALTH_SYSTEMS"]

BINDING_DIRS = ("/usr/share/datacenter-gpu-manager-4/bindings/python3", "/usr/local/dcgm/bindings/python3")
WATCHED_FIELDS: tuple[int, ...] = tuple(s.dcgm_id for s in FIELDS if s.dcgm_id is not None) + (
    DCGM_XID_ERRORS, DCGM_GPU_RECOVERY_ACTION)
HEALTH_SYSTEMS: dict[int, str] = {0x1: "pcie", 0x2: "nvlink", 0x4: "pmu", 0x8: "mcu", 0x10: "memory", 0x20: "sm",
                                  0x40: "inforom", 0x80: "thermal", 0x100: "power", 0x200: "driver",
                                  0x400: "nvswitch_nonfatal", 0x800: "nvswitch_fatal"}
_HEALTH_RESULTS = {0: "pass", 10: "warn", 20: "fail"}
_HEALTH_WATCH_ALL = 0xFFFFFFFF
_INT64_BLANK = 0x7FFFFFFFFFFFFFF0  # DCGM_INT64_BLANK and the not-found / not-supported values above it
_INT32_BLANK = 0x7FFFFFF0
_FP64_BLANK = 140737488355328.0    # DCGM_FP64_BLANK and above
_HINT = "use --source nvml to read the driver directly, or --source sim without GPUs"


def find_bindings(extra: str | None = None) -> Path:
    """The directory holding ``pydcgm.py``, or a one-line :class:`DeviceError` naming where it looked."""
    candidates = [p for p in (extra, os.environ.get("DCGM_BINDINGS"), *BINDING_DIRS) if p]
    for candidate in candidates:
        if (Path(candidate) / "pydcgm.py").is_file():
            return Path(candidate)
    raise DeviceError(f"DCGM source: the DCGM Python bindings (pydcgm) were not found in {', '.join(candidates)} "
                      f"(install datacenter-gpu-manager or set DCGM_BINDINGS); {_HINT}")


class DcgmSource:
    """Telemetry of every GPU on this node through the DCGM host engine at ``hostname``."""

    name = "dcgm"

    def __init__(self, node: str, rack: str, *, reader: Any = None, health: Any = None,
                 hostname: str = "localhost", interval_s: float = 1.0, bindings: str | None = None,
                 uuids: dict[int, str] | None = None, model: str = "") -> None:
        self.node = node
        self.rack = rack
        self.hostname = hostname
        self.interval_s = interval_s
        self._bindings = bindings
        self._reader = reader
        self._health = health
        self._uuids = dict(uuids or {})
        self._model = model
        self._cache: dict[int, dict[int, float]] = {}
        self._recovery: dict[int, int] = {}
        self._incidents: set[tuple[int, int, int]] = set()
        self._silent: dict[int, int] = {}
        self.lost_after = 3
        self.health_error: str | None = None

    def open(self) -> None:
        if self._reader is None:
            self._reader, self._health = self._connect()
        if self._health is not None:
            try:
                self._health.Set(_HEALTH_WATCH_ALL)
            except Exception as exc:  # a host engine without health support still gives telemetry
                self.health_error = f"{type(exc).__name__}: {exc}"
                self._health = None
        self._uuids = self._uuids or {int(k): str(v) for k, v in getattr(self._reader, "m_gpuIdToUUId", {}).items()}
        self._read()  # DcgmReader's first since-last-call read only starts the collection

    def _connect(self) -> tuple[Any, Any]:
        path = str(find_bindings(self._bindings))
        if path not in sys.path:
            sys.path.append(path)
        try:
            import dcgm_structs
            from DcgmReader import DcgmReader
        except ImportError as exc:
            raise DeviceError(f"DCGM source: cannot import the DCGM bindings from {path} ({exc}); {_HINT}") from exc
        reader = DcgmReader(hostname=self.hostname, fieldIds=list(WATCHED_FIELDS),
                            updateFrequency=int(self.interval_s * 1_000_000),
                            fieldGroupName=f"fleethealth_{os.getpid()}")
        try:
            reader.Init()
        except dcgm_structs.DCGMError as exc:
            raise DeviceError(f"DCGM source: cannot load libdcgm or reach nv-hostengine at {self.hostname} "
                              f"({exc}); {_HINT}") from exc
        if getattr(reader, "m_dcgmHandle", None) is None:
            raise DeviceError(f"DCGM source: the DCGM host engine (nv-hostengine) is not reachable at "
                              f"{self.hostname}:5555; {_HINT}")
        return reader, reader.m_dcgmGroup.health

    def close(self) -> None:
        shutdown = getattr(self._reader, "Shutdown", None)
        if shutdown is not None:
            shutdown()

    # ------------------------------------------------------------ sampling
    def _read(self) -> dict[int, dict[int, list[Any]]]:
        return self._reader.GetAllGpuValuesAsFieldIdDictSinceLastCall() or {}

    def sample(self, ts: float) -> Sample:
        if self._reader is None:
            raise DeviceError("DCGM source: sample() before open()")
        fresh = self._read()
        events: list[Event] = []
        for gpu_id, fields in fresh.items():
            gpu_id = int(gpu_id)
            cache = self._cache.setdefault(gpu_id, {})
            for field_id, values in fields.items():
                field_id = int(field_id)
                numbers = [_number(v) for v in (values if isinstance(values, list) else [values])]
                numbers = [x for x in numbers if not math.isnan(x)]
                if not numbers:
                    continue
                cache[field_id] = numbers[-1]
                if field_id == DCGM_XID_ERRORS:
                    events.extend(Event(node=self.node, ts=ts, kind=EventKind.XID, gpu=gpu_id, code=int(x),
                                        message=f"Xid {int(x)} on GPU {gpu_id}", data={"source": "dcgm"})
                                  for x in numbers if x > 0)
                elif field_id == DCGM_GPU_RECOVERY_ACTION:
                    events.extend(self._recovery_event(ts, gpu_id, int(numbers[-1])))
        events.extend(self._lost_gpus(ts, fresh))
        gpus = sorted(set(self._cache) | set(self._uuids))
        cols = {name: np.full(len(gpus), np.nan) for name in GPU_FIELDS}
        for i, gpu_id in enumerate(gpus):
            cache = self._cache.get(gpu_id, {})
            for spec in FIELDS:
                if spec.dcgm_id is not None and spec.dcgm_id in cache:
                    cols[spec.column][i] = cache[spec.dcgm_id]
        events.extend(self._check_health(ts))
        uuid = tuple(self._uuids.get(g, "") for g in gpus) if self._uuids else ()
        telemetry = Telemetry.from_columns(self.node, self.rack, ts, gpus, model=self._model, uuid=uuid, **cols)
        return Sample(telemetry, tuple(events))

    def _lost_gpus(self, ts: float, fresh: dict[Any, dict[Any, list[Any]]]) -> list[Event]:
        """A GPU that answered before and now yields no value ``lost_after`` reads in a row, while
        others do, has fallen off the bus (DCGM blanks its fields): one ``gpu_lost`` event, NaN columns."""
        answered = {int(g) for g, fields in fresh.items()
                    if any(not math.isnan(_number(v)) for vals in fields.values()
                           for v in (vals if isinstance(vals, list) else [vals]))}
        if not answered:  # nothing new from anyone: a quiet interval or a stalled engine, not a lost GPU
            return []
        events = []
        for gpu in list(self._cache):
            if gpu in answered:
                self._silent.pop(gpu, None)
                continue
            self._silent[gpu] = self._silent.get(gpu, 0) + 1
            if self._silent[gpu] == self.lost_after:
                self._cache[gpu] = {}
                events.append(Event(node=self.node, ts=ts, kind=EventKind.GPU_LOST, gpu=gpu,
                                    message=f"GPU {gpu} stopped answering DCGM for {self.lost_after} reads",
                                    data={"uuid": self._uuids.get(gpu, ""), "source": "dcgm"}))
        return events

    def _recovery_event(self, ts: float, gpu: int, action: int) -> list[Event]:
        previous = self._recovery.get(gpu, 0)
        self._recovery[gpu] = action
        if action == previous or action == 0:
            return []
        name = RECOVERY_ACTIONS.get(action, f"action_{action}")
        return [Event(node=self.node, ts=ts, kind=EventKind.HEALTH_WATCH, gpu=gpu,
                      message=f"DCGM requests GPU recovery action {name} on GPU {gpu}",
                      data={"system": "recovery_action", "recovery_action": name, "code": action,
                            "source": "dcgm"})]

    def _check_health(self, ts: float) -> list[Event]:
        if self._health is None:
            return []
        try:
            response = self._health.Check()
        except Exception as exc:  # a failed check is reported once, telemetry continues
            self.health_error = f"{type(exc).__name__}: {exc}"
            return []
        seen: set[tuple[int, int, int]] = set()
        events: list[Event] = []
        for i in range(int(getattr(response, "incidentCount", 0))):
            incident = response.incidents[i]
            gpu = int(incident.entityInfo.entityId)
            code = int(getattr(incident.error, "code", 0))
            key = (gpu, int(incident.system), code)
            seen.add(key)
            if key in self._incidents:
                continue
            msg = incident.error.msg
            msg = msg.decode() if isinstance(msg, bytes) else str(msg)
            system = HEALTH_SYSTEMS.get(int(incident.system), f"system_{int(incident.system):#x}")
            result = _HEALTH_RESULTS.get(int(incident.health), str(int(incident.health)))
            events.append(Event(node=self.node, ts=ts, kind=EventKind.HEALTH_WATCH, gpu=gpu, code=code,
                                message=msg, data={"system": system, "health": result, "source": "dcgm"}))
        self._incidents = seen
        return events


def _number(value: Any) -> float:
    """A DCGM sample (a value object with ``.value`` or a bare number) as float; blanks as NaN."""
    if getattr(value, "isBlank", False):
        return math.nan
    raw = getattr(value, "value", value)
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        return math.nan
    if isinstance(raw, int) and (raw >= _INT64_BLANK or _INT32_BLANK <= raw <= 0x7FFFFFFF):
        return math.nan
    if isinstance(raw, float) and (not math.isfinite(raw) or raw >= _FP64_BLANK):
        return math.nan
    return float(raw)
