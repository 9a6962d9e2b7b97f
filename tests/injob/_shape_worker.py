"""One rank of the shaped training-loop tests: the same tiny job in each loop shape, one rank slowed.

Run as ``python _shape_worker.py WORLD PORT SOCKET PREFIX SHAPES STEPS``: one process imports torch
once and forks WORLD ranks (four interpreters each importing torch cost tens of seconds on a small
loaded machine); it exits 0 when every rank did. For each shape in the comma-separated SHAPES
(``plain``, ``ddp``, ``fsdp``, ``accum``, ``amp``) every rank trains STEPS steps of a small model
whose ``_Work`` layer stands in for the compute: it sleeps ``FWD_S`` in the forward and ``BWD_S``
in the backward, so each rank's local compute is known and does not depend on how loaded the
machine is. From step ``ONSET`` on, rank ``SLOW_RANK``'s forward sleeps ``EXTRA_S`` more (a 30 %
straggler). Two timers report each step to the probe socket SOCKET at once:

- job ``PREFIX + shape``: :func:`fleethealth.injob.instrument` on the model the loop calls;
- job ``PREFIX + shape + "-fwdbwd"``: a :class:`StepTimer` span around forward + backward (for
  ``accum``, around the step's micro-steps): the placement the old docstring recommended.

Shapes: ``plain`` is an unwrapped model whose gradients the loop all-reduces by hand after the
backward; ``ddp`` is DistributedDataParallel; ``fsdp`` is FSDP2 (``fully_shard`` on the first Linear and
the root, CPU mesh); ``accum`` is DDP with ``MICRO`` micro-steps per step, all but the last under
``no_sync``; ``amp`` is DDP under bfloat16 autocast on the CPU.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from fleethealth.injob.instrument import instrument
from fleethealth.injob.timer import StepTimer

FWD_S, BWD_S, EXTRA_S = 0.020, 0.020, 0.012
SLOW_RANK, ONSET, MICRO = 1, 15, 2
GAP_S = 0.01
"""Between steps, outside every span (data loading): slack in which the ranks' gloo threads finish their
share of the last collective, as they would on a machine with a core per thread."""
_extra = {"s": 0.0}


class _Work(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(FWD_S + _extra["s"])
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(BWD_S)
        return grad


class _WorkLayer(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Work.apply(x)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), _WorkLayer(), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _wrap(shape: str, model: torch.nn.Sequential, world: int) -> torch.nn.Module:
    if shape == "plain":
        return model
    if shape == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model[0], mesh=mesh)  # two parameter groups: the first layer's and the rest's
        return fully_shard(model, mesh=mesh)
    return torch.nn.parallel.DistributedDataParallel(model)


def run_shape(shape: str, rank: int, world: int, sock: str, prefix: str, steps: int) -> None:
    model = _wrap(shape, _model(), world)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    timed = instrument(model, job=prefix + shape, rank=rank, gpu=rank, socket_path=sock, log=False)
    old = StepTimer(prefix + shape + "-fwdbwd", rank, gpu=rank, socket_path=sock, cuda=False)
    gen = torch.Generator().manual_seed(100 + rank)
    micro = MICRO if shape == "accum" else 1
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if shape == "amp" else contextlib.nullcontext()
    for step in range(steps):
        _extra["s"] = EXTRA_S if rank == SLOW_RANK and step >= ONSET else 0.0
        with old.compute(step):
            for m in range(micro):
                x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
                sync = contextlib.nullcontext() if m == micro - 1 else model.no_sync()
                with sync:
                    with amp:
                        loss = torch.nn.functional.cross_entropy(model(x).float(), y) / micro
                    loss.backward()
        if shape == "plain":  # a hand-rolled data-parallel step: the all-reduce after the backward
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        timed.step_done(step)
        old.step_done(step)
        time.sleep(GAP_S)
    timed.close()
    old.close()
    dist.barrier()


def rank_main(rank: int, world: int, port: int, sock: str, prefix: str, shapes: list[str], steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for shape in shapes:
            run_shape(shape, rank, world, sock, prefix, steps)
    finally:
        dist.destroy_process_group()


def main() -> int:
    world, port, sock = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    prefix, shapes, steps = sys.argv[4], sys.argv[5].split(","), int(sys.argv[6])
    torch.set_num_threads(1)
    if "fsdp" in shapes:  # once, before the fork
        importlib.import_module("torch.distributed.fsdp")
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # the rank: no threads were started before the fork
            code = 1
            try:
                rank_main(rank, world, port, sock, prefix, shapes, steps)
                code = 0
            except BaseException:  # noqa: BLE001 - report and exit the child, never return into the parent's code
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    failed = [rank for rank, pid in enumerate(pids) if os.waitpid(pid, 0)[1] != 0]
    if failed:
        print(f"ranks {failed} failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
