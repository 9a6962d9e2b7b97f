"""The node probe's loop: sample, aggregate rank datagrams, spool, deliver, export metrics.

::

    every interval:  source.sample()  --(StallGuard: timeout -> telemetry_stalled event)-->
                     (NVML: each GPU on its own thread, gpu_timeout_s -> telemetry_stalled naming the GPU)
                     + the node's NIC port counters from sysfs (NicReader, unless the source has its own)
                     one fh.telemetry message + the source's events (Xid, health, gpu_lost)
    continuously:    Unix-socket datagrams from the node's training ranks (own thread) -> StepAggregator
                     -> one fh.steps batch per (job, step) + in-job events (node filled in)
    all of it:       -> Delivery (write-ahead Spool -> idempotent Producer, replay after an outage)
                     -> ProbeMetrics (/metrics on port 9402)

:meth:`Probe.tick` does one interval's work and :meth:`Probe.pump` hands on completed step
batches until a deadline; :meth:`Probe.run` alternates them until stopped. Tests drive ``tick`` and ``pump``
directly with their own clock, so nothing in them sleeps on the probe's behalf.

The socket end (:class:`DatagramListener`) binds ``SOCK_DGRAM`` at the configured path under the
``/run/fleethealth`` directory that the DaemonSet shares with training pods, replaces a stale
socket file left by a previous probe, and is writable by its owner and group only (mode 0660,
``socket_group``); each datagram's sender credentials are checked (``SCM_CREDENTIALS``) and its
size bounded before it is buffered (:mod:`fleethealth.probe.listener`), and the aggregator limits
events per job and ranks per step (``socket_limits``), each overflow counted and reported once.
The kernel queues only ``net.unix.max_dgram_qlen`` datagrams (10 by default; the deploy files raise
it), so a thread of its own reads them as they come; senders never block, they drop and count.

After every interval :class:`~fleethealth.probe.logs.ProbeWatch` logs what an operator must know:
the broker unreachable, the spool filling or dropping, a GPU off the bus, a bad NIC counter.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import selectors
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleethealth.errors import ConfigError
from fleethealth.probe.aggregator import SocketLimits, StepAggregator, pack
from fleethealth.probe.delivery import Delivery
from fleethealth.probe.listener import DEFAULT_MAX_BYTES as DEFAULT_SOCKET_MAX_BYTES
from fleethealth.probe.listener import DatagramListener, PeerPolicy
from fleethealth.probe.logs import LOGGER, ProbeWatch
from fleethealth.probe.metrics import DEFAULT_PORT, ProbeHealth, ProbeMetrics
from fleethealth.probe.nic import NicReader
from fleethealth.probe.sources import Source, StallGuard
from fleethealth.probe.spool import DEFAULT_MAX_BYTES, Spool
from fleethealth.schema import MAX_BLOCK_STEPS, Event, EventKind, Message, Telemetry
from fleethealth.signing import Signer
from fleethealth.wire import DEFAULT_SOCKET

__all__ = ["Probe", "ProbeConfig", "TickReport", "DatagramListener", "make_source"]


@dataclass(frozen=True)
class ProbeConfig:
    """Everything ``fleethealth probe`` takes besides the source and the bus.

    ``socket_path=None`` runs without the in-job socket; ``metrics_port=None`` without /metrics.
    ``stall_timeout_s`` bounds one source call; ``step_timeout_s`` is how long a step batch waits
    for the node's slower ranks; ``steps_per_message`` is how many of the steps completed in one
    interval (per job) one ``fh.steps`` message may carry (a :class:`~fleethealth.schema.StepBlock`;
    ``1``: one :class:`~fleethealth.schema.StepBatch` per step, as before blocks existed). ``nic_root``
    is the file-system root whose ``sys/class`` the NIC counters are read from (``None``: no NIC
    reading); ``dcgm_exporter_compat`` serves dcgm-exporter's
    ``DCGM_FI_*`` names and labels instead of the probe's own; ``warn_every_s`` rate-limits the
    repeated warnings.
    """

    node: str
    rack: str = "unknown"
    interval_s: float = 1.0
    socket_path: str | None = DEFAULT_SOCKET
    spool_dir: str = "/var/lib/fleethealth/spool"
    spool_max_bytes: int = DEFAULT_MAX_BYTES
    metrics_port: int | None = DEFAULT_PORT
    metrics_addr: str = "0.0.0.0"
    stall_timeout_s: float = 5.0
    step_timeout_s: float = 5.0
    steps_per_message: int = 100
    nic_root: str | None = None
    dcgm_exporter_compat: bool = False
    warn_every_s: float = 60.0
    socket_group: str | None = None
    """The socket's group (name or gid): the training processes' (none: the probe's own)."""
    socket_uids: frozenset[int] = frozenset()
    """Senders admitted by uid (with ``socket_gids``; both empty: root, the probe's uid, the group)."""
    socket_gids: frozenset[int] = frozenset()
    socket_max_bytes: int = DEFAULT_SOCKET_MAX_BYTES
    socket_limits: SocketLimits = SocketLimits()

    def __post_init__(self) -> None:
        if not self.node:
            raise ConfigError("probe: --node must not be empty")
        if not self.interval_s > 0:
            raise ConfigError(f"probe: --interval must be > 0 seconds, got {self.interval_s}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"probe: --metrics-port {self.metrics_port} is not a TCP port")
        if not 1 <= self.steps_per_message <= MAX_BLOCK_STEPS:
            raise ConfigError(f"probe: --steps-per-message must be within 1..{MAX_BLOCK_STEPS}, "
                              f"got {self.steps_per_message}")


@dataclass(frozen=True, slots=True)
class TickReport:
    """What one interval produced: whether a sample arrived, and how many events and batches went out."""

    sampled: bool
    events: int
    batches: int


class Probe:
    """One node's probe. ``delivery`` defaults to a spool under ``config.spool_dir`` towards ``dsn``."""

    def __init__(self, source: Source, config: ProbeConfig, *, dsn: str | None = None,
                 delivery: Delivery | None = None, metrics: ProbeMetrics | None = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 on_connect: Callable[[str], None] | None = None, relay: Any = None,
                 signer: Signer | None = None) -> None:
        if delivery is None:
            if dsn is None:
                raise ConfigError("probe: --kafka DSN is required")
            spool = Spool(Path(config.spool_dir), max_bytes=config.spool_max_bytes)
            delivery = Delivery(dsn, spool, client_id=f"fleethealth-probe-{config.node}", on_connect=on_connect,
                                node=config.node, signer=signer)  # signer: this node's key (fleethealth.signing)
        self.source = source
        self.config = config
        self.delivery = delivery
        self.metrics = metrics if metrics is not None else ProbeMetrics(config.node,
                                                                        compat=config.dcgm_exporter_compat)
        self.metrics.set_health(self.health)
        self.nic = NicReader(config.nic_root) if config.nic_root is not None else None
        self.watch = ProbeWatch(every_s=config.warn_every_s, clock=monotonic)
        self.log = logging.getLogger(LOGGER)
        self.aggregator = StepAggregator(config.node, timeout_s=config.step_timeout_s, limits=config.socket_limits)
        self._clock = clock
        self._monotonic = monotonic
        self._guard: StallGuard | None = None
        self._listener: DatagramListener | None = None
        self._selector: selectors.BaseSelector | None = None
        self._server: object | None = None
        self._samples = 0
        self._events = 0
        self._last_duration = math.nan
        self._last_error: str | None = None
        self._agg_lock = threading.Lock()
        self._closing = threading.Event()
        self._receiver: threading.Thread | None = None
        self.relay = relay
        """A :class:`fleethealth.probe.rollback.RollbackRelay` (or ``None``): told the jobs seen here."""

    # ------------------------------------------------------------ lifecycle
    def open(self, *, background_delivery: bool = True) -> Probe:
        """Open the source (raising its one-line DeviceError), the socket, /metrics and delivery."""
        self.source.open()
        driver = getattr(self.source, "driver_version", "")
        if driver and not self.metrics.driver_version:
            self.metrics.driver_version = str(driver)
        self._guard = StallGuard(self.source, node=self.config.node, timeout_s=self.config.stall_timeout_s)
        if self.config.socket_path is not None:
            self._listener = DatagramListener(self.config.socket_path, group=self.config.socket_group,
                                              policy=PeerPolicy(self.config.socket_uids, self.config.socket_gids),
                                              max_bytes=self.config.socket_max_bytes)
            self._selector = selectors.DefaultSelector()
            self._selector.register(self._listener, selectors.EVENT_READ)
            self._receiver = threading.Thread(target=self._receive, name="fh-probe-socket", daemon=True)
            self._receiver.start()
        if self.config.metrics_port is not None:
            self._server = self.metrics.serve(self.config.metrics_port, self.config.metrics_addr)
        if background_delivery:
            self.delivery.start()
        if self.relay is not None:
            self.relay.start()
        return self

    def close(self, drain_timeout_s: float = 5.0) -> None:
        self._closing.set()
        if self.relay is not None:
            self.relay.close()
        if self._guard is not None:
            self._guard.close()
        if self._receiver is not None:
            self._receiver.join(timeout=2.0)
        if self._selector is not None:
            self._selector.close()
        if self._listener is not None:
            self._listener.close()
        if self._server is not None:
            self._server.shutdown()  # type: ignore[attr-defined]
            self._server.server_close()  # type: ignore[attr-defined]
        self.delivery.close(drain_timeout_s)
        self.source.close()

    def __enter__(self) -> Probe:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ one interval
    def tick(self, now: float | None = None) -> TickReport:
        """Sample the source once and hand everything ready to delivery and metrics."""
        if self._guard is None:
            raise ConfigError("probe: tick() before open()")
        now = self._clock() if now is None else now
        t0 = time.perf_counter()
        result = self._guard.sample(now)
        events: list[Event] = list(result.events)
        batches = 0
        sampled = result.sample is not None
        if result.sample is not None:
            self._last_duration = time.perf_counter() - t0
            self._samples += 1
            sample = result.sample
            telemetry = self._with_nic(sample.telemetry, events)
            self._submit(telemetry)
            self.metrics.observe(telemetry)
            events.extend(sample.events)
            for batch in sample.batches:
                self._submit(batch)
            batches += len(sample.batches)
        elif result.error is not None and result.error != self._last_error:
            events.append(Event(node=self.config.node, ts=now, kind=EventKind.PROBE_ERROR,
                                message=f"{self.source.name} source failed: {result.error}"[:2000],
                                data={"source": self.source.name}))
        self._last_error = result.error if result.sample is None else None
        for event in events:
            self._submit_event(event)
        batches += self._drain()
        self._watch()
        return TickReport(sampled, len(events), batches)

    def _with_nic(self, telemetry: Telemetry, events: list[Event]) -> Telemetry:
        """The sample with this node's NIC ports added (a source with its own, the simulator, keeps them).
        A bad counter is one ``probe_error`` event and one warning; the sample is published anyway."""
        if self.nic is None or telemetry.nic is not None:
            return telemetry
        try:
            ports = self.nic.read(telemetry.ts)
        except Exception as exc:  # noqa: BLE001 - the GPU sample goes out whatever the NIC does
            problems = [f"NIC source failed: {type(exc).__name__}: {exc}"]
            ports = None
        else:
            problems = self.nic.take_problems()
        for problem in problems:
            events.append(Event(node=self.config.node, ts=telemetry.ts, kind=EventKind.PROBE_ERROR,
                                message=problem[:2000], data={"source": "nic"}))
        if ports is None:
            return telemetry
        util = self.nic.util
        return dataclasses.replace(telemetry, nic=ports,
                                   nic_util=telemetry.nic_util if math.isnan(util) else util)

    def _watch(self) -> None:
        stats = self.delivery.stats
        self.watch.delivery(connected=stats.connected, failures_total=stats.failures_total,
                            last_error=stats.last_error, dsn=self.delivery.dsn)
        self.watch.spool(pending_bytes=stats.spool.bytes, max_bytes=self.delivery.spool.max_bytes,
                         dropped_total=stats.spool.dropped_total)

    def pump(self, until: float, stop: threading.Event | None = None) -> None:
        """Wait until ``until`` on the monotonic clock (or ``stop``), handing on the batches that
        complete meanwhile; the socket itself is served by a thread of its own, so a slow sample
        never leaves the ranks' datagrams queued (the kernel queue of a Unix datagram socket is short)."""
        stop = stop if stop is not None else self._closing
        while True:
            remaining = until - self._monotonic()
            if remaining <= 0 or stop.is_set():
                return
            stop.wait(min(remaining, 0.05))
            self._drain()

    def _receive(self) -> None:
        selector = self._selector
        listener = self._listener
        if selector is None or listener is None:
            return
        while not self._closing.is_set():
            try:
                ready = selector.select(timeout=0.2)
            except (OSError, ValueError):  # closed under us
                return
            if not ready:
                continue
            try:
                datagrams = listener.receive()
            except OSError:  # closed under us, or a transient socket error: try again
                if self._closing.wait(0.05):
                    return
                continue
            if not datagrams:
                continue
            now, wall = self._monotonic(), self._clock()
            with self._agg_lock:
                for datagram in datagrams:
                    try:
                        self.aggregator.feed(datagram, now, wall)
                    except Exception as exc:  # noqa: BLE001 - never lose the thread to one datagram
                        self.aggregator.reject(f"{type(exc).__name__}: {exc}")

    def run(self, stop: threading.Event, *, max_ticks: int | None = None) -> int:
        """Tick every ``interval_s`` until ``stop`` is set (or ``max_ticks``); return ticks done."""
        ticks = 0
        next_at = self._monotonic()
        while not stop.is_set() and (max_ticks is None or ticks < max_ticks):
            self.tick()
            ticks += 1
            next_at += self.config.interval_s
            now = self._monotonic()
            if next_at < now:  # fell behind (a stall): skip missed intervals rather than burst
                next_at = now + self.config.interval_s
            if max_ticks is not None and ticks >= max_ticks:
                break
            self.pump(next_at, stop)
        return ticks

    # ------------------------------------------------------------ health
    def health(self) -> ProbeHealth:
        with self._agg_lock:
            agg = self.aggregator.stats
        sock = self._listener.stats if self._listener is not None else None
        delivery = self.delivery.stats
        guard = self._guard
        return ProbeHealth(
            samples_total=self._samples, sample_errors_total=0 if guard is None else guard.errors_total,
            stalls_total=0 if guard is None else guard.stalls_total,
            stalled=int(guard is not None and guard.stalled), sample_duration_seconds=self._last_duration,
            datagrams_total=agg.datagrams_total, datagrams_garbage_total=agg.garbage_total,
            datagrams_late_total=agg.late_total, step_batches_total=agg.batches_total,
            step_batches_incomplete_total=agg.incomplete_total, events_total=self._events,
            spool_records=delivery.spool.records, spool_bytes=delivery.spool.bytes,
            spool_dropped_total=delivery.spool.dropped_total,
            spool_dropped_bytes_total=delivery.spool.dropped_bytes_total,
            delivered_total=delivery.delivered_total, delivery_failures_total=delivery.failures_total,
            bus_connected=int(delivery.connected),
            datagrams_refused_total=0 if sock is None else sock.refused_total,
            datagrams_oversize_total=0 if sock is None else sock.oversize_total,
            events_limited_total=agg.events_limited_total, ranks_limited_total=agg.ranks_limited_total,
            gpu_stalls_total=int(getattr(self.source, "gpu_stalls_total", 0)),
            gpus_stalled=len(getattr(self.source, "stalled_gpus", ())))

    # ------------------------------------------------------------ internals
    def _drain(self) -> int:
        with self._agg_lock:
            drained = self.aggregator.drain(self._monotonic())
        for batch in pack(drained.batches, self.config.steps_per_message):
            self._submit(batch)
        for event in drained.events:
            self._submit_event(event)
        if self.relay is not None and (drained.batches or drained.events):
            self.relay.saw_jobs({b.job for b in drained.batches} | {e.job for e in drained.events})
        return len(drained.batches)

    def _submit(self, msg: Message) -> None:
        self.delivery.submit(msg)

    def _submit_event(self, event: Event) -> None:
        self._events += 1
        self.metrics.count_event(event)
        if event.data.get("source") != "nic":  # NIC problems are logged by the watch, once
            self.watch.event(event)
        else:
            self.watch.nic_problems([event.message or ""])
        self.delivery.submit(event)


def make_source(name: str, *, node: str, rack: str, interval_s: float = 1.0, scenario: str | None = None,
                dcgm_host: str = "localhost", gpu_timeout_s: float | None = None) -> Source:
    """Build the named source with the options that apply to it (``--scenario`` only for ``sim``,
    ``gpu_timeout_s`` for ``nvml``)."""
    from fleethealth.probe.sources import create_source

    if scenario is not None and name != "sim":
        raise ConfigError(f"probe: --scenario applies to --source sim, not --source {name}")
    if name == "sim":
        return create_source("sim", node=node, rack=rack, scenario=scenario)
    if name == "dcgm":
        return create_source("dcgm", node=node, rack=rack, hostname=dcgm_host, interval_s=interval_s)
    if name == "nvml" and gpu_timeout_s is not None:
        return create_source("nvml", node=node, rack=rack, gpu_timeout_s=gpu_timeout_s)
    return create_source(name, node=node, rack=rack)
