"""The simulator source: every fault kind leaves its signature in the node's telemetry and events.

These assertions read the telemetry (and the events and step batches the source hands on), never
a detector's output: the detectors are tested on their own against the same signatures.
"""

from __future__ import annotations

from importlib import resources

import numpy as np
import pytest

from fleethealth.errors import ConfigError
from fleethealth.probe.simsource import SimSource
from fleethealth.probe.sources import create_source
from fleethealth.schema import ClockReason, EventKind
from fleethealth.sim import FleetSim, Scenario

_SCENARIO = {
    "seed": 11,
    "fleet": {"racks": 2, "nodes_per_rack": 2, "gpus_per_node": 4},
    "job": {"id": "sig-1", "steps": 60, "step_time_s": 1.0, "jitter": 0.02},
    "checks": {"selfcheck_every": 10, "replay_every": 25, "checkpoint_every": 25},
    "faults": [
        {"kind": "nvlink_degraded", "node": "n0000", "start_step": 15, "slowdown": 0.15},
        {"kind": "thermal_straggler", "node": "n0001", "gpu": 2, "start_step": 10, "slowdown": 0.2},
        {"kind": "hang", "node": "n0001", "step": 40, "duration_s": 5.0, "restart_s": 5.0},
        {"kind": "hot_aisle", "rack": "r01", "start_step": 20, "temp_rise_c": 15, "slowdown": 0.1},
        {"kind": "ecc_precursor", "node": "n0002", "gpu": 1, "start_step": 5, "fail_step": 45},
        {"kind": "nic_contention", "node": "n0003", "start_step": 25, "slowdown": 0.1},
        {"kind": "xid", "node": "n0003", "gpu": 0, "step": 30, "code": 79},
        {"kind": "sdc_transient", "node": "n0000", "gpu": 3, "start_step": 31},
        {"kind": "sdc_deterministic", "node": "n0002", "gpu": 2, "start_step": 15},
    ],
}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, list]]:
    """Each node's whole run through its own SimSource: telemetry, events and batches in order."""
    sim = FleetSim(Scenario.from_obj(_SCENARIO))
    moments = sum(1 for _ in sim.run())
    out = {}
    for node in sim.node_names:
        source = SimSource(node, sim=sim)
        source.open()
        samples = [source.sample(0.0) for _ in range(moments)]
        out[node] = {"tel": [s.telemetry for s in samples], "events": [e for s in samples for e in s.events],
                     "batches": [b for s in samples for b in s.batches]}
    return out


def _col(run: dict, name: str) -> np.ndarray:
    """(moments, gpus) array of one column over the run."""
    return np.stack([t.columns[name] for t in run["tel"]])


def _step_rows(run: dict) -> dict[int, int]:
    """step -> row of the telemetry sampled with that step's batch (stall ticks have no batch)."""
    ts_rows = {t.ts: i for i, t in enumerate(run["tel"])}
    return {b.step: ts_rows[b.ts] for b in run["batches"]}


def test_thermal_straggler_one_hot_throttled_gpu(runs) -> None:
    run = runs["n0001"]
    rows = _step_rows(run)
    temp, reasons = _col(run, "temp_c"), _col(run, "clock_reasons").astype(int)
    before, after = rows[5], rows[30]
    assert temp[after, 2] - temp[before, 2] > 20 and abs(temp[after, 0] - temp[before, 0]) < 4
    assert reasons[after, 2] & int(ClockReason.thermal()) and not reasons[before, 2] & int(ClockReason.thermal())
    assert _col(run, "sm_clock_mhz")[after, 2] < _col(run, "sm_clock_max_mhz")[after, 2]


def test_hot_aisle_whole_rack_warmer_other_rack_not(runs) -> None:
    rise = {}
    for node in ("n0000", "n0001", "n0002", "n0003"):
        run = runs[node]
        rows = _step_rows(run)
        temp = _col(run, "temp_c")
        rise[node] = float(np.median(temp[rows[35]] - temp[rows[15]]))
    assert rise["n0002"] > 12 and rise["n0003"] > 12      # rack r01
    assert abs(rise["n0000"]) < 3                          # rack r00
    run = runs["n0003"]
    assert (_col(run, "clock_reasons").astype(int)[_step_rows(run)[35]] & int(ClockReason.SW_THERMAL)).all()


def test_nvlink_degraded_links_down_and_counters_climbing(runs) -> None:
    run = runs["n0000"]
    rows = _step_rows(run)
    up, flit, replay = _col(run, "nvlink_links_up"), _col(run, "nvlink_crc_flit"), _col(run, "nvlink_replay")
    assert (up[rows[10]] == _col(run, "nvlink_links_max")[rows[10]]).all()
    assert (up[rows[20]] < 18).all()
    assert (np.diff(flit[rows[16]:rows[30]], axis=0) >= 0).all() and (flit[rows[30]] > flit[rows[16]]).all()
    assert (replay[rows[30]] > replay[rows[16]]).all()


def test_nic_contention_shared_utilisation_high(runs) -> None:
    run = runs["n0003"]
    rows = _step_rows(run)
    assert run["tel"][rows[10]].nic_util < 0.6 and run["tel"][rows[30]].nic_util > 0.9


def test_ecc_precursor_rising_errors_remaps_then_uncorrectable_and_xids(runs) -> None:
    run = runs["n0002"]
    rows = _step_rows(run)
    sbe, pending = _col(run, "ecc_sbe_volatile")[:, 1], _col(run, "remap_pending")[:, 1]
    dbe, remap = _col(run, "ecc_dbe_volatile")[:, 1], _col(run, "remap_correctable")[:, 1]
    assert sbe[rows[10]] < sbe[rows[30]] < sbe[rows[44]] and (np.diff(sbe[rows[5]:rows[44]]) >= 0).all()
    assert remap[rows[44]] > remap[rows[10]] and _col(run, "remap_uncorrectable")[rows[44], 1] > 0
    # the simulated H100 retires no pages: NVML answers NOT_SUPPORTED, so every sample has NaN there
    for name in ("retired_sbe", "retired_dbe", "retired_pending"):
        assert np.isnan(_col(run, name)).all(), name
    assert run["tel"][0].model == "NVIDIA H100 80GB HBM3"
    assert pending[rows[10]] == 0 and pending[rows[40]] == 1
    assert dbe[rows[30]] == 0 and dbe[rows[44]] > 0
    assert sbe[rows[44]] > 0 and _col(run, "ecc_sbe_volatile")[rows[44], 0] < sbe[rows[44]] / 10  # only that GPU
    xids = [(e.gpu, e.code) for e in run["events"] if e.kind is EventKind.XID]
    assert xids == [(1, 63), (1, 48), (1, 64), (1, 79)]
    assert 45 not in {b.step for b in run["batches"] if 1 in b.gpus.tolist()}  # the failed GPU stops reporting


def test_hang_the_nodes_ranks_stop_reporting_telemetry_continues(runs) -> None:
    run = runs["n0001"]
    steps = {b.step for b in run["batches"]}
    assert 40 not in steps and {39, 41} <= steps
    assert len(run["tel"]) > len(run["batches"])  # ticks while the job stands still
    assert any(e.kind is EventKind.HANG_REPORT for e in run["events"])


def test_xid_and_sdc_records(runs) -> None:
    assert [(e.gpu, e.code, e.step) for e in runs["n0003"]["events"] if e.kind is EventKind.XID] == [(0, 79, 30)]
    failed = {(node, e.gpu, e.data["check"]) for node, run in runs.items() for e in run["events"]
              if e.kind is EventKind.SDC_CHECK and not e.data["passed"]}
    assert failed == {("n0000", 3, "selfcheck"), ("n0002", 2, "replay")}
    # the deterministic fault computes the same wrong answer twice: its self-checks pass
    selfchecks = [e for e in runs["n0002"]["events"] if e.kind is EventKind.SDC_CHECK and e.gpu == 2
                  and e.data["check"] == "selfcheck"]
    assert selfchecks and all(e.data["passed"] for e in selfchecks)


def test_healthy_telemetry_is_quiet_but_not_frozen(runs) -> None:
    run = runs["n0001"]
    temp = _col(run, "temp_c")[:, 0]
    assert 55 < np.median(temp) < 80 and temp.std() > 0.05  # noise, no fault on GPU 0 of n0001 before the aisle
    assert np.all(_col(run, "ecc_dbe_volatile") == 0)


def test_event_time_continues_when_the_job_restarts() -> None:
    sim = FleetSim(Scenario.from_obj({**_SCENARIO, "faults": [], "job": {**_SCENARIO["job"], "steps": 5}}))
    source = create_source("sim", node="n0002", rack="r01", sim=sim)
    source.open()
    ts = [source.sample(0.0).telemetry.ts for _ in range(12)]
    assert all(b > a for a, b in zip(ts, ts[1:], strict=False))


def test_unknown_node_or_wrong_rack_is_a_config_error() -> None:
    sim = FleetSim(Scenario.from_obj(_SCENARIO))
    with pytest.raises(ConfigError, match="not in the simulated fleet"):
        SimSource("n9999", sim=sim)
    with pytest.raises(ConfigError, match="rack r01"):
        SimSource("n0002", "r00", sim=sim)


def test_a_volta_fleet_retires_pages_and_remaps_no_rows() -> None:
    """fleet.gpu_model picks what the GPUs report: a V100's precursor retires pages (one pending
    retirement) and its row-remap fields are NaN, faults or not."""
    scenario = Scenario.from_obj({**_SCENARIO, "fleet": {**_SCENARIO["fleet"], "gpu_model": "V100"}})
    sim = FleetSim(scenario)
    source = SimSource("n0002", sim=sim)
    source.open()
    tel = [source.sample(0.0).telemetry for _ in range(50)]
    retired = np.stack([t.columns["retired_sbe"] for t in tel])[:, 1]
    assert retired[45] > retired[5] and np.stack([t.columns["retired_pending"] for t in tel])[45, 1] == 1.0
    for name in ("remap_correctable", "remap_uncorrectable", "remap_pending", "remap_failure"):
        assert np.isnan(np.stack([t.columns[name] for t in tel])).all(), name
    assert tel[0].model.startswith("Tesla V100")
    with pytest.raises(ConfigError, match="gpu_model"):
        Scenario.from_obj({**_SCENARIO, "fleet": {**_SCENARIO["fleet"], "gpu_model": "K80"}})


def test_a_jobs_scenario_gives_each_node_its_own_jobs_steps_and_idle_nodes_telemetry_only() -> None:
    with resources.as_file(resources.files("fleethealth.scenarios") / "multi_job.yaml") as path:
        sim = FleetSim(Scenario.load(path))
    jobs = {}
    for node in ("n0000", "n0030", "n0063"):  # in pretrain-a, in finetune-b, idle
        source = SimSource(node, sim=sim)
        source.open()
        samples = [source.sample(0.0) for _ in range(120)]
        assert all(s.telemetry.node == node for s in samples)
        ts = [s.telemetry.ts for s in samples]
        assert all(b > a for a, b in zip(ts, ts[1:], strict=False))
        jobs[node] = {b.job for s in samples for b in s.batches}
    assert jobs == {"n0000": {"pretrain-a"}, "n0030": {"finetune-b"}, "n0063": set()}
