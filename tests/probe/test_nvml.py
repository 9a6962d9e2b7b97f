"""The NVML source against recorded NVML answers.

These machines have no GPU: every test here replays recorded field values through
:class:`fleethealth.probe.recorded.NvmlReplay`, which has pynvml's call surface and raises pynvml's
own ``NVMLError`` classes, so the adapter's unit conversions, error handling and fallbacks are the
real ones. ``bench/gpu_nvml.py`` (via ``bench/gpu_check.sh nvml``) runs the same source on a GPU.
"""

from __future__ import annotations

import math
import time

import numpy as np
import orjson
import pynvml
import pytest

from fleethealth.errors import DeviceError
from fleethealth.probe.nvml import NvmlSource
from fleethealth.probe.recorded import NvmlReplay
from fleethealth.probe.sources import StallGuard, create_source
from fleethealth.schema import ClockReason, EventKind, Telemetry, decode, encode


def _open(path, **kwargs) -> tuple[NvmlSource, NvmlReplay]:
    replay = NvmlReplay(path)
    source = NvmlSource("n0003", "r00", nvml=replay, **kwargs)
    source.open()
    return source, replay


def test_h100_columns_units_and_fault_signatures(recording) -> None:
    source, _ = _open(recording("nvml_h100_faults.json"), xid_events=False)
    tel = source.sample(1000.0).telemetry
    c = tel.columns
    assert tel.gpu.tolist() == [0, 1, 2, 3]
    assert tel.model == "NVIDIA H100 80GB HBM3" and tel.uuid[3].startswith("GPU-e09a4b6c")
    assert c["power_w"][0] == pytest.approx(312.45)          # mW -> W
    assert c["power_limit_w"].tolist() == [700.0] * 4
    assert c["mem_temp_c"].tolist() == [36.0, 40.0, 37.0, 39.0]  # NVML_FI_DEV_MEMORY_TEMP field value
    # GPU 1: the HW power brake bit (0x80) with HW slowdown, clocks pulled to 705 MHz
    reasons = ClockReason(int(c["clock_reasons"][1]))
    assert ClockReason.HW_POWER_BRAKE in reasons and ClockReason.HW_SLOWDOWN in reasons
    assert int(c["clock_reasons"][1]) & 0x80 and not int(c["clock_reasons"][0]) & 0x80
    assert c["sm_clock_mhz"][1] == 705.0 and c["sm_clock_max_mhz"][1] == 1980.0
    # GPU 2: PCIe downtrained to Gen3 x8 of Gen5 x16, with replays
    assert (c["pcie_gen"][2], c["pcie_gen_max"][2], c["pcie_width"][2], c["pcie_width_max"][2]) == (3, 5, 8, 16)
    assert c["pcie_replay"][2] == 1543.0
    downtrained = (c["pcie_gen"] < c["pcie_gen_max"]) | (c["pcie_width"] < c["pcie_width_max"])
    assert downtrained.tolist() == [False, False, True, False]
    # GPU 3: a row remap pending after an uncorrectable error; NVLink links down, counters summed
    assert c["remap_pending"].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert (c["remap_correctable"][3], c["remap_uncorrectable"][3], c["remap_failure"][3]) == (12.0, 1.0, 0.0)
    assert (c["ecc_sbe_volatile"][3], c["ecc_dbe_volatile"][3], c["ecc_sbe_aggregate"][3]) == (37.0, 1.0, 212.0)
    assert c["nvlink_links_up"].tolist() == [18.0, 18.0, 18.0, 16.0]
    assert c["nvlink_links_max"].tolist() == [18.0] * 4
    assert (c["nvlink_replay"][3], c["nvlink_recovery"][3], c["nvlink_crc_flit"][3], c["nvlink_crc_data"][3]) == (
        136.0, 19.0, 57.0, 4.0)
    # Hopper retires no pages: NOT_SUPPORTED becomes NaN, never an error
    assert np.isnan(c["retired_sbe"]).all() and np.isnan(c["retired_pending"]).all()
    # the sample is a valid wire message
    again = decode(Telemetry, encode(tel))
    assert again.columns["clock_reasons"][1] == 0x88 and math.isnan(again.columns["retired_dbe"][0])


def test_old_driver_falls_back_to_deprecated_calls_and_reads_retired_pages(recording) -> None:
    source, _ = _open(recording("nvml_v100_r470.json"), xid_events=False)
    c = source.sample(1.0).telemetry.columns
    assert c["temp_c"].tolist() == [52.0, 52.0]                   # nvmlDeviceGetTemperature fallback
    assert c["clock_reasons"].tolist() == [0x20, 0x20]            # ...ClocksThrottleReasons fallback
    assert c["retired_sbe"].tolist() == [0.0, 2.0] and c["retired_dbe"].tolist() == [0.0, 1.0]
    assert c["retired_pending"].tolist() == [0.0, 1.0]
    assert np.isnan(c["remap_pending"]).all() and np.isnan(c["mem_temp_c"]).all()
    assert c["nvlink_links_up"].tolist() == [6.0, 6.0]


def test_xid_arrives_through_the_event_set_thread(recording) -> None:
    source, replay = _open(recording("nvml_h100_faults.json"), xid_wait_ms=20)
    try:
        replay.add_xid(1, 79)
        deadline = time.monotonic() + 5
        xids = []
        while time.monotonic() < deadline and len(xids) < 2:
            xids += [e for e in source.sample(2.0).events if e.kind is EventKind.XID]
            time.sleep(0.02)
        assert sorted((e.gpu, e.code) for e in xids) == [(1, 79), (3, 48)]
        assert all(e.node == "n0003" and e.ts == 2.0 for e in xids)
    finally:
        source.close()


def test_gpu_off_the_bus_is_one_event_not_a_crash(recording) -> None:
    source, replay = _open(recording("nvml_h100_faults.json"), xid_events=False)
    source.sample(1.0)
    replay.lose_gpu(2)
    first = source.sample(2.0)
    lost = [e for e in first.events if e.kind is EventKind.GPU_LOST]
    assert [(e.gpu, e.data["uuid"][:12]) for e in lost] == [(2, "GPU-b83d1f07")]
    assert np.isnan(first.telemetry.columns["temp_c"][2]) and first.telemetry.columns["temp_c"][1] == 47.0
    second = source.sample(3.0)
    assert not [e for e in second.events if e.kind is EventKind.GPU_LOST]  # reported once
    assert second.telemetry.columns["power_w"][3] == pytest.approx(309.87)


def test_missing_nvml_library_is_one_clear_line() -> None:
    """The real pynvml on this GPU-less machine: libnvidia-ml.so.1 is absent."""
    source = create_source("nvml", node="n0", rack="r0")
    with pytest.raises(DeviceError) as info:
        source.open()
    text = str(info.value)
    assert "\n" not in text and "libnvidia-ml.so.1" in text and "--source dcgm" in text and "--source sim" in text


def test_driver_not_loaded_is_named(recording) -> None:
    replay = NvmlReplay(recording("nvml_h100_faults.json"))
    replay.fail_init(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(DeviceError, match="kernel driver is not loaded"):
        NvmlSource("n0", "r0", nvml=replay).open()


def test_a_wedged_driver_call_becomes_telemetry_stalled_and_sampling_resumes(recording) -> None:
    source, replay = _open(recording("nvml_h100_faults.json"), xid_events=False)
    guard = StallGuard(source, node="n0003", timeout_s=0.2)
    try:
        assert guard.sample(1.0).sample is not None
        replay.block("nvmlDeviceGetPowerUsage")
        stalled = guard.sample(2.0)
        assert stalled.sample is None and stalled.error is None
        assert [e.kind for e in stalled.events] == [EventKind.TELEMETRY_STALLED]
        assert stalled.events[0].data == {"source": "nvml", "timeout_s": 0.2} and guard.stalled
        again = guard.sample(3.0)  # still wedged: no second event, returns at once
        assert again.sample is None and again.events == ()
        assert guard.stalls_total == 1
        replay.release()
        deadline = time.monotonic() + 5
        while guard.stalled and time.monotonic() < deadline:
            time.sleep(0.01)
        resumed = guard.sample(4.0)
        assert resumed.sample is not None and resumed.sample.telemetry.ts == 4.0 and not guard.stalled
    finally:
        replay.release()
        guard.close()


def test_recorder_writes_a_recording_that_replays_the_same_sample(recording, tmp_path) -> None:
    """bench/gpu_nvml.py --record wraps the real pynvml; here it wraps a replay of a recording."""
    from fleethealth.probe.recorded import NvmlRecorder

    original = NvmlReplay(recording("nvml_v100_r470.json"))
    recorder = NvmlRecorder(original, note="round trip")
    source = NvmlSource("n0", "r0", nvml=recorder, xid_events=False)
    source.open()
    first = source.sample(1.0).telemetry
    recorder.dump(tmp_path / "rec.json")
    again = NvmlSource("n0", "r0", nvml=NvmlReplay(tmp_path / "rec.json"), xid_events=False)
    again.open()
    second = again.sample(1.0).telemetry
    for name, col in first.columns.items():
        np.testing.assert_array_equal(col, second.columns[name], err_msg=name)
    assert second.uuid == first.uuid


def _collect(source: NvmlSource, until, timeout_s: float = 5.0) -> list:
    """Sample until ``until(events)`` holds (the Xid thread runs on its own) or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    events: list = []
    while time.monotonic() < deadline and not until(events):
        events += source.sample(2.0).events
        time.sleep(0.01)
    return events


def test_a_gpu_lost_before_start_is_reported_not_a_failed_start(recording) -> None:
    """GPU 2 already off the bus: enumerating it answers GPU_IS_LOST; the other three are sampled,
    one gpu_lost event goes out with the first sample, and Xid events still arrive for the rest."""
    replay = NvmlReplay(recording("nvml_h100_faults.json"))
    replay.lose_gpu(2)
    source = NvmlSource("n0003", "r00", nvml=replay, xid_wait_ms=20)
    source.open()
    try:
        first = source.sample(1.0)
        lost = [e for e in first.events if e.kind is EventKind.GPU_LOST]
        assert [(e.gpu, e.ts, e.node) for e in lost] == [(2, 1.0, "n0003")] and "GPU is lost" in lost[0].message
        tel = first.telemetry
        assert tel.gpu.tolist() == [0, 1, 2, 3] and tel.uuid[2] == "" and tel.uuid[3].startswith("GPU-e09a4b6c")
        assert np.isnan(tel.columns["temp_c"][2]) and tel.columns["temp_c"][1] == 47.0
        assert tel.model == "NVIDIA H100 80GB HBM3"
        replay.add_xid(1, 79)
        events = list(first.events)
        events += _collect(source, lambda ev: len([e for e in events + ev if e.kind is EventKind.XID]) >= 2)
        assert sorted((e.gpu, e.code) for e in events if e.kind is EventKind.XID) == [(1, 79), (3, 48)]
        assert len([e for e in events if e.kind is EventKind.GPU_LOST]) == 1
        assert not [e for e in events if e.kind is EventKind.PROBE_ERROR]
    finally:
        source.close()


def test_a_gpu_that_cannot_be_registered_for_xid_leaves_the_others_watched(recording) -> None:
    replay = NvmlReplay(recording("nvml_h100_faults.json"))
    replay.fail_register(0, pynvml.NVML_ERROR_UNKNOWN)
    source = NvmlSource("n0003", "r00", nvml=replay, xid_wait_ms=20)
    source.open()
    try:
        replay.add_xid(1, 79)
        events = _collect(source, lambda ev: len([e for e in ev if e.kind is EventKind.XID]) >= 2)
        assert sorted((e.gpu, e.code) for e in events if e.kind is EventKind.XID) == [(1, 79), (3, 48)]
        (error,) = [e for e in events if e.kind is EventKind.PROBE_ERROR]
        assert error.gpu == 0 and "cannot watch GPU 0" in error.message and error.data["source"] == "nvml"
        assert error.ts == 2.0
    finally:
        source.close()


def test_an_event_set_wait_error_is_reported_once_and_the_xid_thread_keeps_going(recording) -> None:
    """nvmlEventSetWait_v2 answers GPU_IS_LOST three times in a row: one probe_error event, a
    backoff, and the Xid events queued behind the errors still arrive."""
    replay = NvmlReplay(recording("nvml_h100_faults.json"))
    replay.fail_wait(pynvml.NVML_ERROR_GPU_IS_LOST, times=3)
    source = NvmlSource("n0003", "r00", nvml=replay, xid_wait_ms=10, xid_backoff_max_s=0.05)
    source.open()
    try:
        replay.add_xid(2, 94)
        events = _collect(source, lambda ev: len([e for e in ev if e.kind is EventKind.XID]) >= 2)
        assert sorted((e.gpu, e.code) for e in events if e.kind is EventKind.XID) == [(2, 94), (3, 48)]
        errors = [e for e in events if e.kind is EventKind.PROBE_ERROR]
        assert len(errors) == 1 and "waiting for Xid events failed" in errors[0].message
        assert source.xid_thread_error is not None and replay.waits >= 5
    finally:
        source.close()
    assert source._xid_thread is not None and not source._xid_thread.is_alive()


def test_pci_bus_ids_label_the_gpus_and_their_absence_is_no_failure(recording) -> None:
    """The recording lacks nvmlDeviceGetPciInfo (NOT_SUPPORTED): the sample has no bus ids; with
    answers for it (added to a copy of the recording) each GPU carries its own."""
    source, _ = _open(recording("nvml_h100_faults.json"), xid_events=False)
    assert source.sample(1.0).telemetry.pci_bus_id == ()
    data = orjson.loads(recording("nvml_h100_faults.json").read_bytes())
    for i, device in enumerate(data["devices"]):
        device["nvmlDeviceGetPciInfo"] = {"": {"busId": f"00000000:{0x18 + i:02X}:00.0"}}
    source, _ = _open(data, xid_events=False)
    assert source.sample(1.0).telemetry.pci_bus_id == tuple(f"00000000:{0x18 + i:02X}:00.0" for i in range(4))


# ------------------------------------------------------------------ the NVML cost of a sample
MAX_CALLS_PER_GPU = 10


def _calls_per_gpu(source: NvmlSource, replay: NvmlReplay, ts: float) -> float:
    before = replay.calls
    source.sample(ts)
    return (replay.calls - before) / source.gpu_count


@pytest.mark.parametrize("name", ["nvml_h100_faults.json", "nvml_v100_r470.json"])
def test_a_sample_costs_at_most_ten_nvml_calls_per_gpu(recording, name) -> None:
    """One field batch per GPU plus the calls no field covers; statics were read at open. Before
    the batch the H100 node took 114 calls per GPU per sample (18 NVLink links x 5 calls)."""
    source, replay = _open(recording(name), xid_events=False)
    first = _calls_per_gpu(source, replay, 1.0)
    replay.calls_by_name.clear()
    steady = _calls_per_gpu(source, replay, 2.0)
    assert first <= MAX_CALLS_PER_GPU and steady <= MAX_CALLS_PER_GPU
    assert replay.calls_by_name["nvmlDeviceGetFieldValues"] == source.gpu_count  # one batch per GPU
    assert not {n for n in replay.calls_by_name if "NvLink" in n or "Ecc" in n or "Retired" in n or "Remapped" in n}


def test_an_unsupported_field_is_nan_and_logged_once_the_rest_published(recording, caplog) -> None:
    """Hopper answers NOT_SUPPORTED for the retired-page fields; a value failing otherwise (here
    the uncorrectable-remap field of GPU 3 answering UNKNOWN) is NaN too, with one warning."""
    data = orjson.loads(recording("nvml_h100_faults.json").read_bytes())
    data["devices"][3]["nvmlDeviceGetFieldValues"][str(pynvml.NVML_FI_DEV_REMAPPED_UNC)] = {
        "error": "NVML_ERROR_UNKNOWN"}
    source, _ = _open(data, xid_events=False)
    with caplog.at_level("INFO", logger="fleethealth.probe.nvml"):
        first = source.sample(1.0)
        second = source.sample(2.0)
    for sample in (first, second):
        c = sample.telemetry.columns
        assert np.isnan(c["retired_sbe"]).all() and np.isnan(c["retired_dbe"]).all()
        assert np.isnan(c["remap_uncorrectable"][3]) and c["remap_uncorrectable"][:3].tolist() == [0.0] * 3
        assert c["remap_pending"][3] == 1.0 and c["remap_correctable"][3] == 12.0   # the rest of the batch
        assert c["power_w"][3] == pytest.approx(309.87) and not sample.events
    logged = [r.getMessage() for r in caplog.records]
    assert sum("GPU 3" in m and "remap_uncorrectable" in m for m in logged) == 1
    assert sum("GPU 0" in m and "retired_sbe" in m and "NOT_SUPPORTED" in m for m in logged) == 1
    assert source.missing[(3, "remap_uncorrectable")] == "NVML_ERROR_UNKNOWN"
    assert source.missing[(0, "retired_pending")] == "NVML_ERROR_NOT_SUPPORTED"


def test_a_driver_without_the_newer_fields_falls_back_to_their_calls(recording) -> None:
    """A driver older than the NVLink state and power-limit fields answers INVALID_ARGUMENT for
    them: the per-link state calls and nvmlDeviceGetEnforcedPowerLimit take over, same values."""
    replay = NvmlReplay(recording("nvml_h100_faults.json"))
    replay.unknown_fields(pynvml.NVML_FI_DEV_NVLINK_GET_STATE, pynvml.NVML_FI_DEV_POWER_CURRENT_LIMIT)
    source = NvmlSource("n0003", "r00", nvml=replay, xid_events=False)
    source.open()
    for ts in (1.0, 2.0):
        c = source.sample(ts).telemetry.columns
        assert c["nvlink_links_up"].tolist() == [18.0, 18.0, 18.0, 16.0]
        assert c["nvlink_links_max"].tolist() == [18.0] * 4 and c["nvlink_replay"][3] == 136.0
        assert c["power_limit_w"].tolist() == [700.0] * 4
    assert replay.calls_by_name["nvmlDeviceGetEnforcedPowerLimit"] == 8  # by call from the first sample on


def test_a_value_answering_gpu_lost_marks_the_gpu_lost(recording) -> None:
    data = orjson.loads(recording("nvml_h100_faults.json").read_bytes())
    data["devices"][1]["nvmlDeviceGetFieldValues"][str(pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL)] = {
        "error": "NVML_ERROR_GPU_IS_LOST"}
    source, _ = _open(data, xid_events=False)
    sample = source.sample(1.0)
    assert [(e.kind, e.gpu) for e in sample.events] == [(EventKind.GPU_LOST, 1)]
    c = sample.telemetry.columns
    assert np.isnan(c["temp_c"][1]) and not np.isnan(c["temp_c"][[0, 2, 3]]).any()
    assert not source.sample(2.0).events


def test_a_failed_batch_leaves_its_columns_nan_and_the_calls_still_answer(recording, caplog) -> None:
    class NoFieldValues(NvmlReplay):
        def nvmlDeviceGetFieldValues(self, handle, fields):  # noqa: N802 - NVML's name
            self.calls += 1
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    replay = NoFieldValues(recording("nvml_h100_faults.json"))
    source = NvmlSource("n0003", "r00", nvml=replay, xid_events=False)
    source.open()
    with caplog.at_level("WARNING", logger="fleethealth.probe.nvml"):
        c = source.sample(1.0).telemetry.columns
        source.sample(2.0)
    assert np.isnan(c["ecc_dbe_volatile"]).all() and np.isnan(c["remap_pending"]).all()
    assert c["temp_c"][1] == 47.0 and c["power_limit_w"].tolist() == [700.0] * 4  # the call fallback
    assert sum("nvmlDeviceGetFieldValues" in r.getMessage() and "GPU 0" in r.getMessage()
               for r in caplog.records) == 1


def test_the_gpu_check_script_runs_on_a_recording_and_counts_its_calls(recording) -> None:
    """bench/gpu_nvml.py takes the same path on a GPU; --replay keeps it runnable here."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_nvml.py"
    done = subprocess.run([sys.executable, str(script), "--replay", str(recording("nvml_h100_faults.json")),
                           "--samples", "2", "--interval", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = orjson.loads(done.stdout)
    assert report["gpus"] == 4 and report["nvml_calls_per_gpu_per_sample"] <= MAX_CALLS_PER_GPU
    assert report["missing"]["0:retired_sbe"] == "NVML_ERROR_NOT_SUPPORTED"
    assert report["per_gpu"][3]["remap_pending"] == 1.0
