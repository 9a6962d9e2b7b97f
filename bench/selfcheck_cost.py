"""What the bitwise self-check costs, as ratios measured in one run (prints one JSON object).

1. ``digest_fraction``: digest-and-compare time (two digests of the gradients, as one self-check does,
   plus the comparison) over the time of one backward pass of the same microbatch, for several
   microbatch sizes. Target <= 5 %.
2. ``step_overhead``: the training step time with :class:`SdcGuard` checking every 100 steps over the
   step time without the guard, in interleaved blocks of the same run (ABBA order, median of the
   per-round ratios). The seed's estimate is one extra microbatch per 100 steps, about 1 %.

    python bench/selfcheck_cost.py                 # CPU, ~20 s
    python bench/selfcheck_cost.py --device cuda   # what bench/gpu_injob.py runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from fleethealth.injob.digest import bit_digest
from fleethealth.injob.guard import SdcGuard
from fleethealth.injob.reporter import Reporter


def make_model(width: int, device: torch.device) -> torch.nn.Module:
    """The bench model: a 4-layer MLP block (about 3 x width^2 x 4 parameters)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width),
                               torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                               torch.nn.Linear(4 * width, 16)).to(device)


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def digest_fraction(width: int, tokens: int, device: torch.device, repeat: int = 15) -> dict:
    model = make_model(width, device)
    params = [p for p in model.parameters()]
    batch = (torch.randn(tokens, width, device=device), torch.randint(0, 16, (tokens,), device=device))

    def backward() -> None:
        loss = loss_fn(model, batch)
        for p in params:
            p.grad = None
        loss.backward()

    def forward_only() -> None:
        with torch.no_grad():
            loss_fn(model, batch)

    fwd_bwd = _median_time(backward, device, repeat)
    fwd = _median_time(forward_only, device, repeat)
    bwd = max(fwd_bwd - fwd, 1e-9)
    grads = [p.grad for p in params]
    names = [str(i) for i in range(len(grads))]

    def digest_and_compare() -> bool:
        return bit_digest(grads, names) == bit_digest(grads, names)

    digest = _median_time(digest_and_compare, device, repeat)
    return {"params": sum(p.numel() for p in params), "tokens": tokens, "backward_s": bwd,
            "digest_and_compare_s": digest, "fraction": digest / bwd}


def step_overhead(width: int, tokens: int, device: torch.device, steps: int, rounds: int, every: int) -> dict:
    """Interleave blocks of ``steps`` training steps without and with the guard."""
    model = make_model(width, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = SdcGuard(model, loss_fn, every=every, replay_every=0, reporter=Reporter(rank=0, sink=lambda e: None))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(tokens, width, generator=gen).to(device),
                torch.randint(0, 16, (tokens,), generator=gen).to(device)) for _ in range(8)]
    step_no = 0

    def block(with_guard: bool) -> float:
        nonlocal step_no
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            batch = batches[step_no % len(batches)]
            if with_guard:
                guard.begin(step_no)
            loss = loss_fn(model, batch)
            loss.backward()
            skip = guard.after_backward(step_no, batch, loss).skip_update if with_guard else False
            if not skip:
                opt.step()
            opt.zero_grad()
            step_no += 1
        _sync(device)
        return (time.perf_counter() - t0) / steps

    guard.startup(batches[0])
    block(False)  # warm-up
    plain, guarded, ratios = [], [], []
    for r in range(rounds):
        pair = {}
        for with_guard in ((False, True) if r % 2 == 0 else (True, False)):  # ABBA against drift
            step_no = (step_no // every + 1) * every  # every guarded block holds the same checks
            pair[with_guard] = block(with_guard)
        plain.append(pair[False])
        guarded.append(pair[True])
        ratios.append(pair[True] / pair[False])
    guard.close()
    p, g = statistics.median(plain), statistics.median(guarded)
    return {"every": every, "steps_per_block": steps, "rounds": rounds, "step_s_without": p, "step_s_with": g,
            "overhead": statistics.median(ratios) - 1.0, "overhead_per_round": [x - 1.0 for x in ratios],
            "checks": guard.checks_total, "false_alarms": guard.failures_total}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--steps", type=int, default=100, help="steps per timed block (one check each)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (1: stable on shared hosts)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    fractions = [digest_fraction(args.width, t, device) for t in args.tokens]
    overhead = step_overhead(args.width, args.tokens[0], device, args.steps, args.rounds, every=100)
    result = {"bench": "selfcheck_cost", "device": str(device), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "width": args.width, "digest_fraction": fractions,
              "digest_fraction_target": 0.05, "step_overhead": overhead}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
