"""One rank of the DDP-beside-the-guard test: ``instrument`` and the SDC guard's comm hook on one model.

Run as ``python _ddp_hook_worker.py RANK WORLD PORT OUTDIR``. The model's forward sleeps
:data:`FWD_S`; four steps, the guard self-checking every second step (its recomputation must not be
timed). Spans go to the stand-in probe socket ``OUTDIR/probe.sock`` (bound by the test); the guard's
``sdc_check`` events and the span method go to ``OUTDIR/rank{R}.json``. A rank that makes no progress
for :data:`STALL_S` prints every thread's stack and exits 1, so a hang shows where it is.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fleethealth.injob.guard import SdcGuard
from fleethealth.injob.instrument import instrument
from fleethealth.injob.reporter import Reporter

FWD_S = 0.2
"""Twice the test's ``SLOP_S``: a recomputation counted in the span by mistake would break its bound."""
STEPS = 4
STALL_S = 120.0


class _Sleep(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FWD_S)
        return self.lin(x)


def loss_fn(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return m(batch).sum()


def main() -> None:
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    faulthandler.dump_traceback_later(STALL_S, exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(_Sleep())
        events: list = []
        guard = SdcGuard(ddp, loss_fn, every=2, reporter=Reporter(job="j", rank=rank, sink=events.append))
        timed = instrument(ddp, job="j", rank=rank, socket_path=str(outdir / "probe.sock"), log=False)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for step in range(STEPS):
            batch = torch.randn(3, 4)
            guard.begin(step)
            loss = loss_fn(ddp, batch)
            loss.backward()
            if not guard.after_backward(step, batch, loss).skip_update:
                opt.step()
            opt.zero_grad()
            timed.step_done(step)
        timed.close()
        guard.close()
    finally:
        dist.destroy_process_group()
    checks = [e.data for e in events if e.kind.value == "sdc_check"]
    (outdir / f"rank{rank}.json").write_text(json.dumps({"method": timed.method, "checks": checks}))
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
