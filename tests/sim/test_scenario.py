"""Scenario files: the docs/architecture.md contract, and a clear ConfigError for everything else."""

from __future__ import annotations

import pytest

from fleethealth.errors import ConfigError
from fleethealth.sim.scenario import FAULT_FIELDS, Scenario


def test_default_scenario_has_every_fault_kind() -> None:
    sc = Scenario.default()
    assert {f.kind for f in sc.faults} == set(FAULT_FIELDS)
    assert sc.fleet.world_size == 256
    assert sc.checks.selfcheck_every == 50 and sc.checks.replay_every == 200


def test_defaults_fill_optional_fields() -> None:
    sc = Scenario.from_obj({"faults": [{"kind": "thermal_straggler", "node": "n0001", "gpu": 2, "start_step": 5}]})
    assert sc.faults[0]["slowdown"] == pytest.approx(0.20)
    assert sc.job.id == "train-1" and sc.fleet.gpus_per_node == 8


@pytest.mark.parametrize(
    ("obj", "needle"),
    [
        ({"faults": [{"kind": "cosmic_ray", "node": "n0001"}]}, "unknown fault kind 'cosmic_ray'"),
        ({"faults": [{"kind": "xid", "node": "n0001", "gpu": 1, "step": 3, "code": 79, "colour": "red"}]},
         "unknown field 'colour'"),
        ({"faults": [{"kind": "xid", "node": "n0001", "gpu": 1, "step": 3}]}, "missing field 'code'"),
        ({"faults": [{"kind": "xid", "node": "n9999", "gpu": 1, "step": 3, "code": 79}]}, "not in the fleet"),
        ({"faults": [{"kind": "xid", "node": "n0001", "gpu": 8, "step": 3, "code": 79}]}, "gpu 8 out of range"),
        ({"faults": [{"kind": "hot_aisle", "rack": "r09", "start_step": 3}]}, "rack 'r09' is not in the fleet"),
        ({"faults": [{"kind": "hang", "node": "n0001", "step": 9000}]}, "past the job's last step"),
        ({"faults": [{"kind": "ecc_precursor", "node": "n0001", "gpu": 0, "start_step": 50, "fail_step": 10}]},
         "fail_step must come after start_step"),
        ({"fleet": {"racks": 2, "shelves": 3}}, "unknown field 'fleet.shelves'"),
        ({"job": {"steps": "many"}}, "'job.steps' must be an integer"),
        ({"speed": 3}, "unknown field 'speed'"),
        ({"job": {"step_time_s": float("inf")}}, "'job.step_time_s' must be a finite"),
        ({"faults": [{"kind": "nic_contention", "node": "n0001", "start_step": 50, "end_step": 20}]},
         "end_step (exclusive) must be after start_step"),
        ({"job": {"steps": 100}, "faults": [{"kind": "sdc_transient", "node": "n0001", "gpu": 0, "start_step": 60}],
          "checks": {"selfcheck_every": 50}}, "no self-check runs at or after start_step 60"),
        ({"job": {"steps": 100}, "faults": [{"kind": "sdc_deterministic", "node": "n0001", "gpu": 0,
                                             "start_step": 0}]}, "no replay runs"),
        ([1, 2], "expected a mapping"),
    ],
)
def test_bad_scenarios_name_the_cause(obj: object, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        Scenario.from_obj(obj)


def test_malformed_file_is_one_clear_error(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Scenario.load(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        Scenario.load(tmp_path / "missing.yaml")


def test_end_step_is_exclusive_and_may_be_the_job_length() -> None:
    sc = Scenario.from_obj({"job": {"steps": 100}, "faults": [{"kind": "nic_contention", "node": "n0001",
                                                               "start_step": 10, "end_step": 100}]})
    assert sc.faults[0]["end_step"] == 100


def test_json_scenarios_load(tmp_path) -> None:
    path = tmp_path / "s.json"
    path.write_text('{"seed": 3, "job": {"steps": 10}}')
    assert Scenario.load(path).job.steps == 10


_JOBS = {"fleet": {"racks": 2, "nodes_per_rack": 4, "gpus_per_node": 2},
         "jobs": [{"id": "a", "nodes": "n0000..n0002", "steps": 50},
                  {"id": "b", "node_count": 2, "steps": 80, "step_time_s": 1.0},
                  {"id": "c", "nodes": ["n0006"], "steps": 20, "step_time_s": 4.0}]}


def test_jobs_place_several_jobs_and_leave_the_rest_idle() -> None:
    sc = Scenario.from_obj({**_JOBS, "faults": [
        {"kind": "hang", "node": "n0004", "step": 70},                         # b's node: b's steps
        {"kind": "thermal_straggler", "job": "a", "node": "n0001", "gpu": 0, "start_step": 10},
        {"kind": "xid", "node": "n0007", "gpu": 1, "step": 60, "code": 48}]})  # idle: the idle ticks
    assert [(j.id, j.nodes) for j in sc.jobs] == [("a", (0, 1, 2)), ("b", (3, 4)), ("c", (6,))]
    assert sc.job.id == "a" and [j.id for j in sc.job_specs] == ["a", "b", "c"]
    assert sc.idle_nodes == (5, 7) and sc.idle_interval_s == 1.0 and sc.idle_ticks == 100
    assert [f.job for f in sc.faults] == ["b", "a", None]
    assert Scenario.default().jobs == () and Scenario.default().job_specs == (Scenario.default().job,)
    assert {f.job for f in Scenario.default().faults} == {None}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"job": {"steps": 10}}, "either 'job'"),
        ({"jobs": []}, "'jobs' must be a non-empty list"),
        ({"jobs": [{"id": "a", "nodes": ["n0000"]}, {"id": "b", "nodes": "n0000..n0001"}]},
         "node n0000 is already in job 'a'"),
        ({"jobs": [{"id": "a", "node_count": 9}]}, "does not fit the fleet of 8 nodes"),
        ({"jobs": [{"id": "a", "nodes": ["n0000"], "node_count": 1}]}, "exactly one of 'nodes' and 'node_count'"),
        ({"jobs": [{"id": "a", "nodes": "n0003..n0001"}]}, "not a range of fleet nodes"),
        ({"jobs": [{"id": "a", "nodes": ["n0000"]}, {"id": "a", "nodes": ["n0001"]}]}, "used twice"),
        ({"jobs": [{"id": "a", "nodes": ["n0000"], "gpus": 3}]}, "unknown field 'gpus'"),
        ({"faults": [{"kind": "hang", "job": "b", "node": "n0001", "step": 3}]}, "runs job 'a', not 'b'"),
        ({"faults": [{"kind": "hang", "node": "n0005", "step": 3}]}, "idle (in no job): a hang fault needs a job"),
        ({"faults": [{"kind": "xid", "job": "a", "node": "n0005", "gpu": 0, "step": 3, "code": 79}]},
         "idle (in no job), not in job 'a'"),
        ({"faults": [{"kind": "hang", "node": "n0006", "step": 20}]}, "past the last step of job 'c' (19)"),
        ({"faults": [{"kind": "xid", "node": "n0005", "gpu": 0, "step": 100, "code": 79}]},
         "past the idle nodes' last telemetry tick (99)"),
        ({"faults": [{"kind": "hot_aisle", "rack": "r00", "start_step": 3}]}, "spans jobs"),
    ],
)
def test_bad_jobs_name_the_cause(change: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        Scenario.from_obj({**_JOBS, **change})


def test_a_one_job_scenario_may_name_its_job_in_a_fault() -> None:
    sc = Scenario.from_obj({"faults": [{"kind": "hang", "job": "train-1", "node": "n0001", "step": 3}]})
    assert sc.faults[0].job == "train-1"
    with pytest.raises(ConfigError, match="not the scenario's job 'train-1'"):
        Scenario.from_obj({"faults": [{"kind": "hang", "job": "other", "node": "n0001", "step": 3}]})


def test_the_shipped_multi_job_scenario_loads() -> None:
    from importlib import resources

    with resources.as_file(resources.files("fleethealth.scenarios") / "multi_job.yaml") as path:
        sc = Scenario.load(path)
    assert sc.fleet.nodes == 64 and len(sc.jobs) == 4 and len({len(j.nodes) for j in sc.jobs}) >= 3
    assert sc.idle_nodes and {f.job for f in sc.faults} == {j.id for j in sc.jobs} | {None}
