"""Per-step compute timing inside a training process, sent out of band to the node probe.

Most loops should not use this class directly: :func:`fleethealth.injob.instrument` puts the span
on the right side of the collective for a plain loop, DDP and FSDP2, sums gradient-accumulation
micro-steps, and sends through a ``StepTimer``. Use ``StepTimer`` by hand only where the local
compute has a clear end *before* any collective::

    timer = StepTimer()                  # job from $FLEETHEALTH_JOB, rank from $RANK, gpu from $LOCAL_RANK
    for step in range(steps):
        with timer.compute(step):        # local compute only: no collective may run inside the span
            loss = model(batch)
            loss.backward()              # a plain model: its gradients are all-reduced below, by hand
        all_reduce_gradients(model)
        optimizer.step()
        timer.step_done(step)            # progress mark: the step completed

Do **not** wrap forward + backward of a ``DistributedDataParallel`` model this way: DDP runs its
all-reduce *inside* ``backward()``, so every rank's span would include waiting for the slowest and
a straggler would make every rank look equally slow (measured: one of four ranks slowed 33 %, all
four spans rose alike). FSDP is worse: its all-gathers run inside the forward too. ``instrument``
ends the DDP span at the last gradient's post-accumulate hook and subtracts FSDP's collectives.

Each step costs one datagram on the probe's Unix socket (:mod:`fleethealth.wire`): on the CPU path
the span's seconds are held until ``step_done`` and go out as one ``"c"`` datagram (``job, rank,
gpu, step, s, ts``, and ``g``, the pipeline stage, when set) whose ``ts`` is the step's completion
— the progress mark and the measurement in one send (a span never marked done goes out at the next
span or at ``close``; a mark without a span is a ``"p"`` datagram). :meth:`StepTimer.report` sends
a span measured elsewhere. A send is a system call, the dominant cost, so one per step matters.
Nothing here blocks the step: the socket is non-blocking and drops (and counts) when the probe is
absent or slow.

On a CPU the span is two ``time.perf_counter()`` reads. On a GPU the span records two CUDA
events on the current stream and reads them *lazily*: a finished pair is converted to seconds
the next time the timer is touched, using ``Event.query()`` (which never waits); nothing calls
``synchronize()``. At most ``max_pending`` spans wait for their events; beyond that the oldest
is dropped and counted, so a stalled device can never grow memory.

Importing this module does not import torch. The CUDA path imports torch only when asked for
(``cuda=True``) or when torch is already loaded in the process and has a device (``cuda=None``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleethealth.errors import ConfigError
from fleethealth.wire import Sender, default_socket

__all__ = ["StepTimer", "TimerStats"]

_log = logging.getLogger("fleethealth.injob")
DROP_WARN_EVERY_S = 60.0
"""At most one warning about dropped datagrams per timer in this many seconds."""


@dataclass(frozen=True, slots=True)
class TimerStats:
    """Counters of one timer: datagrams sent, dropped by the socket, spans dropped unread, spans
    not read yet, and datagrams waiting in the sender's backlog for the probe's queue."""

    sent_total: int
    dropped_total: int
    spans_dropped_total: int
    pending: int
    waiting: int = 0


class _CpuSpan:
    """Context manager reused for every step on the CPU path (no allocation per step)."""

    __slots__ = ("_timer", "_t0")

    def __init__(self, timer: StepTimer) -> None:
        self._timer = timer
        self._t0 = 0.0

    def __enter__(self) -> None:
        timer = self._timer
        if timer._held is not None:  # the previous span was never marked done: send it now
            timer._send_held()
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self._t0
        timer = self._timer
        timer._held = (timer._step, elapsed)


class _CudaSpan:
    """Context manager for the CUDA path: records an event pair and queues it for lazy reading."""

    __slots__ = ("_timer", "_start", "_end")

    def __init__(self, timer: StepTimer) -> None:
        self._timer = timer
        self._start: Any = None
        self._end: Any = None

    def __enter__(self) -> None:
        timer = self._timer
        timer._poll()
        self._start, self._end = timer._take_events()
        self._start.record()

    def __exit__(self, *exc: object) -> None:
        self._end.record()
        self._timer._queue(self._timer._step, self._start, self._end)


class StepTimer:
    """Measure each rank's pre-collective compute time and report it to the node probe.

    Parameters
    ----------
    job, rank:
        The job name and this process's global rank, read from the environment as
        :class:`~fleethealth.injob.Reporter` reads them when omitted: ``$FLEETHEALTH_JOB``, and
        ``$RANK`` (torchrun), else the default process group's rank when one is initialised, else 0.
    gpu:
        The local GPU index; defaults to ``$LOCAL_RANK`` (else 0).
    group:
        The rank's comparison group, e.g. its pipeline stage: the detectors compare a rank only
        with the ranks of its group. ``None`` (default): one group for the whole job.
    socket_path:
        The probe's Unix datagram socket; defaults to ``$FLEETHEALTH_SOCKET`` as set when the timer
        is built, else ``/run/fleethealth/probe.sock``.
    cuda:
        ``True`` times with CUDA events, ``False`` with ``perf_counter``; ``None`` (default) uses
        CUDA events when torch is already imported and has a device.
    event_factory:
        Builds one timing event (``record()``, ``query()``, ``elapsed_time(other)`` in ms); defaults
        to ``torch.cuda.Event(enable_timing=True)``. Replaceable so the lazy reading can be tested
        where no device exists.
    max_pending:
        Spans whose events have not completed yet that may wait; older ones are dropped and counted.
    sender:
        A :class:`fleethealth.wire.Sender` to reuse; built from ``socket_path`` when omitted.
    """

    def __init__(self, job: str | None = None, rank: int | None = None, *, gpu: int | None = None,
                 group: int | None = None, socket_path: str | None = None, cuda: bool | None = None,
                 event_factory: Callable[[], Any] | None = None, max_pending: int = 64,
                 sender: Sender | None = None) -> None:
        if job is None:
            job = os.environ.get("FLEETHEALTH_JOB", "")
            if not job:
                raise ConfigError("StepTimer: no job name: pass job= or set FLEETHEALTH_JOB")
        if not isinstance(job, str) or not job:
            raise ConfigError("StepTimer: job must be a non-empty string")
        if rank is None:
            rank = _env_rank()
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"StepTimer: rank must be a non-negative integer, got {rank!r}")
        if gpu is None:
            gpu = _env_int("LOCAL_RANK", 0)
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise ConfigError(f"StepTimer: gpu must be a non-negative integer, got {gpu!r}")
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 0):
            raise ConfigError(f"StepTimer: group must be a non-negative integer or None, got {group!r}")
        if max_pending < 1:
            raise ConfigError("StepTimer: max_pending must be >= 1")
        if socket_path is None:
            socket_path = default_socket()
        self.job = job
        self.rank = rank
        self.gpu = gpu
        self.group = group
        self.max_pending = max_pending
        self._sender = sender if sender is not None else Sender(socket_path)
        self._own_sender = sender is None
        self._step = 0
        self._held: tuple[int, float] | None = None  # CPU path: (step, seconds) awaiting step_done
        self._spans_dropped = 0
        self._next_drop_warning = 0.0
        # The datagram prefix is fixed per timer; only step, seconds and ts change per step.
        self._compute_head: dict[str, Any] = {"t": "c", "job": job, "rank": rank, "gpu": gpu}
        if group is not None:
            self._compute_head["g"] = group
        self._progress_head = {"t": "p", "job": job, "rank": rank, "gpu": gpu}
        if event_factory is None and _want_cuda(cuda):
            event_factory = _torch_event_factory(gpu)
        self.cuda = event_factory is not None
        self._event_factory = event_factory
        self._pending: deque[tuple[int, Any, Any, float]] = deque()
        self._free: list[tuple[Any, Any]] = []
        self._span: _CpuSpan | _CudaSpan = _CudaSpan(self) if self.cuda else _CpuSpan(self)

    # ------------------------------------------------------------ step path
    def compute(self, step: int) -> _CpuSpan | _CudaSpan:
        """Return the span for ``step``'s compute: use it as ``with timer.compute(step): ...``."""
        self._step = step
        return self._span

    def step_done(self, step: int) -> None:
        """Mark ``step`` completed (after its collective). On the CPU path this sends the step's
        compute time with the completion time; on the CUDA path it reads finished spans first."""
        held = self._held
        if held is not None and held[0] == step:
            self._held = None
            self._send_compute(step, held[1], time.time())
            return
        if held is not None:
            self._send_held()
        if self.cuda:
            self._poll()
        if not self._sender.send({**self._progress_head, "step": step, "ts": time.time()}):
            self._dropped()

    def report(self, step: int, seconds: float, ts: float | None = None) -> None:
        """Send ``step``'s local compute measured elsewhere (``seconds``) as completed at ``ts``
        (default: now) — the progress mark and the measurement in one datagram, as ``step_done`` does."""
        if self._held is not None:
            self._send_held()
        self._send_compute(step, seconds, time.time() if ts is None else ts)

    def flush(self) -> int:
        """Read and send every finished CUDA span now (never waits); return how many were sent."""
        return self._poll()

    # ------------------------------------------------------------ reporting
    @property
    def stats(self) -> TimerStats:
        return TimerStats(self._sender.sent_total, self._sender.dropped_total, self._spans_dropped,
                          len(self._pending), self._sender.waiting)

    def close(self) -> None:
        """Send what has finished and release the socket (if this timer opened it)."""
        if self._held is not None:
            self._send_held()
        self._poll()
        if self._own_sender:
            self._sender.close()

    def __enter__(self) -> StepTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _send_held(self) -> None:
        step, seconds = self._held  # type: ignore[misc]
        self._held = None
        self._send_compute(step, seconds, time.time())

    def _send_compute(self, step: int, seconds: float, ts: float) -> None:
        if not self._sender.send({**self._compute_head, "step": step, "s": seconds, "ts": ts}):
            self._dropped()

    def _dropped(self) -> None:
        """Warn (at most once a minute) that step timings are being lost: no probe, or a full queue."""
        now = time.monotonic()
        if now < self._next_drop_warning:
            return
        self._next_drop_warning = now + DROP_WARN_EVERY_S
        _log.warning("fleethealth: %d step timings of job %s rank %d dropped so far (probe socket %s absent or "
                     "its queue full); stragglers cannot be scored without them",
                     self._sender.dropped_total, self.job, self.rank, self._sender.path)

    def _take_events(self) -> tuple[Any, Any]:
        if self._free:
            return self._free.pop()
        make = self._event_factory
        return make(), make()  # type: ignore[misc]

    def _queue(self, step: int, start: Any, end: Any) -> None:
        if len(self._pending) >= self.max_pending:
            _, old_start, old_end, _ = self._pending.popleft()
            self._free.append((old_start, old_end))
            self._spans_dropped += 1
        self._pending.append((step, start, end, time.time()))

    def _poll(self) -> int:
        """Convert finished event pairs (in order) to datagrams; stop at the first unfinished."""
        sent = 0
        pending = self._pending
        while pending:
            step, start, end, wall = pending[0]
            if not end.query():
                break
            pending.popleft()
            seconds = max(start.elapsed_time(end), 0.0) / 1000.0
            self._free.append((start, end))
            self._send_compute(step, seconds, wall)
            sent += 1
        return sent



def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"StepTimer: ${name} must be an integer, got {value!r}") from None


def _env_rank() -> int:
    if os.environ.get("RANK"):
        return _env_int("RANK", 0)
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank())
        except Exception:  # noqa: BLE001 - a broken distributed install must not break training
            return 0
    return 0


def _want_cuda(cuda: bool | None) -> bool:
    if cuda is not None:
        return cuda
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken CUDA install must not break training: fall back to the CPU clock
        return False


def _torch_event_factory(gpu: int) -> Callable[[], Any]:
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("StepTimer(cuda=True): torch reports no CUDA device; use cuda=False")

    def make() -> Any:
        return torch.cuda.Event(enable_timing=True)

    return make
