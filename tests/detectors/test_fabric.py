"""The fabric rule (health rule ``fabric``) and the wire form of a GPU's fabric registration.

Values are those NVML and DCGM report (``fleethealth/schema/fabric.py`` names the sources):
NVML state 3 COMPLETED with status 0 is a registered GPU; DCGM's Fabric Manager status 4 is Failure.
"""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from fleethealth.detectors.health import HealthRules
from fleethealth.detectors.state import from_state, state_dict
from fleethealth.errors import ConfigError, SchemaError
from fleethealth.policy.engine import PolicyEngine
from fleethealth.schema import Action, Fabric, FindingKind, Telemetry, decode, encode

G = 8
CONNECTED = 1 << 14
DISCONNECTED = 2 << 14


def _sample(ts: float, node: str = "gpu-b", **fabric) -> Telemetry:
    values = {"state": [3] * G, "status": [0] * G, "health_mask": [CONNECTED] * G, "since": [0.0] * G,
              "clique_id": [32766] * G, "cluster_uuid": ["6d1c8f0a"] * G, **fabric}
    return Telemetry.from_columns(node, "rack-1", ts, list(range(G)), temp_c=[50.0] * G,
                                  fabric=Fabric.build(G, **values))


def _with(values: list[int], i: int, v: int) -> list[int]:
    out = list(values)
    out[i] = v
    return out


def test_a_registration_that_completed_with_an_error_is_one_critical_finding_naming_the_gpu() -> None:
    rules = HealthRules()
    status = _with([0] * G, 5, 10)  # NVML_ERROR_TIMEOUT
    (f,) = rules.check([_sample(100.0, status=status)])
    assert f.kind is FindingKind.FABRIC and f.node == "gpu-b" and f.gpu == 5 and f.detector == "health.fabric"
    ev = f.evidence
    assert ev["reason"] == "registration_failed" and ev["severity"] == "critical" and ev["gpus"] == [5]
    assert ev["fabric"][0]["state"] == "completed" and ev["fabric"][0]["status"] == 10
    # the same fault in every later sample: one episode, no second finding
    assert rules.check([_sample(100.0 + 10 * k, status=status) for k in range(1, 30)]) == []


def test_a_healthy_fabric_and_a_node_without_one_are_no_finding() -> None:
    rules = HealthRules()
    assert rules.check([_sample(100.0 + k) for k in range(5)]) == []
    plain = Telemetry.from_columns("gpu-c", "rack-1", 200.0, list(range(G)), temp_c=[50.0] * G)
    unsupported = _sample(201.0, node="gpu-d", state=[0] * G, status=[-1] * G, health_mask=[0] * G)
    assert rules.check([plain, unsupported]) == []


def test_not_registered_past_the_grace_is_a_warning_and_within_it_is_nothing() -> None:
    rules = HealthRules(fabric_grace_s=600.0)
    waiting = dict(state=_with([3] * G, 2, 2), status=_with([0] * G, 2, -1), since=[1000.0] * G)
    assert rules.check([_sample(1000.0 + 60 * k, **waiting) for k in range(11)]) == []  # 600 s: not yet
    (f,) = rules.check([_sample(1000.0 + 660.0, **waiting)])
    assert (f.gpu, f.evidence["reason"], f.evidence["severity"]) == (2, "not_registered", "warning")
    assert f.evidence["fabric"][0]["state"] == "in_progress" and f.evidence["grace_s"] == 600.0
    # NOT_STARTED on every GPU (a fabric manager that never started): one finding for the node, GPUs listed
    never = dict(state=[1] * G, status=[-1] * G, since=[0.0] * G)
    (g,) = HealthRules(fabric_grace_s=600.0).check([_sample(700.0, node="gpu-e", **never)])
    assert g.gpu is None and g.evidence["gpus"] == list(range(G)) and g.evidence["reason"] == "not_registered"


def test_a_disconnected_fabric_manager_and_dcgms_failure_status_are_findings() -> None:
    (down,) = HealthRules().check([_sample(50.0, health_mask=[DISCONNECTED] * G)])
    assert down.gpu is None and down.evidence["reason"] == "fabric_manager_down" and len(down.evidence["gpus"]) == G
    dcgm = dict(fm_status=_with([3] * G, 7, 4), status=_with([0] * G, 7, -1))  # DcgmFMStatusFailure on GPU 7
    (failed,) = HealthRules().check([_sample(50.0, **dcgm)])
    assert failed.gpu == 7 and failed.evidence["reason"] == "registration_failed"
    assert failed.evidence["fabric"][0]["fm_status"] == "failure"
    # Unrecognized (5) and NvmlTooOld (6): a driver and DCGM that do not match, not a fault of the GPU
    mismatch = dict(fm_status=[5] * 4 + [6] * 4, state=[-1] * G, status=[-1] * G)
    assert HealthRules().check([_sample(50.0, **mismatch)]) == []


def test_the_grace_is_checked_and_is_a_configuration_key() -> None:
    from fleethealth.commands._settings import schema

    with pytest.raises(ConfigError, match="fabric_grace_s"):
        HealthRules(fabric_grace_s=0).check([])
    assert "detect.health.fabric_grace_s" in schema().keys


def test_the_policy_reports_a_fabric_finding_like_the_other_node_hardware_findings() -> None:
    (f,) = HealthRules().check([_sample(100.0, status=_with([0] * G, 5, 10))])
    (rec,) = PolicyEngine().decide([f], now=101.0)
    assert rec.action is Action.NONE and rec.node == "gpu-b"


def test_fabric_rows_round_trip_and_old_records_still_decode() -> None:
    s = _sample(100.0, status=_with([0] * G, 5, 10))
    again = decode(Telemetry, encode(s))
    assert again.fabric is not None and again.fabric.status.tolist() == s.fabric.status.tolist()
    assert again.fabric.cluster_uuid == s.fabric.cluster_uuid
    old = orjson.loads(encode(s))
    del old["fabric"]
    assert decode(Telemetry, orjson.dumps(old)).fabric is None
    rules = HealthRules()
    rules.check([s])
    restored = from_state(state_dict(rules))
    assert restored.previous_["gpu-b"].fabric.status.tolist() == s.fabric.status.tolist()
    before_fabric = state_dict(rules)  # a snapshot written before the rule existed restores with its default
    del before_fabric.tree[2]["fabric_grace_s"]
    assert from_state(before_fabric).fabric_grace_s == 900.0


@pytest.mark.parametrize(("change", "field"), [
    (lambda f: f.update(state=[9] * G), "fabric.state"),
    (lambda f: f.update(state=[3] * (G - 1)), "fabric.state"),
    (lambda f: f.update(status=["0"] * G), "fabric.status"),
    (lambda f: f.update(since=[1e9] * G), "fabric.since"),           # after the sample's own time
    (lambda f: f.update(cluster_uuid=["x" * 65] * G), "fabric.cluster_uuid"),
    (lambda f: f.update(extra=1), "fabric.extra"),
    (lambda f: f.pop("clique_id"), "fabric.clique_id"),
])
def test_hostile_fabric_rows_are_refused_naming_the_field(change, field) -> None:
    obj = orjson.loads(encode(_sample(100.0)))
    change(obj["fabric"])
    with pytest.raises(SchemaError) as info:
        decode(Telemetry, orjson.dumps(obj))
    assert field in str(info.value)
    assert np.isfinite(_sample(1.0).columns["temp_c"]).all()
