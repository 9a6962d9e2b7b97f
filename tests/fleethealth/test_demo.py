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
    return subprocess.run([sys.executable, "-m", "fleethealth.cli", "demo", "--scenario", str(scenario),
                           "--out", str(tmp_path / "out"), "--data", str(tmp_path / "data"), *extra],
                          capture_output=True, text=True, timeout=300)


def _jsonl(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_thermal_straggler_found_on_the_injected_node_only(tmp_path: Path) -> None:
    run = _demo(tmp_path, SMALL, "--json")
    assert run.returncode == 0, run.stderr
    summary = orjson.loads(run.stdout)
    assert summary["dead_letters"] == 0 and summary["messages"] > 160 * 8
    findings = _jsonl(tmp_path / "out" / "findings.jsonl")
    assert findings, "no findings exported"
    assert {f["node"] for f in findings} == {"n0005"}
    straggler = [f for f in findings if f["kind"] == "straggler"]
    assert len(straggler) == 1
    f = straggler[0]
    assert (f["gpu"], f["rank"], f["diagnosis"], f["job"]) == (2, 5 * 4 + 2, "NODE_THERMAL", "train-e2e")
    assert 40 <= f["step"] <= 50 and 0.15 < f["slowdown"] < 0.25
    assert f["evidence"]["diagnosis"]["temp_c"] > f["evidence"]["diagnosis"]["thermal_limit_c"]
    recs = _jsonl(tmp_path / "out" / "recommendations.jsonl")
    assert [(r["action"], r["node"], r["guard"]) for r in recs] == [("evict", "n0005", "allowed")]
    # the store stays behind for analysts: the same finding through `fleethealth query`
    query = subprocess.run([sys.executable, "-m", "fleethealth.cli", "query", "--json", "--data",
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
