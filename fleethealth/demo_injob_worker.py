"""The training job of ``fleethealth demo --injob``: one rank of a DDP run on the CPU with gloo.

Each rank is a process started by :mod:`fleethealth.demo_injob` (``torch.multiprocessing``, no
torchrun). It runs the same job up to three times in one process group:

1. **clean** — the reference run: no fault, events discarded; rank 0 saves the final weights;
2. **run** — the job under test: :class:`~fleethealth.injob.SdcGuard` wired in as ``examples/ddp_train.py``
   shows, events to the node probe's socket of the rank's node, a checkpoint every ``ckpt_every``
   steps (rank 0 writes the file, then :meth:`SdcGuard.checkpoint` emits the record with both marks,
   written beside it), ``job_start`` / ``job_exit`` from :class:`~fleethealth.injob.JobLife`, and the
   fault of :class:`~fleethealth.injob.FaultInjector` on the ranks placed on the faulty node. When a
   check fails every rank gets the same verdict: the step's update is skipped and, for a
   ``transient`` fault, the job rolls back by itself to ``verdict.rollback_to`` (the policy's rule,
   applied by the guard), restores that checkpoint and trains on; for any other class (the device
   keeps computing wrong, or there is no clean checkpoint) the job halts;
3. **resume** — only when the launcher orders it (having read the rollback recommendation from the
   store, after a halt): restore the named checkpoint (weights, optimiser, data-order position), run
   on the new placement (the culprit rank on a spare node: the fault stays with the quarantined
   device), train to the end, save the final weights.

Everything that makes two runs bitwise equal is fixed: seeds, deterministic algorithms (the guard
turns them on), one thread per rank, the data order as a seeded permutation per epoch whose
position is part of the checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fleethealth.injob.ckptcheck.background import CheckpointValidator
from fleethealth.injob.faults import FaultInjector
from fleethealth.injob.guard import SdcGuard
from fleethealth.injob.lifecycle import JobLife
from fleethealth.injob.reporter import Reporter
from fleethealth.payloads.checkpoint import CheckpointRecord

__all__ = ["JobSpec", "PhaseReport", "worker", "checkpoint_path"]

_FEATURES, _HIDDEN, _CLASSES, _EXAMPLES, _BATCH = 32, 64, 10, 2048, 16


@dataclass(frozen=True)
class JobSpec:
    """Everything a rank needs (picklable). ``placement[r]`` is rank r's node; ``sockets`` maps a
    node to its probe socket; the fault runs on the ranks placed on ``fault_node``."""

    job: str
    world: int
    steps: int
    every: int
    replay_every: int
    ckpt_every: int
    seed: int
    ckpt_dir: str
    out_dir: str
    master_port: int
    placement: tuple[str, ...]
    sockets: dict[str, str] = field(default_factory=dict)
    fault: str = "none"
    fault_step: int = 0
    fault_node: str | None = None
    fault_bit: int = 22
    fault_target: str | None = None
    fault_index: int = 0
    validate: bool = False
    """Rank 0 validates each checkpoint of the run under test (``ckptcheck.CheckpointValidator``)."""
    corrupt_step: int | None = None
    """The checkpoint of this step is written corrupt: one weight 100x (a rank failing while it wrote)."""


@dataclass(frozen=True)
class PhaseReport:
    """What one rank's phase did: the steps trained, whether it halted, when its fault fired."""

    phase: str
    rank: int
    first_step: int
    last_step: int | None
    halted_at: int | None
    fault_fired_at: int | None
    checks: int
    failures: int
    events_sent: int
    events_dropped: int
    rolled_back: tuple[tuple[int, int], ...] = ()
    """``(failed step, checkpoint step)`` of each rollback the job carried out by itself."""


def checkpoint_path(ckpt_dir: str, step: int) -> Path:
    return Path(ckpt_dir) / f"ckpt-{step:06d}.pt"


def _loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(_FEATURES, _HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(_HIDDEN, _HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(_HIDDEN, _CLASSES))


class _Data:
    """A fixed synthetic data set and a seeded per-epoch order, split over ranks like
    ``DistributedSampler``; ``state()`` / ``load()`` carry the position through a checkpoint."""

    def __init__(self, seed: int, rank: int, world: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(_EXAMPLES, _FEATURES, generator=gen)
        teacher = torch.randn(_FEATURES, _CLASSES, generator=gen)
        self.y = (self.x @ teacher).argmax(dim=1)
        self.seed, self.rank, self.world = seed, rank, world
        self.per_epoch = _EXAMPLES // world // _BATCH
        self.epoch, self.index = 0, 0
        self._order = self._perm()

    def _perm(self) -> torch.Tensor:
        perm = torch.randperm(_EXAMPLES, generator=torch.Generator().manual_seed(self.seed * 7919 + self.epoch))
        return perm[self.rank::self.world]

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._perm()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index == self.per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._perm()
        idx = self._order[self.index * _BATCH:(self.index + 1) * _BATCH]
        self.index += 1
        return self.x[idx], self.y[idx]


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".partial")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _save_weights(model: torch.nn.Module, path: Path) -> None:
    tmp = path.with_name(path.name + ".partial.npz")
    np.savez(tmp, **{name: p.detach().cpu().numpy() for name, p in model.state_dict().items()})
    os.replace(tmp, path)


def _train(rank: int, spec: JobSpec, phase: str, *, placement: tuple[str, ...],
           resume_uri: str | None = None, history: tuple[str, ...] = ()) -> PhaseReport:
    record = phase != "clean"
    node = placement[rank]
    reporter = (Reporter(job=spec.job, rank=rank, gpu=0, sink=lambda e: None) if not record else
                Reporter(job=spec.job, rank=rank, gpu=0, socket_path=spec.sockets[node]))
    model = _model(spec.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = _Data(spec.seed, rank, spec.world)
    first = 0
    marks: CheckpointRecord | None = None
    if resume_uri is not None:
        state = torch.load(resume_uri.removeprefix("file://"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        data.load(state["data"])
        first = int(state["step"]) + 1
        marks = CheckpointRecord(step=int(state["step"]), uri=resume_uri,
                                 last_verified_step=state["last_verified_step"],
                                 last_replay_step=state["last_replay_step"])
    # find_unused_parameters keeps DDP from rebuilding its buckets after the first iteration: the
    # bucket layout decides how gloo's ring splits (and so sums) each gradient, and a run resumed
    # from a checkpoint must sum in the same order as one that never stopped
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    guard = SdcGuard(ddp, _loss_fn, every=spec.every, replay_every=spec.replay_every, reporter=reporter)
    if marks is not None:  # the restored checkpoint's marks: what it was verified against
        guard.watermark.last_verified_step = marks.last_verified_step
        guard.watermark.last_replay_step = marks.last_replay_step
    fault: FaultInjector | None = None
    if record and spec.fault != "none" and node == spec.fault_node:
        fault = FaultInjector(spec.fault, step=spec.fault_step, bit=spec.fault_bit, index=spec.fault_index,
                              target=spec.fault_target).attach(model)
    halted_at: int | None = None
    rolled_back: list[tuple[int, int]] = []
    # the validator is built before the loop (it imports DCP) and queues enough for every checkpoint
    # and, resumed, seeds its norm band with the valid checkpoints the launcher names
    validator = (CheckpointValidator(reporter, queue_size=max(2, spec.steps // spec.ckpt_every + 1),
                                     history=[h.removeprefix("file://") for h in history])
                 if record and rank == 0 and spec.validate else None)
    life = (JobLife(reporter, world=spec.world, first_step=first, resumed_from=resume_uri, placement=placement,
                    rank=rank) if record else contextlib.nullcontext())
    try:
        with life:
            step = first
            while step < spec.steps:
                batch = data.next()
                if fault is not None:
                    fault.begin(step)
                guard.begin(step)
                loss = _loss_fn(ddp, batch)
                loss.backward()
                verdict = guard.after_backward(step, batch, loss)  # the same verdict on every rank
                if not verdict.skip_update:
                    opt.step()
                opt.zero_grad()
                if not isinstance(life, JobLife):
                    step += 1
                    continue
                life.step = step
                transient = verdict.classification is not None and verdict.classification.value == "transient"
                if verdict.rollback_to is not None and transient:
                    # a transient fault: this node computes correctly again; roll back in place to the
                    # policy's target (the guard applies the policy's rule) and train on
                    target = next(c for c in guard.book if c.step == verdict.rollback_to)
                    _restore(target.uri, model, opt, data)
                    guard.rolled_back(target.step)
                    rolled_back.append((step, target.step))
                    step = target.step + 1
                    continue
                if verdict.check is not None:  # persistent, data or code, or no clean checkpoint
                    if validator is not None:  # the job stops here: what it saved is judged before it exits
                        validator.wait(60)
                    halted_at = step
                    life.halt(f"an SDC check failed at step {step} ({verdict.rollback_reason})")
                    break
                if step % spec.ckpt_every == 0:
                    _checkpoint(rank, spec, guard, model, opt, data, step, validator, corrupt=phase == "run")
                step += 1
            if halted_at is None:
                if rank == 0:
                    _save_weights(model, Path(spec.out_dir) / f"{phase}-final.npz")
                dist.barrier()
    finally:
        if fault is not None:
            fault.detach()
        if validator is not None:
            validator.close(60)
        guard.close()
    report = PhaseReport(phase=phase, rank=rank, first_step=first,
                         last_step=halted_at if halted_at is not None else spec.steps - 1, halted_at=halted_at,
                         fault_fired_at=None if fault is None else fault.fired_at, checks=guard.checks_total,
                         failures=guard.failures_total, events_sent=reporter.sent_total,
                         events_dropped=0, rolled_back=tuple(rolled_back))
    reporter.close()  # sends what waits in its backlog (bounded): the drop count is final after it
    return replace(report, events_dropped=reporter.dropped_total)


def _restore(uri: str, model: torch.nn.Module, opt: torch.optim.Optimizer, data: _Data) -> None:
    state = torch.load(uri.removeprefix("file://"), weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    data.load(state["data"])


def _checkpoint(rank: int, spec: JobSpec, guard: SdcGuard, model: torch.nn.Module, opt: torch.optim.Optimizer,
                data: _Data, step: int, validator: CheckpointValidator | None = None, *, corrupt: bool = False) -> None:
    """Rank 0 writes the file first (atomically), then the record with both marks goes out and is
    written beside it: nothing claims a checkpoint that is not whole on disk. With a validator, rank 0
    hands it the checkpoint after the record went out; its verdict follows in the background."""
    path = checkpoint_path(spec.ckpt_dir, step)
    marks = guard.watermark.checkpoint(step, path.as_uri())
    state: dict[str, Any] = {}
    if rank == 0:
        if validator is not None:
            # the demo keeps one validation outstanding, so each verdict reaches the policy before the
            # steps that follow and its story is the same on every run; a training job never waits
            validator.wait(60)
        weights = model.state_dict()
        if corrupt and step == spec.corrupt_step:  # as a failing rank writes it: digests match, the norm does not
            weights = {k: v * 100 if k == "4.weight" else v for k, v in weights.items()}
        state = {"model": weights, "optim": opt.state_dict(), "data": data.state(), "step": step,
                 "last_verified_step": marks.last_verified_step, "last_replay_step": marks.last_replay_step}
        _atomic_save(state, path)
    dist.barrier()
    record = guard.checkpoint(step, path.as_uri())  # rank 0 emits the checkpoint event
    if validator is not None:
        validator.saved(step, path, state, uri=path.as_uri())
    if rank == 0:
        import orjson

        tmp = path.with_suffix(".json.partial")
        tmp.write_bytes(orjson.dumps(record.__dict__))
        os.replace(tmp, path.with_suffix(".json"))


def worker(rank: int, spec: JobSpec, commands: Any, results: Any) -> None:
    """One rank: clean run, the run under test when ordered, then resume orders until told to stop."""
    torch.set_num_threads(1)
    with contextlib.suppress(OSError):  # torch's C++ warnings go to the rank's log, not the demo's screen
        fd = os.open(Path(spec.out_dir) / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec.master_port}", rank=rank,
                                world_size=spec.world)
    except Exception as exc:  # noqa: BLE001 - reported to the launcher as one line
        results.put(("error", rank, f"rank {rank} could not join the process group: {exc}"))
        return
    try:
        results.put(("report", rank, _train(rank, spec, "clean", placement=spec.placement)))
        if commands.get()[0] != "run":  # the run under test starts once the probes listen: none of it is lost
            return
        results.put(("report", rank, _train(rank, spec, "run", placement=spec.placement)))
        while True:
            order = commands.get()
            if order[0] != "resume":
                break
            _, uri, placement, history = order
            results.put(("report", rank, _train(rank, spec, "resume", placement=tuple(placement), resume_uri=uri,
                                                history=tuple(history))))
    except Exception:  # noqa: BLE001 - the launcher reports it and stops the others
        results.put(("error", rank, traceback.format_exc(limit=6)))
    finally:
        dist.destroy_process_group()
