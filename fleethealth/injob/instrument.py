"""``instrument(model)``: each rank's local compute of one step, timed on the right side of every collective.

::

    timed = instrument(model)          # a plain module, DDP(model) or a fully_shard(...) model
    for step, batch in enumerate(loader):
        loss = loss_fn(model, batch)   # any number of micro-steps (gradient accumulation, no_sync)
        loss.backward()
        optimizer.step()
        timed.step_done(step)          # one datagram: this step's local compute, to the node probe
    timed.close()

The number reported for a step is the same quantity in every mode: **the rank's local compute of
that step, excluding time spent waiting for other ranks**, summed over the step's micro-steps. A
straggler detector compares it across ranks, so a slow rank stands out instead of every rank
waiting for it. How it is measured depends on what the model is wrapped in (``timed.method``):

``plain``
    From the start of the module's forward (a forward pre-hook, only when autograd records) to the
    end of the backward pass that accumulates its gradients (the first ``post_accumulate_grad``
    hook of a backward queues an end-of-backward callback).
``ddp``
    The same, on the wrapped module: the span starts after DDP's own pre-forward (buffer broadcast)
    and ends when the last gradient is ready, before DDP's reducer waits for the last bucket's
    all-reduce. DDP runs its all-reduce *inside* ``backward()``, so timing forward + backward puts
    every rank's wait for the slowest into every rank's number and hides the straggler. This uses
    gradient hooks, not a communication hook: DDP allows one comm hook and the SDC guard owns it.
``fsdp2``
    ``fully_shard`` runs all-gathers inside the forward and the backward and reduce-scatters in the
    backward. The span runs from the root's forward to the end of the backward (the last FSDP
    ``finalize_backward``), and the time the rank spends inside FSDP's unshard, wait-for-unshard,
    post-backward (reduce-scatter) and finalize calls is subtracted: on a CPU (gloo) those calls
    block while the collective runs, so that time is the wait plus FSDP's own copy-in / copy-out.

Micro-steps: a micro-step runs from the first forward that records autograd to the end of the
backward that accumulates gradients (two forwards and one backward — two inputs, one loss — are one
micro-step); ``step_done`` sends the sum of the micro-steps since the last ``step_done`` (gradient
accumulation, ``no_sync``). A forward not followed by such a backward before ``step_done`` adds
nothing: an evaluation under ``no_grad`` is not counted at all, and the SDC guard's recomputations,
which use ``torch.autograd.grad`` after the step's last backward, are dropped at ``step_done``. A
``step_done`` with no micro-step sends a progress mark only.

Pipeline parallelism: pass ``group=`` (the pipeline stage) and the detectors compare each rank with
the ranks of its own stage only.

Clocks (``timed.clock``): ``perf_counter`` on a CPU; on a CUDA device (``cuda=None`` picks it when
the parameters live on one) CUDA events recorded on the current stream at the same two points,
read lazily with ``Event.query()`` the next time the object is touched — never ``synchronize()`` —
so the host never waits for the device. Under ``fsdp2`` on a GPU the compute stream itself waits
on the all-gather stream, so event spans include that wait (``timed.includes_waits`` is True and a
warning says so); a kernel-time mode would be needed there and is not built.

Reporting never blocks training: datagrams go through the timer's non-blocking socket, which drops
and counts when the probe is absent or slow.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from fleethealth.errors import ConfigError
from fleethealth.injob.timer import StepTimer, TimerStats
from fleethealth.wire import Sender

__all__ = ["METHODS", "Instrumented", "instrument"]

METHODS = ("plain", "ddp", "fsdp2")
"""What :func:`instrument` can choose, in :attr:`Instrumented.method`."""

_log = logging.getLogger("fleethealth.injob")

_FSDP_TIMED = ("unshard", "wait_for_unshard", "post_backward", "finalize_backward")
"""FSDP2 parameter-group calls that block on a collective on a CPU; their time is subtracted."""


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return None
    return FSDPModule


def _choose(target: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """The method and the module whose forward starts the span."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(target, DistributedDataParallel):
        return "ddp", target.module
    fsdp = _fsdp_module_type()
    if fsdp is not None and any(isinstance(m, fsdp) for m in target.modules()):
        if not isinstance(target, fsdp):
            raise ConfigError("instrument: pass the root fully_shard module (the one the training loop calls); "
                              f"{type(target).__name__} is not sharded itself but holds sharded modules")
        return "fsdp2", target
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        FullyShardedDataParallel = ()  # type: ignore[assignment,misc]  # noqa: N806
    if FullyShardedDataParallel and isinstance(target, FullyShardedDataParallel):
        raise ConfigError("instrument: FullyShardedDataParallel (FSDP1) is not supported; use "
                          "torch.distributed.fsdp.fully_shard (FSDP2)")
    return "plain", target


def _in_backward() -> bool:
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


class _CpuClock:
    """Micro-spans as ``perf_counter`` readings, summed per step on the host."""

    name = "perf_counter"

    def __init__(self) -> None:
        self.start: float | None = None
        self.end: float | None = None
        self.comm_at_start = 0.0
        self.comm_at_end = 0.0
        self.total = 0.0
        self.micro = 0

    def mark_start(self, comm: float) -> None:
        if self.start is not None and self.end is None:
            return  # a second forward before the backward (two inputs, one loss): the micro-step goes on
        self.close_micro()
        self.start, self.end, self.comm_at_start = time.perf_counter(), None, comm

    def mark_end(self, comm: float) -> None:
        if self.start is not None:
            self.end, self.comm_at_end = time.perf_counter(), comm

    def close_micro(self) -> None:
        if self.start is not None and self.end is not None:
            self.total += max((self.end - self.start) - (self.comm_at_end - self.comm_at_start), 0.0)
            self.micro += 1
        self.start = self.end = None

    def take(self) -> tuple[int, float]:
        self.close_micro()
        micro, total = self.micro, self.total
        self.micro, self.total = 0, 0.0
        return micro, total


class _CudaClock:
    """Micro-spans as CUDA event pairs on the current stream, read later without waiting."""

    name = "cuda_events"

    def __init__(self, event_factory: Callable[[], Any], max_pending: int) -> None:
        self.make = event_factory
        self.max_pending = max_pending
        self.start: Any = None
        self.end: Any = None
        self.pairs: list[tuple[Any, Any]] = []
        self.pending: deque[tuple[int, list[tuple[Any, Any]], float]] = deque()
        self.free: list[Any] = []
        self.dropped = 0

    def _event(self) -> Any:
        return self.free.pop() if self.free else self.make()

    def mark_start(self, comm: float) -> None:
        if self.start is not None and self.end is None:
            return  # a second forward before the backward: the micro-step goes on
        self.close_micro()
        self.start = self._event()
        self.start.record()

    def mark_end(self, comm: float) -> None:
        if self.start is None:
            return
        if self.end is None:
            self.end = self._event()
        self.end.record()  # recording again moves the end to the latest point

    def close_micro(self) -> None:
        if self.start is not None:
            if self.end is not None:
                self.pairs.append((self.start, self.end))
            else:
                self.free.append(self.start)
        self.start = self.end = None

    def queue(self, step: int, wall: float) -> int:
        self.close_micro()
        pairs, self.pairs = self.pairs, []
        if not pairs:
            return 0
        if len(self.pending) >= self.max_pending:
            _, old, _ = self.pending.popleft()
            self.free.extend(e for pair in old for e in pair)
            self.dropped += 1
        self.pending.append((step, pairs, wall))
        return len(pairs)

    def poll(self, send: Callable[[int, float, float], None]) -> int:
        sent = 0
        while self.pending:
            step, pairs, wall = self.pending[0]
            if not pairs[-1][1].query():  # events complete in stream order: the last one decides
                break
            self.pending.popleft()
            seconds = sum(max(s.elapsed_time(e), 0.0) for s, e in pairs) / 1000.0
            self.free.extend(ev for pair in pairs for ev in pair)
            send(step, seconds, wall)
            sent += 1
        return sent


class Instrumented:
    """The handle :func:`instrument` returns: call :meth:`step_done` once per optimizer step.

    Attributes: ``method`` (one of :data:`METHODS`), ``clock`` (``perf_counter`` or ``cuda_events``),
    ``includes_waits`` (True only where the clock cannot exclude waiting: FSDP2 on CUDA events),
    ``group`` (the pipeline stage, or None), ``timer`` (the :class:`StepTimer` that sends),
    ``last_micro_steps`` (micro-steps in the last step sent), ``comm_s`` (seconds subtracted so far).
    """

    def __init__(self, target: torch.nn.Module, timer: StepTimer, *, method: str, root: torch.nn.Module,
                 cuda_events: Callable[[], Any] | None, max_pending: int, own_timer: bool) -> None:
        self.target = target
        self.timer = timer
        self.method = method
        self.group = timer.group
        self._own_timer = own_timer
        self._clock: _CpuClock | _CudaClock = (_CpuClock() if cuda_events is None
                                               else _CudaClock(cuda_events, max_pending))
        self.clock = self._clock.name
        self.includes_waits = method == "fsdp2" and cuda_events is not None
        self.comm_s = 0.0
        self.last_micro_steps = 0
        self._queued = False  # an end-of-backward callback is queued for the running backward
        self._comm_depth = 0
        self._handles: list[Any] = []
        self._patched: list[tuple[Any, str]] = []
        self._handles.append(root.register_forward_pre_hook(self._on_forward, prepend=True))
        if method == "fsdp2":
            self._wrap_fsdp(root)
        else:
            params = [p for p in root.parameters() if p.requires_grad]
            if not params:
                raise ConfigError("instrument: the model has no parameter that requires a gradient")
            for p in params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if self.includes_waits:
            warnings.warn("fleethealth instrument: FSDP2 on CUDA events counts the compute stream's waits for "
                          "all-gathers; straggler scores of this job are blunted", RuntimeWarning, stacklevel=3)

    def describe(self) -> str:
        """One line saying how this job's steps are timed."""
        where = {"plain": "forward start to the end of the backward",
                 "ddp": "forward start to the last gradient ready (post-accumulate-grad hooks), before DDP's "
                        "last all-reduce wait",
                 "fsdp2": "forward start to the end of the backward, minus time inside FSDP's all-gathers and "
                          "reduce-scatters"}[self.method]
        stage = "" if self.group is None else f", pipeline stage {self.group}"
        return f"fleethealth: timing {self.method} steps with {self.clock}: {where}{stage}"

    # ------------------------------------------------------------ hooks (the training step's path)
    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or _in_backward():
            return  # evaluation, or activation recomputation inside a backward
        self._clock.mark_start(self.comm_s)

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._queued = False
        self._clock.mark_end(self.comm_s)

    def _wrap_fsdp(self, root: torch.nn.Module) -> None:
        fsdp = _fsdp_module_type()
        groups = []
        for m in root.modules():
            if fsdp is not None and isinstance(m, fsdp):
                state = m._get_fsdp_state()
                group = getattr(state, "_fsdp_param_group", None)
                if group is not None:
                    groups.append(group)
        if not groups:
            raise ConfigError("instrument: the fully_shard model has no FSDP parameter group to time")
        for group in groups:
            for name in _FSDP_TIMED:
                original = getattr(group, name, None)
                if original is None:
                    raise ConfigError(f"instrument: this torch ({torch.__version__}) has no FSDPParamGroup.{name}; "
                                      "FSDP2 timing needs it")
                setattr(group, name, self._timed(original, end=name == "finalize_backward"))
                self._patched.append((group, name))

    def _timed(self, call: Callable[..., Any], *, end: bool) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._comm_depth:
                return call(*args, **kwargs)
            self._comm_depth = 1
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.comm_s += time.perf_counter() - t0
                self._comm_depth = 0
                if end:
                    self._clock.mark_end(self.comm_s)
        return timed

    # ------------------------------------------------------------ step path
    def step_done(self, step: int) -> None:
        """Close ``step``: send its local compute (the sum of its micro-steps) with the completion time,
        or a progress mark when it had none. On CUDA, queue it and send what has finished (never waits)."""
        clock = self._clock
        if isinstance(clock, _CpuClock):
            micro, seconds = clock.take()
            self.last_micro_steps = micro
            if micro:
                self.timer.report(step, seconds)
            else:
                self.timer.step_done(step)
            return
        self.last_micro_steps = clock.queue(step, time.time())
        clock.poll(self.timer.report)
        if not self.last_micro_steps:
            self.timer.step_done(step)

    def flush(self) -> int:
        """CUDA: send every finished step now (never waits); return how many. CPU: 0."""
        return self._clock.poll(self.timer.report) if isinstance(self._clock, _CudaClock) else 0

    @property
    def stats(self) -> TimerStats:
        s = self.timer.stats
        if isinstance(self._clock, _CudaClock):
            return TimerStats(s.sent_total, s.dropped_total, self._clock.dropped, len(self._clock.pending))
        return s

    def close(self) -> None:
        """Remove the hooks, restore FSDP's methods, send what has finished, close the timer it opened."""
        self.flush()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for group, name in self._patched:
            vars(group).pop(name, None)
        self._patched.clear()
        if self._own_timer:
            self.timer.close()

    def __enter__(self) -> Instrumented:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def instrument(target: torch.nn.Module, *, job: str | None = None, rank: int | None = None,
               gpu: int | None = None, group: int | None = None, socket_path: str | None = None,
               cuda: bool | None = None, event_factory: Callable[[], Any] | None = None,
               max_pending: int = 64, sender: Sender | None = None, timer: StepTimer | None = None,
               log: bool = True) -> Instrumented:
    """Time ``target``'s steps correctly for how it is wrapped, and report them to the node probe.

    ``target``: the module the training loop calls — a plain module, ``DistributedDataParallel(m)``
    or the root of a ``fully_shard`` model. ``job``, ``rank`` and ``gpu`` default as for
    :class:`StepTimer` (``$FLEETHEALTH_JOB``, ``$RANK``, ``$LOCAL_RANK``); ``group`` is the pipeline
    stage. ``cuda``: ``True`` CUDA events, ``False`` the host clock, ``None`` CUDA events when the
    parameters are on a CUDA device. ``event_factory`` replaces ``torch.cuda.Event(enable_timing=True)``
    (tests). ``timer`` reuses a :class:`StepTimer` (else one is built from the arguments).

    Returns an :class:`Instrumented`; its ``method`` says which of :data:`METHODS` was chosen and
    :meth:`Instrumented.describe` says it in a line (logged at INFO unless ``log=False``).
    """
    if not isinstance(target, torch.nn.Module):
        raise ConfigError(f"instrument: expected a torch.nn.Module, got {type(target).__name__}")
    method, root = _choose(target)
    if cuda is None:
        first = next(root.parameters(), None)
        cuda = first is not None and first.device.type == "cuda"
    if cuda and event_factory is None:
        if not torch.cuda.is_available():
            raise ConfigError("instrument(cuda=True): torch reports no CUDA device; use cuda=False")

        def event_factory() -> Any:
            return torch.cuda.Event(enable_timing=True)
    own = timer is None
    if timer is None:
        timer = StepTimer(job, rank, gpu=gpu, group=group, socket_path=socket_path, cuda=False,
                          sender=sender)
    elif group is not None and timer.group != group:
        raise ConfigError(f"instrument: group={group} differs from the timer's group {timer.group}")
    out = Instrumented(target, timer, method=method, root=root, cuda_events=event_factory if cuda else None,
                       max_pending=max_pending, own_timer=own)
    if log:
        _log.info("%s", out.describe())
    return out
