"""DistributedDataParallel training with the fleethealth in-job SDC defence, on CPUs with gloo.

    python examples/ddp_train.py --world 4 --steps 200        # spawns 4 local processes
    torchrun --nproc-per-node 4 examples/ddp_train.py         # or let torchrun start them

The lines marked ``# fleethealth`` are the whole integration. ``instrument(ddp)`` times each step
from the forward to the last gradient ready (post-accumulate-grad hooks): DDP all-reduces inside
``backward()``, so a span around forward + backward would hold every rank's wait for the slowest.
With DDP the guard registers a communication hook that digests each gradient bucket *before* its
all-reduce on check steps, so the self-check compares the training pass itself; every
``replay_every`` steps rank r and rank r + world/2 recompute the same microbatch, and a third rank
votes on a mismatch.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fleethealth.injob import HangWatchdog, Reporter, SdcGuard, instrument  # fleethealth


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    reporter = Reporter(job="example-ddp", rank=rank, gpu=rank,                                # fleethealth
                        sink=(lambda e: print(f"[rank {rank}] {e.kind.value} step={e.step} {e.message}"))
                        if args.print_events else None)
    watchdog = HangWatchdog(timeout_s=args.timeout, reporter=reporter).start()                 # fleethealth
    guard = SdcGuard(ddp, loss_fn, every=args.every, replay_every=args.replay_every,            # fleethealth
                     reporter=reporter, watchdog=watchdog)
    timed = instrument(ddp, job="example-ddp", rank=rank, gpu=rank)                            # fleethealth
    if rank == 0:
        print(timed.describe())

    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        batch = (torch.randn(32, 32, generator=gen), torch.randint(0, 10, (32,), generator=gen))
        guard.begin(step)                                                                     # fleethealth
        loss = loss_fn(ddp, batch)
        loss.backward()
        if not guard.after_backward(step, batch, loss).skip_update:                           # fleethealth
            opt.step()
        opt.zero_grad()
        timed.step_done(step)                                                                 # fleethealth

    watchdog.stop()
    timed.close()
    if rank == 0:
        print(f"{guard.checks_total} checks on rank 0, {guard.failures_total} failed; replay tolerance "
              f"{guard.calibration.tolerance:g}; last verified step {guard.watermark.last_verified_step}")
    guard.close()
    dist.destroy_process_group()


def _spawned(rank: int, world: int, args: argparse.Namespace) -> None:
    train(rank, world, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4, help="processes to spawn when not under torchrun")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--replay-every", type=int, default=100, help="10,000 in production; short here")
    ap.add_argument("--timeout", type=float, default=90.0, help="hang watchdog timeout, seconds")
    ap.add_argument("--print-events", action="store_true")
    args = ap.parse_args()
    if "RANK" in os.environ:  # started by torchrun
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    mp.spawn(_spawned, args=(args.world, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
