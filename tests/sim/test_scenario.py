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
