"""``fleethealth demo`` end to end: simulated fleet -> probe delivery -> real broker -> runner -> chDB -> JSONL.

Nothing is mocked: the demo starts the Tansu broker and a chDB store itself, in a subprocess
exactly as a user runs it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

SMALL = """
seed: 3
fleet: {racks: 2, nodes_per_rack: 4, gpus_per_node: 4}
job: {id: train-e2e, steps: 160, step_time_s: 2.0, jitter: 0.02}
faults:
  - {kind: thermal_straggler, node: n0005, gpu: 2, start_step: 40, slowdown: 0.20}
"""


def _demo(tmp_path: Path, scenario_text: str, *extra: str) -> subprocess.CompletedProcess[str]:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(scenario_text)
    return subprocess.run([sys.executable, "-m", "fleethealth", "demo", "--scenario", str(scenario),
                           "--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"), *extra],
                          capture_output=True, text=True, timeout=300)


def _jsonl(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_thermal_straggler_found_on_the_injected_node_only(tmp_path: Path) -> None:
    run = _demo(tmp_path, SMALL, "--json", "--no-report")  # tests/report/test_report.py checks the page
    assert run.returncode == 0, run.stderr
    summary = orjson.loads(run.stdout)
    assert summary["dead_letters"] == 0 and summary["messages"] > 160 * 8
    assert summary["report"] is None and not (tmp_path / "out" / "report.html").exists()
    findings = _jsonl(tmp_path / "out" / "findings.jsonl")
    assert findings, "no findings exported"
    assert {f["node"] for f in findings} == {"n0005"}
    straggler = [f for f in findings if f["kind"] == "straggler"]
    assert len(straggler) == 1
    f = straggler[0]
    assert (f["gpu"], f["rank"], f["diagnosis"], f["job"]) == (2, 5 * 4 + 2, "NODE_THERMAL", "train-e2e")
    assert 40 <= f["step"] <= 50 and 0.15 < f["slowdown"] < 0.25
    assert f["evidence"]["temp_c"] > f["evidence"]["thermal_limit_c"]
    recs = _jsonl(tmp_path / "out" / "recommendations.jsonl")
    assert [(r["action"], r["node"], r["guard"]) for r in recs] == [("evict", "n0005", "allowed")]
    # the store stays behind for analysts: the same finding through `fleethealth query`
    query = subprocess.run([sys.executable, "-m", "fleethealth", "query", "--json", "--data",
                            str(tmp_path / "data"), "SELECT node, diagnosis FROM findings FINAL"],
                           capture_output=True, text=True, timeout=120)
    assert query.returncode == 0, query.stderr
    assert [orjson.loads(line) for line in query.stdout.splitlines()] == [{"node": "n0005",
                                                                           "diagnosis": "NODE_THERMAL"}]


@pytest.mark.parametrize(("text", "needle"), [
    ("seed: [unclosed\n", "not valid YAML"),
    ("faults:\n  - {kind: meteor, node: n0001}\n", "unknown fault kind 'meteor'"),
])
def test_bad_scenario_is_one_line_and_exit_2(tmp_path: Path, text: str, needle: str) -> None:
    run = _demo(tmp_path, text)
    assert run.returncode == 2
    assert needle in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_default_demo_finds_every_fault_kind_and_flags_no_healthy_node(tmp_path: Path) -> None:
    """docs/architecture.md "Fault scenarios": each kind's expected outcome, on the shipped scenario."""
    run = subprocess.run([sys.executable, "-m", "fleethealth", "demo", "--json", "--out", str(tmp_path / "out"),
                          "--data", str(tmp_path / "data")], capture_output=True, text=True,
                         timeout=540)  # 89 s in the last quiet full run; past 300 s at load average 10
    assert run.returncode == 0, run.stderr
    findings = _jsonl(tmp_path / "out" / "findings.jsonl")
    recs = _jsonl(tmp_path / "out" / "recommendations.jsonl")

    def kinds(node: str) -> set[tuple[str, str | None]]:
        return {(f["kind"], f["diagnosis"]) for f in findings if f["node"] == node}

    assert kinds("n0013") == {("straggler", "NODE_THERMAL")}                       # thermal_straggler
    rack_r02 = {f"n{i:04d}" for i in range(16, 24)}
    env = [f for f in findings if f["diagnosis"] == "ENVIRONMENTAL"]                 # hot_aisle: one rack episode
    assert len(env) == 1 and env[0]["node"] in rack_r02 and env[0]["evidence"]["rack"] == "r02"
    assert kinds("n0021") == {("straggler", "NODE_LINK"), ("link", None)}           # nvlink_degraded
    assert kinds("n0005") == {("straggler", "NETWORK_CONTENTION")}                 # nic_contention
    ecc_gpu = [f for f in findings if f["node"] == "n0007"]
    risk = [f for f in ecc_gpu if f["kind"] == "failure_risk"]                       # ecc_precursor, before it fails
    assert risk and risk[0]["gpu"] == 1 and risk[0]["probability"] >= 0.5
    fail_ts = min(f["ts"] for f in ecc_gpu if f["kind"] == "xid" and f["evidence"].get("code") == 79)
    assert risk[0]["ts"] < fail_ts
    sdc = {(f["node"], f["gpu"], f["detector"]) for f in findings if f["kind"] == "sdc"}
    assert sdc == {("n0030", 5, "sdc.selfcheck"), ("n0011", 2, "sdc.replay")}      # sdc_transient / _deterministic
    assert [(f["node"], f["rank"]) for f in findings if f["kind"] == "hang"] == [("n0002", 16)]  # hang
    assert ("xid", None) in kinds("n0019")                                           # xid 79
    faulty = {"n0013", "n0021", "n0005", "n0007", "n0030", "n0011", "n0002", "n0019"} | rack_r02
    assert {f["node"] for f in findings} <= faulty                                   # no healthy node flagged

    acted = {(r["action"], r["node"]) for r in recs if r["action"] != "none"}
    assert ("alert_facilities", env[0]["node"]) in acted
    assert not {n for a, n in acted if a == "evict"} & (rack_r02 - {"n0021"})       # no eviction for the hot aisle
    assert {("quarantine", "n0011"), ("rollback", "n0011"), ("quarantine", "n0030"), ("rollback", "n0030")} <= acted
    # against the scenario's ground truth: each rollback target is before its SDC fault began
    from fleethealth.sim import Scenario

    starts = {f["node"]: f["start_step"] for f in Scenario.default().faults if f.kind.startswith("sdc_")}
    targets = {r["node"]: r["evidence"]["target_step"] for r in recs if r["action"] == "rollback"}
    assert set(targets) == set(starts) and all(targets[n] < starts[n] for n in starts), targets

    # the job's two stops, derived by the detectors from its start / exit records (the simulator writes none);
    # read in this process (`fleethealth query` on the demo's store is the small scenario's test above)
    from fleethealth.store import open_store

    with open_store(f"chdb://{tmp_path / 'data' / 'store'}") as store:
        stops = store.query("SELECT node, step, data FROM events FINAL WHERE kind = 'interruption' ORDER BY ts").rows
    data = [orjson.loads(d) for _, _, d in stops]
    assert [(node, int(step), d["cause"], d["lost_steps"]) for (node, step, _), d in zip(stops, data, strict=True)] \
        == [("n0002", 450, "hang", 0), ("n0007", 500, "gpu_failure", 0)]
    assert all(d["detection_s"] + d["restart_s"] == pytest.approx(gap, abs=1.0)
               for d, gap in zip(data, (120.0 + 600.0, 600.0), strict=True))  # the simulated stall, whole
