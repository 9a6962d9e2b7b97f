"""One rank of the replay-calibration test: healthy ranks that differ in the last bits, a slow replay.

Run as ``python _calib_worker.py RANK WORLD PORT OUTDIR``. Rank ``r``'s arithmetic is off by a fixed,
rank-specific factor (``1 + EPS`` on the ranks in :data:`DIFFERING`, exactly 1 elsewhere), the way two
healthy devices of different kinds disagree in the last bits while each reproduces itself bit for
bit. With two ranks the pair differs; with four only rank 3 does (most ranks bitwise equal).

- replays at steps 0, 3 and 6 (the start-up calibration runs at step 0);
- every recomputation of step 3's replay sleeps :data:`SLOW_S` (watchdog timeout :data:`TIMEOUT_S`,
  ``abort=True``);
- with four ranks, rank 3 turns deterministically wrong (factor ``1 + BAD``) from step 6.

Each rank writes its ``sdc_check`` events, tolerance and watchdog state to ``OUTDIR/rank{R}.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fleethealth.injob.guard import SdcGuard
from fleethealth.injob.reporter import Reporter
from fleethealth.injob.watchdog import HangWatchdog

STEPS, REPLAY_EVERY, SLOW_STEP, BAD_STEP = 7, 3, 3, 6
EPS, BAD = 1e-4, 1e-2
DIFFERING = {2: {1}, 4: {3}}
TIMEOUT_S, SLOW_S = 1.0, 1.2


def main() -> None:
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)  # every rank the same weights; no updates, so they stay the same
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))
    state = {"step": 0, "training": False}

    def loss_fn(module: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if state["step"] == SLOW_STEP and not state["training"]:
            time.sleep(SLOW_S)
        factor = 1.0
        if rank in DIFFERING[world]:
            factor += BAD if (world == 4 and state["step"] >= BAD_STEP) else EPS
        x, y = batch
        return torch.nn.functional.cross_entropy(module(x), y) * factor

    events: list[dict] = []
    reporter = Reporter(job="calib", rank=rank, gpu=rank, sink=lambda e: events.append(e.to_obj()))
    aborted: list[int] = []
    watchdog = HangWatchdog(TIMEOUT_S, reporter=reporter, poll_s=0.05, abort=True,
                            abort_fn=lambda: aborted.append(state["step"]))
    guard = SdcGuard(model, loss_fn, every=0, replay_every=REPLAY_EVERY, reporter=reporter, watchdog=watchdog)
    gen = torch.Generator().manual_seed(100 + rank)
    watchdog.start()
    for step in range(STEPS):
        state["step"] = step
        batch = (torch.randn(16, 12, generator=gen), torch.randint(0, 3, (16,), generator=gen))
        guard.begin(step)
        state["training"] = True
        loss = loss_fn(model, batch)
        loss.backward()
        state["training"] = False
        guard.after_backward(step, batch, loss)
        model.zero_grad()
    watchdog.stop()
    out = {"rank": rank, "events": [e for e in events if e["kind"] == "sdc_check"],
           "hangs": [e for e in events if e["kind"] == "hang_report"], "aborted": aborted,
           "tolerance": guard.calibration.tolerance}
    (outdir / f"rank{rank}.json").write_text(json.dumps(out, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
