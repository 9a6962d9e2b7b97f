"""Fabric registration read by the NVML and DCGM sources, from fixtures (``fixtures/README.md``).

NVML: ``nvmlDeviceGetGpuFabricInfoV`` per GPU, replayed by :class:`NvmlReplay` into the struct the
source passes by reference. DCGM: fields 170-173 (Fabric Manager status, its error code, cluster
UUID, clique id), replayed by :class:`DcgmReplay`. A node without NVSwitch sends no ``fabric``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleethealth.detectors.health import HealthRules
from fleethealth.probe.dcgm import DcgmSource
from fleethealth.probe.nvml import NvmlSource
from fleethealth.probe.recorded import DcgmReplay, NvmlRecorder, NvmlReplay
from fleethealth.schema import FindingKind, Telemetry, decode, encode

FIXTURES = Path(__file__).parent / "fixtures"
RECORDINGS = Path(__file__).parent / "recordings"
CLUSTER = "6d1c8f0a3b5e4c27a9f2d8e1b4c7a350"


def _nvml(path: Path) -> tuple[NvmlSource, NvmlReplay]:
    replay = NvmlReplay(path)
    source = NvmlSource("gpu-b", "rack-1", nvml=replay, xid_events=False)
    source.open()
    return source, replay


def test_nvml_fabric_rows_of_a_registered_node_and_of_one_failed_gpu() -> None:
    source, replay = _nvml(FIXTURES / "nvml_fabric_h100x8_healthy.json")
    try:
        fabric = decode(Telemetry, encode(source.sample(100.0).telemetry)).fabric
        assert fabric.state.tolist() == [3] * 8 and fabric.status.tolist() == [0] * 8
        assert fabric.cluster_uuid == (CLUSTER,) * 8 and fabric.clique_id.tolist() == [32766] * 8
        assert fabric.since.tolist() == [100.0] * 8 and fabric.fm_status.tolist() == [-1] * 8
        replay.calls_by_name.clear()
        before = replay.calls
        source.sample(101.0)
        assert replay.calls_by_name["nvmlDeviceGetGpuFabricInfoV"] == 8  # one call a GPU a sample
        assert (replay.calls - before) / 8 <= 10  # still at most ten calls a GPU a sample
    finally:
        source.close()
    failed, _ = _nvml(FIXTURES / "nvml_fabric_h100x8_gpu5_failed.json")
    try:
        samples = [failed.sample(100.0 + 10 * k).telemetry for k in range(6)]
        assert samples[0].fabric.status.tolist() == [0] * 5 + [10] + [0] * 2
        (f,) = HealthRules().check(samples)
        assert (f.kind, f.node, f.gpu, f.evidence["reason"]) == (FindingKind.FABRIC, "gpu-b", 5, "registration_failed")
    finally:
        failed.close()


def test_a_gpu_without_nvswitch_sends_no_fabric_and_is_asked_once() -> None:
    source, replay = _nvml(RECORDINGS / "nvml_h100_faults.json")
    try:
        assert replay.calls_by_name["nvmlDeviceGetGpuFabricInfoV"] == 4  # at open: NOT_SUPPORTED
        assert source.sample(1.0).telemetry.fabric is None and source.sample(2.0).telemetry.fabric is None
        assert replay.calls_by_name["nvmlDeviceGetGpuFabricInfoV"] == 4
    finally:
        source.close()


def test_the_recorder_writes_fabric_answers_that_replay_the_same_rows(tmp_path) -> None:
    recorder = NvmlRecorder(NvmlReplay(FIXTURES / "nvml_fabric_h100x8_gpu5_failed.json"))
    source = NvmlSource("gpu-b", "rack-1", nvml=recorder, xid_events=False)
    source.open()
    first = source.sample(1.0).telemetry.fabric
    source.close()
    recorder.dump(tmp_path / "rec.json")
    again, _ = _nvml(tmp_path / "rec.json")
    try:
        fabric = again.sample(1.0).telemetry.fabric
        assert fabric.status.tolist() == first.status.tolist() == [0] * 5 + [10] + [0] * 2
        assert fabric.cluster_uuid == first.cluster_uuid and fabric.health_mask.tolist() == [1 << 14] * 8
    finally:
        again.close()


def test_dcgm_fabric_manager_fields_become_fabric_rows_and_one_finding() -> None:
    replay = DcgmReplay(FIXTURES / "dcgm_fabric_h100x8.json")
    source = DcgmSource("gpu-c", "rack-1", reader=replay.reader, health=replay.health)
    source.open()
    samples = [source.sample(ts).telemetry for ts in (10.0, 20.0, 30.0)]
    fabric = samples[1].fabric
    assert fabric.fm_status.tolist() == [3] * 5 + [4] + [3] * 2 and fabric.state.tolist() == [3] * 8
    assert fabric.status[5] == -11 and fabric.status[0] == 0 and fabric.since[5] == 20.0
    assert fabric.health_mask.tolist() == [1 << 14] * 8
    assert fabric.cluster_uuid[5] == "6d1c8f0a-3b5e-4c27-a9f2-d8e1b4c7a350" and fabric.clique_id[5] == 32766
    assert samples[0].fabric.state[5] == 2  # still in progress at the first read: no finding yet
    (f,) = HealthRules().check(samples)
    assert (f.node, f.gpu, f.evidence["reason"]) == ("gpu-c", 5, "registration_failed")
    assert f.evidence["fabric"][0]["fm_status"] == "failure"


def test_dcgm_fabric_health_mask_with_the_fabric_manager_disconnected_is_a_finding() -> None:
    recorded = json.loads((FIXTURES / "dcgm_fabric_h100x8.json").read_text())
    for read in recorded["reads"][1:]:
        for fields in read.values():
            fields["170"], fields["174"] = [3], [2 << 14]  # registered, then the fabric manager went away
    replay = DcgmReplay(recorded)
    source = DcgmSource("gpu-c", "rack-1", reader=replay.reader, health=replay.health)
    source.open()
    (f,) = HealthRules().check([source.sample(ts).telemetry for ts in (10.0, 20.0, 30.0)])
    assert f.gpu is None and f.evidence["reason"] == "fabric_manager_down" and f.evidence["gpus"] == list(range(8))


@pytest.mark.parametrize("name", ["dcgm_h100_faults.json"])
def test_a_dcgm_node_without_fabric_fields_sends_no_fabric(name) -> None:
    replay = DcgmReplay(RECORDINGS / name)
    source = DcgmSource("n0011", "r01", reader=replay.reader, health=replay.health)
    source.open()
    assert all(source.sample(float(t)).telemetry.fabric is None for t in range(1, 4))
