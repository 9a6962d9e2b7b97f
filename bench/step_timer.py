"""Per-step cost of the in-job StepTimer against a no-op baseline in the same run (one JSON object).

Each step is ``with timer.compute(step): pass`` plus ``timer.step_done(step)`` — the whole cost a
training loop pays (two datagrams on the probe's Unix socket, CPU clock path) — against the same
loop with a do-nothing context manager and call. A separate receiver process drains the socket,
as the probe does, so sends are real sends and not cheap drops; the drops that remain (the
kernel's datagram queue is short) are reported. Blocks of timed and baseline steps alternate so
machine noise hits both alike; the per-step cost is the median difference.

Target: <= 20 µs per step.

    python bench/step_timer.py             # ~5 s
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--steps", type=int, default=2000, help="steps per block")
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
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
