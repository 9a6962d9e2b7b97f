"""Telemetry health rules: each rule fires on its signal, flapping input yields
one episode, escalation re-reports, healthy simulator telemetry yields nothing."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.detectors.health import HealthRules
from fleethealth.errors import ConfigError
from fleethealth.schema import ClockReason, Event, EventKind, FindingKind, Telemetry


def _t(ts, node="n0001", **cols):
    base = {"ecc_dbe_volatile": 0.0, "remap_failure": 0.0, "remap_pending": 0.0, "retired_pending": 0.0,
            "retired_sbe": 2.0, "retired_dbe": 0.0, "clock_reasons": 0.0, "pcie_gen": 5.0, "pcie_gen_max": 5.0,
            "pcie_width": 16.0, "pcie_width_max": 16.0, "util_pct": 97.0, "ecc_sbe_volatile": 0.0}
    full = {k: np.full(4, v) for k, v in base.items()}
    for name, (gpu, value) in cols.items():
        full.setdefault(name, np.zeros(4))[gpu] = value
    return Telemetry.from_columns(node, "r00", ts, np.arange(4), **full)


def _xid(code, ts, node="n0003", gpu=2, **data):
    return Event(node=node, ts=ts, kind=EventKind.XID, job="train-1", gpu=gpu, step=7, code=code, data=data)


def test_xid_storm_is_one_finding_per_code_and_gpu():
    rules = HealthRules(clear_after_s=600.0)
    storm = [_xid(74, 100.0 + 0.1 * i) for i in range(500)] + [_xid(74, 100.0, gpu=3), _xid(79, 150.0)]
    found = rules.check([], storm)
    assert [(f.kind, f.gpu, f.evidence["code"]) for f in found] == [
        (FindingKind.XID, 2, 74), (FindingKind.XID, 3, 74), (FindingKind.XID, 2, 79)]
    f = found[0]
    assert f.evidence["severity"] == "critical" and f.evidence["action"] == "drain" and f.job == "train-1"
    assert f.step == 7 and f.detector == "health.xid"
    assert rules.suppressed_total_ == 499
    # quiet for longer than clear_after_s: a new episode
    assert len(rules.check([], [_xid(74, 100.0 + 50.0 + 601.0)])) == 1


def test_info_xids_are_counted_not_reported_and_reported_severity_can_raise_it():
    rules = HealthRules()
    assert rules.check([], [_xid(45, 1.0), _xid(56, 2.0)]) == []
    assert rules.xid_below_min_total_ == 2
    (f,) = rules.check([], [_xid(13, 3.0, severity="critical")])
    assert f.evidence["severity"] == "critical"
    assert rules.check([], [Event(node="n1", ts=4.0, kind=EventKind.XID)]) == []
    assert rules.invalid_events_total_ == 1


def test_ecc_rules_and_escalation():
    rules = HealthRules()
    assert rules.check([_t(0.0), _t(10.0)]) == []
    (grow,) = rules.check([_t(20.0, retired_sbe=(1, 3.0))])
    assert grow.kind is FindingKind.ECC and grow.gpu == 1 and grow.evidence["reasons"] == ["retired_growth"]
    assert grow.evidence["severity"] == "warning"
    # still growing, then pending: same episode (no new finding)
    assert rules.check([_t(30.0, retired_sbe=(1, 4.0)), _t(40.0, retired_sbe=(1, 4.0), remap_pending=(1, 1.0))]) == []
    (worse,) = rules.check([_t(50.0, retired_sbe=(1, 4.0), remap_pending=(1, 1.0), ecc_dbe_volatile=(1, 2.0))])
    assert worse.evidence["severity"] == "critical" and worse.evidence["escalated_from"] == "warning"
    assert worse.evidence["uncorrectable"] == 2.0
    assert worse.evidence["corroboration"]["by"] == ["prior_fault"]  # the warning episode before it
    # a node's first sample claiming a failed remap waits for its next one: corroborated when it holds again
    assert rules.check([_t(60.0, node="n0009", remap_failure=(0, 1.0))]) == []
    (fail,) = rules.check([_t(61.0, node="n0009", remap_failure=(0, 1.0))])
    assert fail.evidence["remap_failure"] is True and fail.evidence["severity"] == "critical"
    assert fail.ts == 60.0 and fail.evidence["corroboration"]["by"] == ["counters_persist"]


def _live(ts, node, lost=None):
    """A sample of a node whose GPUs all read (temperature and power), but GPU ``lost`` (NaN: off the bus)."""
    s = _t(ts, node=node)
    temp, power = np.full(4, 45.0), np.full(4, 300.0)
    if lost is not None:
        temp[lost] = power[lost] = np.nan
    return Telemetry.from_columns(node, "r00", ts, np.arange(4), **{**s.columns, "temp_c": temp, "power_w": power})


def test_a_removing_finding_needs_support_in_the_nodes_own_stream():
    """docs/architecture.md "Corroboration": an Xid 79 for a node that never reported, or one whose GPU the
    next sample still reads, stands alone; the GPU off the bus or the node falling silent supports it."""
    rules = HealthRules(silence_s=30.0)
    (ghost,) = rules.check([], [Event(node="ghost", ts=10.0, kind=EventKind.XID, gpu=0, code=79)])
    assert ghost.evidence["corroboration"]["by"] == [] and "no telemetry" in ghost.evidence["corroboration"]["missing"]
    rules.check([_live(100.0, "a"), _live(100.0, "b"), _live(100.0, "c")])
    # forged for a healthy, reporting node: held, then refuted by its next sample
    assert rules.check([], [Event(node="a", ts=100.5, kind=EventKind.XID, gpu=1, code=79)]) == []
    (forged,) = rules.check([_live(101.0, "a")])
    assert forged.evidence["corroboration"]["by"] == [] and forged.ts == 100.5
    # genuine: the GPU reads as NaN in the next sample
    assert rules.check([], [Event(node="b", ts=101.5, kind=EventKind.XID, gpu=2, code=79)]) == []
    (lost,) = rules.check([_live(102.0, "b", lost=2)])
    assert lost.evidence["corroboration"]["by"] == ["gpu_off_bus"]
    # genuine: the node stops reporting while the others go on
    assert rules.check([], [Event(node="c", ts=102.5, kind=EventKind.XID, gpu=0, code=79)]) == []
    assert rules.check([_live(120.0, "a"), _live(120.0, "b")]) == []
    (silent,) = rules.check([_live(140.0, "a")])
    assert silent.node == "c" and silent.evidence["corroboration"]["by"] == ["telemetry_silent"]


def test_ecc_rules_on_a_gpu_that_remaps_rows_and_retires_no_pages():
    """Hopper: the retired-page fields are NaN (NOT_SUPPORTED); remapped rows growing is the
    warning, a pending remap keeps the episode, uncorrectable errors escalate it."""
    rules = HealthRules()
    nan = float("nan")
    hopper = {"retired_sbe": np.full(4, nan), "retired_dbe": np.full(4, nan), "retired_pending": np.full(4, nan)}

    def t(ts, **cols):
        s = _t(ts, **{"remap_correctable": (0, 0.0), "remap_uncorrectable": (0, 0.0), **cols})
        return Telemetry.from_columns(s.node, s.rack, ts, s.gpu, **{**s.columns, **hopper})

    assert rules.check([t(0.0), t(10.0)]) == []  # NaN retired pages never hold
    (grow,) = rules.check([t(20.0, remap_correctable=(2, 1.0))])
    assert (grow.gpu, grow.evidence["reasons"], grow.evidence["severity"]) == (2, ["remap_growth"], "warning")
    assert grow.evidence["retired_pages"] is None and grow.evidence["remapped_rows"] == 1.0
    assert rules.check([t(30.0, remap_correctable=(2, 1.0), remap_pending=(2, 1.0))]) == []
    (worse,) = rules.check([t(40.0, remap_correctable=(2, 1.0), remap_uncorrectable=(2, 1.0), remap_pending=(2, 1.0),
                               ecc_dbe_volatile=(2, 1.0))])
    assert worse.evidence["severity"] == "critical" and worse.evidence["escalated_from"] == "warning"
    assert worse.evidence["reasons"] == ["uncorrectable", "pending", "remap_growth"]
    assert worse.evidence["remapped_rows"] == 2.0


def test_flapping_power_brake_is_one_power_brake_episode_per_node():
    rules = HealthRules(clear_after_s=300.0)
    brake = int(ClockReason.HW_POWER_BRAKE | ClockReason.HW_SLOWDOWN)
    samples = [_t(float(i), clock_reasons=(0, brake if i % 2 else 0)) for i in range(200)]
    (f,) = rules.check(samples)
    assert f.kind is FindingKind.POWER_BRAKE and f.ts == 1.0 and "HW_POWER_BRAKE" in f.evidence["clock_reasons"]
    assert f.gpu is None and f.evidence["gpus"] == [0]
    assert rules.check([_t(1000.0, clock_reasons=(0, brake))])[0].ts == 1000.0
    # software power capping alone is normal at full load
    assert HealthRules().check([_t(1.0, clock_reasons=(0, int(ClockReason.SW_POWER_CAP)))]) == []


def test_pcie_downtraining_width_always_generation_only_when_busy():
    rules = HealthRules()
    (w,) = rules.check([_t(1.0, pcie_width=(2, 8.0))])
    assert w.kind is FindingKind.LINK and w.gpu == 2 and w.evidence["pcie_width"] == 8.0
    assert rules.check([_t(2.0, node="n0002", pcie_gen=(0, 1.0), util_pct=(0, 0.0))]) == []
    (g,) = rules.check([_t(3.0, node="n0002", pcie_gen=(0, 3.0))])
    assert g.evidence["pcie_gen"] == 3.0


def test_stale_samples_and_nan_fields():
    rules = HealthRules()
    rules.check([_t(10.0)])
    assert rules.check([_t(5.0, ecc_dbe_volatile=(0, 1.0))]) == []
    assert rules.stale_total_ == 1
    blank = Telemetry.from_columns("n0005", "r00", 1.0, np.arange(2))
    assert rules.check([blank]) == []


def test_bad_parameters():
    with pytest.raises(ConfigError, match="min_xid_severity"):
        HealthRules(min_xid_severity="loud").check([], [])
    with pytest.raises(ConfigError, match="clear_after_s"):
        HealthRules(clear_after_s=0).check([], [])


def test_simulated_ecc_precursor_and_healthy_fleet():
    """Simulator telemetry: the precursor GPU gets ECC findings (then Xid 63/48/64/79); no other GPU
    of the fleet gets any health finding."""
    from fleethealth.sim.fleet import FleetSim
    from fleethealth.sim.scenario import Scenario

    sim = FleetSim(Scenario.from_obj({
        "seed": 9, "fleet": {"racks": 2, "nodes_per_rack": 4, "gpus_per_node": 8}, "job": {"steps": 120},
        "faults": [{"kind": "ecc_precursor", "node": "n0006", "gpu": 1, "start_step": 10, "fail_step": 100},
                   {"kind": "xid", "node": "n0003", "gpu": 4, "step": 50, "code": 79}]}))
    rules = HealthRules()
    found = []
    for frame in sim.run():
        found += rules.check(frame.telemetry, frame.events)
    assert {(f.node, f.gpu) for f in found} == {("n0006", 1), ("n0003", 4)}
    ecc = [f for f in found if f.kind is FindingKind.ECC]
    assert ecc[0].step is None and ecc[0].evidence["severity"] == "warning"
    assert ecc[-1].evidence["severity"] == "critical"
    xids = sorted(f.evidence["code"] for f in found if f.kind is FindingKind.XID and f.node == "n0006")
    assert xids == [48, 63, 64, 79]


def _links(ts, errors, node="n0001"):
    return _t(ts, node=node, nvlink_replay=(1, errors), nvlink_crc_flit=(0, 0.0), nvlink_crc_data=(0, 0.0),
              nvlink_recovery=(0, 0.0))


def test_climbing_nvlink_errors_are_one_link_episode_with_hysteresis():
    rules = HealthRules(nvlink_errors_per_min=10.0, nvlink_clear_per_min=2.0, nvlink_window_s=300.0)
    # 30 errors a minute from t=0: one finding once half the window is seen, then the episode holds
    found = [f for k in range(60) for f in rules.check([_links(10.0 * k, 5.0 * k)])]
    (f,) = found
    assert f.kind is FindingKind.LINK and f.gpu == 1 and f.evidence["rule"] == "nvlink"
    assert f.evidence["errors_per_min"] >= 10.0 and f.ts == 150.0 and f.evidence["gpus"] == [1]
    # the rate falls to ~5/min: between the two thresholds it keeps holding, nothing new
    assert [f for k in range(60, 120) for f in rules.check([_links(10.0 * k, 295.0 + (k - 59) * 0.8)])] == []
    assert (rules.nvlink_hot_ == {("n0001", 1)})


def test_a_trickle_or_one_jump_of_nvlink_errors_is_no_finding_and_a_counter_reset_starts_over():
    rules = HealthRules(nvlink_errors_per_min=10.0)
    trickle = [_links(10.0 * k, float(k // 6)) for k in range(100)]        # one a minute
    assert rules.check(trickle) == []
    jump = [_links(1000.0 + 10.0 * k, 16.0 + (40.0 if k == 0 else 40.0)) for k in range(40)]  # once, then flat
    assert rules.check(jump) == []
    reset = [_links(2000.0 + 10.0 * k, float(k)) for k in range(40)]          # driver reload: counters restart
    assert rules.check(reset) == []
    with pytest.raises(ConfigError, match="nvlink_clear_per_min"):
        HealthRules(nvlink_errors_per_min=5.0, nvlink_clear_per_min=6.0).check([])


def _stalled(ts, node="n0002", source="nvml"):
    return Event(node=node, ts=ts, kind=EventKind.TELEMETRY_STALLED, data={"source": source, "timeout_s": 5.0},
                 message=f"{source} source did not answer within 5 s")


def test_repeated_stalls_on_one_node_are_one_telemetry_stall_finding():
    rules = HealthRules(stall_count=3, stall_window_s=600.0)
    # two stalls on n0002 and one elsewhere: below the count on every node
    assert rules.check([], [_stalled(0.0), _stalled(100.0), _stalled(150.0, node="n0005")]) == []
    (f,) = rules.check([_t(200.0, node="n0002")], [_stalled(300.0)])
    assert f.kind is FindingKind.TELEMETRY_STALL and f.node == "n0002" and f.gpu is None and f.ts == 300.0
    assert f.detector == "health.telemetry_stall" and f.evidence["severity"] == "warning"
    assert f.evidence["stall_ts"] == [0.0, 100.0, 300.0] and f.evidence["sources"] == ["nvml"]
    # the node keeps stalling: the same episode, no new finding
    assert rules.check([], [_stalled(400.0), _stalled(500.0, source="dcgm")]) == []


def test_stalls_spread_wider_than_the_window_are_not_a_finding():
    rules = HealthRules(stall_count=3, stall_window_s=600.0)
    assert rules.check([], [_stalled(0.0), _stalled(500.0), _stalled(1000.0), _stalled(1500.0)]) == []
    with pytest.raises(ConfigError, match="stall_count"):
        HealthRules(stall_count=0).check([], [])
