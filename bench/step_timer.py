"""Per-step cost of the in-job StepTimer against a no-op baseline in the same run (one JSON object).

Each step is ``with timer.compute(step): pass`` plus ``timer.step_done(step)`` — the whole cost a
training loop pays (two datagrams on the probe's Unix socket, CPU clock path) — against the same
loop with a do-nothing context manager and call. A separate receiver process drains the socket,
as the probe does, so sends are real sends and not cheap drops; the drops that remain (the
kernel's datagram queue is short) are reported. Blocks of timed and baseline steps alternate so
machine noise hits both alike; the per-step cost is the median difference.

Target: <= 20 µs per step.

``--instrument`` adds the cost of :func:`fleethealth.injob.instrument` (``"instrument"`` in the
output): a small MLP with ``--layers`` Linear layers (two parameter tensors each) runs forward,
backward and ``zero_grad`` per step, in blocks with and without ``instrument`` alternating; the
cost is the median difference per step in this thread's CPU time (a send's system call included).
It grows with the parameter tensors (one post-accumulate
hook call each).

    python bench/step_timer.py             # ~5 s
    python bench/step_timer.py --instrument
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

from fleethealth.injob.timer import StepTimer

TARGET_US = 20.0
_RECEIVER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
s.bind(sys.argv[1])
print("ready", flush=True)
n = 0
while True:
    if s.recv(65536) == b"stop":
        break
    n += 1
print(n, flush=True)
"""


def _block_timer(timer: StepTimer, start: int, n: int) -> float:
    compute, done = timer.compute, timer.step_done
    t0 = time.perf_counter()
    for step in range(start, start + n):
        with compute(step):
            pass
        done(step)
    return time.perf_counter() - t0


def _block_baseline(n: int) -> float:
    ctx = nullcontext()

    def done(step: int) -> None:
        return None

    t0 = time.perf_counter()
    for step in range(n):
        with ctx:
            pass
        done(step)
    return time.perf_counter() - t0


def _instrument_cost(path: str, layers: int, blocks: int, steps: int) -> dict:
    import torch

    from fleethealth.injob.instrument import instrument

    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
    x = torch.randn(4, 8)

    def block(timed: object | None, start: int) -> float:
        t0 = time.thread_time()  # CPU time of this thread: a loaded machine's waits for a core do not count
        for step in range(start, start + steps):
            model(x).sum().backward()
            model.zero_grad(set_to_none=False)
            if timed is not None:
                timed.step_done(step)  # type: ignore[attr-defined]
        return (time.thread_time() - t0) / steps

    block(None, 0)  # warm up autograd
    diffs, on, off = [], [], []
    for b in range(blocks):
        timed = instrument(model, job="bench-job", rank=0, gpu=0, socket_path=path, log=False)
        t = block(timed, b * steps)
        timed.close()
        z = block(None, 0)
        on.append(t)
        off.append(z)
        diffs.append(t - z)
    return {"parameter_tensors": 2 * layers, "per_step_us": round(statistics.median(diffs) * 1e6, 2),
            "per_step_us_p90": round(sorted(diffs)[int(0.9 * len(diffs))] * 1e6, 2),
            "step_us_with": round(statistics.median(on) * 1e6, 1),
            "step_us_without": round(statistics.median(off) * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--steps", type=int, default=2000, help="steps per block")
    parser.add_argument("--instrument", action="store_true", help="also measure instrument() on a small MLP")
    parser.add_argument("--layers", type=int, default=12, help="Linear layers of that MLP")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "probe.sock")
        receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER, path], stdout=subprocess.PIPE, text=True)
        receiver.stdout.readline()
        timer = StepTimer("bench-job", 0, gpu=0, socket_path=path, cuda=False)
        diffs, timed, base = [], [], []
        for b in range(args.blocks):
            t = _block_timer(timer, b * args.steps, args.steps) / args.steps
            z = _block_baseline(args.steps) / args.steps
            timed.append(t)
            base.append(z)
            diffs.append(t - z)
        stats = timer.stats
        timer.close()
        cost = _instrument_cost(path, args.layers, 40, 100) if args.instrument else None
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"stop", path)
        received = int(receiver.communicate(timeout=30)[0].strip() or 0)
    per_step_us = statistics.median(diffs) * 1e6
    report = {
        "bench": "step_timer", "path": "cpu (perf_counter)", "steps": args.blocks * args.steps,
        "per_step_us": round(per_step_us, 2),
        "per_step_us_p90": round(sorted(diffs)[int(0.9 * len(diffs))] * 1e6, 2),
        "timed_step_us": round(statistics.median(timed) * 1e6, 2),
        "baseline_step_us": round(statistics.median(base) * 1e6, 3),
        "ratio_to_baseline": round(statistics.median(timed) / statistics.median(base), 1),
        "datagrams_sent": stats.sent_total, "datagrams_dropped": stats.dropped_total,
        "datagrams_received": received,
        "target_us": TARGET_US, "meets_target": per_step_us <= TARGET_US,
    }
    if cost is not None:
        report["instrument"] = cost
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
