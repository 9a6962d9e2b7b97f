"""The DCGM source against recorded DCGM reads.

These machines have neither a GPU nor a DCGM host engine: the tests replay recorded
``DcgmReader.GetAllGpuValuesAsFieldIdDictSinceLastCall()`` reads and ``health.Check()``
incidents (keyed by DCGM field id) through :class:`fleethealth.probe.recorded.DcgmReplay`, which
has the reader's and the health object's call surface.
"""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.errors import DeviceError
from fleethealth.probe.dcgm import WATCHED_FIELDS, DcgmSource, find_bindings
from fleethealth.probe.fields import FIELDS
from fleethealth.probe.recorded import DcgmReplay
from fleethealth.schema import ClockReason, EventKind


@pytest.fixture
def opened(recording) -> tuple[DcgmSource, DcgmReplay]:
    replay = DcgmReplay(recording("dcgm_h100_faults.json"))
    source = DcgmSource("n0011", "r01", reader=replay.reader, health=replay.health, model="NVIDIA H100 80GB HBM3")
    source.open()
    return source, replay


def test_field_ids_cover_the_issue_list() -> None:
    ids = set(WATCHED_FIELDS)
    for fid in (310, 311, 312, 313, 390, 391, 392, 393, 394, 395, 396, 230, 112, 409, 419, 429, 439, 202,
                237, 238, 235, 236, 155, 150, 140, 1523):
        assert fid in ids, fid
    assert {s.column for s in FIELDS if s.dcgm_id is None} == {"nvlink_links_up", "nvlink_links_max"}


def test_columns_and_fault_signatures(opened) -> None:
    source, replay = opened
    assert replay.watches == 0xFFFFFFFF  # health.Set(DCGM_HEALTH_WATCH_ALL)
    sample = source.sample(10.0)
    tel, c = sample.telemetry, sample.telemetry.columns
    assert tel.gpu.tolist() == [0, 1, 2, 3] and tel.uuid[1].startswith("GPU-7a2e9c51")
    assert ClockReason.HW_POWER_BRAKE in ClockReason(int(c["clock_reasons"][1]))
    assert c["sm_clock_mhz"][1] == 705.0 and c["power_w"][1] == pytest.approx(188.0)
    assert (c["pcie_gen"][2], c["pcie_gen_max"][2], c["pcie_width"][2], c["pcie_width_max"][2]) == (3, 5, 8, 16)
    assert c["remap_pending"].tolist() == [0, 0, 0, 1] and c["remap_correctable"][3] == 12.0
    assert c["remap_uncorrectable"][3] == 1.0 and c["ecc_dbe_aggregate"][3] == 1.0
    assert np.isnan(c["retired_sbe"]).all()           # blank values (no page retirement on Hopper)
    assert np.isnan(c["nvlink_links_up"]).all()       # DCGM has no per-GPU link-count field


def test_xid_recovery_action_and_health_incidents_become_events(opened) -> None:
    source, _ = opened
    first = source.sample(10.0).events
    xids = sorted((e.gpu, e.code) for e in first if e.kind is EventKind.XID)
    assert xids == [(3, 48), (3, 63)]  # every Xid value since the last read, not only the newest
    health = {(e.gpu, e.data["system"]): e for e in first if e.kind is EventKind.HEALTH_WATCH}
    assert health[(3, "recovery_action")].data["recovery_action"] == "gpu_reset"
    memory = health[(3, "memory")]
    assert memory.data["health"] == "fail" and "row remapping is pending" in memory.message
    assert health[(2, "pcie")].data["health"] == "warn" and health[(2, "pcie")].code == 5
    second = source.sample(11.0).events
    # the same incidents and the unchanged recovery action are not repeated; a new Xid 63 is
    assert [(e.kind, e.code) for e in second] == [(EventKind.XID, 63)]


def test_a_gpu_that_stops_answering_is_lost_once(opened) -> None:
    source, _ = opened
    kinds = []
    for t in range(1, 6):
        sample = source.sample(float(t))
        kinds.append([(e.kind, e.gpu) for e in sample.events if e.kind is EventKind.GPU_LOST])
    assert kinds == [[], [], [], [], [(EventKind.GPU_LOST, 3)]]
    assert np.isnan(sample.telemetry.columns["temp_c"][3]) and sample.telemetry.columns["temp_c"][0] == 42.0


def test_dcgm_sentinels_are_nan(recording) -> None:
    replay = DcgmReplay({"format": "fleethealth-dcgm-recording/1", "gpus": {"0": "GPU-x"},
                         "reads": [{}, {"0": {"150": [0x7FFFFFFFFFFFFFF0], "155": [140737488355328.0],
                                          "100": [0x7FFFFFFFFFFFFFF2], "101": [1593]}}]})
    source = DcgmSource("n0", "r0", reader=replay.reader, health=None)
    source.open()
    c = source.sample(1.0).telemetry.columns
    assert np.isnan([c["temp_c"][0], c["power_w"][0], c["sm_clock_mhz"][0]]).all() and c["mem_clock_mhz"][0] == 1593


def test_missing_bindings_is_one_clear_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DCGM_BINDINGS", str(tmp_path))
    with pytest.raises(DeviceError) as info:
        find_bindings()
    text = str(info.value)
    assert "\n" not in text and str(tmp_path) in text and "--source nvml" in text and "pydcgm" in text
    with pytest.raises(DeviceError, match="--source sim"):
        DcgmSource("n0", "r0").open()
