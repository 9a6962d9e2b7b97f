"""``fleethealth demo`` on the shipped four-job scenario: 64 nodes, four jobs of different sizes and
step times, eight idle nodes, faults spread over them — each found with the right kind, diagnosis
and job, no healthy node flagged, and each stop derived for its own job only.

The real path, as a user runs it: the demo in a subprocess with the Tansu broker and a chDB store.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import resources
from pathlib import Path

import orjson
import pytest

from fleethealth.sim import Scenario


def _demo(where: Path, *extra: str) -> dict:
    with resources.as_file(resources.files("fleethealth.scenarios") / "multi_job.yaml") as path:
        run = subprocess.run([sys.executable, "-m", "fleethealth", "demo", "--json", "--scenario", str(path),
                              "--out", str(where / "out"), "--data", str(where / "data"), *extra],
                             capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return orjson.loads(run.stdout)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scenario through one runner of the whole detector tier."""
    where = tmp_path_factory.mktemp("single")
    assert _demo(where)["dead_letters"] == 0
    return where


def _outputs(where: Path) -> tuple[list[tuple], list[tuple]]:
    def rows(name: str) -> list[dict]:
        return [orjson.loads(line) for line in (where / "out" / name).read_text().splitlines()]

    findings = sorted((f["id"], f["kind"], f["diagnosis"], f["job"], f["node"], f["rank"], f["step"])
                      for f in rows("findings.jsonl"))
    recs = sorted((r["id"], r["action"], r["guard"], r["node"], r["finding_id"]) for r in rows("recommendations.jsonl"))
    return findings, recs


@pytest.mark.slow
def test_three_replicas_of_each_stage_find_and_decide_what_one_runner_does(single: Path, tmp_path: Path) -> None:
    out = _demo(tmp_path, "--replicas", "3")
    assert out["dead_letters"] == 0
    stages = out["stages"]
    assert set(stages) == {"node", "job", "policy"}
    # the node and job stages' replicas split the four partitions between them (64 nodes' records land on
    # all of them; four jobs' keys on as many as their hashes give); the policy is one writer. Each replica
    # held partitions at some time: a replica slow past its poll interval on a loaded machine may lose them
    # to a rebalance before the end, so the partitions held at the end are not what this checks
    for stage in ("node", "job"):
        assert stages[stage]["replicas"] == 3, stages[stage]
        held = {p for parts in stages[stage]["partitions"] for p in parts}
        assert held == {0, 1, 2, 3} and all(stages[stage]["partitions"]), stages[stage]
    assert all(stages["node"]["records"]) and sum(stages["job"]["records"]) > 0, stages
    assert stages["policy"]["replicas"] == 1
    assert stages["node"]["node_states"] > 0
    findings, recs = _outputs(tmp_path)
    one_findings, one_recs = _outputs(single)
    # the same ids, kinds, diagnoses, actions and guards; on a difference, what only one side has
    assert findings == one_findings, {"only_replicas": sorted(set(findings) - set(one_findings)),
                                      "only_one_runner": sorted(set(one_findings) - set(findings))}
    assert recs == one_recs, {"only_replicas": sorted(set(recs) - set(one_recs)),
                              "only_one_runner": sorted(set(one_recs) - set(recs))}
    assert len(findings) >= 10 and len(recs) >= 10


@pytest.mark.slow
def test_four_jobs_on_64_nodes_every_fault_found_on_its_job(single: Path) -> None:
    tmp_path = single
    with resources.as_file(resources.files("fleethealth.scenarios") / "multi_job.yaml") as path:
        scenario = Scenario.load(path)
    assert scenario.fleet.nodes == 64 and len(scenario.jobs) == 4 and len(scenario.idle_nodes) == 8

    card = orjson.loads((tmp_path / "out" / "scorecard.json").read_bytes())
    assert card["injected"] == len(scenario.faults) == card["found"] == card["correct"], card
    assert card["healthy_flagged"] == []
    assert [(f["fault"], f["where"], f["job"]) for f in card["faults"]] == [
        (f.kind, f["node"], f.job) for f in scenario.faults]

    findings = [orjson.loads(line) for line in (tmp_path / "out" / "findings.jsonl").read_text().splitlines()]

    def found(node: str) -> set[tuple[str, str | None, str | None]]:
        return {(f["kind"], f["diagnosis"], f["job"]) for f in findings if f["node"] == node}

    assert found("n0010") == {("straggler", "NODE_THERMAL", "pretrain-a")}      # rank 41 of the 24-node job
    assert [f["rank"] for f in findings if f["node"] == "n0010"] == [10 * 4 + 1]
    assert found("n0030") == {("hang", None, "finetune-b")}
    assert [f["rank"] for f in findings if f["kind"] == "hang"] == [(30 - 24) * 4]  # finetune-b starts at n0024
    assert found("n0045") == {("xid", None, "eval-c")}
    assert found("n0050") == {("straggler", "NETWORK_CONTENTION", "train-d")}
    idle = found("n0062")                                                        # idle: node facts, no job
    assert ("failure_risk", None, None) in idle and {job for _, _, job in idle} == {None}
    faulty = {f["node"] for f in scenario.faults}
    assert {f["node"] for f in findings} == faulty                               # no healthy node flagged
    # the job-stage findings carry their job; the four jobs' stragglers were judged against their own peers
    assert {f["job"] for f in findings if f["kind"] in ("straggler", "hang")} == {"pretrain-a", "finetune-b",
                                                                                 "train-d"}

    # the one stop, derived from finetune-b's own start / exit records; the other jobs ran through
    query = subprocess.run([sys.executable, "-m", "fleethealth", "query", "--json", "--data", str(tmp_path / "data"),
                            "SELECT job, node, step FROM events FINAL WHERE kind = 'interruption' ORDER BY ts"],
                           capture_output=True, text=True, timeout=120)
    assert query.returncode == 0, query.stderr
    assert [orjson.loads(line) for line in query.stdout.splitlines()] == [
        {"job": "finetune-b", "node": "n0030", "step": 70}]  # attributed to the hung node


_JOBS = Scenario.from_obj({
    "fleet": {"racks": 1, "nodes_per_rack": 4, "gpus_per_node": 2},
    "jobs": [{"id": "a", "node_count": 2, "steps": 50, "step_time_s": 2.0},
             {"id": "b", "node_count": 1, "steps": 50, "step_time_s": 0.5}],  # n0003 idle: ticks every 0.5 s
    "faults": [{"kind": "hang", "node": "n0002", "step": 20},
               {"kind": "xid", "node": "n0003", "gpu": 0, "step": 40, "code": 79}]}, name="jobs")


def test_scorecard_wants_the_faults_own_job_and_counts_its_steps() -> None:
    from fleethealth.report.scorecard import score
    from fleethealth.schema import Finding, FindingKind

    t0 = _JOBS.start_ts
    other_job = Finding(kind=FindingKind.HANG, node="n0002", ts=t0 + 11.0, job="a", detector="hang")
    card = score(_JOBS, [other_job], [])
    assert not card.faults[0].found and card.faults[0].job == "b"      # a hang of another job is not this one
    own = Finding(kind=FindingKind.HANG, node="n0002", ts=t0 + 0.5 * 23, job="b", detector="hang")
    idle = Finding(kind=FindingKind.XID, node="n0003", ts=t0 + 0.5 * 41, detector="health.xid")
    hang, xid = score(_JOBS, [other_job, own, idle], []).faults
    assert (hang.found, hang.job, hang.step, hang.latency_steps) == (True, "b", 23, 3)   # b's 0.5 s steps
    assert (xid.found, xid.job, xid.step, xid.latency_steps) == (True, None, 41, 1)      # the idle ticks


def test_the_closed_loop_refuses_a_scenario_with_several_jobs(tmp_path: Path) -> None:
    from fleethealth.demo import run_demo
    from fleethealth.errors import ConfigError

    with pytest.raises(ConfigError, match="the closed loop weighs one job"):
        run_demo(_JOBS, tmp_path / "out", tmp_path / "data", closed_loop=True)
    assert not (tmp_path / "data").exists()  # refused before anything started
