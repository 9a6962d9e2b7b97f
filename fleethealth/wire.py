"""The one small message format the in-job library and the node probe share.

Training processes send datagrams over a Unix socket (``SOCK_DGRAM``) to the probe on their node.
A datagram is one JSON object with a ``"t"`` tag:

- ``"c"`` compute: ``job, rank, gpu, step, s`` (pre-collective compute seconds), ``ts``, and
  optionally ``g``: the rank's comparison group (its pipeline stage), a non-negative integer
- ``"p"`` progress: ``job, rank, gpu, step, ts`` (the step completed)
- ``"e"`` event: ``event`` (an :class:`fleethealth.schema.Event` object without the node: the probe
  fills it in)

:class:`Sender` never blocks the caller: the socket is non-blocking. A datagram the receiver cannot
take now (its queue full, the probe restarting) waits in a bounded backlog, in order, and goes out
with the next send or :meth:`Sender.flush`; one that finds the backlog full, or is over the size
limit, is dropped and counted. Nothing here imports the probe, and the probe imports nothing of the
in-job library but this module.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from fleethealth.schema import Event

__all__ = ["DEFAULT_SOCKET", "default_socket", "MAX_DATAGRAM", "MAX_GPU", "MAX_GROUP", "MAX_RANK", "MAX_STEP",
           "Sender", "WireMessage", "event_datagram", "parse"]

DEFAULT_SOCKET = os.environ.get("FLEETHEALTH_SOCKET", "/run/fleethealth/probe.sock")
"""The socket path as the environment said at import (kept for callers that name it); senders
read :func:`default_socket` when they are made."""


def default_socket() -> str:
    """``$FLEETHEALTH_SOCKET`` as it is now, else ``/run/fleethealth/probe.sock``."""
    return os.environ.get("FLEETHEALTH_SOCKET") or "/run/fleethealth/probe.sock"

MAX_DATAGRAM = 200_000
"""Larger datagrams (a very deep stack dump) are dropped (and counted) by the sender, never split."""
MAX_RANK = 2**31 - 1
"""The largest rank a datagram may carry (step batches hold ranks as int32)."""
MAX_GPU = 2**15 - 1
"""The largest local GPU index a datagram may carry (step batches hold GPUs as int16)."""
MAX_STEP = 2**63 - 1
"""The largest step a datagram may carry (int64 downstream)."""
MAX_GROUP = 2**31 - 1
"""The largest comparison group a datagram may carry (step batches hold groups as int32)."""


@dataclass(frozen=True, slots=True)
class WireMessage:
    """One parsed datagram. ``kind`` is ``"c"``, ``"p"`` or ``"e"``."""

    kind: str
    job: str
    rank: int
    gpu: int
    step: int
    ts: float
    value: float = 0.0
    event: dict[str, Any] | None = None
    group: int | None = None


def event_datagram(event: Event) -> dict[str, Any]:
    """The ``"e"`` datagram of an event for :class:`Sender`: the probe fills the node."""
    obj = event.to_obj()
    obj.pop("node", None)
    return {"t": "e", "event": obj}


def parse(datagram: bytes) -> WireMessage:
    """Parse one datagram; raise ``ValueError`` with the reason on anything malformed."""
    try:
        obj = orjson.loads(datagram)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    kind = obj.get("t")
    if kind == "e":
        event = obj.get("event")
        if not isinstance(event, dict):
            raise ValueError("event datagram without an event object")
        return WireMessage("e", str(event.get("job") or ""), int(event.get("rank") or 0),
                           int(event.get("gpu") or 0), int(event.get("step") or 0),
                           float(event.get("ts") or 0.0), event=event)
    if kind not in ("c", "p"):
        raise ValueError(f"unknown datagram tag {kind!r}")
    try:
        job, rank, gpu, step, ts = obj["job"], obj["rank"], obj["gpu"], obj["step"], obj["ts"]
        value = obj.get("s", 0.0)
    except KeyError as exc:
        raise ValueError(f"missing field {exc.args[0]!r}") from None
    if not isinstance(job, str) or not job:
        raise ValueError("job must be a non-empty string")
    for name, v, most in (("rank", rank, MAX_RANK), ("gpu", gpu, MAX_GPU), ("step", step, MAX_STEP)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer")
        if v > most:
            raise ValueError(f"{name} {v} is out of range (at most {most})")
    for name, v in (("ts", ts), ("s", value)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not (0.0 <= v < float("inf")):
            raise ValueError(f"{name} must be a finite non-negative number")
    group = obj.get("g")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or not 0 <= group <= MAX_GROUP):
        raise ValueError(f"g (the rank's group) must be an integer from 0 to {MAX_GROUP}")
    return WireMessage(kind, job, rank, gpu, step, float(ts), float(value), group=group)


class Sender:
    """Datagrams to the node probe that never block and never raise on the step path.

    A datagram the probe cannot take now (its receive queue full: ranks finishing a step together,
    a loaded node) is kept in a backlog of at most ``backlog`` datagrams (``backlog_bytes`` in all) and sent,
    oldest first, before the next one or by :meth:`flush`; :meth:`close` flushes for at most
    ``close_timeout_s``. ``sent_total`` counts datagrams the kernel took, ``dropped_total`` those
    lost: over the size limit, not serialisable, the backlog full (``send`` returned False), or lost
    after ``send`` took it: still waiting at close, or refused by the kernel for good
    (``lost_after_accept``).
    """

    def __init__(self, path: str | None = None, *, backlog: int = 4096, backlog_bytes: int = 4 << 20,
                 close_timeout_s: float = 2.0) -> None:
        if backlog < 0 or backlog_bytes < 0 or close_timeout_s < 0:
            raise ValueError("Sender: backlog, backlog_bytes and close_timeout_s must be >= 0")
        self.path = path if path is not None else default_socket()
        self.backlog = backlog
        self.backlog_bytes = backlog_bytes
        self._waiting_bytes = 0
        self.close_timeout_s = close_timeout_s
        self.sent_total = 0
        self.dropped_total = 0
        self.lost_after_accept = 0
        self._waiting: deque[bytes] = deque()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def send(self, obj: dict[str, Any]) -> bool:
        """Send one datagram, or queue it behind those waiting; False (a drop, counted) if neither."""
        try:
            data = orjson.dumps(obj)
        except TypeError:
            self.dropped_total += 1
            return False
        if len(data) > MAX_DATAGRAM:
            self.dropped_total += 1
            return False
        if self.flush():
            taken = self._put(data)
            if taken is not False:
                return taken is True
        if len(self._waiting) >= self.backlog or self._waiting_bytes + len(data) > self.backlog_bytes:
            self.dropped_total += 1
            return False
        self._waiting.append(data)
        self._waiting_bytes += len(data)
        return True

    def flush(self) -> bool:
        """Send what waits, oldest first, until the probe cannot take more; True when nothing waits."""
        while self._waiting:
            taken = self._put(self._waiting[0])
            if taken is False:
                return False
            if taken is None:
                self.lost_after_accept += 1
            self._waiting_bytes -= len(self._waiting.popleft())
        return True

    @property
    def waiting(self) -> int:
        """Datagrams in the backlog."""
        return len(self._waiting)

    def _put(self, data: bytes) -> bool | None:
        """One datagram to the kernel: True if taken, False if the probe cannot take it now, None if it
        is lost (counted)."""
        try:
            self._sock.sendto(data, self.path)
        except BlockingIOError:  # the probe's queue is full: it drains as the probe reads
            return False
        except OSError:  # no probe listening, or anything else: waiting would not help
            self.dropped_total += 1
            return None
        self.sent_total += 1
        return True

    def close(self) -> None:
        """Flush the backlog for at most ``close_timeout_s`` (the job is ending), then close."""
        deadline = time.monotonic() + self.close_timeout_s
        while not self.flush() and time.monotonic() < deadline:
            time.sleep(0.005)
        self.lost_after_accept += len(self._waiting)
        self.dropped_total += len(self._waiting)
        self._waiting.clear()
        self._waiting_bytes = 0
        self._sock.close()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
