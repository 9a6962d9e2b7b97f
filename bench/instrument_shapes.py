"""Which rank looks slow: ``instrument`` against forward + backward timing, per loop shape (one JSON object).

Runs ``tests/injob/_shape_worker.py`` — four gloo ranks on this machine, each loop shape in turn
(plain with a hand-rolled all-reduce, DDP, FSDP2, DDP with gradient accumulation under ``no_sync``,
DDP under bfloat16 autocast), rank 1's forward 30 % slower from step 15 (the work is a known sleep,
40 ms a step) — and reads the spans both placements sent to a probe socket. For each shape and
placement it prints each rank's lower-quartile span over the steps from 17 on (ms) and
``separation``: rank 1's span over the slowest other rank's. The forward + backward placement is
the baseline measured in the same run.

    python bench/instrument_shapes.py [--steps 40]       # ~1 min on a small machine
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from fleethealth.wire import parse

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "injob" / "_shape_worker.py"
SHAPES = ("plain", "ddp", "fsdp", "accum", "amp")
WORLD, SLOW, ONSET = 4, 1, 15


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    if args.steps < ONSET + 6:
        print(f"instrument_shapes: --steps must be at least {ONSET + 6}", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="fh-shapes-")
    path = os.path.join(tmp, "probe.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind(path)
    sock.settimeout(0.2)
    got: list[bytes] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                got.append(sock.recv(65536))
            except TimeoutError:
                continue

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(WORKER), str(WORLD), str(port), path, "bench-", ",".join(SHAPES),
                           str(args.steps)], capture_output=True, text=True, env=env)
    stop.set()
    reader.join(timeout=2.0)
    sock.close()
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return 1
    spans: dict[str, np.ndarray] = {}
    for datagram in got:
        msg = parse(datagram)
        if msg.kind == "c":
            spans.setdefault(msg.job, np.full((WORLD, args.steps), np.nan))[msg.rank, msg.step] = msg.value
    out: dict = {"bench": "instrument_shapes", "world": WORLD, "slowed_rank": SLOW, "onset_step": ONSET,
                 "slowdown": 0.3, "steps": args.steps, "shapes": {}}
    others = [r for r in range(WORLD) if r != SLOW]
    for shape in SHAPES:
        row = {}
        for placement, suffix in (("instrument", ""), ("forward_backward", "-fwdbwd")):
            a = spans[f"bench-{shape}{suffix}"]
            after = np.nanquantile(a[:, ONSET + 2:], 0.25, axis=1)
            row[placement] = {"span_ms": [round(float(v) * 1000, 1) for v in after],
                              "separation": round(float(after[SLOW] / after[others].max()), 3),
                              "missing": int(np.isnan(a).sum())}
        out["shapes"][shape] = row
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
