"""Straggler diagnosis (seed 000 R2) on hand-made telemetry for each class, the rack episode
aggregator, and one pass over the fleet simulator's telemetry for every straggler fault kind."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from fleethealth.detectors.diagnosis import (
    Diagnoser,
    DiagnosisThresholds,
    RackEpisodes,
    diagnose_straggler,
)
from fleethealth.errors import ConfigError
from fleethealth.schema import ClockReason, Diagnosis, Finding, FindingKind, NicPorts, Telemetry


def _sample(node="n0001", rack="r00", ts=100.0, *, temp=66.0, reasons=0, links_up=18.0, crc=0.0,
            nic=0.35, hot_gpu=None):
    temps = np.full(8, temp)
    bits = np.zeros(8)
    if hot_gpu is not None:
        temps[hot_gpu] = 92.0
        bits[hot_gpu] = reasons
    else:
        bits[:] = reasons
    up = np.full(8, 18.0)
    up[0] = links_up
    return Telemetry.from_columns(node, rack, ts, np.arange(8), nic_util=nic, temp_c=temps, clock_reasons=bits,
                                  nvlink_links_up=up, nvlink_links_max=np.full(8, 18.0),
                                  nvlink_crc_flit=np.full(8, crc), nvlink_replay=np.zeros(8),
                                  nvlink_crc_data=np.zeros(8), nvlink_recovery=np.zeros(8))


def _peers(n=7, **kw):
    return [_sample(f"n{i:04d}", **kw) for i in range(2, 2 + n)]


def test_hot_gpu_with_cool_peers_is_node_thermal():
    thermal = ClockReason.SW_THERMAL | ClockReason.HW_THERMAL
    res = diagnose_straggler(_sample(hot_gpu=3, reasons=thermal), _peers(), gpu=3)
    assert res.diagnosis is Diagnosis.NODE_THERMAL
    ev = res.evidence
    assert ev["temp_c"] == 92.0 and ev["thermal_limit_c"] == 85.0 and ev["peers"] == 7
    assert ev["peer_median_temp_c"] == pytest.approx(66.0) and ev["peer_throttle_share"] == 0.0
    assert set(ev["clock_reasons"]) == {"SW_THERMAL", "HW_THERMAL"}


def test_thermal_clock_reason_alone_enters_thermal_branch():
    res = diagnose_straggler(_sample(reasons=ClockReason.HW_THERMAL, temp=80.0), _peers())
    assert res.diagnosis is Diagnosis.NODE_THERMAL


def test_hot_rack_is_environmental_by_temperature_or_by_throttling_share():
    by_temp = diagnose_straggler(_sample(temp=88.0), _peers(temp=87.0))
    assert by_temp.diagnosis is Diagnosis.ENVIRONMENTAL
    assert by_temp.evidence["peer_median_temp_c"] == 87.0
    # a hot aisle 15 °C up stays under the limit, but the whole rack throttles
    aisle = diagnose_straggler(_sample(temp=81.0, reasons=ClockReason.SW_THERMAL),
                               _peers(temp=81.0, reasons=ClockReason.SW_THERMAL))
    assert aisle.diagnosis is Diagnosis.ENVIRONMENTAL and aisle.evidence["peer_throttle_share"] == 1.0


def test_neither_the_power_cap_nor_the_power_brake_is_thermal():
    capped = diagnose_straggler(_sample(reasons=ClockReason.SW_POWER_CAP), _peers())
    assert capped.diagnosis is Diagnosis.UNKNOWN
    brake = diagnose_straggler(_sample(reasons=ClockReason.HW_POWER_BRAKE), _peers())
    assert brake.diagnosis is Diagnosis.UNKNOWN and brake.evidence["power_brake"] is True
    assert "not a thermal cause" in brake.evidence["reason"]
    # a braked rack is not a hot rack either: a hot GPU among braked peers is still its own
    hot = diagnose_straggler(_sample(hot_gpu=3, reasons=ClockReason.HW_THERMAL),
                             _peers(reasons=ClockReason.HW_POWER_BRAKE),
                             gpu=3)
    assert hot.diagnosis is Diagnosis.NODE_THERMAL and hot.evidence["peer_throttle_share"] == 0.0


def test_links_down_is_node_link():
    res = diagnose_straggler(_sample(links_up=12.0), _peers(), gpu=5)
    assert res.diagnosis is Diagnosis.NODE_LINK
    assert res.evidence["nvlink_gpus_degraded"] == [0]


def test_rising_link_error_counters_need_the_previous_sample():
    before, now = _sample(ts=100.0, crc=10.0), _sample(ts=102.0, crc=30.0)  # 20 per GPU in 2 s = 600/min
    assert diagnose_straggler(now, _peers()).diagnosis is Diagnosis.UNKNOWN
    res = diagnose_straggler(now, _peers(), previous=before)
    assert res.diagnosis is Diagnosis.NODE_LINK and res.evidence["nvlink_errors_per_min"] == 600.0
    slow_growth = diagnose_straggler(_sample(ts=200.0, crc=10.1), _peers(), previous=before)
    assert slow_growth.diagnosis is Diagnosis.UNKNOWN
    reset = diagnose_straggler(_sample(ts=104.0, crc=0.0), _peers(), previous=now)
    assert reset.diagnosis is Diagnosis.UNKNOWN  # a counter reset is not an error burst


_LINK = 400e9 / 8  # bytes/s of a 400 Gb/s port


def _ported(ts: float, *, sent_s: float, waited_s: float, up: float = 1.0, downed: float = 0.0,
            node: str = "n0001") -> Telemetry:
    """A sample whose one IB port has sent ``sent_s`` link-seconds of bytes and waited ``waited_s``
    seconds for credit since time 0 (counters as the probe's NIC source publishes them)."""
    ports = NicPorts.from_columns(["mlx5_0/1"], ["ib"], up=[up], link_gbps=[400.0 if up else math.nan],
                                  tx_bytes=[sent_s * _LINK], rx_bytes=[0.5 * sent_s * _LINK],
                                  xmit_wait=[waited_s * _LINK / 8], link_downed=[downed])
    return dataclasses.replace(_sample(node=node, ts=ts, nic=math.nan), nic=ports)


def test_nic_port_counters_judge_contention_by_credit_wait_or_utilisation():
    before = _ported(100.0, sent_s=30.0, waited_s=0.4)
    # 2 s later: sent 0.8 link-seconds (40 % util) but waited 0.6 s for credit (30 % of the interval)
    waiting = diagnose_straggler(_ported(102.0, sent_s=30.8, waited_s=1.0), _peers(), previous=before)
    assert waiting.diagnosis is Diagnosis.NETWORK_CONTENTION
    ev = waiting.evidence
    assert ev["nic_source"] == "port_counters" and ev["nic_util"] == pytest.approx(0.4)
    assert ev["nic_xmit_wait_share"] == pytest.approx(0.3) and ev["nic_xmit_wait_band"] == 0.10
    assert ev["nic_ports"] == [{"port": "mlx5_0/1", "util": pytest.approx(0.4), "xmit_wait_share": pytest.approx(0.3)}]
    saturated = diagnose_straggler(_ported(102.0, sent_s=31.9, waited_s=0.41), _peers(), previous=before)
    assert saturated.diagnosis is Diagnosis.NETWORK_CONTENTION and saturated.evidence["nic_util"] == 0.95
    healthy = diagnose_straggler(_ported(102.0, sent_s=30.7, waited_s=0.41), _peers(), previous=before)
    assert healthy.diagnosis is Diagnosis.UNKNOWN and healthy.evidence["nic_util"] == pytest.approx(0.35)
    # the node-level nic_util summary is not what decides once port counters are there
    claims = dataclasses.replace(_ported(102.0, sent_s=30.7, waited_s=0.41), nic_util=0.99)
    assert diagnose_straggler(claims, _peers(), previous=before).diagnosis is Diagnosis.UNKNOWN
    # one sample alone gives no rate; counters that stepped back (a probe restart) give none either
    assert diagnose_straggler(before, _peers()).diagnosis is Diagnosis.UNKNOWN
    restarted = diagnose_straggler(_ported(102.0, sent_s=1.0, waited_s=0.0), _peers(), previous=before)
    assert restarted.diagnosis is Diagnosis.UNKNOWN and restarted.evidence["nic_util"] is None


def test_nic_port_going_down_is_node_link():
    before = _ported(100.0, sent_s=30.0, waited_s=0.4)
    down = diagnose_straggler(_ported(102.0, sent_s=30.0, waited_s=0.4, up=0.0), _peers(), previous=before)
    assert down.diagnosis is Diagnosis.NODE_LINK and down.evidence["nic_ports_down"] == ["mlx5_0/1"]
    flapped = diagnose_straggler(_ported(102.0, sent_s=30.7, waited_s=0.41, downed=1.0), _peers(), previous=before)
    assert flapped.diagnosis is Diagnosis.NODE_LINK
    # a port that was already down before is not news
    still = diagnose_straggler(_ported(104.0, sent_s=30.0, waited_s=0.4, up=0.0), _peers(),
                               previous=_ported(102.0, sent_s=30.0, waited_s=0.4, up=0.0))
    assert still.diagnosis is Diagnosis.UNKNOWN


def test_nic_util_summary_of_older_probes_beyond_band_is_network_contention_else_unknown():
    res = diagnose_straggler(_sample(nic=0.97), _peers())
    assert res.diagnosis is Diagnosis.NETWORK_CONTENTION
    assert res.evidence["nic_util"] == 0.97 and res.evidence["nic_util_band"] == 0.85
    assert res.evidence["nic_source"] == "nic_util"
    quiet = diagnose_straggler(_sample(), _peers())
    assert quiet.diagnosis is Diagnosis.UNKNOWN and quiet.evidence["nic_util"] == 0.35


def test_nan_fields_and_no_peers_are_handled():
    blank = Telemetry.from_columns("n0001", "r00", 1.0, np.arange(4))
    res = diagnose_straggler(blank, [])
    assert res.diagnosis is Diagnosis.UNKNOWN and res.evidence["temp_c"] is None
    alone = diagnose_straggler(_sample(hot_gpu=1, reasons=ClockReason.HW_THERMAL), [], gpu=1)
    # a hot node with no peer to compare: node and environment cannot be told apart, and it says why
    assert alone.diagnosis is Diagnosis.UNKNOWN and alone.evidence["peers"] == 0
    assert "no rack peer" in alone.evidence["reason"]
    assert math.isnan(res.evidence["sample_ts"]) is False


def test_thresholds_validate():
    with pytest.raises(ConfigError, match="nic_util_band"):
        DiagnosisThresholds(nic_util_band=2.0)
    with pytest.raises(ConfigError, match="nic_xmit_wait_band"):
        DiagnosisThresholds(nic_xmit_wait_band=-0.1)
    with pytest.raises(ConfigError, match="nic_bytes_per_tick"):
        DiagnosisThresholds(nic_bytes_per_tick=0.0)
    tight = DiagnosisThresholds(nic_util_band=0.3)
    assert diagnose_straggler(_sample(), _peers(), thresholds=tight).diagnosis is Diagnosis.NETWORK_CONTENTION


def test_diagnoser_keeps_two_samples_and_rack_peers():
    d = Diagnoser()
    d.observe([_sample(ts=100.0, crc=0.0)] + _peers(ts=100.0))
    d.observe([_sample(ts=102.0, crc=50.0)] + _peers(ts=102.0))
    d.observe([_sample(ts=101.0, crc=0.0)])  # late sample: ignored
    assert d.stale_total_ == 1
    assert d.diagnose("n0001").diagnosis is Diagnosis.NODE_LINK
    assert d.rack_of("n0003") == "r00"
    missing = d.diagnose("n9999", gpu=2)
    assert missing.diagnosis is Diagnosis.UNKNOWN and missing.evidence["telemetry"] == "missing"


def _straggler(node, rank, ts, diagnosis=Diagnosis.ENVIRONMENTAL, job="train-1"):
    return Finding(kind=FindingKind.STRAGGLER, node=node, ts=ts, job=job, rank=rank, gpu=rank % 8, step=10,
                   z=4.0, slowdown=0.1, diagnosis=diagnosis, detector="straggler.cusum", evidence={"arm": 3})


def test_rack_episode_folds_64_environmental_stragglers_into_one():
    racks = {f"n{i:04d}": f"r{i // 8:02d}" for i in range(32)}
    agg = RackEpisodes(quiet_s=600.0)
    stragglers = [_straggler(f"n{16 + r // 8:04d}", 128 + r, 1000.0 + r) for r in range(64)]
    other = _straggler("n0003", 24, 1001.0, diagnosis=Diagnosis.NODE_THERMAL)
    out = agg.check(stragglers[:30] + [other], racks.get) + agg.check(stragglers[30:], racks.get)
    rack = [f for f in out if f.detector == "straggler.rack"]
    assert len(rack) == 1 and other in out and len(out) == 2
    assert rack[0].diagnosis is Diagnosis.ENVIRONMENTAL and rack[0].rank is None
    assert rack[0].evidence["rack"] == "r02" and rack[0].evidence["first_rank"] == 128
    assert agg.open_episodes() == {"r02": 64}
    # after a quiet period, a new episode in the same rack; another job has its own episode
    later = agg.check([_straggler("n0017", 130, 5000.0), _straggler("n0017", 130, 5001.0, job="train-2")],
                       racks.get)
    assert len(later) == 2 and all(f.detector == "straggler.rack" for f in later)
    unknown_rack = _straggler("n0999", 1, 6000.0)
    assert agg.check([unknown_rack], racks.get) == [unknown_rack]


def test_simulated_faults_get_their_diagnosis():
    """The fleet simulator's telemetry for each straggler fault kind, diagnosed per R2."""
    from fleethealth.sim.fleet import FleetSim
    from fleethealth.sim.scenario import Scenario

    scenario = Scenario.from_obj({
        "seed": 3, "fleet": {"racks": 4, "nodes_per_rack": 8, "gpus_per_node": 8}, "job": {"steps": 40},
        "faults": [{"kind": "thermal_straggler", "node": "n0013", "gpu": 3, "start_step": 5},
                   {"kind": "hot_aisle", "rack": "r02", "start_step": 5},
                   {"kind": "nvlink_degraded", "node": "n0025", "start_step": 5},
                   {"kind": "nic_contention", "node": "n0005", "start_step": 5}]})
    sim = FleetSim(scenario)
    d = Diagnoser()
    for step in (20, 21):
        d.observe(sim.step(step).telemetry)
    assert d.diagnose("n0013", 3).diagnosis is Diagnosis.NODE_THERMAL
    assert {d.diagnose(f"n{i:04d}", 0).diagnosis for i in range(16, 24)} == {Diagnosis.ENVIRONMENTAL}
    assert d.diagnose("n0025", 1).diagnosis is Diagnosis.NODE_LINK
    contended = d.diagnose("n0005", 2)
    assert contended.diagnosis is Diagnosis.NETWORK_CONTENTION
    # judged from the simulated port counters (credit wait), as on a real node
    assert contended.evidence["nic_source"] == "port_counters"
    assert contended.evidence["nic_xmit_wait_share"] == pytest.approx(0.30, abs=0.01)
    healthy = [n for n in sim.node_names if n not in {"n0013", "n0025", "n0005"} and sim.rack_of(n) != "r02"]
    assert {d.diagnose(n).diagnosis for n in healthy} == {Diagnosis.UNKNOWN}


def test_results_are_frozen():
    res = diagnose_straggler(_sample(), [])
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.diagnosis = Diagnosis.NODE_LINK  # type: ignore[misc]


def _rack(temps_by_node: dict[str, float], *, ts: float, limit: float | None = None,
          power: float | None = None) -> list[Telemetry]:
    out = []
    for node, temp in temps_by_node.items():
        cols = {"temp_c": np.full(8, temp)}
        if limit is not None:
            cols["slowdown_temp_c"] = np.full(8, limit)
        if power is not None:  # busy GPUs at this power
            cols.update(power_w=np.full(8, power), power_limit_w=np.full(8, 700.0), util_pct=np.full(8, 97.0))
        out.append(Telemetry.from_columns(node, "r02", ts, np.arange(8), **cols))
    return out


def test_a_hot_aisle_where_only_part_of_the_rack_crosses_its_limit_is_environmental():
    """Every node of the rack runs 12 °C above what its GPUs' thermal models predict at their load;
    only two cross 85 °C. Judged by the share that throttles (2 of 7) it looked like a bad node;
    judged by the rack's residual it is the aisle."""
    diag = Diagnoser()
    base = {f"n{i:04d}": 68.0 + (i % 3) for i in range(16, 24)}  # per-slot offsets: warm and cool slots
    for k in range(60):  # ten minutes of one load: the thermal models learn
        diag.observe(_rack(base, ts=10.0 * k, power=600.0))
    hot = {n: t + 12.0 for n, t in base.items()}
    hot["n0016"], hot["n0017"] = 88.0, 87.0  # these two crossed the limit, the rest run hot below it
    diag.observe(_rack(hot, ts=700.0, power=600.0))
    res = diag.diagnose("n0016", 3, at=700.0)
    assert res.diagnosis is Diagnosis.ENVIRONMENTAL, res.evidence
    assert res.evidence["rack_residual_c"] >= 10.0 and res.evidence["peer_throttle_share"] == 0.0
    assert res.evidence["excess_c"] < res.evidence["node_excess_limit_c"]
    # one node heating alone in a rack that stays as its load explains is the node
    alone = dict(base)
    alone["n0016"] = 92.0
    diag2 = Diagnoser()
    for k in range(60):
        diag2.observe(_rack(base, ts=10.0 * k, power=600.0))
    diag2.observe(_rack(alone, ts=700.0, power=600.0))
    res2 = diag2.diagnose("n0016", 3, at=700.0)
    assert res2.diagnosis is Diagnosis.NODE_THERMAL and abs(res2.evidence["rack_residual_c"]) < 1.0


def test_each_gpu_is_judged_against_its_own_slowdown_temperature():
    peers = _rack({f"n{i:04d}": 60.0 for i in range(17, 24)}, ts=1.0, limit=95.0)
    warm_but_fine = Telemetry.from_columns("n0016", "r02", 1.0, np.arange(8), temp_c=np.full(8, 88.0),
                                           slowdown_temp_c=np.full(8, 95.0))
    res = diagnose_straggler(warm_but_fine, peers, gpu=0)
    assert res.diagnosis is not Diagnosis.NODE_THERMAL and res.evidence["thermal_limit_c"] == 95.0
    assert res.evidence["thermal_limit_source"] == "gpu"
    low_limit = Telemetry.from_columns("n0016", "r02", 1.0, np.arange(8), temp_c=np.full(8, 82.0),
                                       slowdown_temp_c=np.full(8, 80.0))
    assert diagnose_straggler(low_limit, peers, gpu=0).diagnosis is Diagnosis.NODE_THERMAL
    unreported = Telemetry.from_columns("n0016", "r02", 1.0, np.arange(8), temp_c=np.full(8, 88.0))
    res = diagnose_straggler(unreported, peers, gpu=0)
    assert res.evidence["thermal_limit_source"] == "default" and res.diagnosis is Diagnosis.NODE_THERMAL


def test_stale_or_missing_telemetry_is_unknown_with_the_reason():
    diag = Diagnoser()
    diag.observe(_rack({"n0016": 92.0, "n0017": 60.0}, ts=100.0))
    stale = diag.diagnose("n0016", 0, at=100.0 + 600.0)
    assert stale.diagnosis is Diagnosis.UNKNOWN and "older than the straggler" in stale.evidence["reason"]
    assert diag.diagnose("n0999", 0, at=100.0).evidence["reason"] == "no telemetry from the node"
    blank = Telemetry.from_columns("n0001", "r00", 1.0, np.arange(4))
    assert "none of the fields" in diagnose_straggler(blank, []).evidence["reason"]
