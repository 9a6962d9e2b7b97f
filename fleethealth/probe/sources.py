"""The telemetry source contract, the registry of sources by name, and the stall guard.

A source is small: ``open()``, ``sample(ts) -> Sample``, ``close()``. ``sample`` returns one
:class:`fleethealth.schema.Telemetry` for all GPUs of the node plus any events seen since the
last call (Xid, health-watch incidents, a GPU that fell off the bus). Sources are registered by
name and imported lazily, so ``--source sim`` never touches NVML and ``--source nvml`` never
loads DCGM::

    source = create_source("nvml", node="n0001", rack="r00")

:class:`StallGuard` runs ``sample`` on a worker thread and gives up after a timeout: a degrading
GPU that stalls NVML or DCGM becomes a ``telemetry_stalled`` event while the probe keeps running,
instead of a monitor that hangs until its liveness probe kills it and the fault is never reported.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from fleethealth.errors import ConfigError
from fleethealth.schema import Event, EventKind, StepBatch, Telemetry

__all__ = ["Sample", "Source", "SOURCES", "register_source", "create_source", "StallGuard", "GuardResult"]


@dataclass(frozen=True)
class Sample:
    """What one call to a source returns: the node's telemetry, events since the last call, and
    (only from the simulator, which plays the training job too) the node's step batches."""

    telemetry: Telemetry
    events: tuple[Event, ...] = ()
    batches: tuple[StepBatch, ...] = field(default=())


@runtime_checkable
class Source(Protocol):
    """A telemetry source for one node. ``name`` is its registry name."""

    name: str

    def open(self) -> None:
        """Connect to the library or service; raise :class:`fleethealth.errors.DeviceError` naming
        what is missing and which ``--source`` would work."""

    def sample(self, ts: float) -> Sample | None:
        """Read every GPU now; ``ts`` is the event time stamped on the sample (``None``: this source
        has no telemetry, as ``none``; nothing is published for the interval)."""

    def close(self) -> None:
        """Release the library or service."""


SOURCES: dict[str, str] = {
    "nvml": "fleethealth.probe.nvml:NvmlSource",
    "dcgm": "fleethealth.probe.dcgm:DcgmSource",
    "sim": "fleethealth.probe.simsource:SimSource",
    "none": "fleethealth.probe.nosource:NoSource",
}
"""Source name -> ``module:Class``; the module is imported only when that source is created."""


def register_source(name: str, target: str) -> None:
    """Register a source class under ``name`` as ``"package.module:Class"``."""
    if ":" not in target:
        raise ConfigError(f"source target {target!r} must look like 'package.module:Class'")
    SOURCES[name] = target


def create_source(name: str, **kwargs: Any) -> Source:
    """Build the source registered as ``name`` (not yet opened); unknown names list the known ones."""
    target = SOURCES.get(name)
    if target is None:
        raise ConfigError(f"unknown telemetry source {name!r} (known: {', '.join(sorted(SOURCES))})")
    module_name, _, cls_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(**kwargs)


@dataclass(frozen=True)
class GuardResult:
    """One guarded call: ``sample`` when it returned in time, else ``None``; ``events`` holds the
    ``telemetry_stalled`` event when a stall begins (once per stall, not once per tick);
    ``error`` the exception text when the source raised."""

    sample: Sample | None
    events: tuple[Event, ...] = ()
    error: str | None = None


class StallGuard:
    """Call ``source.sample`` on a worker thread with a timeout.

    While a call is stuck, later ticks do not start another (the library is presumably wedged);
    they return ``GuardResult(None)`` at once. When the stuck call finally returns, its stale
    sample is discarded and sampling resumes. ``stalls_total`` counts stall episodes and
    ``stalled`` says whether one is in progress.
    """

    def __init__(self, source: Source, *, node: str, timeout_s: float = 5.0) -> None:
        if timeout_s <= 0:
            raise ConfigError("stall timeout must be > 0 seconds")
        self.source = source
        self.node = node
        self.timeout_s = timeout_s
        self.stalls_total = 0
        self.errors_total = 0
        self._lock = threading.Lock()
        self._request = threading.Condition(self._lock)
        self._pending_ts: float | None = None
        self._done = threading.Event()
        self._result: Sample | BaseException | None = None
        self._busy = False
        self._abandoned = False
        self._stalled_since: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=f"fh-sample-{source.name}", daemon=True)
        self._thread.start()

    @property
    def stalled(self) -> bool:
        return self._stalled_since is not None

    def sample(self, ts: float) -> GuardResult:
        """Sample at event time ``ts``; never waits longer than ``timeout_s``."""
        with self._lock:
            if self._busy:  # the previous call is still stuck
                return GuardResult(None)
            self._busy = True
            self._done.clear()
            self._pending_ts = ts
            self._request.notify()
        finished = self._done.wait(self.timeout_s)
        with self._lock:
            if not finished and not self._done.is_set():
                self._abandoned = True
                if self._stalled_since is not None:
                    return GuardResult(None)
                self._stalled_since = ts
                self.stalls_total += 1
                event = Event(node=self.node, ts=ts, kind=EventKind.TELEMETRY_STALLED,
                              message=f"{self.source.name} source did not answer within {self.timeout_s:g} s",
                              data={"source": self.source.name, "timeout_s": self.timeout_s})
                return GuardResult(None, (event,))
            result, self._result = self._result, None
        if isinstance(result, BaseException):
            self.errors_total += 1
            return GuardResult(None, error=f"{type(result).__name__}: {result}")
        return GuardResult(result)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._request.notify()

    def _work(self) -> None:
        while True:
            with self._lock:
                while self._pending_ts is None and not self._closed:
                    self._request.wait()
                if self._closed:
                    return
                ts, self._pending_ts = self._pending_ts, None
            try:
                result: Sample | BaseException | None = self.source.sample(ts)
            except Exception as exc:  # reported through GuardResult.error; the probe keeps running
                result = exc
            with self._lock:
                if self._abandoned:  # the caller gave up on this call: drop the stale sample, end the stall
                    self._result = None
                    self._abandoned = False
                    self._stalled_since = None
                else:
                    self._result = result
                self._busy = False
                self._done.set()
