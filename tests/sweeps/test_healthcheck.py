"""deploy/slurm/healthcheck.sh, Slurm's HealthCheckProgram: a failing node is drained with a reason.

``scontrol`` is a stand-in that logs its arguments (no Slurm here); the self-test behind it is the
real ``fleethealth selftest`` on the CPU, narrowed with ``--only`` to stay fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "deploy" / "slurm" / "healthcheck.sh"


def _check(tmp_path: Path, extra: str) -> tuple[int, list[str]]:
    log = tmp_path / "scontrol.log"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > {log}\n')
    scontrol.chmod(0o755)
    env = {**os.environ, "FLEETHEALTH": f"{sys.executable} -m fleethealth", "SCONTROL": str(scontrol),
           "FH_NODE": "n0042", "FH_SELFTEST_ARGS": extra, "FH_TIMEOUT": "120"}
    env.pop("FLEETHEALTH_KAFKA", None)
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, timeout=180, check=False)
    return proc.returncode, log.read_text().splitlines() if log.exists() else []


def test_healthy_node_is_left_alone(tmp_path: Path) -> None:
    assert _check(tmp_path, "--device cpu --only gemm_exact_fp32") == (0, [])


def test_wrong_answer_drains_the_node_naming_the_test(tmp_path: Path) -> None:
    rc, args = _check(tmp_path, "--device cpu --only gemm_exact_fp32,gemm_repeat_fp32 --inject-fault bitflip")
    assert rc == 1
    assert args[:3] == ["update", "NodeName=n0042", "State=DRAIN"]
    assert args[3] == "Reason=fleethealth selftest: gemm_exact_fp32@cpu fail,gemm_repeat_fp32@cpu fail"


def test_a_node_that_cannot_run_the_suite_is_drained_with_the_cause(tmp_path: Path) -> None:
    rc, args = _check(tmp_path, "--device cuda:3")
    assert rc == 1
    assert args[3].startswith("Reason=fleethealth selftest could not run: CuPy is not installed")
