"""What the probe tells an operator: log set-up (``--log-level``, ``--log-format text|json``) and
the warnings that matter on a node.

:func:`configure_logging` points the ``fleethealth`` loggers at standard error, one line per record,
as text (``2026-12-01T08:00:00Z WARNING fleethealth.probe: ...``) or as one JSON object a line
(``{"ts": ..., "level": ..., "logger": ..., "msg": ..., **extra}``) for a log shipper.

:class:`ProbeWatch` looks at the probe after every interval and warns, each at most once per
``every_s`` of its clock (the clock is injected; tests never sleep):

- the broker is unreachable (delivery failing and no producer connected), and again when it is back;
- the spool passes 50 % and 90 % of its bound (once per crossing; re-armed when it drains below);
- the spool drops records (how many since the last warning);
- a GPU fell off the bus (every ``gpu_lost`` event and Xid 79; never rate-limited: each is news);
- a NIC counter was missing, unreadable or went backwards (each once, from the NIC source).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from fleethealth.errors import ConfigError
from fleethealth.schema import Event, EventKind

__all__ = ["configure_logging", "JsonFormatter", "ProbeWatch", "LOG_FORMATS", "LOGGER"]

LOG_FORMATS = ("text", "json")
LOGGER = "fleethealth.probe"
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``msg`` and any ``extra``."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and not key.startswith("_"):
                obj[key] = value
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


def configure_logging(level: str = "info", fmt: str = "text", *, stream: Any = None) -> logging.Handler:
    """Send the ``fleethealth`` loggers to ``stream`` (standard error) at ``level`` in ``fmt``."""
    if fmt not in LOG_FORMATS:
        raise ConfigError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ConfigError(f"--log-level must be one of debug, info, warning, error, got {level!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%SZ")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger("fleethealth")
    for old in list(root.handlers):
        if getattr(old, "_fleethealth", False):
            root.removeHandler(old)
    handler._fleethealth = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(numeric)
    return handler


class ProbeWatch:
    """Rate-limited warnings about the probe's delivery, spool, GPUs and NIC (see the module docstring)."""

    def __init__(self, *, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger | None = None) -> None:
        self.every_s = every_s
        self._clock = clock
        self.log = logger or logging.getLogger(LOGGER)
        self._last: dict[str, float] = {}
        self._unreachable = False
        self._spool_level = 0
        self._dropped = 0
        self._dropped_told = 0

    def _due(self, key: str) -> bool:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            return False
        self._last[key] = now
        return True

    def delivery(self, *, connected: bool, failures_total: int, last_error: str | None, dsn: str) -> None:
        """After each interval: warn while the broker is unreachable, note when it is back."""
        failing = failures_total > 0 and not connected
        if failing and self._due("broker"):
            self.log.warning("broker %s unreachable (%d failed attempts so far): %s; records wait in the spool",
                             dsn, failures_total, last_error or "no producer",
                             extra={"event": "broker_unreachable", "failures_total": failures_total})
        if self._unreachable and connected:
            self.log.info("broker %s reachable again", dsn, extra={"event": "broker_reachable"})
            self._last.pop("broker", None)
        self._unreachable = failing

    def spool(self, *, pending_bytes: int, max_bytes: int, dropped_total: int) -> None:
        """After each interval: warn as the spool fills past 50 % and 90 %, and when it drops."""
        share = pending_bytes / max_bytes if max_bytes > 0 else 0.0
        level = 2 if share >= 0.9 else 1 if share >= 0.5 else 0
        if level > self._spool_level:
            self.log.warning("spool %.0f %% full (%d of %d bytes): the broker is not keeping up",
                             100 * share, pending_bytes, max_bytes,
                             extra={"event": "spool_filling", "spool_share": round(share, 3)})
            self._spool_level = level
        elif level == 0 and self._spool_level > 0:
            self.log.info("spool below 50 %% again (%d bytes)", pending_bytes, extra={"event": "spool_draining"})
            self._spool_level = 0
        if dropped_total > self._dropped:
            self._dropped = dropped_total
            if self._due("spool_drop"):
                self.log.warning("spool full: dropped %d oldest records (%d in all)",
                                 dropped_total - self._dropped_told, dropped_total,
                                 extra={"event": "spool_dropped", "dropped_total": dropped_total})
                self._dropped_told = dropped_total

    def event(self, event: Event) -> None:
        """Every event the probe sends: a GPU lost is a warning each time."""
        if event.kind is EventKind.GPU_LOST or (event.kind is EventKind.XID and event.code == 79):
            self.log.warning("GPU %s on %s fell off the bus: %s", event.gpu, event.node, event.message or "",
                             extra={"event": "gpu_lost", "gpu": event.gpu})
        elif event.kind in (EventKind.TELEMETRY_STALLED, EventKind.PROBE_ERROR):
            self.log.warning("%s", event.message, extra={"event": event.kind.value})

    def nic_problems(self, problems: list[str]) -> None:
        for problem in problems:
            self.log.warning("%s", problem, extra={"event": "nic_counter"})
