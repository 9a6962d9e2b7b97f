"""Where in-job check results go: the node probe's socket, or any callable (torch-free).

A :class:`Reporter` stamps the job, rank and GPU on every event and hands it to a sink. The default
sink is a :class:`fleethealth.wire.Sender` to the node probe (non-blocking, drop-counting), so
reporting never stalls a training step; a test or a framework passes its own callable instead::

    seen = []
    reporter = Reporter(job="train-1", rank=3, gpu=3, sink=seen.append)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

from fleethealth.schema import Event
from fleethealth.wire import Sender, default_socket, event_datagram

__all__ = ["Reporter", "Sink"]

Sink = Callable[[Event], object]
"""Receives every event the in-job library emits."""

_log = logging.getLogger("fleethealth.injob")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else None


class Reporter:
    """Stamp identity on events and deliver them without ever raising on the step path.

    ``job`` defaults to ``$FLEETHEALTH_JOB``; ``rank`` and ``gpu`` default to torchrun's ``RANK`` and
    ``LOCAL_RANK``. ``sink`` replaces the probe socket; ``socket_path`` selects another probe socket
    (default ``$FLEETHEALTH_SOCKET`` as it is when the reporter is made, else
    ``/run/fleethealth/probe.sock``). ``sent_total`` / ``failed_total`` count deliveries, and
    :attr:`dropped_total` the events that did not reach the probe; a drop is logged as a warning the
    first time, then at most once every ``warn_every_s`` with the count since.
    """

    def __init__(self, *, job: str | None = None, rank: int | None = None, gpu: int | None = None,
                 sink: Sink | None = None, socket_path: str | None = None,
                 clock: Callable[[], float] = time.time, warn_every_s: float = 60.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.job = job if job is not None else os.environ.get("FLEETHEALTH_JOB", "") or None
        self.rank = rank if rank is not None else _env_int("RANK")
        self.gpu = gpu if gpu is not None else _env_int("LOCAL_RANK")
        self.clock = clock
        self.sender: Sender | None = None
        if sink is None:
            self.sender = Sender(socket_path if socket_path is not None else default_socket())
            sender = self.sender
            self._sink: Sink = lambda event: sender.send(event_datagram(event))
        else:
            self._sink = sink
        self.sent_total = 0
        self.failed_total = 0
        self.warn_every_s = warn_every_s
        self._monotonic = monotonic
        self._warned_at: float | None = None
        self._unwarned = 0

    @property
    def dropped_total(self) -> int:
        """Events that did not reach the probe (or the sink) since the reporter was made: refused when
        emitted, and those the sender took into its backlog but never delivered (final after
        :meth:`close`)."""
        return self.failed_total + (self.sender.lost_after_accept if self.sender is not None else 0)

    def now(self) -> float:
        return float(self.clock())

    def emit(self, event: Event) -> bool:
        """Fill job, rank and GPU where the event leaves them empty, then deliver it.

        Returns False (and counts a failure) when the sink refused or raised; never raises.
        """
        event = dataclasses.replace(
            event, job=event.job if event.job is not None else self.job,
            rank=event.rank if event.rank is not None else self.rank,
            gpu=event.gpu if event.gpu is not None else self.gpu)
        try:
            ok = self._sink(event)
        except Exception:  # a broken sink must never stop training
            _log.exception("fleethealth: event sink failed")
            ok = False
        if ok is False:
            self.failed_total += 1
            self._warn_drop()
            return False
        self.sent_total += 1
        return True

    def _warn_drop(self) -> None:
        """One warning for the first drop, then at most one every ``warn_every_s`` (never raises)."""
        self._unwarned += 1
        now = self._monotonic()
        if self._warned_at is not None and now - self._warned_at < self.warn_every_s:
            return
        where = self.sender.path if self.sender is not None else "the event sink"
        _log.warning("fleethealth: %d event(s) dropped (%d in all): %s did not take them (no probe "
                     "listening, its queue full, or an event over the size limit); training goes on",
                     self._unwarned, self.failed_total, where)
        self._warned_at = now
        self._unwarned = 0

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
