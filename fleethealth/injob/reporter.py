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
from fleethealth.wire import DEFAULT_SOCKET, Sender, event_datagram

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
    ``LOCAL_RANK``. ``sink`` replaces the probe socket; ``socket_path`` selects another probe socket.
    ``sent_total`` / ``failed_total`` count deliveries; the wire sender's own drop counter stays on
    ``sender.dropped_total``.
    """

    def __init__(self, *, job: str | None = None, rank: int | None = None, gpu: int | None = None,
                 sink: Sink | None = None, socket_path: str = DEFAULT_SOCKET,
                 clock: Callable[[], float] = time.time) -> None:
        self.job = job if job is not None else os.environ.get("FLEETHEALTH_JOB", "") or None
        self.rank = rank if rank is not None else _env_int("RANK")
        self.gpu = gpu if gpu is not None else _env_int("LOCAL_RANK")
        self.clock = clock
        self.sender: Sender | None = None
        if sink is None:
            self.sender = Sender(socket_path)
            sender = self.sender
            self._sink: Sink = lambda event: sender.send(event_datagram(event))
        else:
            self._sink = sink
        self.sent_total = 0
        self.failed_total = 0

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
            return False
        self.sent_total += 1
        return True

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
