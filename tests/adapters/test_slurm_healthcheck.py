"""slurmd itself runs deploy/slurm/healthcheck.sh as its HealthCheckProgram on the real single-node Slurm.

The ``slurm_cluster`` fixture configures ``HealthCheckProgram`` (every 2 s) through a wrapper that
does nothing until a test writes the settings file. slurmd starts it the way it always does: as
root, with an empty environment except ``SLURMD_NODENAME``, killed after 60 s. So the settings file
carries ``SLURM_CONF`` (the test cluster's) and the fleethealth command, and the node name comes from
slurmd. Without Slurm (or root) these tests are skipped with the reason printed.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest


def _reasons(cluster) -> dict[str, str]:
    out = cluster.sinfo("--list-reasons", "--noheader", "--Node", "--format=%N|%E")
    return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)


def _arm(cluster, **settings: str) -> None:
    conf = {"SLURM_CONF": str(cluster.conf), "FLEETHEALTH": f"{sys.executable} -m fleethealth",
            "DEVICE": "cpu", "BUDGET_S": "45", **settings}
    cluster.healthcheck_conf.write_text("".join(f'{k}="{v}"\n' for k, v in conf.items()))


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


@pytest.fixture
def armed(slurm_cluster):
    yield slurm_cluster
    slurm_cluster.healthcheck_conf.unlink(missing_ok=True)
    time.sleep(3)  # let a check already started by slurmd finish before the node is cleaned up
    subprocess.run(["scontrol", "update", f"NodeName={slurm_cluster.node}", "State=RESUME"], env=slurm_cluster.env,
                   capture_output=True, timeout=15)


def test_slurmd_runs_the_check_and_a_fault_drains_with_the_fleethealth_prefix(armed):
    node = armed.node
    assert node not in _reasons(armed)
    _arm(armed, SELFTEST_ARGS="--only gemm_exact_fp32 --inject-fault bitflip")
    assert _wait(lambda: node in _reasons(armed), 90), "slurmd never ran the health check (see slurmd.log)"
    assert _reasons(armed)[node] == "fleethealth: quick self-test: gemm_exact_fp32@cpu fail"


def test_slurmd_check_leaves_an_admins_reason_alone(armed):
    node = armed.node
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=bios update"], env=armed.env,
                   check=True, timeout=15)
    marker = armed.root / "check-ran"
    # a stand-in fleethealth that reports a failing test and records that slurmd ran it
    fake = armed.root / "fake-fleethealth"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\n"
                    "echo '{\"test\":\"gemm_exact_fp32\",\"device\":\"cpu\",\"verdict\":\"fail\"}'\nexit 1\n")
    fake.chmod(0o755)
    _arm(armed, FLEETHEALTH=str(fake))
    assert _wait(marker.exists, 60), "slurmd never ran the health check"
    time.sleep(1)
    assert _reasons(armed)[node] == "bios update"


def test_slurmd_check_fails_open_when_fleethealth_is_missing(armed):
    log = armed.root / "logger.out"
    logger = armed.root / "logger"  # stands in for logger(1), so the test can read what was logged
    logger.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    logger.chmod(0o755)
    _arm(armed, FLEETHEALTH="/opt/nowhere/fleethealth", LOGGER=str(logger))
    assert _wait(log.exists, 30), "slurmd never ran the health check"
    time.sleep(2.5)  # at least one more interval
    assert "FAILING OPEN, node not drained: fleethealth command '/opt/nowhere/fleethealth' not found" in log.read_text()
    assert armed.node not in _reasons(armed)
    assert armed.sinfo("--noheader", "--Node", "--format=%T").strip().rstrip("*") == "idle"
