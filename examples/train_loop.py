"""A plain PyTorch training loop with the fleethealth in-job SDC defence (CPU or one GPU).

    python examples/train_loop.py --steps 300 --print-events

The lines marked ``# fleethealth`` are the whole integration: ``instrument`` times each step's local
compute for the straggler detector, the guard checks for silent data corruption. Results go to the
node probe's socket (``$FLEETHEALTH_SOCKET``, default ``/run/fleethealth/probe.sock``); without a
probe they are dropped and counted, and training is never slowed or stopped by reporting.
"""

from __future__ import annotations

import argparse

import torch

from fleethealth.injob import HangWatchdog, Reporter, SdcGuard, instrument  # fleethealth


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=100, help="self-check cadence in steps")
    ap.add_argument("--print-events", action="store_true", help="print events instead of sending them")
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    sink = (lambda e: print(f"[event] {e.kind.value} step={e.step} {e.message}")) if args.print_events else None
    reporter = Reporter(job="example-train", sink=sink)                      # fleethealth
    watchdog = HangWatchdog(timeout_s=90.0, reporter=reporter).start()       # fleethealth
    guard = SdcGuard(model, loss_fn, every=args.every, reporter=reporter,    # fleethealth
                     watchdog=watchdog)
    timed = instrument(model, job="example-train")                           # fleethealth
    print(timed.describe())

    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        batch = (torch.randn(64, 32, generator=gen).to(device), torch.randint(0, 10, (64,), generator=gen).to(device))
        guard.begin(step)                                                    # fleethealth
        loss = loss_fn(model, batch)
        loss.backward()
        verdict = guard.after_backward(step, batch, loss)                    # fleethealth
        if not verdict.skip_update:                                          # fleethealth
            opt.step()
        opt.zero_grad()
        timed.step_done(step)                                                # fleethealth
        if step % 100 == 99:  # a checkpoint records both verification marks and tells the detectors
            record = guard.checkpoint(step, f"file:///tmp/ckpt-{step}.pt")
            print(f"step {step}: loss {loss.item():.4f}, checkpoint verified through {record.last_verified_step} "
                  f"(replay-verified through {record.last_replay_step})")

    watchdog.stop()
    guard.close()
    timed.close()
    stats = timed.stats
    print(f"{stats.sent_total + stats.dropped_total} step timings, {stats.sent_total} sent to the probe")
    print(f"{guard.checks_total} checks, {guard.failures_total} failed, "
          f"{guard.invariants.anomalies_total} invariant anomalies; last verified step "
          f"{guard.watermark.last_verified_step}")


if __name__ == "__main__":
    main()
