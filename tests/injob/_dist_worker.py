"""One rank of the multi-process in-job test: a small DDP job on gloo with injected faults.

Run as ``python _dist_worker.py RANK WORLD PORT OUTDIR``. Every rank trains the same schedule:

- steps 0-14 healthy (self-check every 5 steps, replay every 10);
- step 15: one bit flipped in rank 2's training-pass gradient (a parameter hook, fires once);
- steps 16-21: rank 1's gradient always perturbed (the same wrong answer every time); replay at 20;
- step 22: rank 3's microbatch holds an inf (non-finite loss; data, not hardware);
- step 24: rank 2 stalls 2.5 s before its backward (watchdog timeout 1 s on every rank);
- step 27: rank 0's training-pass gradient scaled x1000 once (a gradient spike).

Each rank writes its events, verdicts and watchdog reports to ``OUTDIR/rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fleethealth.injob.guard import SdcGuard
from fleethealth.injob.invariants import Invariants
from fleethealth.injob.reporter import Reporter
from fleethealth.injob.watchdog import HangWatchdog

STEPS = 30
FLIP_STEP, FLIP_RANK = 15, 2
DET_RANK, DET_FROM, DET_UNTIL = 1, 16, 21
NAN_STEP, NAN_RANK = 22, 3
HANG_STEP, HANG_RANK = 24, 2
SPIKE_STEP, SPIKE_RANK = 27, 0


def loss_fn(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(module(x), y)


def _stall_before_backward(seconds: float) -> None:
    time.sleep(seconds)


def main() -> None:
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(24, 3))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    torch.manual_seed(1000 + rank)  # each rank its own dropout stream: replays must carry the source's
    events: list[dict] = []
    reporter = Reporter(job="test-job", rank=rank, gpu=rank, sink=lambda e: events.append(e.to_obj()))
    watchdog = HangWatchdog(1.0, reporter=reporter, poll_s=0.05)
    nonfinite: list[dict] = []
    guard = SdcGuard(ddp, loss_fn, every=5, replay_every=10, reporter=reporter, watchdog=watchdog,
                     domains=list(range(world)), invariants=Invariants(warmup=10),
                     on_nonfinite=lambda v, c: nonfinite.append({"step": v.step, "classification": c}))
    state = {"step": -1, "fired": set()}

    def fault_hook(grad: torch.Tensor) -> torch.Tensor:
        step = state["step"]
        if rank == FLIP_RANK and step == FLIP_STEP and "flip" not in state["fired"]:
            state["fired"].add("flip")
            grad = grad.clone()
            grad.view(-1).view(torch.int32)[7] ^= 1 << 3
        if rank == DET_RANK and DET_FROM <= step <= DET_UNTIL:
            grad = grad.clone()
            grad.view(-1)[3] *= 1.01
        if rank == SPIKE_RANK and step == SPIKE_STEP and "spike" not in state["fired"]:
            state["fired"].add("spike")
            grad = grad * 1000.0
        return grad

    model[0].weight.register_hook(fault_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    verdicts = []
    watchdog.start()
    for step in range(STEPS):
        state["step"] = step
        x = torch.randn(16, 12, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        if rank == NAN_RANK and step == NAN_STEP:
            x[0, 0] = float("inf")
        guard.begin(step)
        loss = loss_fn(ddp, (x, y))
        if rank == HANG_RANK and step == HANG_STEP:
            _stall_before_backward(2.5)
        loss.backward()
        verdict = guard.after_backward(step, (x, y), loss)
        verdicts.append({"step": step, "skip": verdict.skip_update,
                         "classification": None if verdict.classification is None else verdict.classification.value,
                         "failed": [c.check.value for c in verdict.failed]})
        if not verdict.skip_update:
            opt.step()
        opt.zero_grad()
    watchdog.stop()
    out = {"rank": rank, "events": events, "verdicts": verdicts, "nonfinite": nonfinite,
           "checks_total": guard.checks_total, "watermark": guard.watermark.last_verified_step,
           "failed_step": guard.watermark.failed_step, "startup": guard.startup_report.deterministic,
           "replay_tolerance": guard.calibration.tolerance,
           "spikes": guard.invariants.spikes_total}
    (outdir / f"rank{rank}.json").write_text(json.dumps(out, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
