"""deploy/slurm/healthcheck.sh, Slurm's HealthCheckProgram, run the way slurmd runs it.

slurmd starts the program with an empty environment except ``SLURMD_NODENAME`` and kills it after
60 s, so every run here is ``env -i SLURMD_NODENAME=n0042 healthcheck.sh CONF`` with the settings in
CONF. ``scontrol``, ``sinfo`` and ``logger`` are stand-ins that log their arguments (a real slurmd
running the script is in tests/adapters/test_slurm_healthcheck.py); the self-test behind it is the
real ``fleethealth selftest`` on the CPU, narrowed with ``--only`` to stay fast.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "deploy" / "slurm" / "healthcheck.sh"
_LOGGING = '#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done >> {log}\necho --- >> {log}\n{tail}'


def _tool(tmp_path: Path, name: str, tail: str = "") -> Path:
    path = tmp_path / name
    path.write_text(_LOGGING.format(log=tmp_path / f"{name}.log", tail=tail))
    path.chmod(0o755)
    return path


def _calls(tmp_path: Path, name: str) -> list[list[str]]:
    log = tmp_path / f"{name}.log"
    if not log.exists():
        return []
    calls, current = [], []
    for line in log.read_text().splitlines():
        if line == "---":
            calls.append(current)
            current = []
        else:
            current.append(line)
    return calls


def _check(tmp_path: Path, *, selftest: str = "", sinfo: str = "idle|none", **settings: str) -> tuple[int, float]:
    conf = {"FLEETHEALTH": f"{sys.executable} -m fleethealth", "DEVICE": "cpu", "SELFTEST_ARGS": selftest,
            "SCONTROL": str(_tool(tmp_path, "scontrol")), "SINFO": str(_tool(tmp_path, "sinfo", f"echo '{sinfo}'\n")),
            "LOGGER": str(_tool(tmp_path, "logger")), **settings}
    path = tmp_path / "healthcheck.conf"
    path.write_text("# fleethealth health check\n" + "".join(f'{k}="{v}"\n' for k, v in conf.items()))
    start = time.monotonic()
    proc = subprocess.run(["env", "-i", "SLURMD_NODENAME=n0042", "/bin/bash", str(SCRIPT), str(path)],
                          capture_output=True, timeout=120, check=False)
    return proc.returncode, time.monotonic() - start


def _drains(tmp_path: Path) -> list[list[str]]:
    return [c for c in _calls(tmp_path, "scontrol") if c[:1] == ["update"]]


def _logged(tmp_path: Path) -> str:
    return "\n".join(" ".join(c) for c in _calls(tmp_path, "logger"))


def test_healthy_node_is_left_alone(tmp_path: Path) -> None:
    assert _check(tmp_path, selftest="--only gemm_exact_fp32")[0] == 0
    assert _drains(tmp_path) == [] and _calls(tmp_path, "sinfo") == []


def test_wrong_answer_drains_the_node_named_by_slurmd_with_the_fleethealth_prefix(tmp_path: Path) -> None:
    rc, _ = _check(tmp_path, selftest="--only gemm_exact_fp32,gemm_repeat_fp32 --inject-fault bitflip")
    assert rc == 1
    (args,) = _drains(tmp_path)
    assert args[:3] == ["update", "NodeName=n0042", "State=DRAIN"]  # SLURMD_NODENAME, not hostname
    assert args[3] == "Reason=fleethealth: quick self-test: gemm_exact_fp32@cpu fail,gemm_repeat_fp32@cpu fail"
    assert "draining n0042" in _logged(tmp_path)


def test_an_admins_drain_reason_is_left_alone(tmp_path: Path) -> None:
    rc, _ = _check(tmp_path, selftest="--only gemm_exact_fp32 --inject-fault bitflip",
                   sinfo="drained|disk replacement, ticket 4711")
    assert rc == 1 and _drains(tmp_path) == []
    assert "by another owner (reason 'disk replacement, ticket 4711'): left alone" in _logged(tmp_path)


def test_a_node_opted_out_in_the_settings_is_not_checked(tmp_path: Path) -> None:
    rc, _ = _check(tmp_path, selftest="--only gemm_exact_fp32 --inject-fault bitflip", ENABLED="no")
    assert rc == 0 and _drains(tmp_path) == [] and _calls(tmp_path, "logger") == []


def test_missing_fleethealth_fails_open_loudly(tmp_path: Path) -> None:
    rc, _ = _check(tmp_path, FLEETHEALTH="/opt/nowhere/fleethealth")
    assert rc == 0 and _drains(tmp_path) == []
    logged = _calls(tmp_path, "logger")
    assert logged and logged[-1][:4] == ["-t", "fleethealth-healthcheck", "-p", "daemon.err"]
    assert "FAILING OPEN" in logged[-1][-1] and "/opt/nowhere/fleethealth" in logged[-1][-1]


def test_a_suite_that_cannot_run_or_crashes_fails_open(tmp_path: Path) -> None:
    rc, _ = _check(tmp_path, DEVICE="cuda:3")
    assert rc == 0 and _drains(tmp_path) == []
    assert "could not run (exit 2)" in _logged(tmp_path)
    crash = tmp_path / "crash"
    crash.mkdir()
    broken = crash / "fleethealth"  # a broken install: a traceback exits 1 without any verdict
    broken.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\necho 'ImportError: numpy' >&2\n"
                      "exit 1\n")
    broken.chmod(0o755)
    rc, _ = _check(crash, FLEETHEALTH=str(broken))
    assert rc == 0 and _drains(crash) == [] and "exited 1 without a verdict: ImportError: numpy" in _logged(crash)


def test_a_hung_test_is_cut_at_the_budget_and_drains(tmp_path: Path) -> None:
    hung = tmp_path / "hung"
    hung.write_text("#!/bin/sh\nexec sleep 30\n")
    hung.chmod(0o755)
    rc, took = _check(tmp_path, FLEETHEALTH=str(hung), BUDGET_S="1")
    assert rc == 1 and took < 10
    assert _drains(tmp_path)[0][3] == "Reason=fleethealth: quick self-test hung (no result within 1s)"


def test_the_budget_stays_under_slurmds_60_s_kill(tmp_path: Path) -> None:
    rc, _ = _check(tmp_path, selftest="--only gemm_exact_fp32", BUDGET_S="300", SUITE="full")
    assert rc == 0
    logged = _logged(tmp_path)
    assert "BUDGET_S=300 exceeds what slurmd allows" in logged and "50 used" in logged
    assert "unknown settings ignored: SUITE" in logged  # the full suite is the sweep's, not settable here
    assert "--budget" not in SCRIPT.read_text() and "--suite quick" in SCRIPT.read_text()
