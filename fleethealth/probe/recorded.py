"""Record a node's NVML answers to a JSON file, and replay them with the same call surface.

:class:`NvmlRecorder` wraps ``pynvml`` and notes every device call the NVML source makes (its
arguments and its result or NVML error); ``bench/gpu_nvml.py --record FILE`` writes one from a
real GPU. :class:`NvmlReplay` answers the same calls from such a file, so the NVML adapter can be
tested where no GPU exists (the probe's tests do exactly that) and a field report can be replayed.

Format (``"format": "fleethealth-nvml-recording/1"``)::

    {"note": "...", "devices": [{"nvmlDeviceGetPowerUsage": {"": 312000},
                                 "nvmlDeviceGetTotalEccErrors": {"0,0": 0, "1,1": 0},
                                 "nvmlDeviceGetRetiredPages": {"0": {"error": "NVML_ERROR_NOT_SUPPORTED"}},
                                 "nvmlDeviceGetUtilizationRates": {"": {"gpu": 97, "memory": 41}},
                                 "nvmlDeviceGetFieldValues": {"82": [{"nvmlReturn": 0, "valueType": 1,
                                                                      "value": 38}]}}, ...],
     "xid": [{"gpu": 3, "code": 79}]}

Arguments after the device handle are joined with commas into the key. A call absent from the
recording answers ``NVML_ERROR_NOT_SUPPORTED``, as a GPU without that feature does.

``nvmlDeviceGetFieldValues`` is answered value by value, each with its own return code, as NVML
does: a field recorded under its id (``"82"``, or ``"165:3"`` for field 165 with scope 3) answers
its recorded value; otherwise the value is derived from the recorded answer of the call that
reads the same counter (:data:`FIELD_CALLS`: ``NVML_FI_DEV_ECC_SBE_VOL_TOTAL`` from
``nvmlDeviceGetTotalEccErrors``, the remapped-row fields from ``nvmlDeviceGetRemappedRows``, the
NVLink totals as the sum of the recorded per-link counters, ...), so recordings made before the
probe read fields still replay; anything else answers ``NOT_SUPPORTED`` for that value.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

from fleethealth.errors import ConfigError

__all__ = ["FORMAT", "DCGM_FORMAT", "FIELD_CALLS", "NvmlReplay", "NvmlRecorder", "DcgmReplay"]

FORMAT = "fleethealth-nvml-recording/1"
FABRIC_CALLS = ("nvmlDeviceGetGpuFabricInfoV", "nvmlDeviceGetGpuFabricInfo")
"""Calls answered by filling a struct the caller passes by reference (recorded as its fields)."""
_UNION = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


class _Handle:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<nvml device {self.index}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Handle) and other.index == self.index

    def __hash__(self) -> int:
        return hash(("nvml-device", self.index))


class NvmlReplay:
    """Answer NVML calls from a recording. Constants and ``NVMLError`` come from ``pynvml`` itself
    (a pure-Python module that imports without the driver), so error handling is the real one.

    Test hooks: :meth:`lose_gpu` makes every later call on a GPU raise ``NVML_ERROR_GPU_IS_LOST``
    (enumerating it and registering it for events included); :meth:`block` makes one call wait
    until :meth:`release` (a wedged driver), on every GPU or (``gpu=``) on one, ``"*"`` every call;
    :meth:`fail_init` makes ``nvmlInit`` raise a given NVML
    error; :meth:`fail_register` makes registering one GPU for events raise one; :meth:`fail_wait`
    makes the next ``times`` event-set waits raise one; :meth:`unknown_fields` makes field ids
    answer ``NVML_ERROR_INVALID_ARGUMENT`` per value (a driver older than those fields).

    ``calls`` counts the device calls answered (``calls_by_name`` per function): the probe's
    tests and ``bench/probe_overhead.py`` read the NVML cost of a sample from it.
    """

    def __init__(self, recording: dict[str, Any] | str | Path) -> None:
        import pynvml

        if not isinstance(recording, dict):
            recording = orjson.loads(Path(recording).read_bytes())
        if recording.get("format") != FORMAT:
            raise ConfigError(f"not an NVML recording (format {recording.get('format')!r}, expected {FORMAT})")
        self._lib = pynvml
        self.NVMLError = pynvml.NVMLError
        self.devices: list[dict[str, dict[str, Any]]] = recording["devices"]
        self._xid: list[dict[str, int]] = list(recording.get("xid", []))
        self._lost: set[int] = set()
        self._blocked: dict[str, threading.Event] = {}
        self._init_error: int | None = None
        self._register_errors: dict[int, int] = {}
        self._wait_errors: list[int] = []
        self._lock = threading.Lock()
        self._unknown_fields: set[int] = set()
        self.calls = 0
        self.calls_by_name: Counter[str] = Counter()
        self.waits = 0

    # ------------------------------------------------------------ test hooks
    def lose_gpu(self, index: int) -> None:
        self._lost.add(index)

    def block(self, name: str, gpu: int | None = None) -> None:
        self._blocked[name if gpu is None else (name, gpu)] = threading.Event()  # type: ignore[index]

    def release(self) -> None:
        for gate in self._blocked.values():
            gate.set()
        self._blocked = {}

    def fail_init(self, code: int) -> None:
        self._init_error = code

    def fail_register(self, index: int, code: int) -> None:
        self._register_errors[index] = code

    def fail_wait(self, code: int, times: int = 1) -> None:
        with self._lock:
            self._wait_errors.extend([code] * times)

    def unknown_fields(self, *field_ids: int) -> None:
        self._unknown_fields.update(field_ids)

    def add_xid(self, gpu: int, code: int) -> None:
        with self._lock:
            self._xid.append({"gpu": gpu, "code": code})

    # ------------------------------------------------------------ library surface
    def __getattr__(self, name: str) -> Any:
        if name.startswith("nvmlDevice"):
            return lambda handle, *args: self._answer(name, handle, args)
        return getattr(self._lib, name)  # constants, NVMLError subclasses

    def nvmlInit(self) -> None:
        if self._init_error is not None:
            raise self._lib.NVMLError(self._init_error)

    def nvmlShutdown(self) -> None:
        return None

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < len(self.devices):
            raise self._lib.NVMLError(self._lib.NVML_ERROR_INVALID_ARGUMENT)
        if index in self._lost:
            raise self._lib.NVMLError(self._lib.NVML_ERROR_GPU_IS_LOST)
        return _Handle(index)

    def nvmlDeviceRegisterEvents(self, handle: _Handle, event_types: int, event_set: Any) -> None:
        if handle.index in self._lost:
            raise self._lib.NVMLError(self._lib.NVML_ERROR_GPU_IS_LOST)
        code = self._register_errors.get(handle.index)
        if code is not None:
            raise self._lib.NVMLError(code)

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlEventSetFree(self, event_set: Any) -> None:
        return None

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> SimpleNamespace:
        with self._lock:
            self.waits += 1
            error = self._wait_errors.pop(0) if self._wait_errors else None
            xid = self._xid.pop(0) if error is None and self._xid else None
        if error is not None:
            raise self._lib.NVMLError(error)
        if xid is not None:
            return SimpleNamespace(device=_Handle(xid["gpu"]), eventType=self._lib.nvmlEventTypeXidCriticalError,
                                   eventData=xid["code"], gpuInstanceId=0, computeInstanceId=0)
        threading.Event().wait(min(timeout_ms, 20) / 1000.0)
        raise self._lib.NVMLError(self._lib.NVML_ERROR_TIMEOUT)

    def _answer(self, name: str, handle: _Handle, args: tuple[Any, ...]) -> Any:
        with self._lock:
            self.calls += 1
            self.calls_by_name[name] += 1
        blocked = self._blocked
        gate = blocked.get(name) or blocked.get((name, handle.index)) or blocked.get(("*", handle.index))  # type: ignore[call-overload]
        if gate is not None:
            gate.wait()
        if handle.index in self._lost:
            raise self._lib.NVMLError(self._lib.NVML_ERROR_GPU_IS_LOST)
        if name == "nvmlDeviceGetFieldValues":
            return [self._field(handle.index, f) for f in args[0]]
        if name in FABRIC_CALLS:
            return self._fabric(handle.index, name, args[0])
        answers = self.devices[handle.index].get(name)
        key = ",".join(str(a) for a in args)
        if answers is None or key not in answers:
            raise self._lib.NVMLError(self._lib.NVML_ERROR_NOT_SUPPORTED)
        return _decode(self._lib, answers[key])

    def _fabric(self, index: int, name: str, out: Any) -> int:
        """Fill the caller's fabric-info struct (passed by reference) from the recorded answer."""
        answer = self.devices[index].get(name, {}).get("")
        if answer is None:
            raise self._lib.NVMLError(self._lib.NVML_ERROR_NOT_SUPPORTED)
        if "error" in answer:
            raise self._lib.NVMLError(getattr(self._lib, answer["error"]))
        struct = getattr(out, "_obj", out)
        for key, value in answer.items():
            if key == "clusterUuid":
                raw = bytes.fromhex(value)
                struct.clusterUuid[:len(raw)] = list(raw)
            elif hasattr(struct, key):
                setattr(struct, key, int(value))
        return self._lib.NVML_SUCCESS

    def _field(self, index: int, field: int | tuple[int, int]) -> SimpleNamespace:
        """One value of a field-values batch, with its own return code."""
        lib = self._lib
        fid, scope = (int(field[0]), int(field[1])) if isinstance(field, tuple) else (int(field), 0)
        device = self.devices[index]
        if fid in self._unknown_fields:
            return _field_value(fid, scope, lib.NVML_ERROR_INVALID_ARGUMENT, 0)
        recorded = device.get("nvmlDeviceGetFieldValues", {}).get(_field_key(fid, scope))
        if recorded is not None:
            v = recorded[0] if isinstance(recorded, list) else recorded
            if "error" in v:
                return _field_value(fid, scope, getattr(lib, v["error"]), 0)
            return _field_value(fid, scope, v["nvmlReturn"], v["value"], v["valueType"])
        derive = FIELD_CALLS.get(fid)
        if derive is None:
            return _field_value(fid, scope, lib.NVML_ERROR_NOT_SUPPORTED, 0)
        code, value = derive(lib, device, scope)
        return _field_value(fid, scope, code, value)


def _field_key(fid: int, scope: int) -> str:
    return str(fid) if scope == 0 else f"{fid}:{scope}"


def _field_value(fid: int, scope: int, code: int, value: Any, kind: int = 3) -> SimpleNamespace:
    number = 0 if value is None else value
    return SimpleNamespace(fieldId=fid, scopeId=scope, nvmlReturn=int(code), valueType=int(kind),
                           value=SimpleNamespace(**dict.fromkeys(_UNION, number)))


def _recorded(lib: Any, device: dict[str, dict[str, Any]], name: str, key: str) -> tuple[int, Any]:
    """(return code, answer) of a recorded call; absent answers NOT_SUPPORTED, as a replayed call does."""
    answers = device.get(name)
    if answers is None or key not in answers:
        return lib.NVML_ERROR_NOT_SUPPORTED, None
    answer = answers[key]
    if isinstance(answer, dict) and "error" in answer:
        return getattr(lib, answer["error"]), None
    return lib.NVML_SUCCESS, answer


def _from_call(name: str, key: Callable[[Any], str] = lambda lib: "",
               pick: Callable[[Any], Any] = lambda a: a) -> Callable[..., tuple[int, Any]]:
    def derive(lib: Any, device: dict[str, dict[str, Any]], scope: int) -> tuple[int, Any]:
        code, answer = _recorded(lib, device, name, key(lib))
        return (code, None) if code != lib.NVML_SUCCESS else (code, pick(answer))
    return derive


def _ecc(kind: str, counter: str) -> Callable[..., tuple[int, Any]]:
    return _from_call("nvmlDeviceGetTotalEccErrors",
                      lambda lib: f"{getattr(lib, kind)},{getattr(lib, counter)}")


def _nvlink_total(counter: str) -> Callable[..., tuple[int, Any]]:
    def derive(lib: Any, device: dict[str, dict[str, Any]], scope: int) -> tuple[int, Any]:
        answers = device.get("nvmlDeviceGetNvLinkErrorCounter", {})
        suffix = f",{getattr(lib, counter)}"
        values = [v for k, v in answers.items() if k.endswith(suffix) and isinstance(v, int | float)]
        return (lib.NVML_SUCCESS, sum(values)) if values else (lib.NVML_ERROR_NOT_SUPPORTED, None)
    return derive


def _nvlink_state(lib: Any, device: dict[str, dict[str, Any]], scope: int) -> tuple[int, Any]:
    return _recorded(lib, device, "nvmlDeviceGetNvLinkState", str(scope))


def _field_ids() -> dict[str, int]:
    import pynvml

    return {name: getattr(pynvml, name) for name in dir(pynvml) if name.startswith("NVML_FI_DEV_")}


def _field_calls() -> dict[int, Callable[..., tuple[int, Any]]]:
    fi = _field_ids()
    c, u = "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED"
    vol, agg = "NVML_VOLATILE_ECC", "NVML_AGGREGATE_ECC"
    pages = "nvmlDeviceGetRetiredPages"
    table: dict[str, Callable[..., tuple[int, Any]]] = {
        "NVML_FI_DEV_ECC_SBE_VOL_TOTAL": _ecc(c, vol), "NVML_FI_DEV_ECC_DBE_VOL_TOTAL": _ecc(u, vol),
        "NVML_FI_DEV_ECC_SBE_AGG_TOTAL": _ecc(c, agg), "NVML_FI_DEV_ECC_DBE_AGG_TOTAL": _ecc(u, agg),
        "NVML_FI_DEV_RETIRED_SBE": _from_call(
            pages, lambda lib: str(lib.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS), len),
        "NVML_FI_DEV_RETIRED_DBE": _from_call(
            pages, lambda lib: str(lib.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR), len),
        "NVML_FI_DEV_RETIRED_PENDING": _from_call("nvmlDeviceGetRetiredPagesPendingStatus"),
        "NVML_FI_DEV_REMAPPED_COR": _from_call("nvmlDeviceGetRemappedRows", pick=lambda a: a[0]),
        "NVML_FI_DEV_REMAPPED_UNC": _from_call("nvmlDeviceGetRemappedRows", pick=lambda a: a[1]),
        "NVML_FI_DEV_REMAPPED_PENDING": _from_call("nvmlDeviceGetRemappedRows", pick=lambda a: int(bool(a[2]))),
        "NVML_FI_DEV_REMAPPED_FAILURE": _from_call("nvmlDeviceGetRemappedRows", pick=lambda a: int(bool(a[3]))),
        "NVML_FI_DEV_PCIE_REPLAY_COUNTER": _from_call("nvmlDeviceGetPcieReplayCounter"),
        "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": _from_call("nvmlDeviceGetTotalEnergyConsumption"),
        "NVML_FI_DEV_POWER_CURRENT_LIMIT": _from_call("nvmlDeviceGetEnforcedPowerLimit"),
        "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": _nvlink_total("NVML_NVLINK_ERROR_DL_CRC_FLIT"),
        "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": _nvlink_total("NVML_NVLINK_ERROR_DL_CRC_DATA"),
        "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": _nvlink_total("NVML_NVLINK_ERROR_DL_REPLAY"),
        "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": _nvlink_total("NVML_NVLINK_ERROR_DL_RECOVERY"),
        "NVML_FI_DEV_NVLINK_GET_STATE": _nvlink_state,
    }
    return {fi[name]: derive for name, derive in table.items()}


FIELD_CALLS: dict[int, Callable[..., tuple[int, Any]]] = _field_calls()
"""Field id -> how a replay derives its value from the recorded answer of the equivalent call."""


def _decode(lib: Any, value: Any) -> Any:
    if isinstance(value, dict):
        if "error" in value:
            raise lib.NVMLError(getattr(lib, value["error"]))
        return SimpleNamespace(**value)
    if isinstance(value, list) and value and isinstance(value[0], dict) and "nvmlReturn" in value[0]:
        return [SimpleNamespace(nvmlReturn=v["nvmlReturn"], valueType=v["valueType"],
                                value=SimpleNamespace(**dict.fromkeys(_UNION, v["value"]))) for v in value]
    return value


class NvmlRecorder:
    """Wrap ``pynvml`` and record every device call's answer; :meth:`dump` writes the recording."""

    def __init__(self, lib: Any, note: str = "") -> None:
        self._lib = lib
        self.note = note
        self._index: dict[int, int] = {}
        self.devices: list[dict[str, dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._lib, name)
        if not name.startswith("nvmlDevice") or name in ("nvmlDeviceGetCount", "nvmlDeviceRegisterEvents"):
            return target
        if name == "nvmlDeviceGetHandleByIndex":
            return self._handle_by_index

        def call(handle: Any, *args: Any) -> Any:
            index = self._index.get(_addr(handle))
            key = "" if name in FABRIC_CALLS else ",".join(str(a) for a in args)
            try:
                result = target(handle, *args)
            except self._lib.NVMLError as exc:
                if index is not None and name != "nvmlDeviceGetFieldValues":
                    self.devices[index].setdefault(name, {})[key] = {"error": _error_name(self._lib, exc)}
                raise
            if index is None:
                return result
            if name in FABRIC_CALLS:  # the answer is the struct the caller passed by reference
                struct = getattr(args[0], "_obj", args[0])
                self.devices[index].setdefault(name, {})[""] = {
                    f: (bytes(getattr(struct, f)).hex() if f == "clusterUuid" else int(getattr(struct, f)))
                    for f, _ in struct._fields_ if f != "version"}
                return result
            if name == "nvmlDeviceGetFieldValues":  # one entry per field, so any batch replays
                fields = self.devices[index].setdefault(name, {})
                for asked, value in zip(args[0], result, strict=False):
                    fid, scope = asked if isinstance(asked, tuple) else (asked, 0)
                    fields[_field_key(int(fid), int(scope))] = _encode(name, [value])
            else:
                self.devices[index].setdefault(name, {})[key] = _encode(name, result)
            return result

        return call

    def _handle_by_index(self, index: int) -> Any:
        handle = self._lib.nvmlDeviceGetHandleByIndex(index)
        self._index[_addr(handle)] = index
        while len(self.devices) <= index:
            self.devices.append({})
        return handle

    def recording(self) -> dict[str, Any]:
        return {"format": FORMAT, "note": self.note, "devices": self.devices, "xid": []}

    def dump(self, path: str | Path) -> None:
        Path(path).write_bytes(orjson.dumps(self.recording(), option=orjson.OPT_INDENT_2))


def _addr(handle: Any) -> Any:
    import ctypes

    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return id(handle)


def _error_name(lib: Any, exc: BaseException) -> str:
    code = getattr(exc, "value", None)
    for name in dir(lib):
        if name.startswith("NVML_ERROR_") and getattr(lib, name) == code:
            return name
    return "NVML_ERROR_UNKNOWN"


def _encode(name: str, result: Any) -> Any:
    if name == "nvmlDeviceGetFieldValues":
        out = []
        for v in result:
            kind = int(v.valueType)
            union = v.value
            out.append({"nvmlReturn": int(v.nvmlReturn), "valueType": kind,
                        "value": getattr(union, _UNION[kind]) if 0 <= kind < len(_UNION) else None})
        return out
    if name == "nvmlDeviceGetUtilizationRates":
        return {"gpu": int(result.gpu), "memory": int(result.memory)}
    if isinstance(result, bytes):
        return result.decode()
    if isinstance(result, tuple):
        return list(result)
    return result


DCGM_FORMAT = "fleethealth-dcgm-recording/1"


class DcgmReplay:
    """Answer ``DcgmReader`` and DCGM health calls from a recording of successive reads.

    Recording: ``{"format": "fleethealth-dcgm-recording/1", "gpus": {"0": "GPU-...", ...},
    "reads": [{"0": {"150": [41, 42]}, ...}, ...], "health": [[{"gpu": 3, "system": 16,
    "health": 20, "code": 83, "msg": "..."}], ...]}``. Each call of
    ``GetAllGpuValuesAsFieldIdDictSinceLastCall`` returns the next read (then ``{}``); each
    ``Check()`` the incidents of the read just returned. ``reader`` and ``health`` are the two
    objects a :class:`fleethealth.probe.dcgm.DcgmSource` takes.
    """

    def __init__(self, recording: dict[str, Any] | str | Path) -> None:
        if not isinstance(recording, dict):
            recording = orjson.loads(Path(recording).read_bytes())
        if recording.get("format") != DCGM_FORMAT:
            raise ConfigError(f"not a DCGM recording (format {recording.get('format')!r}, expected {DCGM_FORMAT})")
        self.m_gpuIdToUUId = {int(k): v for k, v in recording.get("gpus", {}).items()}
        self._reads: list[dict[str, dict[str, list[Any]]]] = list(recording["reads"])
        self._health: list[list[dict[str, Any]]] = list(recording.get("health", []))
        self._cursor = 0
        self.watches: int | None = None
        self.reader = self
        self.health = _DcgmHealth(self)

    def GetAllGpuValuesAsFieldIdDictSinceLastCall(self) -> dict[int, dict[int, list[SimpleNamespace]]]:
        if self._cursor >= len(self._reads):
            self._cursor += 1
            return {}
        read = self._reads[self._cursor]
        self._cursor += 1
        return {int(g): {int(f): [SimpleNamespace(value=v, isBlank=v is None) for v in values]
                         for f, values in fields.items()} for g, fields in read.items()}

    def Shutdown(self) -> None:
        return None

    def _incidents(self) -> list[dict[str, Any]]:
        index = self._cursor - 1
        return self._health[index] if 0 <= index < len(self._health) else []


class _DcgmHealth:
    def __init__(self, replay: DcgmReplay) -> None:
        self._replay = replay

    def Set(self, systems: int) -> None:
        self._replay.watches = systems

    def Check(self) -> SimpleNamespace:
        incidents = [SimpleNamespace(system=i["system"], health=i["health"],
                                     error=SimpleNamespace(code=i.get("code", 0), msg=i.get("msg", "")),
                                     entityInfo=SimpleNamespace(entityGroupId=1, entityId=i["gpu"]))
                     for i in self._replay._incidents()]
        worst = max((i.health for i in incidents), default=0)
        return SimpleNamespace(overallHealth=worst, incidentCount=len(incidents), incidents=incidents)
