"""The DCGM source against recorded DCGM reads.

These machines have neither a GPU nor a DCGM host engine: the tests replay recorded
``DcgmReader.GetAllGpuValuesAsFieldIdDictSinceLastCall()`` reads and ``health.Check()``
incidents (keyed by DCGM field id) through :class:`fleethealth.probe.recorded.DcgmReplay`, which
has the reader's and the health object's call surface. Field metadata of DCGM 3.3, 4.4 and 4.6
comes from fixtures written from DCGM's ``dcgm_fields.h`` / ``dcgm_fields.cpp`` at those releases;
the connect and watch errors are driven through stand-in binding modules with DCGM's call surface.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from fleethealth.errors import DeviceError
from fleethealth.probe.dcgm import WATCHED_FIELDS, DcgmSource, find_bindings, parse_version, select_fields
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


# ---------------------------------------------------------------- DCGM 3.3 to 4.6
FIXTURES = Path(__file__).parent / "fixtures"


def _meta(release: str):
    """``DcgmFieldGetById`` of a DCGM release, from metadata written out of its dcgm_fields.h and
    dcgm_fields.cpp (``fixtures/dcgm_fields_<release>.json``; see fixtures/README.md)."""
    recorded = json.loads((FIXTURES / f"dcgm_fields_{release}.json").read_text())
    fields = {int(k): v for k, v in recorded["fields"].items()}

    def lookup(fid: int):
        f = fields.get(fid)
        return None if f is None else SimpleNamespace(fieldId=fid, fieldType=f["type"].encode(), size=f["size"],
                                                       tag=f["name"].encode())

    return lookup, recorded["version"]


@pytest.mark.parametrize(("release", "missing"), [("3.3", {1523, 170, 171, 172, 173, 174}), ("4.4", {1523}),
                                                   ("4.6", set())])
def test_only_fields_the_running_dcgm_knows_are_watched(release, missing) -> None:
    lookup, version = _meta(release)
    chosen = select_fields(WATCHED_FIELDS, lookup, parse_version(version))
    assert set(chosen.unknown) == missing and set(chosen.watch) == set(WATCHED_FIELDS) - missing
    if missing:
        assert chosen.unknown[1523] == f"DCGM {version} has no field 1523 (added in DCGM 4.5.0)"
    # every integer field of DCGM is 64-bit, so the 64-bit blank applies to all of them
    assert set(chosen.widths.values()) == {64}
    assert 155 not in chosen.widths  # a double field: the FP64 blank


def test_an_engine_older_than_the_library_is_judged_by_its_version() -> None:
    lookup, _ = _meta("4.6")  # the local library knows 1523, the host engine is 4.4.1
    chosen = select_fields(WATCHED_FIELDS, lookup, parse_version("version:4.4.1;arch:x86_64"))
    assert chosen.unknown == {1523: "DCGM 4.4.1 predates field 1523 (added in DCGM 4.5.0)",
                              174: "DCGM 4.4.1 predates field 174 (added in DCGM 4.4.2)"}


def test_unknown_field_is_one_warning_and_the_sample_still_published(recording, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="fleethealth.probe.dcgm")
    lookup, version = _meta("4.4")
    replay = DcgmReplay(recording("dcgm_h100_faults.json"))
    source = DcgmSource("n0011", "r01", reader=replay.reader, health=replay.health, field_meta=lookup,
                        version=version)
    source.open()
    sample = source.sample(10.0)
    source.sample(11.0)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "field 1523" in warnings[0] and "4.4.2" in warnings[0]
    assert sample.telemetry.columns["temp_c"][0] == 41.0


def test_blank_sentinels_follow_the_value_width() -> None:
    big = 0x7FFFFFF5  # a real 64-bit counter value inside the 32-bit blank range
    replay = DcgmReplay({"format": "fleethealth-dcgm-recording/1", "gpus": {"0": "GPU-x"},
                         "reads": [{}, {"0": {"202": [big], "156": [big], "310": [0x7FFFFFFFFFFFFFF3]}}]})
    meta = {202: SimpleNamespace(fieldType=b"i", size=8), 156: SimpleNamespace(fieldType=b"i", size=4),
            310: SimpleNamespace(fieldType=b"i", size=8)}
    source = DcgmSource("n0", "r0", reader=replay.reader, health=None, field_meta=lambda f: meta.get(f, meta[202]))
    source.open()
    c = source.sample(1.0).telemetry.columns
    assert c["pcie_replay"][0] == big                  # 64-bit: not a blank
    assert np.isnan(c["energy_mj"][0])                 # declared 32-bit: DCGM_INT32_BLANK + 5
    assert np.isnan(c["ecc_sbe_volatile"][0])          # DCGM_INT64_NOT_PERMISSIONED


_FAKE_BINDINGS = '''
class DCGMError(Exception):
    pass

def _dcgmInit(libDcgmPath=None):
    if MODE == "nolib":
        raise DCGMError("libdcgm.so: cannot open shared object file")
'''
_FAKE_READER = '''
import dcgm_structs

class _Group:
    health = None

class _Ids:
    driverVersion = b"550.54.15"

class _Attrs:
    identifiers = _Ids()

class _Discovery:
    def GetGpuAttributes(self, gpu):
        return _Attrs()

class _System:
    discovery = _Discovery()

class DcgmReader:
    """Stands in for DCGM's DcgmReader: MODE picks what the host engine does."""
    def __init__(self, hostname, fieldIds, updateFrequency, fieldGroupName):
        self.hostname, self.fieldIds = hostname, list(fieldIds)
        self.m_dcgmHandle = None
        self.m_dcgmGroup = _Group()
        self.m_gpuIdToUUId = {0: "GPU-x"}
        self.m_gpuIdToBusId = {0: "00000000:18:00.0"}
        self.m_dcgmSystem = _System()
    def Init(self):
        if dcgm_structs.MODE == "down":
            return  # DcgmReader logs and stays disconnected
        self.m_dcgmHandle = object()
        if dcgm_structs.MODE == "old-engine" and 1523 in self.fieldIds:
            raise dcgm_structs.DCGMError("Bad parameter passed to function")
        if dcgm_structs.MODE == "refuse":
            raise dcgm_structs.DCGMError("Insufficient permissions")
    def GetAllGpuValuesAsFieldIdDictSinceLastCall(self):
        return {}
    def Shutdown(self):
        pass
'''


@pytest.fixture
def fake_bindings(tmp_path, monkeypatch):
    """A directory with modules of the DCGM bindings' call surface (no DCGM here), on DCGM_BINDINGS."""
    (tmp_path / "pydcgm.py").write_text("")
    (tmp_path / "dcgm_fields.py").write_text("def DcgmFieldGetById(fid):\n    return object()\n")
    (tmp_path / "dcgm_agent.py").write_text(
        "class _V:\n    rawBuildInfoString = 'version:4.6.0;arch:x86_64'\n"
        "def dcgmVersionInfo():\n    return _V()\n")
    (tmp_path / "DcgmReader.py").write_text(_FAKE_READER)
    monkeypatch.setenv("DCGM_BINDINGS", str(tmp_path))
    for name in ("pydcgm", "dcgm_fields", "dcgm_agent", "dcgm_structs", "DcgmReader"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))

    def mode(name: str) -> None:
        (tmp_path / "dcgm_structs.py").write_text(f"MODE = {name!r}\n" + _FAKE_BINDINGS)

    yield mode
    for name in ("pydcgm", "dcgm_fields", "dcgm_agent", "dcgm_structs", "DcgmReader"):
        sys.modules.pop(name, None)


def test_errors_say_what_failed(fake_bindings, caplog) -> None:
    fake_bindings("nolib")
    with pytest.raises(DeviceError, match="cannot load libdcgm.so"):
        DcgmSource("n0", "r0").open()
    for name in ("dcgm_structs", "DcgmReader"):
        sys.modules.pop(name, None)
    fake_bindings("down")
    with pytest.raises(DeviceError, match="not reachable at nvidia-dcgm:5555") as down:
        DcgmSource("n0", "r0", hostname="nvidia-dcgm:5555").open()
    assert "FLEETHEALTH_DCGM_HOST" in str(down.value) and "libdcgm" not in str(down.value)
    for name in ("dcgm_structs", "DcgmReader"):
        sys.modules.pop(name, None)
    fake_bindings("refuse")
    with pytest.raises(DeviceError, match="refused to watch fields") as refused:
        DcgmSource("n0", "r0").open()
    assert "Insufficient permissions" in str(refused.value) and "libdcgm" not in str(refused.value)


def test_an_older_engine_refusing_new_fields_is_retried_without_them(fake_bindings, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="fleethealth.probe.dcgm")
    fake_bindings("old-engine")
    source = DcgmSource("n0", "r0", hostname="nvidia-dcgm:5555")
    source.open()
    assert 1523 not in source.selection.watch and 1523 in source.selection.unknown
    assert any("retrying without fields 1523" in r.getMessage() for r in caplog.records)
    # the labels dcgm-exporter's compatibility mode needs come from DCGM's GPU attributes
    assert source.driver_version == "550.54.15"
    assert source.sample(1.0).telemetry.pci_bus_id == ("00000000:18:00.0",)
