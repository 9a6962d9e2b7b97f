"""Launchers build argument lists (never shell strings) and read the node's JSON records.

Slurm is not installed here: ``fake_srun`` (see conftest) logs its arguments and runs the rest of
the command on this machine, so the ``srun -w`` path is exercised end to end with the real
``fleethealth selftest`` behind it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleethealth.errors import ConfigError, DeviceError, SchemaError
from fleethealth.sweeps.launch import (
    LocalLauncher,
    NodeStatus,
    SrunLauncher,
    parse_records,
    run_node,
    slurm_idle_nodes,
)

from .conftest import srun_calls

PY = (sys.executable, "-m", "fleethealth")


def test_argument_lists() -> None:
    assert LocalLauncher("python3").argv("n0001", "quick", "cpu", ["memory"]) == [
        "python3", "-m", "fleethealth", "selftest", "--suite", "quick", "--device", "cpu", "--json",
        "--node", "n0001", "--only", "memory"]
    assert SrunLauncher(extra=("--exclusive",)).argv("n0002", "full") == [
        "srun", "-w", "n0002", "-N", "1", "-n", "1", "--exclusive", "fleethealth", "selftest", "--suite", "full",
        "--device", "all", "--json", "--node", "n0002"]
    with pytest.raises(ConfigError, match="invalid node name"):
        SrunLauncher().argv("n1;reboot", "full")
    with pytest.raises(ConfigError, match="must start with '-'"):
        SrunLauncher(extra=("reboot",)).argv("n1", "full")
    with pytest.raises(ConfigError, match="unknown suite"):
        LocalLauncher().argv("n1", "nightly")


def test_srun_runs_the_real_selftest_on_the_named_node(fake_srun, tmp_path) -> None:
    launcher = SrunLauncher(srun=str(fake_srun), command=PY)
    run = run_node(launcher, "n0005", suite="quick", device="cpu", only=["gemm_exact_fp32", "gemm_repeat_fp32"])
    assert run.status is NodeStatus.PASS and run.exit_code == 0, run.error
    assert [r.test for r in run.results] == ["gemm_exact_fp32", "gemm_repeat_fp32"]
    assert srun_calls(tmp_path) == [list(run.argv[1:])]
    assert run.argv[1:3] == ("-w", "n0005")


def test_a_node_that_cannot_run_the_suite_is_an_error_with_its_reason(fake_srun) -> None:
    run = run_node(SrunLauncher(srun=str(fake_srun), command=PY), "n0006", suite="quick", device="cuda:3")
    assert run.status is NodeStatus.ERROR and run.exit_code == 2
    assert "CuPy is not installed" in run.error


def test_a_failing_node_is_fail_with_its_failing_tests(fake_srun) -> None:
    launcher = SrunLauncher(srun=str(fake_srun), command=(*PY,))
    run = run_node(launcher, "n0007", suite="quick", device="cpu", only=["gemm_exact_fp32"])
    assert run.status is NodeStatus.PASS
    bad = run_node(LocalLauncher(), "n0007", suite="quick", device="cpu", only=["memory"],
                   run=lambda argv, **kw: subprocess.run([*argv, "--inject-fault", "stuck-bit"], **kw))
    assert bad.status is NodeStatus.FAIL and bad.exit_code == 1
    assert "memory_walking_ones@cpu" in bad.failing


def test_timeouts_and_missing_programs_are_errors() -> None:
    def too_slow(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    assert "timed out" in run_node(LocalLauncher(), "n1", run=too_slow, timeout_s=5).error
    missing = run_node(SrunLauncher(srun="/nonexistent/srun"), "n1")
    assert missing.status is NodeStatus.ERROR and "cannot start /nonexistent/srun" in missing.error


def test_records_are_parsed_and_bad_ones_rejected() -> None:
    good = ('srun: job 12 queued\n{"suite":"quick","test":"t","device":"cpu","verdict":"pass","mismatches":[],'
            '"max_error":0.0,"duration_s":1.0,"throughput":2.0,"unit":"GB/s"}\n')
    assert [r.test for r in parse_records(good)] == ["t"]
    with pytest.raises(SchemaError, match="verdict"):
        parse_records(good.replace('"pass"', '"ok"'))


def test_idle_nodes_from_sinfo(tmp_path) -> None:
    sinfo = tmp_path / "sinfo"
    sinfo.write_text("#!/bin/sh\nprintf 'n0001\\nn0002\\nn0001\\n'\n")
    sinfo.chmod(0o755)
    assert slurm_idle_nodes(str(sinfo)) == ["n0001", "n0002"]
    broken = tmp_path / "sinfo2"
    broken.write_text("#!/bin/sh\necho 'sinfo: error: slurmctld down' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(DeviceError, match="slurmctld down"):
        slurm_idle_nodes(str(broken))
