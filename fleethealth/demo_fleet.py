"""The demo's simulated fleet publishing, in a process of its own, while the detectors read.

A fleet's probes publish while the detector tier consumes; the demo runs them the same way. The
simulator hands what its node probes would see — telemetry, per-node step batches, events — to the
probe's delivery path (the bounded disk spool, then the idempotent producer) from a child process, so
on two cores the fleet and the detectors each have one. The child is forked before the parent opens
its store or a Kafka client (it inherits none of their threads); it reports over a pipe as JSON lines
(never a pickle): its progress after each step, then its totals per topic, or the error that ended it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

import orjson

from fleethealth.broker import _die_with_parent
from fleethealth.errors import BusUnavailable
from fleethealth.probe.delivery import Delivery
from fleethealth.probe.spool import Spool
from fleethealth.schema import Topic
from fleethealth.sim import FleetSim, Scenario

__all__ = ["FleetPublisher"]

_DELIVERY_BATCH = 5000
"""Records the probes' delivery sends at most at once; the spool never holds more than this unsent."""


@dataclass
class FleetPublisher:
    """A scenario's fleet publishing to ``dsn`` from a child process; :meth:`poll` reads its reports."""

    steps_total: int
    _process: Any
    _conn: Connection
    steps_done: int = 0
    published: int = 0
    """Messages handed to the delivery so far (all of them once :attr:`done`)."""
    by_topic: dict[Topic, int] = field(default_factory=dict)
    """Messages per topic, known once :attr:`done`."""
    finished_at: float | None = None
    """``time.perf_counter()`` when the parent read the child's totals: its last message delivered."""

    @property
    def done(self) -> bool:
        """The child has published everything (its totals are read)."""
        return self.finished_at is not None

    @classmethod
    def start(cls, scenario: Scenario, dsn: str, spool: Path) -> FleetPublisher:
        """Fork the fleet: it publishes ``scenario`` to ``dsn`` through a spool at ``spool``."""
        for stream in (sys.stdout, sys.stderr):  # the child flushes its copies of their buffers as it exits
            stream.flush()
        parent, child = multiprocessing.Pipe(duplex=False)
        process = multiprocessing.get_context("fork").Process(
            target=_publish, args=(scenario, dsn, spool, child, _die_with_parent(), os.getpid()),
            name="fleethealth-demo-fleet", daemon=True)
        process.start()
        child.close()
        return cls(steps_total=sum(j.steps for j in scenario.job_specs), _process=process, _conn=parent)

    @property
    def pid(self) -> int:
        """The child's process id."""
        return int(self._process.pid)

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Read what the child has reported (waiting up to ``timeout_s`` for a first report); True once it
        has published everything. Raises :class:`BusUnavailable` with the child's error, or when it ended
        without its totals."""
        wait = timeout_s
        while not self.done and self._conn.poll(wait):
            wait = 0.0
            try:
                report = orjson.loads(self._conn.recv_bytes())
            except EOFError:  # its end closed without its totals: it died
                self._process.join(10.0)
                self._ended()
            if "error" in report:
                raise BusUnavailable(f"the demo's fleet stopped: {report['error']}")
            self.steps_done, self.published = report["steps"], report["published"]
            if "by_topic" in report:
                self.by_topic = {Topic(t): n for t, n in report["by_topic"].items()}
                self.finished_at = time.perf_counter()
        if not self.done and not self._process.is_alive() and not self._conn.poll(0):
            self._ended()
        return self.done

    def _ended(self) -> NoReturn:
        raise BusUnavailable(f"the demo's fleet ended (exit code {self._process.exitcode}) before it had "
                             f"published everything: {self.steps_done} of {self.steps_total} steps")

    def wait(self) -> None:
        """Block until the child has published everything."""
        while not self.poll(1.0):
            pass

    def close(self) -> None:
        """End the child (at once when it is still publishing) and reap it."""
        if self._process.is_alive():
            self._process.terminate()
        self._process.join(10.0)
        self._conn.close()


def _publish(scenario: Scenario, dsn: str, spool: Path, out: Connection,
             die_with_parent: Callable[[], object] | None, parent: int) -> None:
    """The child: the simulated fleet through the probes' delivery path, reporting over ``out``; it is
    killed with the demo (a demo SIGKILLed leaves no fleet publishing)."""
    if die_with_parent is not None:
        die_with_parent()
    if os.getppid() != parent:  # the demo died before the hook was set: nothing will read this fleet
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends it; a ^C is the parent's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        delivery = Delivery(dsn, Spool(spool), client_id="fleethealth-demo-probes", batch_records=_DELIVERY_BATCH)
        published = delivered = steps = 0
        by_topic = {Topic.TELEMETRY: 0, Topic.STEPS: 0, Topic.EVENTS: 0}

        def deliver(backlog: int) -> int:
            sent = 0
            while published - delivered - sent > backlog:
                n = delivery.step(force=True)
                if n == 0:
                    raise BusUnavailable(f"the probes could not deliver to the broker: {delivery.stats.last_error}")
                sent += n
            return sent

        try:
            for tick in FleetSim(scenario).run():
                for msg in (*tick.telemetry, *tick.batches, *tick.events):
                    delivery.submit(msg)
                published += len(tick.telemetry) + len(tick.batches) + len(tick.events)
                by_topic[Topic.TELEMETRY] += len(tick.telemetry)
                by_topic[Topic.STEPS] += len(tick.batches)
                by_topic[Topic.EVENTS] += len(tick.events)
                delivered += deliver(_DELIVERY_BATCH)  # keep the spool short whatever the scenario's size
                if tick.step is not None:
                    steps += 1
                    out.send_bytes(orjson.dumps({"steps": steps, "published": published}))
            delivered += deliver(0)
        finally:
            delivery.close()
        out.send_bytes(orjson.dumps({"steps": steps, "published": published,
                                     "by_topic": {str(t): n for t, n in by_topic.items()}}))
    except BaseException as exc:  # reported to the parent, which raises it
        last = traceback.extract_tb(exc.__traceback__)[-1:]
        where = f" ({last[0].filename}:{last[0].lineno})" if last else ""
        out.send_bytes(orjson.dumps({"error": f"{type(exc).__name__}: {exc}{where}"}))
    finally:
        out.close()
