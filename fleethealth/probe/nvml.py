"""NVML telemetry source (``nvidia-ml-py``, module ``pynvml``).

Reads, for every GPU, the columns of :data:`fleethealth.schema.GPU_FIELDS` in at most ten NVML
calls a sample (``bench/probe_overhead.py`` prints the count; it was 114 on the recorded H100
node before the batch):

- one ``nvmlDeviceGetFieldValues`` batch (:data:`SCALAR_FIELDS`): ECC totals (corrected /
  uncorrected, volatile / aggregate), retired pages and their pending status, remapped rows
  (correctable, uncorrectable, pending, failure), the HBM temperature, energy since driver load,
  the enforced power limit, the PCIe replay counter, the NVLink CRC flit / CRC data / replay /
  recovery totals over all links, and each link's state (``NVML_FI_DEV_NVLINK_GET_STATE`` with
  the link in ``scopeId``; a link that is not there ends the list);
- the values no field carries: ``nvmlDeviceGetTemperatureV`` (``nvmlDeviceGetTemperature`` on
  drivers without it), power, SM and memory clocks, ``nvmlDeviceGetCurrentClocksEventReasons``
  (the raw bitmask; :class:`schema.ClockReason` decodes it, including the HW power brake
  ``0x80``), utilisation, and the current PCIe link generation and width (a downtrained link
  shows ``pcie_gen < pcie_gen_max``);
- static values once at open: maximum SM clock, maximum PCIe generation and width, the slowdown
  temperature threshold.

A field the GPU does not support (each value of a batch carries its own return code: Hopper
answers ``NOT_SUPPORTED`` for retired pages, Volta for remapped rows) is NaN and logged once per
GPU and column, never an error; the rest of the sample is published. Fallbacks for older
drivers, each taken once a GPU shows it needs it: a driver that does not know the power-limit
field gets ``nvmlDeviceGetEnforcedPowerLimit``, one that does not know the NVLink state field the
per-link ``nvmlDeviceGetNvLinkState`` calls (more than ten calls a sample there).

Xid errors arrive through an NVML event set (``nvmlEventTypeXidCriticalError``) waited on by a
background thread and are returned as ``xid`` events with the next sample. A GPU that falls off
the bus (``NVML_ERROR_GPU_IS_LOST``, for the whole batch or any value of it) yields one
``gpu_lost`` event and NaN columns, not a crash, including a GPU already lost when the probe
starts (its index is enumerated on its own and the event goes out with the first sample). The Xid
thread skips GPUs it cannot register (reporting each failure, lost GPUs aside, as a
``probe_error`` event) and keeps waiting after an event-set error, backing off and reporting the
error once as a ``probe_error`` event until a wait succeeds.

Each GPU is read on a thread of its own (:class:`~fleethealth.probe.gpureads.GpuReads`), all of them
together bounded by ``gpu_timeout_s``: a GPU whose driver call stalls is left out of the sample (NaN
columns) with one ``telemetry_stalled`` event naming it (``data["gpus"]`` lists them when several
stall at once; ``gpu_stalls_total`` counts them), while its siblings' columns go out every interval;
the stuck GPU is not read again until its call returns, so a stuck call holds one thread, never more.

Fabric registration (NVSwitch systems, :mod:`fleethealth.schema.fabric`): each GPU's
``nvmlDeviceGetGpuFabricInfoV`` (``nvmlDeviceGetGpuFabricInfo`` on drivers without it), one call a
GPU a sample; a GPU that answers NOT_SUPPORTED (no NVSwitch) is not asked again, and a node none of
whose GPUs has a fabric sends no ``fabric`` in its telemetry.

The library handle is injected (``nvml=``): production passes nothing and gets ``pynvml``; the
tests pass a recorded-values fixture with the same call surface
(:class:`fleethealth.probe.recorded.NvmlReplay`, which also counts the calls), since these
machines have no GPU.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import threading
from typing import Any

import numpy as np

from fleethealth.errors import DeviceError
from fleethealth.probe.gpureads import GpuReads
from fleethealth.probe.sources import Sample
from fleethealth.schema import GPU_FIELDS, Event, EventKind, Fabric, Telemetry

__all__ = ["NvmlSource", "load_pynvml", "SCALAR_FIELDS"]

_log = logging.getLogger("fleethealth.probe.nvml")

SCALAR_FIELDS: tuple[tuple[str, str, float], ...] = (
    ("mem_temp_c", "NVML_FI_DEV_MEMORY_TEMP", 1.0),
    ("power_limit_w", "NVML_FI_DEV_POWER_CURRENT_LIMIT", 1e-3),        # mW
    ("energy_mj", "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 1.0),
    ("ecc_sbe_volatile", "NVML_FI_DEV_ECC_SBE_VOL_TOTAL", 1.0),
    ("ecc_dbe_volatile", "NVML_FI_DEV_ECC_DBE_VOL_TOTAL", 1.0),
    ("ecc_sbe_aggregate", "NVML_FI_DEV_ECC_SBE_AGG_TOTAL", 1.0),
    ("ecc_dbe_aggregate", "NVML_FI_DEV_ECC_DBE_AGG_TOTAL", 1.0),
    ("retired_sbe", "NVML_FI_DEV_RETIRED_SBE", 1.0),
    ("retired_dbe", "NVML_FI_DEV_RETIRED_DBE", 1.0),
    ("retired_pending", "NVML_FI_DEV_RETIRED_PENDING", 1.0),
    ("remap_correctable", "NVML_FI_DEV_REMAPPED_COR", 1.0),
    ("remap_uncorrectable", "NVML_FI_DEV_REMAPPED_UNC", 1.0),
    ("remap_pending", "NVML_FI_DEV_REMAPPED_PENDING", 1.0),
    ("remap_failure", "NVML_FI_DEV_REMAPPED_FAILURE", 1.0),
    ("pcie_replay", "NVML_FI_DEV_PCIE_REPLAY_COUNTER", 1.0),
    ("nvlink_crc_flit", "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", 1.0),
    ("nvlink_crc_data", "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", 1.0),
    ("nvlink_replay", "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", 1.0),
    ("nvlink_recovery", "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", 1.0),
)
"""(column, NVML field id name, scale) read in each GPU's batch, scope 0."""

_FLAGS = frozenset({"retired_pending", "remap_pending", "remap_failure"})
_NVLINK_TOTALS = ("nvlink_crc_flit", "nvlink_crc_data", "nvlink_replay", "nvlink_recovery")
_CALL_FALLBACK = {"power_limit_w": ("nvmlDeviceGetEnforcedPowerLimit", 1e-3)}
"""Columns read by a call on drivers that do not know their field (the field is newer than the call)."""
_STATIC: tuple[tuple[str, str, str | None], ...] = (
    ("sm_clock_max_mhz", "nvmlDeviceGetMaxClockInfo", "NVML_CLOCK_SM"),
    ("pcie_gen_max", "nvmlDeviceGetMaxPcieLinkGeneration", None),
    ("pcie_width_max", "nvmlDeviceGetMaxPcieLinkWidth", None),
    # the GPU's own throttle point (NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1 in nvml.h)
    ("slowdown_temp_c", "nvmlDeviceGetTemperatureThreshold", "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN"),
)
"""Values that do not change while the driver runs, read once at open."""
_TEMP_CALLS = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature")
_REASON_CALLS = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
_BATCH_MAX = 64
"""Most values asked in one nvmlDeviceGetFieldValues call."""
_UNION = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")

_MISSING_HINT = "use --source dcgm where a DCGM host engine runs, or --source sim without GPUs"


def load_pynvml() -> Any:
    """Import ``pynvml`` or raise a one-line :class:`DeviceError` saying what is missing."""
    try:
        import pynvml
    except ImportError as exc:
        raise DeviceError("NVML source: the Python package nvidia-ml-py (module pynvml) is not installed "
                          f"(pip install 'fleethealth[nvml]'); {_MISSING_HINT}") from exc
    return pynvml


class NvmlSource:
    """Telemetry of every GPU on this node through NVML.

    ``nvml`` is the library module (``pynvml`` when omitted) or any object with the same calls,
    constants and ``NVMLError``. ``xid_events`` starts the Xid event-set thread on ``open()``;
    after an event-set error it retries with a backoff doubling up to ``xid_backoff_max_s``.
    ``gpu_timeout_s`` bounds one sample's reads of all GPUs together (config
    ``probe.gpu_timeout_s``; below ``probe.stall_timeout_s``, which bounds the whole source).
    """

    name = "nvml"

    def __init__(self, node: str, rack: str, *, nvml: Any = None, xid_events: bool = True,
                 xid_wait_ms: int = 500, xid_backoff_max_s: float = 5.0, gpu_timeout_s: float = 0.5) -> None:
        self.node = node
        self.gpu_timeout_s = gpu_timeout_s
        self._reads = GpuReads(timeout_s=gpu_timeout_s)
        self._fabric_off: set[int] = set()                   # GPUs without a fabric (NOT_SUPPORTED)
        self._fabric_seen: dict[int, tuple[int, float]] = {}  # GPU -> (fabric state, when first read)
        self._errors: dict[int, str] = {}                     # GPU -> the last unexpected read error
        self.rack = rack
        self._nvml = nvml
        self._xid_events = xid_events
        self._xid_wait_ms = xid_wait_ms
        self._handles: list[Any] = []   # None where the GPU was lost before it could be enumerated
        self._uuids: tuple[str, ...] = ()
        self._model = ""
        self._bus_ids: tuple[str, ...] = ()
        self.driver_version = ""
        self._lost: set[int] = set()
        self._pending: list[Event] = []
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._xid_thread: threading.Thread | None = None
        self.xid_thread_error: str | None = None
        self._xid_backoff_max_s = xid_backoff_max_s
        self._static: dict[int, dict[str, float]] = {}     # per GPU: the values read once at open
        self._static_retry: dict[int, set[str]] = {}        # static columns whose read failed transiently
        self._by_call: dict[int, set[str]] = {}             # columns a GPU's driver serves by call, not field
        self._nvlink_calls: dict[int, bool] = {}            # per GPU: NVLink state by legacy calls
        self._prefer: dict[tuple[str, ...], str] = {}       # the call of a fallback chain this driver answers
        self._scalar_ids: list[tuple[str, int, float]] | None = None
        self.missing: dict[tuple[int, str], str] = {}
        """(GPU, column) -> the NVML error that left the column NaN, each logged once."""

    # ------------------------------------------------------------ lifecycle
    def open(self) -> None:
        nv = self._nvml = self._nvml if self._nvml is not None else load_pynvml()
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            raise DeviceError(f"NVML source: cannot initialise NVML ({_nvml_reason(nv, exc)}); "
                              f"{_MISSING_HINT}") from exc
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as exc:
            raise DeviceError(f"NVML source: cannot enumerate GPUs ({_nvml_reason(nv, exc)})") from exc
        handles: list[Any] = []
        uuids: list[str] = []
        for i in range(count):
            handle, uuid = self._enumerate(i)
            handles.append(handle)
            uuids.append(uuid)
        self._handles, self._uuids = handles, tuple(uuids)
        self._model = self._read_model()
        self._bus_ids, self.driver_version = self._read_labels()
        self._read_statics()
        if self._xid_events and any(i not in self._lost for i in range(count)):
            self._xid_thread = threading.Thread(target=self._watch_xid, name="fh-nvml-xid", daemon=True)
            self._xid_thread.start()

    def _enumerate(self, i: int) -> tuple[Any, str]:
        """GPU ``i``'s handle and UUID; a GPU already off the bus is marked lost (its ``gpu_lost``
        event goes out with the first sample) instead of failing the whole node."""
        nv = self._nvml
        handle = None
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(i)
            return handle, _text(nv.nvmlDeviceGetUUID(handle))
        except nv.NVMLError as exc:
            if _code(exc) != nv.NVML_ERROR_GPU_IS_LOST:
                raise DeviceError(f"NVML source: cannot enumerate GPU {i} ({_nvml_reason(nv, exc)})") from exc
            self._lost.add(i)
            self._pending.append(Event(node=self.node, ts=0.0, kind=EventKind.GPU_LOST, gpu=i,
                                       message=f"GPU {i} fell off the bus ({_nvml_reason(nv, exc)})",
                                       data={"uuid": "", "source": "nvml"}))
            return handle, ""

    def _read_model(self) -> str:
        nv = self._nvml
        for i, handle in enumerate(self._handles):
            if i in self._lost:
                continue
            try:
                return _text(nv.nvmlDeviceGetName(handle))
            except nv.NVMLError as exc:
                if _code(exc) != nv.NVML_ERROR_GPU_IS_LOST:
                    raise DeviceError(f"NVML source: cannot read the name of GPU {i} "
                                      f"({_nvml_reason(nv, exc)})") from exc
        return ""

    def _read_labels(self) -> tuple[tuple[str, ...], str]:
        """Each GPU's PCI bus id and the driver version, once at open (labels of the dcgm-exporter
        compatible metrics; ``""`` where NVML does not say)."""
        nv = self._nvml
        bus = []
        for i, handle in enumerate(self._handles):
            try:
                bus.append("" if i in self._lost else _text(nv.nvmlDeviceGetPciInfo(handle).busId))
            except Exception:  # noqa: BLE001 - a label, never worth failing the source for
                bus.append("")
        try:
            driver = _text(nv.nvmlSystemGetDriverVersion())
        except Exception:  # noqa: BLE001 - likewise
            driver = ""
        return (tuple(bus) if any(bus) else ()), driver

    def _read_statics(self) -> None:
        nv = self._nvml
        for i, handle in enumerate(self._handles):
            if i in self._lost:
                continue
            read = _Reader(nv)
            try:
                self._static[i] = {column: self._read_static(i, read, handle, column) for column, _, _ in _STATIC}
                self._read_fabric(i, read, handle)  # once at open: a GPU without a fabric is not asked again
            except _GpuLost as exc:
                self._mark_lost_at_open(i, str(exc))

    def _read_static(self, i: int, read: _Reader, h: Any, column: str) -> float:
        nv = self._nvml
        _, name, arg = next(s for s in _STATIC if s[0] == column)
        fn = getattr(nv, name, None)
        args = () if arg is None else (getattr(nv, arg, 1),)
        value = math.nan if fn is None else read(fn, h, *args)
        retry = self._static_retry.setdefault(i, set())
        code = read.last_code if fn is not None else nv.NVML_ERROR_FUNCTION_NOT_FOUND
        if math.isnan(value) and code not in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
            retry.add(column)   # a transient failure: read it again with the next sample
        else:
            retry.discard(column)
            if math.isnan(value):
                self._note(i, column, code)
        return value

    def _mark_lost_at_open(self, i: int, reason: str) -> None:
        self._lost.add(i)
        self._pending.append(Event(node=self.node, ts=0.0, kind=EventKind.GPU_LOST, gpu=i,
                                   message=f"GPU {i} fell off the bus ({reason})",
                                   data={"uuid": self._uuids[i] if i < len(self._uuids) else "",
                                         "source": "nvml"}))

    def close(self) -> None:
        self._stop.set()
        self._reads.close()
        if self._xid_thread is not None:
            self._xid_thread.join(timeout=2 * self._xid_wait_ms / 1000 + 1)
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass

    # ------------------------------------------------------------ sampling
    @property
    def gpu_count(self) -> int:
        return len(self._handles)

    @property
    def gpu_stalls_total(self) -> int:
        """Per-GPU stalls begun since open (each GPU's stall counts once however long it lasts)."""
        return sum(self._reads.stalls_total.values())

    @property
    def stalled_gpus(self) -> frozenset[int]:
        """GPUs whose driver call is stuck now (left out of every sample until it returns)."""
        return frozenset(self._reads.stalled)

    def sample(self, ts: float) -> Sample:
        if not self._handles and self._nvml is None:
            raise DeviceError("NVML source: sample() before open()")
        g = len(self._handles)
        cols = {name: np.full(g, np.nan) for name in GPU_FIELDS}
        events: list[Event] = []
        calls = [(i, functools.partial(self._read_gpu, i, h)) for i, h in enumerate(self._handles)
                 if i not in self._lost]
        rnd = self._reads.read(calls)
        fabric: dict[int, tuple[int, int, int, int, str]] = {}
        for i, out in sorted(rnd.results.items()):
            info = out.pop("_fabric", None)
            if info is not None:
                fabric[i] = info
            for name, value in out.items():
                cols[name][i] = value
            self._errors.pop(i, None)
        for i, exc in sorted(rnd.errors.items()):
            uuid = self._uuids[i] if i < len(self._uuids) else ""
            if isinstance(exc, _GpuLost):
                self._lost.add(i)
                events.append(Event(node=self.node, ts=ts, kind=EventKind.GPU_LOST, gpu=i,
                                    message=f"GPU {i} fell off the bus ({exc})", data={"uuid": uuid, "source": "nvml"}))
                continue
            text = f"{type(exc).__name__}: {exc}"[:1000]
            if self._errors.get(i) != text:  # once per distinct error; the GPU's columns stay NaN
                self._errors[i] = text
                events.append(Event(node=self.node, ts=ts, kind=EventKind.PROBE_ERROR, gpu=i,
                                    message=f"reading GPU {i} failed: {text}", data={"source": "nvml"}))
        if rnd.began:
            began = list(rnd.began)
            events.append(Event(node=self.node, ts=ts, kind=EventKind.TELEMETRY_STALLED,
                                gpu=began[0] if len(began) == 1 else None,
                                message=f"GPU {', '.join(map(str, began))} did not answer its driver calls within "
                                        f"{self.gpu_timeout_s:g} s; left out until they return",
                                data={"source": "nvml", "timeout_s": self.gpu_timeout_s, "gpus": began}))
        with self._pending_lock:
            xids, self._pending = self._pending, []
        events.extend(Event(node=self.node, ts=ts, kind=e.kind, gpu=e.gpu, code=e.code, message=e.message,
                            data=e.data) for e in xids)
        telemetry = Telemetry.from_columns(self.node, self.rack, ts, np.arange(g), model=self._model,
                                           uuid=self._uuids, pci_bus_id=self._bus_ids,
                                           fabric=self._fabric_of(g, ts, fabric), **cols)
        return Sample(telemetry, tuple(events))

    def _fabric_of(self, g: int, ts: float, read: dict[int, tuple[int, int, int, int, str]]) -> Fabric | None:
        """The sample's fabric rows: ``None`` while no GPU has a fabric; ``since`` is when the probe first
        read each GPU's current state."""
        if not read:
            return None
        state, status = np.full(g, -1, dtype=np.int64), np.full(g, -1, dtype=np.int64)
        mask, clique = np.zeros(g, dtype=np.int64), np.full(g, -1, dtype=np.int64)
        since, uuid = np.full(g, np.nan), [""] * g
        for i, (st, code, health, cid, cluster) in read.items():
            seen = self._fabric_seen.get(i)
            if seen is None or seen[0] != st:
                seen = self._fabric_seen[i] = (st, ts)
            state[i], status[i], mask[i], clique[i], since[i], uuid[i] = st, code, health, cid, seen[1], cluster
        return Fabric(state=state, status=status, fm_status=np.full(g, -1, dtype=np.int64), health_mask=mask,
                      since=since, clique_id=clique, cluster_uuid=tuple(uuid))

    def _read_fabric(self, i: int, read: _Reader, h: Any) -> tuple[int, int, int, int, str] | None:
        """(state, status, health mask, clique id, cluster UUID hex) of GPU ``i``, or ``None`` (no fabric,
        or this read failed). The V call first; a driver without it (FUNCTION_NOT_FOUND) or with another
        struct version (ARGUMENT_VERSION_MISMATCH) gets the older call."""
        if i in self._fabric_off:
            return None
        nv = self._nvml
        older = (nv.NVML_ERROR_FUNCTION_NOT_FOUND, getattr(nv, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", -25))
        for call, struct in (("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t"),
                             ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t")):
            fn, cls = getattr(nv, call, None), getattr(nv, struct, None)
            if fn is None or cls is None:
                continue
            info = cls()
            if read.raw(fn, h, ctypes.byref(info)) is None:
                if read.last_code in older:
                    continue
                if read.last_code == nv.NVML_ERROR_NOT_SUPPORTED:
                    break
                self._note(i, "fabric", read.last_code)
                return None
            state = int(info.state)
            if state == getattr(nv, "NVML_GPU_FABRIC_STATE_NOT_SUPPORTED", 0):
                break
            return (state, int(info.status), int(getattr(info, "healthMask", 0)), int(info.cliqueId),
                    bytes(info.clusterUuid).hex())
        self._fabric_off.add(i)
        return None

    def _read_gpu(self, i: int, h: Any) -> dict[str, float]:
        """GPU ``i``'s columns: its field batch, the calls no field covers, its static values."""
        nv = self._nvml
        read = _Reader(nv)
        out = dict(self._static.get(i, {}))
        for column in sorted(self._static_retry.get(i, ())):
            out[column] = self._read_static(i, read, h, column)
        links = nv.NVML_NVLINK_MAX_LINKS if not self._nvlink_calls.get(i) else 0
        by_call = sorted(self._by_call.get(i, ()))
        scalars = [(column, fid, scale) for column, fid, scale in self._scalars() if column not in by_call]
        ids: list[Any] = [fid for _, fid, _ in scalars]
        ids += [(nv.NVML_FI_DEV_NVLINK_GET_STATE, link) for link in range(links)]
        values = self._field_values(i, read, h, ids)
        for (column, _, scale), (code, value) in zip(scalars, values, strict=False):
            if code == nv.NVML_SUCCESS:
                out[column] = float(bool(value)) if column in _FLAGS else value * scale
            elif column in _CALL_FALLBACK and code != nv.NVML_ERROR_NOT_SUPPORTED:
                out[column] = self._fallback(i, read, h, column)
            else:
                self._note(i, column, code)
        for column in by_call:
            name, scale = _CALL_FALLBACK[column]
            out[column] = self._call(i, read, column, getattr(nv, name), h) * scale
        out.update(self._nvlink(i, read, h, values[len(scalars):]))
        out["temp_c"] = self._first(i, read, "temp_c", _TEMP_CALLS, h, nv.NVML_TEMPERATURE_GPU)
        out["power_w"] = self._call(i, read, "power_w", nv.nvmlDeviceGetPowerUsage, h) / 1000.0
        out["sm_clock_mhz"] = self._call(i, read, "sm_clock_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
        out["mem_clock_mhz"] = self._call(i, read, "mem_clock_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
        out["clock_reasons"] = self._first(i, read, "clock_reasons", _REASON_CALLS, h)
        util = read.raw(nv.nvmlDeviceGetUtilizationRates, h)
        if util is None:
            self._note(i, "util_pct", read.last_code)
        out["util_pct"] = math.nan if util is None else float(util.gpu)
        out["pcie_gen"] = self._call(i, read, "pcie_gen", nv.nvmlDeviceGetCurrPcieLinkGeneration, h)
        out["pcie_width"] = self._call(i, read, "pcie_width", nv.nvmlDeviceGetCurrPcieLinkWidth, h)
        fabric = self._read_fabric(i, read, h)
        if fabric is not None:
            out["_fabric"] = fabric  # type: ignore[assignment]
        return out

    def _scalars(self) -> list[tuple[str, int, float]]:
        if self._scalar_ids is None:
            nv = self._nvml
            self._scalar_ids = [(column, int(getattr(nv, name)), scale) for column, name, scale in SCALAR_FIELDS]
        return self._scalar_ids

    def _field_values(self, i: int, read: _Reader, h: Any, ids: list[Any]) -> list[tuple[int, float]]:
        """(return code, value) per asked field, in order; a failed batch answers its error for each."""
        nv = self._nvml
        out: list[tuple[int, float]] = []
        for at in range(0, len(ids), _BATCH_MAX):
            chunk = ids[at: at + _BATCH_MAX]
            values = read.raw(nv.nvmlDeviceGetFieldValues, h, chunk)
            if values is None:
                code = read.last_code if read.last_code is not None else nv.NVML_ERROR_UNKNOWN
                self._note(i, "nvmlDeviceGetFieldValues", code)
                out += [(code, math.nan)] * len(chunk)
                continue
            for v in values:
                code = int(v.nvmlReturn)
                if code == nv.NVML_ERROR_GPU_IS_LOST:
                    raise _GpuLost(_nvml_reason(nv, nv.NVMLError(code)))
                out.append((code, _field_number(v) if code == nv.NVML_SUCCESS else math.nan))
        return out

    def _nvlink(self, i: int, read: _Reader, h: Any, states: list[tuple[int, float]]) -> dict[str, float]:
        """Links present and up from the per-link state fields (or calls); the error totals are
        kept only for a GPU that has NVLink."""
        nv = self._nvml
        links = up = 0
        if self._nvlink_calls.get(i):
            states = self._nvlink_states_by_call(read, h)
        first = states[0][0] if states else nv.NVML_ERROR_NOT_SUPPORTED
        for code, state in states:
            if code != nv.NVML_SUCCESS:  # link not present (or NVLink unsupported): stop at the first gap
                if code == nv.NVML_ERROR_NOT_SUPPORTED:
                    continue
                break
            links += 1
            up += int(state == nv.NVML_FEATURE_ENABLED)
        if links == 0 and i not in self._nvlink_calls:
            # a driver older than the state field answers an error other than NOT_SUPPORTED: ask the
            # per-link call once; if it answers, this GPU's links are read by call from now on
            self._nvlink_calls[i] = False
            if first not in (nv.NVML_SUCCESS, nv.NVML_ERROR_NOT_SUPPORTED):
                probe = read.raw(nv.nvmlDeviceGetNvLinkState, h, 0)
                if probe is not None:
                    self._nvlink_calls[i] = True
                    return self._nvlink(i, read, h, [])
        elif i not in self._nvlink_calls:
            self._nvlink_calls[i] = False
        if links == 0:
            return dict.fromkeys(_NVLINK_TOTALS, math.nan)
        return {"nvlink_links_up": float(up), "nvlink_links_max": float(links)}

    def _nvlink_states_by_call(self, read: _Reader, h: Any) -> list[tuple[int, float]]:
        nv = self._nvml
        out: list[tuple[int, float]] = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            state = read.raw(nv.nvmlDeviceGetNvLinkState, h, link)
            code = nv.NVML_SUCCESS if state is not None else (read.last_code or nv.NVML_ERROR_UNKNOWN)
            out.append((code, math.nan if state is None else float(state)))
            if state is None and code != nv.NVML_ERROR_NOT_SUPPORTED:
                break
        return out

    def _fallback(self, i: int, read: _Reader, h: Any, column: str) -> float:
        """The call behind a field this GPU's driver does not know; used from now on if it answers."""
        name, scale = _CALL_FALLBACK[column]
        fn = getattr(self._nvml, name, None)
        value = math.nan if fn is None else read(fn, h)
        if math.isnan(value):
            self._note(i, column, read.last_code if fn is not None else self._nvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return value
        self._by_call.setdefault(i, set()).add(column)
        return value * scale

    def _call(self, i: int, read: _Reader, column: str, fn: Any, *args: Any) -> float:
        value = read(fn, *args)
        if math.isnan(value):
            self._note(i, column, read.last_code)
        return value

    def _first(self, i: int, read: _Reader, column: str, names: tuple[str, ...], *args: Any) -> float:
        """The first of ``names`` (newest call first) that the library has and answers; the one
        that answered is the only one asked from then on."""
        nv = self._nvml
        chosen = self._prefer.get(names)
        for name in (chosen,) if chosen is not None else names:
            fn = getattr(nv, name, None)
            if fn is None:
                continue
            value = read(fn, *args)
            if not math.isnan(value):
                self._prefer[names] = name
                return value
        self._note(i, column, read.last_code)
        return math.nan

    def _note(self, i: int, column: str, code: int | None) -> None:
        """Log once per GPU and column why it is NaN (NOT_SUPPORTED is the GPU's nature: info)."""
        if (i, column) in self.missing:
            return
        nv = self._nvml
        name = _error_name(nv, code)
        self.missing[(i, column)] = name
        if code == nv.NVML_ERROR_NOT_SUPPORTED:
            _log.info("NVML source: GPU %d does not report %s (%s); it stays NaN", i, column, name)
        else:
            _log.warning("NVML source: reading %s of GPU %d failed (%s); NaN this sample, reported once",
                         column, i, name)

    # ------------------------------------------------------------ Xid thread
    def _watch_xid(self) -> None:
        nv = self._nvml
        try:
            event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            self._xid_error(None, f"cannot create the NVML event set, no Xid events on this node "
                                  f"({_nvml_reason(nv, exc)})")
            return
        try:
            index = self._register_xid(event_set)
            backoff = 0.0
            while not self._stop.is_set():
                try:
                    data = nv.nvmlEventSetWait_v2(event_set, self._xid_wait_ms)
                except nv.NVMLError as exc:
                    if _code(exc) == nv.NVML_ERROR_TIMEOUT:
                        backoff = 0.0
                        continue
                    reason = _nvml_reason(nv, exc)
                    if backoff == 0.0 or reason != self.xid_thread_error:  # once per spell of failures
                        self._xid_error(None, f"waiting for Xid events failed ({reason}); retrying")
                    self.xid_thread_error = reason
                    backoff = min(max(2 * backoff, self._xid_wait_ms / 1000), self._xid_backoff_max_s)
                    self._stop.wait(backoff)
                    continue
                backoff = 0.0
                if not data.eventType & nv.nvmlEventTypeXidCriticalError:
                    continue
                gpu = index.get(_handle_key(data.device))
                code = int(data.eventData)
                event = Event(node=self.node, ts=0.0, kind=EventKind.XID, gpu=gpu, code=code,
                              message=f"Xid {code} on GPU {gpu}", data={"source": "nvml"})
                with self._pending_lock:
                    self._pending.append(event)
        finally:
            try:
                nv.nvmlEventSetFree(event_set)
            except nv.NVMLError:
                pass

    def _register_xid(self, event_set: Any) -> dict[Any, int]:
        """Register every GPU still on the bus for Xid events; one GPU failing skips only that GPU."""
        nv = self._nvml
        index: dict[Any, int] = {}
        for i, h in enumerate(self._handles):
            if i in self._lost or h is None:
                continue
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, event_set)
                index[_handle_key(h)] = i
            except nv.NVMLError as exc:
                code = _code(exc)
                if code == nv.NVML_ERROR_NOT_SUPPORTED or code == nv.NVML_ERROR_GPU_IS_LOST:
                    continue  # no Xid events on this GPU; a lost GPU is reported by the next sample
                self._xid_error(i, f"cannot watch GPU {i} for Xid errors ({_nvml_reason(nv, exc)})")
        return index

    def _xid_error(self, gpu: int | None, message: str) -> None:
        self.xid_thread_error = message
        event = Event(node=self.node, ts=0.0, kind=EventKind.PROBE_ERROR, gpu=gpu, message=message[:2000],
                      data={"source": "nvml", "part": "xid"})
        with self._pending_lock:
            self._pending.append(event)


class _GpuLost(Exception):
    pass


class _Reader:
    """Call one NVML function: NaN (or ``None`` from :meth:`raw`) when unsupported or failing, the
    error code in ``last_code``; ``NVML_ERROR_GPU_IS_LOST`` raises :class:`_GpuLost` so the whole
    GPU is marked lost."""

    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self.last_code: int | None = None

    def raw(self, fn: Any, *args: Any) -> Any:
        nv = self.nv
        self.last_code = None
        try:
            return fn(*args)
        except nv.NVMLError as exc:
            code = _code(exc)
            if code == nv.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost(_nvml_reason(nv, exc)) from exc
            self.last_code = code if code is not None else nv.NVML_ERROR_UNKNOWN
            return None

    def __call__(self, fn: Any, *args: Any) -> float:
        value = self.raw(fn, *args)
        return math.nan if value is None else float(value)


def _field_number(v: Any) -> float:
    kind = int(v.valueType)
    return float(getattr(v.value, _UNION[kind])) if 0 <= kind < len(_UNION) else math.nan


_ERROR_NAMES = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_INVALID_ARGUMENT", "NVML_ERROR_NO_PERMISSION",
                "NVML_ERROR_NOT_FOUND", "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_TIMEOUT", "NVML_ERROR_GPU_IS_LOST",
                "NVML_ERROR_UNINITIALIZED", "NVML_ERROR_INSUFFICIENT_SIZE", "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
                "NVML_ERROR_UNKNOWN")


def _error_name(nv: Any, code: int | None) -> str:
    for name in _ERROR_NAMES:
        if getattr(nv, name, None) == code:
            return name
    return f"NVML error {code}"


def _code(exc: BaseException) -> int | None:
    return getattr(exc, "value", None)


def _nvml_reason(nv: Any, exc: BaseException) -> str:
    code = _code(exc)
    if code == getattr(nv, "NVML_ERROR_LIBRARY_NOT_FOUND", -1):
        return "the NVML library libnvidia-ml.so.1 was not found: no NVIDIA driver on this node"
    if code == getattr(nv, "NVML_ERROR_DRIVER_NOT_LOADED", -1):
        return "the NVIDIA kernel driver is not loaded"
    if code == getattr(nv, "NVML_ERROR_NO_PERMISSION", -1):
        return "no permission to open /dev/nvidia* (run with the NVIDIA runtime or as root)"
    return str(exc)


def _handle_key(handle: Any) -> Any:
    """A hashable identity for an NVML device handle (a ctypes pointer in pynvml)."""
    import ctypes

    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return handle


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
