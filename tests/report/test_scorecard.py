"""The scorecard against hand-made findings, its accounting of the goodput buckets, and the wall
between ground truth and the detectors: nothing the detector runner imports reaches the scenario."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from fleethealth.policy.goodput import Interruption
from fleethealth.report.data import goodput_buckets
from fleethealth.report.scorecard import score
from fleethealth.schema import Action, Diagnosis, Finding, FindingKind, Guard, Recommendation
from fleethealth.sim import Scenario

SCENARIO = Scenario.from_obj({
    "seed": 1, "fleet": {"racks": 3, "nodes_per_rack": 2, "gpus_per_node": 2},
    "job": {"id": "j", "steps": 100, "step_time_s": 2.0, "jitter": 0.02},
    "faults": [{"kind": "thermal_straggler", "node": "n0001", "gpu": 1, "start_step": 10},
               {"kind": "hot_aisle", "rack": "r01", "start_step": 20},
               {"kind": "hang", "node": "n0000", "step": 50}],
}, name="hand")
T0 = SCENARIO.start_ts


def test_found_missed_wrong_diagnosis_and_healthy_flagged() -> None:
    straggler = Finding(kind=FindingKind.STRAGGLER, node="n0001", ts=T0 + 30, job="j", gpu=1, rank=3, step=15,
                        diagnosis=Diagnosis.NODE_THERMAL, detector="straggler")
    wrong = Finding(kind=FindingKind.STRAGGLER, node="n0003", ts=T0 + 60, job="j", step=30,
                    diagnosis=Diagnosis.NODE_THERMAL, detector="straggler")   # a hot aisle called a node fault
    healthy = Finding(kind=FindingKind.XID, node="n0000", ts=T0 + 70, job="j", detector="xid")  # hang is not xid
    recs = [Recommendation(action=Action.EVICT, node="n0001", ts=T0 + 31, reason="r", guard=Guard.ALLOWED,
                           finding_id=straggler.id),
            Recommendation(action=Action.EVICT, node="n0003", ts=T0 + 61, reason="r", guard=Guard.NEEDS_HUMAN,
                           finding_id=wrong.id),
            Recommendation(action=Action.NONE, node="n0003", ts=T0 + 62, reason="r", finding_id=wrong.id)]
    card = score(SCENARIO, [straggler, wrong, healthy], recs)
    thermal, aisle, hang = card.faults
    assert (thermal.found, thermal.correct, thermal.latency_steps, thermal.action, thermal.guard) == (
        True, True, 5, "evict", "allowed")
    assert aisle.found and not aisle.correct and aisle.node == "n0003" and aisle.latency_steps == 10
    assert (aisle.action, aisle.guard) == ("evict", "needs_human")   # the 'none' row is not an action
    assert not hang.found and hang.latency_steps is None and hang.expected_kind == "hang"
    assert (card.found, card.correct) == (2, 1)
    assert card.healthy_flagged == ()  # n0000 carries the hang fault: flagged, but not healthy
    other = Finding(kind=FindingKind.ECC, node="n0004", ts=T0 + 80, detector="health")
    assert score(SCENARIO, [other], []).healthy_flagged == ("n0004",)
    assert any("MISSED hang" in line for line in card.lines())


def test_latency_from_event_time_when_a_finding_has_no_step() -> None:
    f = Finding(kind=FindingKind.HANG, node="n0000", ts=T0 + 2.0 * 53, job="j", detector="hang")
    (hang,) = [s for s in score(SCENARIO, [f], []).faults if s.fault == "hang"]
    assert hang.found and hang.step == 53 and hang.latency_steps == 3


def test_goodput_buckets_by_hand() -> None:
    # 10 steps of 1 s, two of them 1.5 s (a straggler): ideal 1 s, stragglers 2 × 0.5 s
    step_s = np.array([1.0] * 8 + [1.5, 1.5])
    cut = Interruption(job="j", ts=0.0, node="n", cause="hang", detected_by="hang", lost_steps=3,
                       restart_s=60.0, detection_s=30.0, isolation_s=24.0, reconfiguration_s=18.0, reload_s=18.0)
    g = goodput_buckets(step_s, [cut])
    assert g.ideal_step_s == pytest.approx(1.0)
    assert g.buckets == pytest.approx({"detection": 30.0, "diagnosis": 24.0, "restart": 36.0, "recomputation": 3.0,
                                       "stragglers": 1.0})
    assert g.productive_s == pytest.approx(10.0)
    assert g.ettr == pytest.approx(10.0 / (10.0 + 30 + 24 + 36 + 3 + 1))


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def test_the_detector_path_never_sees_the_ground_truth(source_modules) -> None:
    """Everything the runner (detectors, diagnosis, policy) imports, transitively and including imports
    inside functions, stays clear of the simulator, the shipped scenarios and the scorecard."""
    modules = source_modules
    seen, todo = set(), ["fleethealth.detectors.runner"]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for dep in _imports(modules[mod], modules):
            # a package's __init__ is imported on the way to any of its modules
            parts = dep.split(".")
            todo += [".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in modules]
    assert "fleethealth.detectors.pipeline" in seen and "fleethealth.policy.engine" in seen  # the walk works
    truth = {m for m in seen if m.startswith(("fleethealth.sim", "fleethealth.scenarios", "fleethealth.report"))}
    assert not truth, f"the detector path imports the ground truth: {sorted(truth)}"


def test_importing_the_report_package_or_the_cli_draws_in_no_plotting() -> None:
    import subprocess
    import sys

    code = ("import sys, fleethealth.report, fleethealth.report.scorecard, fleethealth.commands, fleethealth.demo; "
            "print(','.join(m for m in ('matplotlib', 'jinja2') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == ""
