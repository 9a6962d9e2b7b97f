"""One rank of the gradient-accumulation test: a small causal transformer under gloo DDP, 40
microbatches per optimizer step (``no_sync`` on all but the last), the loop dividing each
microbatch's loss by 40 while ``loss_fn`` returns the model's own loss (as nanoGPT's train.py does).

Run as ``python _accum_worker.py RANK WORLD PORT OUTDIR``. Two phases, one process group:

1. ``defaults``: the guard at its defaults (self-check and replay at step 0), 1 step: no SDC.
2. ``fault``: self-check every 2 steps, replay every 4, a checkpoint every 2 steps pruned with
   ``guard.prune``; a transient flip in rank 2's last microbatch at step 6. The loop rolls back by
   itself to ``guard.rollback_target(book)`` and trains on to step 8.

Each rank writes its events, verdicts and rollbacks to ``OUTDIR/rank{R}.json``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import _tinygpt as G  # noqa: E402

from fleethealth.injob.faults import FaultInjector  # noqa: E402
from fleethealth.injob.guard import SdcGuard  # noqa: E402
from fleethealth.injob.reporter import Reporter  # noqa: E402

ACCUM = 40
DEFAULT_STEPS = 1
STEPS, EVERY, REPLAY_EVERY, CKPT_EVERY = 8, 2, 4, 2
FAULT_STEP, FAULT_RANK = 6, 2


def _microbatches(rank: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [G.batch(torch.Generator().manual_seed(rank * 1_000_003 + step * 1_009 + m)) for m in range(ACCUM)]


def _verdict(v) -> dict:  # noqa: ANN001
    return {"step": v.step, "skip": v.skip_update, "check": v.check, "culprits": list(v.culprits),
            "classification": None if v.classification is None else v.classification.value,
            "microbatches": v.microbatches, "failed": [c.check.value for c in v.failed]}


def _run(rank: int, world: int, outdir: Path, phase: str) -> dict:
    torch.manual_seed(0)
    model = G.TinyGPT()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    events: list[dict] = []
    reporter = Reporter(job=f"accum-{phase}", rank=rank, gpu=rank, sink=lambda e: events.append(e.to_obj()))
    if phase == "defaults":
        guard, steps, fault = SdcGuard(ddp, G.lm_loss, reporter=reporter), DEFAULT_STEPS, None
    else:
        guard, steps = SdcGuard(ddp, G.lm_loss, every=EVERY, replay_every=REPLAY_EVERY, reporter=reporter), STEPS
        fault = None
        if rank == FAULT_RANK:  # the self-check covers the last microbatch: the drill flips that one
            fault = FaultInjector("transient", step=FAULT_STEP, micro=ACCUM - 1).attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    verdicts, rollbacks, pruned = [], [], []
    step = 0
    while step < steps:
        micro = _microbatches(rank, step)
        guard.begin(step)
        if fault is not None:
            fault.begin(step)
        for m, b in enumerate(micro):
            with ddp.no_sync() if m < ACCUM - 1 else contextlib.nullcontext():
                loss = G.lm_loss(ddp, b) / ACCUM
                loss.backward()
        v = guard.after_backward(step, micro[-1], loss)
        verdicts.append(_verdict(v))
        if not v.skip_update:
            opt.step()
        opt.zero_grad()
        if v.rollback_to is not None:  # the rollback loop: the same target on every rank
            target = next(c for c in guard.book if c.step == v.rollback_to)
            rollbacks.append({"at": step, "target": target.step, "reason": v.rollback_reason,
                              "same_as_rollback_target": guard.rollback_target() == target})
            state = torch.load(target.uri)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            for c in guard.rolled_back(target.step):
                Path(c.uri).unlink(missing_ok=True)
            step = target.step + 1
            continue
        if v.check is not None:  # failed, and no clean checkpoint: a human must decide
            rollbacks.append({"at": step, "target": None, "reason": v.rollback_reason})
            break
        if step % CKPT_EVERY == 0:
            path = outdir / f"{phase}-r{rank}-{step}.pt"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
            guard.checkpoint(step, str(path))
            for c in guard.prune():
                Path(c.uri).unlink()
                pruned.append(c.step)
        step += 1
    guard.close()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return {"events": events, "verdicts": verdicts, "rollbacks": rollbacks, "pruned": pruned,
            "book": [c.step for c in guard.book], "weights": digest,
            "fired_at": None if fault is None else fault.fired_at,
            "accumulation_scale": guard.checker.accumulation_scale}


def main() -> None:
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {"rank": rank, "defaults": _run(rank, world, outdir, "defaults"), "fault": _run(rank, world, outdir, "fault")}
    (outdir / f"rank{rank}.json").write_text(json.dumps(out, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
