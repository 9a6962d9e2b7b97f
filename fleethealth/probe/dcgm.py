"""DCGM telemetry source: the same columns as the NVML source, read from ``nv-hostengine`` by field id.

The Python bindings (``pydcgm``, ``dcgm_fields``, ``dcgm_structs``, ``DcgmReader``) ship with the
DCGM install, not on PyPI; :func:`find_bindings` looks in ``$DCGM_BINDINGS``, then
``/usr/share/datacenter-gpu-manager-4/bindings/python3`` and ``/usr/local/dcgm/bindings/python3``.

Per GPU the source watches every field of :data:`fleethealth.probe.fields.FIELDS` that has a DCGM
id, plus Xid (230) and the GPU recovery action (1523) — but only the fields the running DCGM
knows (DCGM 3.3 to 4.6 are supported). Before watching it asks DCGM for each field's metadata
(``dcgm_fields.DcgmFieldGetById``) and its version (``dcgm_agent.dcgmVersionInfo``): a field DCGM has
no metadata for, or one newer than that version (:data:`fleethealth.probe.fields.FIELD_SINCE`; the
recovery action exists from 4.5.0), is left out with one warning naming it, and its column stays
NaN. If the host engine still refuses the watch (a standalone engine older than the local
library, as GPU Operator may run), the source retries once without the newer fields, and if that
fails says that the *watch* failed and on which fields, not that libdcgm is missing. Each
interval it reads the fields with
``DcgmReader.GetAllGpuValuesAsFieldIdDictSinceLastCall()``: the newest value of each field becomes
the column (DCGM's blank / not-found / not-supported / not-permissioned sentinels become NaN, by
the width of the field's value: DCGM's integer fields are 64-bit, so a 64-bit counter is checked
against ``DCGM_INT64_BLANK``, never the 32-bit sentinel), and *every* Xid value since the
last call becomes one ``xid`` event, so a repeated Xid is not lost. A recovery action other than
``none`` becomes a ``health_watch`` event when it changes. DCGM health watches
(``health.Set(DCGM_HEALTH_WATCH_ALL)``; ``health.Check()`` each interval) turn each new incident
into a ``health_watch`` event naming the system (PCIe, NVLink, memory, thermal, power, ...).

``hostname`` is the host engine, ``localhost`` (the embedded or node-local ``nv-hostengine``)
or ``HOST[:PORT]`` — GPU Operator's standalone engine is ``nvidia-dcgm:5555`` (``--dcgm-host``,
``$FLEETHEALTH_DCGM_HOST``).

The reader and the health object are injected (``reader=``, ``health=``), and so are the field
metadata and the version (``field_meta=``, ``version=``): production passes nothing and connects to
the host engine; tests pass recorded values with the same call surface, since these machines have
neither a GPU nor DCGM.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fleethealth.errors import DeviceError
from fleethealth.probe.fields import (
    DCGM_FABRIC_FIELDS,
    DCGM_GPU_RECOVERY_ACTION,
    DCGM_XID_ERRORS,
    FIELD_SINCE,
    FIELDS,
    RECOVERY_ACTIONS,
)
from fleethealth.probe.sources import Sample
from fleethealth.schema import GPU_FIELDS, Event, EventKind, Fabric, Telemetry

__all__ = ["DcgmSource", "find_bindings", "select_fields", "FieldSelection", "parse_version", "BINDING_DIRS",
           "WATCHED_FIELDS", "HEALTH_SYSTEMS"]

_log = logging.getLogger("fleethealth.probe.dcgm")

BINDING_DIRS = ("/usr/share/datacenter-gpu-manager-4/bindings/python3", "/usr/local/dcgm/bindings/python3")
WATCHED_FIELDS: tuple[int, ...] = tuple(s.dcgm_id for s in FIELDS if s.dcgm_id is not None) + (
    DCGM_XID_ERRORS, DCGM_GPU_RECOVERY_ACTION, *DCGM_FABRIC_FIELDS.values())
HEALTH_SYSTEMS: dict[int, str] = {0x1: "pcie", 0x2: "nvlink", 0x4: "pmu", 0x8: "mcu", 0x10: "memory", 0x20: "sm",
                                  0x40: "inforom", 0x80: "thermal", 0x100: "power", 0x200: "driver",
                                  0x400: "nvswitch_nonfatal", 0x800: "nvswitch_fatal"}
_HEALTH_RESULTS = {0: "pass", 10: "warn", 20: "fail"}
_HEALTH_WATCH_ALL = 0xFFFFFFFF
_INT64_BLANK = 0x7FFFFFFFFFFFFFF0  # DCGM_INT64_BLANK; NOT_FOUND, NOT_SUPPORTED, NOT_PERMISSIONED are +1..+3
_INT32_BLANK = 0x7FFFFFF0          # DCGM_INT32_BLANK, for the few 32-bit values (field size 4)
_FP64_BLANK = 140737488355328.0    # DCGM_FP64_BLANK and above
_FM = DCGM_FABRIC_FIELDS
_FM_STATE = {0: 0, 1: 1, 2: 2, 3: 3, 4: 3}
"""``dcgmFabricManagerStatus_t`` -> NVML's fabric state (Failure is a completed registration with an error;
Unrecognized and NvmlTooOld say nothing of the state)."""
_HINT = "use --source nvml to read the driver directly, or --source sim without GPUs"


@dataclass(frozen=True)
class FieldSelection:
    """Which wanted fields to watch: ``watch`` (ids), ``unknown`` (id -> why it is left out) and
    ``widths`` (id -> 32 or 64, the bit width of an integer field's value, for the blank check)."""

    watch: tuple[int, ...]
    unknown: dict[int, str]
    widths: dict[int, int]


def parse_version(text: str | bytes | None) -> tuple[int, int, int] | None:
    """``"version:4.4.1;arch:x86_64;..."`` or ``"4.4.1"`` -> ``(4, 4, 1)``; ``None`` when there is none."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    if not text:
        return None
    m = re.search(r"(?:^|version:)\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def select_fields(wanted: Iterable[int], field_meta: Callable[[int], Any],
                  version: tuple[int, int, int] | None) -> FieldSelection:
    """The fields of ``wanted`` this DCGM knows: ``field_meta(id)`` is DCGM's metadata for the id
    (an object with ``fieldType`` and ``size``, as ``dcgm_fields.DcgmFieldGetById`` returns) or
    ``None``; ``version`` is DCGM's release (``None``: unknown, metadata alone decides)."""
    watch, unknown, widths = [], {}, {}
    shown = ".".join(map(str, version)) if version else "this DCGM"
    for fid in wanted:
        since = FIELD_SINCE.get(fid)
        try:
            meta = field_meta(fid)
        except Exception as exc:  # noqa: BLE001 - a metadata lookup that fails is an unknown field
            unknown[fid] = f"DCGM field metadata lookup failed ({type(exc).__name__}: {exc})"
            continue
        if meta is None:
            unknown[fid] = f"DCGM {shown} has no field {fid}" + (
                f" (added in DCGM {'.'.join(map(str, since))})" if since else "")
            continue
        if since is not None and version is not None and version < since:
            unknown[fid] = f"DCGM {shown} predates field {fid} (added in DCGM {'.'.join(map(str, since))})"
            continue
        watch.append(fid)
        kind = getattr(meta, "fieldType", b"i")
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        if kind == "i":
            widths[fid] = 32 if int(getattr(meta, "size", 8) or 8) == 4 else 64
    return FieldSelection(tuple(watch), unknown, widths)


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
                 uuids: dict[int, str] | None = None, model: str = "",
                 field_meta: Callable[[int], Any] | None = None, version: str | None = None) -> None:
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
        self._fabric_uuid: dict[int, str] = {}                # GPU -> DCGM_FI_DEV_FABRIC_CLUSTER_UUID
        self._fabric_seen: dict[int, tuple[int, float]] = {}  # GPU -> (fabric state, when first read)
        self.lost_after = 3
        self.health_error: str | None = None
        self._field_meta = field_meta
        self._bus_ids: dict[int, str] = {}
        self.version = parse_version(version)
        self.selection = FieldSelection(WATCHED_FIELDS, {}, {})
        self.driver_version = ""

    def open(self) -> None:
        if self._reader is None:
            self._reader, self._health = self._connect()
        elif self._field_meta is not None:
            self._select(self._field_meta)
        if self._health is not None:
            try:
                self._health.Set(_HEALTH_WATCH_ALL)
            except Exception as exc:  # a host engine without health support still gives telemetry
                self.health_error = f"{type(exc).__name__}: {exc}"
                self._health = None
        self._uuids = self._uuids or {int(k): str(v) for k, v in getattr(self._reader, "m_gpuIdToUUId", {}).items()}
        self._bus_ids = {int(k): _text(v) for k, v in (getattr(self._reader, "m_gpuIdToBusId", None) or {}).items()}
        self.driver_version = self.driver_version or self._read_driver_version()
        self._read()  # DcgmReader's first since-last-call read only starts the collection

    def _read_driver_version(self) -> str:
        """The NVIDIA driver version from DCGM's GPU attributes (``""`` when the reader cannot say)."""
        system = getattr(self._reader, "m_dcgmSystem", None)
        if system is None or not self._uuids:
            return ""
        try:
            attrs = system.discovery.GetGpuAttributes(min(self._uuids))
            return _text(attrs.identifiers.driverVersion)
        except Exception:  # noqa: BLE001 - a label, not worth failing the source for
            return ""

    def _select(self, field_meta: Callable[[int], Any]) -> FieldSelection:
        self.selection = select_fields(WATCHED_FIELDS, field_meta, self.version)
        for fid, why in sorted(self.selection.unknown.items()):
            _log.warning("DCGM source: not watching field %d: %s; its value stays unknown", fid, why,
                         extra={"event": "dcgm_field_unknown", "field_id": fid})
        return self.selection

    def _connect(self) -> tuple[Any, Any]:
        path = str(find_bindings(self._bindings))
        if path not in sys.path:
            sys.path.append(path)
        try:
            import dcgm_agent
            import dcgm_fields
            import dcgm_structs
            from DcgmReader import DcgmReader
        except ImportError as exc:
            raise DeviceError(f"DCGM source: cannot import the DCGM bindings from {path} ({exc}); {_HINT}") from exc
        try:
            dcgm_structs._dcgmInit()
        except Exception as exc:  # noqa: BLE001 - the bindings raise their own types for a missing library
            raise DeviceError(f"DCGM source: cannot load libdcgm.so ({type(exc).__name__}: {exc}); install "
                              f"datacenter-gpu-manager on the node; {_HINT}") from exc
        if self.version is None:
            try:
                self.version = parse_version(dcgm_agent.dcgmVersionInfo().rawBuildInfoString)
            except Exception as exc:  # noqa: BLE001 - an old library without the call: metadata alone decides
                _log.info("DCGM source: cannot read the DCGM version (%s); choosing fields by metadata", exc)
        selection = self._select(self._field_meta or dcgm_fields.DcgmFieldGetById)
        fields = list(selection.watch)
        for attempt in (0, 1):
            reader = DcgmReader(hostname=self.hostname, fieldIds=fields,
                                updateFrequency=int(self.interval_s * 1_000_000),
                                fieldGroupName=f"fleethealth_{os.getpid()}")
            try:
                reader.Init()
            except dcgm_structs.DCGMError as exc:
                if getattr(reader, "m_dcgmHandle", None) is None:
                    where = self.hostname if ":" in self.hostname else f"{self.hostname}:5555"
                    raise DeviceError(f"DCGM source: cannot connect to the DCGM host engine (nv-hostengine) at "
                                      f"{where} ({exc}); start it, or point --dcgm-host / "
                                      f"$FLEETHEALTH_DCGM_HOST at it (GPU Operator with dcgm.enabled: "
                                      f"nvidia-dcgm.gpu-operator.svc.cluster.local:5555); "
                                      f"{_HINT}") from exc
                newer = [f for f in fields if f in FIELD_SINCE]
                if attempt == 0 and newer:  # an engine older than the library: retry without the newer fields
                    _log.warning("DCGM source: the host engine at %s refused to watch %d fields (%s); retrying "
                                 "without fields %s, which need a newer DCGM", self.hostname, len(fields), exc,
                                 ", ".join(map(str, newer)), extra={"event": "dcgm_watch_retry"})
                    for f in newer:
                        self.selection.unknown[f] = f"the host engine at {self.hostname} refused it ({exc})"
                    fields = [f for f in fields if f not in FIELD_SINCE]
                    self.selection = FieldSelection(tuple(fields), self.selection.unknown, self.selection.widths)
                    with contextlib.suppress(Exception):
                        reader.Shutdown()
                    continue
                raise DeviceError(f"DCGM source: the host engine at {self.hostname} refused to watch fields "
                                  f"{', '.join(map(str, fields))} ({exc}); {_HINT}") from exc
            break
        if getattr(reader, "m_dcgmHandle", None) is None:
            where = self.hostname if ":" in self.hostname else f"{self.hostname}:5555"
            raise DeviceError(f"DCGM source: the DCGM host engine (nv-hostengine) is not reachable at "
                              f"{where} (DcgmReader could not connect); start it, or point --dcgm-host / "
                              f"$FLEETHEALTH_DCGM_HOST at it (GPU Operator with dcgm.enabled: "
                              f"nvidia-dcgm.gpu-operator.svc.cluster.local:5555); {_HINT}")
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
                if field_id == _FM["cluster_uuid"]:  # the one string field: kept apart from the numbers
                    self._cluster_uuid(gpu_id, values)
                    continue
                width = self.selection.widths.get(field_id, 64)
                numbers = [_number(v, width) for v in (values if isinstance(values, list) else [values])]
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
        bus = tuple(self._bus_ids.get(g, "") for g in gpus) if self._bus_ids else ()
        telemetry = Telemetry.from_columns(self.node, self.rack, ts, gpus, model=self._model, uuid=uuid,
                                           pci_bus_id=bus, fabric=self._fabric(gpus, ts), **cols)
        return Sample(telemetry, tuple(events))

    def _cluster_uuid(self, gpu: int, values: Any) -> None:
        for v in values if isinstance(values, list) else [values]:
            raw = getattr(v, "value", v)
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            if isinstance(text, str) and not text.startswith("<<<") and len(text) <= 64:  # DCGM_STR_BLANK & co.
                self._fabric_uuid[gpu] = text

    def _fabric(self, gpus: list[int], ts: float) -> Fabric | None:
        """The GPUs' fabric rows from DCGM's Fabric Manager fields; ``None`` while no GPU reports a
        fabric (every status NotSupported or unread)."""
        status = [self._cache.get(g, {}).get(_FM["fm_status"]) for g in gpus]
        if all(s is None or s == 0 for s in status):
            return None
        n = len(gpus)
        rows: dict[str, list[Any]] = {"state": [-1] * n, "status": [-1] * n, "fm_status": [-1] * n,
                                      "health_mask": [0] * n, "since": [math.nan] * n, "clique_id": [-1] * n,
                                      "cluster_uuid": [""] * n}
        for i, (g, fm) in enumerate(zip(gpus, status, strict=True)):
            if fm is None or not 0 <= fm <= 255:
                continue
            cache, fm = self._cache.get(g, {}), int(fm)
            state = _FM_STATE.get(fm, -1)
            seen = self._fabric_seen.get(g)
            if seen is None or seen[0] != state:
                seen = self._fabric_seen[g] = (state, ts)
            error = cache.get(_FM["fm_error"])
            rows["state"][i], rows["fm_status"][i], rows["since"][i] = state, fm, seen[1]
            rows["status"][i] = 0 if fm == 3 else (int(error) if fm == 4 and error is not None
                                                   and -(2**31) <= error < 2**31 else -1)
            clique = cache.get(_FM["clique_id"])
            rows["clique_id"][i] = int(clique) if clique is not None and 0 <= clique < 2**32 else -1
            rows["cluster_uuid"][i] = self._fabric_uuid.get(g, "")
            mask = cache.get(_FM["health_mask"])
            rows["health_mask"][i] = int(mask) if mask is not None and 0 <= mask < 2**32 else 0
        return Fabric.build(n, **rows)

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


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _number(value: Any, width: int = 64) -> float:
    """A DCGM sample (a value object with ``.value`` or a bare number) as float; blanks as NaN.

    ``width`` is the bit width of an integer field's value: 64 (every DCGM integer field) checks
    against ``DCGM_INT64_BLANK``, 32 against ``DCGM_INT32_BLANK``."""
    if getattr(value, "isBlank", False):
        return math.nan
    raw = getattr(value, "value", value)
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        return math.nan
    if isinstance(raw, int) and raw >= (_INT64_BLANK if width == 64 else _INT32_BLANK):
        return math.nan
    if isinstance(raw, float) and (not math.isfinite(raw) or raw >= _FP64_BLANK):
        return math.nan
    return float(raw)
