"""The plain-loop example runs as written (CPU) and reports its checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_train_loop_example_runs_and_checks() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_loop.py"), "--steps", "40", "--every", "10",
                          "--print-events"], capture_output=True, text=True, timeout=120, env=env, check=True).stdout
    assert out.count("selfcheck passed") == 4
    assert "timing plain steps with perf_counter" in out and "40 step timings" in out
    assert "4 checks, 0 failed, 0 invariant anomalies; last verified step 30" in out
