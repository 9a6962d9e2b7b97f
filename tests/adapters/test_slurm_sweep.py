"""The sweep returns a drained node for real, on the real single-node Slurm (``slurm_cluster``).

fleethealth drained ``n0000`` and its quarantine book (chDB, ``store`` fixture) holds it. A drained
node runs no job step, so the sweep takes it into a ``Flags=MAINT,IGNORE_JOBS`` reservation, resumes
it there and runs the suite through the real ``srun --reservation``; the node-side command prints a
recorded real full-suite CPU run (tests/sweeps/recordings/full_cpu_pass.jsonl; a CPU suite on this
machine takes minutes), optionally with one test failed. Without Slurm (or root) these tests skip.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleethealth.adapters import SlurmAdapter
from fleethealth.adapters.slurm import reservation_name
from fleethealth.policy import quarantine
from fleethealth.sweeps.launch import SrunLauncher
from fleethealth.sweeps.runner import run_sweep

RECORDED = Path(__file__).parents[1] / "sweeps" / "recordings" / "full_cpu_pass.jsonl"


def _node_command(tmp_path: Path, *, fail: str | None = None) -> Path:
    lines = []
    for line in RECORDED.read_text().splitlines():
        rec = json.loads(line)
        rec["node"] = "n0000"
        if rec["test"] == fail:
            rec["verdict"] = "fail"
        lines.append(json.dumps(rec))
    data = tmp_path / "run.jsonl"
    data.write_text("\n".join(lines) + "\n")
    script = tmp_path / "node-selftest"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write(open({str(data)!r}).read())\n"
                      f"sys.exit({1 if fail else 0})\n")
    script.chmod(0o755)
    return script


def _scontrol(cluster, *args: str) -> str:
    return subprocess.run(["scontrol", *args], env=cluster.env, capture_output=True, text=True, timeout=15,
                          check=True).stdout


@pytest.fixture
def slurm(slurm_cluster):
    adapter = SlurmAdapter(env=slurm_cluster.env)
    yield adapter
    adapter.unreserve(slurm_cluster.node)
    if adapter.info(slurm_cluster.node).held:
        _scontrol(slurm_cluster, "update", f"NodeName={slurm_cluster.node}", "State=RESUME")


def _sweep(cluster, slurm, store, command: Path, calls: list[list[str]]):
    def run(argv, **kw):
        calls.append(list(argv))
        return subprocess.run(argv, env=cluster.env, **kw)

    launcher = SrunLauncher(command=(str(command),), scheduler=slurm, reserve_minutes=10)
    return run_sweep([cluster.node], launcher=launcher, store=store, timeout_s=120, run=functools.partial(run))


def test_a_passing_full_suite_returns_the_drained_node_to_idle(slurm_cluster, slurm, store, tmp_path):
    node = slurm_cluster.node
    slurm.drain(node, "quarantine: sdc from cross-rank replay")
    quarantine.quarantine(store, node, "sdc from cross-rank replay", ts=1000.0)
    calls: list[list[str]] = []
    report = _sweep(slurm_cluster, slurm, store, _node_command(tmp_path), calls)
    (outcome,) = report.outcomes
    assert outcome.run.status.value == "pass", outcome.run.error
    assert outcome.released
    assert f"--reservation={reservation_name(node)}" in calls[0]  # reached inside the MAINT reservation
    assert quarantine.record(store, node) is None  # out of the book ...
    info = slurm.info(node)  # ... and back in Slurm's pool
    assert not info.held and info.state.rstrip("*") == "idle" and info.reason == ""
    assert reservation_name(node) not in _scontrol(slurm_cluster, "show", "reservation")


def test_a_failing_node_is_drained_again_with_its_reason(slurm_cluster, slurm, store, tmp_path):
    node = slurm_cluster.node
    slurm.drain(node, "quarantine: sdc from cross-rank replay")
    quarantine.quarantine(store, node, "sdc from cross-rank replay", ts=1000.0)
    report = _sweep(slurm_cluster, slurm, store, _node_command(tmp_path, fail="gemm_exact_fp32"), [])
    (outcome,) = report.outcomes
    assert outcome.run.status.value == "fail" and not outcome.released
    info = slurm.info(node)
    assert info.held and info.reason == "fleethealth: quarantine: sdc from cross-rank replay"
    assert quarantine.record(store, node) is not None
    assert reservation_name(node) not in _scontrol(slurm_cluster, "show", "reservation")


def test_a_node_another_owner_drained_is_not_swept(slurm_cluster, slurm, store, tmp_path):
    node = slurm_cluster.node
    _scontrol(slurm_cluster, "update", f"NodeName={node}", "State=DRAIN", "Reason=cooling loop work")
    calls: list[list[str]] = []
    report = _sweep(slurm_cluster, slurm, store, _node_command(tmp_path), calls)
    (outcome,) = report.outcomes
    assert outcome.run.status.value == "error" and "another owner" in outcome.run.error
    assert calls == [] and slurm.info(node).reason == "cooling loop work"
