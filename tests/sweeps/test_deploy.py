"""The sweep's deployment pieces parse and call the CLI correctly; the package exports its surface."""

from __future__ import annotations

from pathlib import Path

import yaml

import fleethealth.sweeps as sweeps
from fleethealth.commands import build_parser

ROOT = Path(__file__).parents[2]


def test_cronjob_runs_a_full_local_sweep_of_its_own_node_on_every_gpu() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "base" / "sweep-cronjob.yaml").read_text()))
    cron = next(d for d in docs if d["kind"] == "CronJob")
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    command = [part.replace("$(NODE_NAME)", "n0001") for part in container["command"]]
    assert command[0] == "fleethealth"
    args = build_parser().parse_args(command[1:])
    assert (args.command, args.launcher, args.suite, args.device, args.nodes) == ("sweep", "local", "full", "all",
                                                                                 ["n0001"])
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == "8"
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    assert any(d["kind"] == "PriorityClass" and d["value"] < 0 for d in docs)


def test_healthcheck_script_is_executable_bash() -> None:
    script = ROOT / "deploy" / "slurm" / "healthcheck.sh"
    assert script.stat().st_mode & 0o111
    assert script.read_text().startswith("#!/usr/bin/env bash\n")


def test_exported_names() -> None:
    assert set(sweeps.__all__) == {
        "LocalLauncher", "NodeOutcome", "NodeRisk", "NodeRun", "NodeStatus", "ReleaseDecision", "SrunLauncher",
        "SweepReport", "apply_release", "rank_nodes", "release_decision", "risk_from_store", "run_node", "run_sweep",
        "slurm_idle_nodes", "validate_node"}
    for name in sweeps.__all__:
        assert getattr(sweeps, name) is not None
