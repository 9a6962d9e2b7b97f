"""Per-GPU driver reads bounded in time: one stuck GPU costs the node that GPU's columns, not its sample.

A degrading GPU can wedge the driver calls made *on it* (NVSentinel's users saw DCGM stall for days
on one GPU). The whole-source :class:`~fleethealth.probe.sources.StallGuard` then drops every GPU's
sample of the node. :class:`GpuReads` instead runs each GPU's read on a worker thread of that GPU's
own and waits for all of them together for at most ``timeout_s``:

- a GPU that answers in time gives its columns as before;
- a GPU whose read is still running at the deadline is left out of this sample (NaN columns) and
  *begins a stall*: :meth:`GpuReads.read` returns it in ``began`` once (the caller publishes one
  ``telemetry_stalled`` event naming it) and counts it in ``stalls_total[gpu]``;
- while its read is still stuck, later samples do not start another read on it and do not wait for
  it: at most one outstanding read per GPU, one thread per GPU for the life of the source, no pile-up;
- when the stuck call finally returns, its stale result is dropped and the GPU is read again from the
  next sample on (``stalled`` no longer names it).

A call that never returns keeps its GPU's worker blocked in the driver for good: the GPU stays out of
every sample (``stalled`` names it, the probe's ``/healthz`` says so), its siblings keep coming each
interval, and the worker, a daemon thread, is abandoned when the source closes (it cannot be
interrupted from Python; it does not keep the process alive).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleethealth.errors import ConfigError

__all__ = ["GpuReads", "ReadRound"]


@dataclass(frozen=True)
class ReadRound:
    """One bounded round: ``results`` (GPU -> what its read returned) for the GPUs that answered in
    time, ``errors`` (GPU -> the exception its read raised), ``began`` the GPUs whose stall began in
    this round, ``stuck`` every GPU left out because its read is still running."""

    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)
    began: tuple[int, ...] = ()
    stuck: tuple[int, ...] = ()


class _Worker:
    """One GPU's reader thread: takes one request at a time; ``busy`` while a call is running."""

    def __init__(self, gpu: int, owner: GpuReads) -> None:
        self.gpu = gpu
        self.owner = owner
        self.busy = False
        self.abandoned = False          # the round that asked gave up on this call
        self.request: tuple[int, Callable[[], Any]] | None = None
        self.thread = threading.Thread(target=self._run, name=f"fh-gpu-read-{gpu}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        owner = self.owner
        while True:
            with owner.cond:
                while self.request is None and not owner.closed:
                    owner.cond.wait()
                if owner.closed:
                    return
                round_id, call = self.request  # type: ignore[misc]
                self.request = None
            try:
                result: Any = call()
                error: BaseException | None = None
            except BaseException as exc:  # noqa: BLE001 - handed to the round that asked, never lost
                result, error = None, exc
            with owner.cond:
                self.busy = False
                if self.abandoned:      # the stall ends: the stale answer is dropped
                    self.abandoned = False
                    owner.stalled.discard(self.gpu)
                elif owner.round_id == round_id:
                    if error is not None:
                        owner.errors[self.gpu] = error
                    else:
                        owner.results[self.gpu] = result
                owner.cond.notify_all()


class GpuReads:
    """Run one read per GPU in parallel, each on its GPU's own thread, waiting at most ``timeout_s``
    in all (see the module docstring). ``clock`` is the monotonic clock the deadline is taken on."""

    def __init__(self, *, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"GPU read timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self._clock = clock
        self.cond = threading.Condition()
        self.closed = False
        self.round_id = 0
        self.results: dict[int, Any] = {}
        self.errors: dict[int, BaseException] = {}
        self.stalled: set[int] = set()
        """GPUs whose read is stuck now."""
        self.stalls_total: dict[int, int] = {}
        """GPU -> stalls begun (a stall counts once however many samples it spans)."""
        self._workers: dict[int, _Worker] = {}

    def read(self, calls: Sequence[tuple[int, Callable[[], Any]]]) -> ReadRound:
        """Start ``call()`` for each ``(gpu, call)`` whose GPU is not stuck, wait until all answered
        or ``timeout_s`` passed, and return the round."""
        with self.cond:
            if self.closed:
                raise ConfigError("GPU reads used after close()")
            self.round_id += 1
            self.results, self.errors = {}, {}
            asked: list[int] = []
            stuck: list[int] = []
            for gpu, call in calls:
                worker = self._workers.get(gpu)
                if worker is None:
                    worker = self._workers[gpu] = _Worker(gpu, self)
                if worker.busy:         # still inside an earlier call: never a second one on this GPU
                    stuck.append(gpu)
                    continue
                worker.busy = True
                worker.request = (self.round_id, call)
                asked.append(gpu)
            self.cond.notify_all()
            deadline = self._clock() + self.timeout_s
            while True:
                pending = [g for g in asked if g not in self.results and g not in self.errors]
                remaining = deadline - self._clock()
                if not pending or remaining <= 0:
                    break
                self.cond.wait(remaining)
            began = []
            for gpu in pending:
                self._workers[gpu].abandoned = True
                self.stalled.add(gpu)
                self.stalls_total[gpu] = self.stalls_total.get(gpu, 0) + 1
                began.append(gpu)
            return ReadRound(results=dict(self.results), errors=dict(self.errors), began=tuple(began),
                             stuck=tuple(sorted(stuck + began)))

    @property
    def threads(self) -> int:
        """Reader threads started (one per GPU ever read)."""
        return len(self._workers)

    def close(self) -> None:
        """Stop the idle workers; one stuck in a driver call is abandoned (a daemon thread)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
