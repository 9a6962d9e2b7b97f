"""NVML telemetry source (``nvidia-ml-py``, module ``pynvml``).

Reads, for every GPU, the columns of :data:`fleethealth.schema.GPU_FIELDS` with the current,
non-deprecated calls: ``nvmlDeviceGetTemperatureV`` (falling back to ``nvmlDeviceGetTemperature``
on drivers without it) and the HBM temperature field, power and enforced limit, SM / memory
clocks, ``nvmlDeviceGetCurrentClocksEventReasons`` (the raw bitmask; :class:`schema.ClockReason`
decodes it, including the HW power brake ``0x80``), ``nvmlDeviceGetTotalEccErrors`` (corrected /
uncorrected, volatile / aggregate), retired pages and their pending status, remapped rows
(correctable, uncorrectable, pending, failure), NVLink link state and the per-link CRC flit /
CRC data / replay / recovery counters (summed over links), the PCIe replay counter and current vs
maximum link generation and width (a downtrained link shows ``pcie_gen < pcie_gen_max``), and
utilisation. A field the GPU does not support is NaN, never an error.

Xid errors arrive through an NVML event set (``nvmlEventTypeXidCriticalError``) waited on by a
background thread and are returned as ``xid`` events with the next sample. A GPU that falls off
the bus (``NVML_ERROR_GPU_IS_LOST``) yields one ``gpu_lost`` event and NaN columns, not a crash,
including a GPU already lost when the probe starts (its index is enumerated on its own and the
event goes out with the first sample). The Xid thread skips GPUs it cannot register (reporting
each failure, lost GPUs aside, as a ``probe_error`` event) and keeps waiting after an event-set
error, backing off and reporting the error once as a ``probe_error`` event until a wait succeeds.

The library handle is injected (``nvml=``): production passes nothing and gets ``pynvml``; the
tests pass a recorded-values object with the same call surface, since these machines have no GPU.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from fleethealth.errors import DeviceError
from fleethealth.probe.sources import Sample
from fleethealth.schema import GPU_FIELDS, Event, EventKind, Telemetry

__all__ = ["NvmlSource", "load_pynvml"]

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
    """

    name = "nvml"

    def __init__(self, node: str, rack: str, *, nvml: Any = None, xid_events: bool = True,
                 xid_wait_ms: int = 500, xid_backoff_max_s: float = 5.0) -> None:
        self.node = node
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

    def close(self) -> None:
        self._stop.set()
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

    def sample(self, ts: float) -> Sample:
        if not self._handles and self._nvml is None:
            raise DeviceError("NVML source: sample() before open()")
        g = len(self._handles)
        cols = {name: np.full(g, np.nan) for name in GPU_FIELDS}
        events: list[Event] = []
        for i, handle in enumerate(self._handles):
            if i in self._lost:
                continue
            try:
                for name, value in self._read_gpu(handle).items():
                    cols[name][i] = value
            except _GpuLost as exc:
                self._lost.add(i)
                events.append(Event(node=self.node, ts=ts, kind=EventKind.GPU_LOST, gpu=i,
                                    message=f"GPU {i} fell off the bus ({exc})",
                                    data={"uuid": self._uuids[i] if i < len(self._uuids) else "",
                                          "source": "nvml"}))
        with self._pending_lock:
            xids, self._pending = self._pending, []
        events.extend(Event(node=self.node, ts=ts, kind=e.kind, gpu=e.gpu, code=e.code, message=e.message,
                            data=e.data) for e in xids)
        telemetry = Telemetry.from_columns(self.node, self.rack, ts, np.arange(g), model=self._model,
                                           uuid=self._uuids, pci_bus_id=self._bus_ids, **cols)
        return Sample(telemetry, tuple(events))

    def _read_gpu(self, h: Any) -> dict[str, float]:
        nv = self._nvml
        read = _Reader(nv)
        out: dict[str, float] = {}
        # Prefer the current calls; drivers older than the call answer FUNCTION_NOT_FOUND.
        out["temp_c"] = read.first(("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"),
                                   h, nv.NVML_TEMPERATURE_GPU)
        out["mem_temp_c"] = read.field(h, nv.NVML_FI_DEV_MEMORY_TEMP)
        # the GPU's own throttle point (NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1 in nvml.h)
        out["slowdown_temp_c"] = read.first(("nvmlDeviceGetTemperatureThreshold",), h,
                                            getattr(nv, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1))
        out["power_w"] = read(nv.nvmlDeviceGetPowerUsage, h) / 1000.0
        out["power_limit_w"] = read(nv.nvmlDeviceGetEnforcedPowerLimit, h) / 1000.0
        out["sm_clock_mhz"] = read(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
        out["sm_clock_max_mhz"] = read(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM)
        out["mem_clock_mhz"] = read(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
        out["clock_reasons"] = read.first(("nvmlDeviceGetCurrentClocksEventReasons",
                                           "nvmlDeviceGetCurrentClocksThrottleReasons"), h)
        util = read.raw(nv.nvmlDeviceGetUtilizationRates, h)
        out["util_pct"] = math.nan if util is None else float(util.gpu)
        for column, err, counter in (("ecc_sbe_volatile", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"),
                                     ("ecc_dbe_volatile", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
                                     ("ecc_sbe_aggregate", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_AGGREGATE_ECC"),
                                     ("ecc_dbe_aggregate", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
                                      "NVML_AGGREGATE_ECC")):
            out[column] = read(nv.nvmlDeviceGetTotalEccErrors, h, getattr(nv, err), getattr(nv, counter))
        sbe = read.raw(nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        dbe = read.raw(nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        out["retired_sbe"] = math.nan if sbe is None else float(len(sbe))
        out["retired_dbe"] = math.nan if dbe is None else float(len(dbe))
        out["retired_pending"] = read(nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
        rows = read.raw(nv.nvmlDeviceGetRemappedRows, h)
        if rows is not None:
            corr, unc, pending, failure = rows
            out.update(remap_correctable=float(corr), remap_uncorrectable=float(unc),
                       remap_pending=float(bool(pending)), remap_failure=float(bool(failure)))
        out.update(self._read_nvlink(read, h))
        out["pcie_replay"] = read(nv.nvmlDeviceGetPcieReplayCounter, h)
        out["pcie_gen"] = read(nv.nvmlDeviceGetCurrPcieLinkGeneration, h)
        out["pcie_gen_max"] = read(nv.nvmlDeviceGetMaxPcieLinkGeneration, h)
        out["pcie_width"] = read(nv.nvmlDeviceGetCurrPcieLinkWidth, h)
        out["pcie_width_max"] = read(nv.nvmlDeviceGetMaxPcieLinkWidth, h)
        return out

    def _read_nvlink(self, read: _Reader, h: Any) -> dict[str, float]:
        nv = self._nvml
        counters = {"nvlink_crc_flit": nv.NVML_NVLINK_ERROR_DL_CRC_FLIT,
                    "nvlink_crc_data": nv.NVML_NVLINK_ERROR_DL_CRC_DATA,
                    "nvlink_replay": nv.NVML_NVLINK_ERROR_DL_REPLAY,
                    "nvlink_recovery": nv.NVML_NVLINK_ERROR_DL_RECOVERY}
        links = up = 0
        totals = dict.fromkeys(counters, 0.0)
        seen = dict.fromkeys(counters, False)
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            state = read.raw(nv.nvmlDeviceGetNvLinkState, h, link)
            if state is None:  # link not present (or NVLink unsupported): stop at the first gap
                if read.last_not_supported:
                    continue
                break
            links += 1
            up += int(state == nv.NVML_FEATURE_ENABLED)
            for column, counter in counters.items():
                value = read(nv.nvmlDeviceGetNvLinkErrorCounter, h, link, counter)
                if not math.isnan(value):
                    totals[column] += value
                    seen[column] = True
        if links == 0:
            return {}
        out = {"nvlink_links_up": float(up), "nvlink_links_max": float(links)}
        out.update({c: totals[c] for c in counters if seen[c]})
        return out

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
    """Call one NVML function: NaN (or ``None`` from :meth:`raw`) when unsupported or failing;
    ``NVML_ERROR_GPU_IS_LOST`` raises :class:`_GpuLost` so the whole GPU is marked lost."""

    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self.last_not_supported = False

    def raw(self, fn: Any, *args: Any) -> Any:
        nv = self.nv
        self.last_not_supported = False
        try:
            return fn(*args)
        except nv.NVMLError as exc:
            code = _code(exc)
            if code == nv.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost(_nvml_reason(nv, exc)) from exc
            self.last_not_supported = code == nv.NVML_ERROR_NOT_SUPPORTED
            return None

    def __call__(self, fn: Any, *args: Any) -> float:
        value = self.raw(fn, *args)
        return math.nan if value is None else float(value)

    def first(self, names: tuple[str, ...], *args: Any) -> float:
        """The first of ``names`` (newest call first) that the library has and answers."""
        for name in names:
            fn = getattr(self.nv, name, None)
            if fn is None:
                continue
            value = self(fn, *args)
            if not math.isnan(value):
                return value
        return math.nan

    def field(self, h: Any, field_id: int) -> float:
        values = self.raw(self.nv.nvmlDeviceGetFieldValues, h, [field_id])
        if not values or values[0].nvmlReturn != self.nv.NVML_SUCCESS:
            return math.nan
        value = values[0]
        kind = value.valueType
        union = value.value
        return float({0: union.dVal, 1: union.uiVal, 2: union.ulVal, 3: union.ullVal,
                      4: union.sllVal, 5: union.siVal, 6: union.usVal}.get(kind, math.nan))


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
