"""Run a worker script as ``world`` gloo ranks, each a process, and read what each wrote
(``OUT/rank{r}.json``); a rank that fails fails the caller with its log's tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fleethealth.broker import free_port


def run_ranks(worker: Path, world: int, out: Path, *, timeout_s: float) -> list[dict]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), str(world), str(port), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        if p.returncode != 0:
            raise AssertionError(f"rank {r} failed:\n{log[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
