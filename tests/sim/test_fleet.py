"""The simulator's fault signatures, asserted on what it emits (telemetry, batches, events)."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.schema import ClockReason, EventKind
from fleethealth.sim.fleet import FleetSim
from fleethealth.sim.scenario import Scenario


def _sim(*faults: dict, steps: int = 400, **extra: object) -> FleetSim:
    return FleetSim(Scenario.from_obj({"seed": 11, "fleet": {"racks": 2, "nodes_per_rack": 4, "gpus_per_node": 4},
                                       "job": {"steps": steps}, "faults": list(faults), **extra}))


def _node(items: list, node: str):
    return next(x for x in items if x.node == node)


def test_deterministic_and_random_access() -> None:
    a, b = _sim(), _sim()
    sa, sb = a.step(37), b.step(37)
    np.testing.assert_array_equal(sa.batches[3].compute_s, sb.batches[3].compute_s)
    assert sa.ts == sb.ts
    steps = [s for s in a.run() if s.step is not None]
    np.testing.assert_array_equal(steps[37].batches[3].compute_s, sa.batches[3].compute_s)


def test_placement_follows_the_contract() -> None:
    sim = _sim()
    node, gpu = sim.placement
    assert node[13] == 13 // 4 and gpu[13] == 13 % 4
    assert sim.rack_of("n0005") == "r01"
    batch = _node(sim.step(0).batches, "n0002")
    assert batch.ranks.tolist() == [8, 9, 10, 11]


def test_healthy_jitter_is_lognormal_around_the_nominal_compute_time() -> None:
    sim = _sim()
    compute = np.concatenate([b.compute_s for s in range(50) for b in sim.step(s).batches])
    ratio = np.log(compute / np.median(compute))
    assert 0.015 < ratio.std() < 0.03
    reasons = np.concatenate([t.columns["clock_reasons"] for s in range(50) for t in sim.step(s).telemetry])
    assert not (reasons.astype(np.int64) & int(ClockReason.thermal())).any()  # only benign power-cap blips


def test_thermal_straggler_signature() -> None:
    sim = _sim({"kind": "thermal_straggler", "node": "n0003", "gpu": 1, "start_step": 100, "slowdown": 0.2})
    before, after = sim.step(99), sim.step(150)
    tel = _node(after.telemetry, "n0003")
    assert tel.columns["temp_c"][1] > 85 > _node(before.telemetry, "n0003").columns["temp_c"][1]
    assert int(tel.columns["clock_reasons"][1]) & int(ClockReason.HW_THERMAL)
    assert tel.columns["sm_clock_mhz"][1] < tel.columns["sm_clock_max_mhz"][1]
    compute = _node(after.batches, "n0003").compute_s
    assert compute[1] / np.median(compute) > 1.12


def test_hot_aisle_heats_and_slows_the_whole_rack() -> None:
    sim = _sim({"kind": "hot_aisle", "rack": "r01", "start_step": 10, "temp_rise_c": 15, "slowdown": 0.1})
    step = sim.step(20)
    hot = np.concatenate([t.columns["temp_c"] for t in step.telemetry if t.rack == "r01"])
    cool = np.concatenate([t.columns["temp_c"] for t in step.telemetry if t.rack == "r00"])
    assert np.median(hot) - np.median(cool) > 12
    slow = np.concatenate([b.compute_s for b in step.batches if sim.rack_of(b.node) == "r01"])
    fast = np.concatenate([b.compute_s for b in step.batches if sim.rack_of(b.node) == "r00"])
    assert np.median(slow) / np.median(fast) > 1.05


def test_nvlink_and_nic_signatures() -> None:
    sim = _sim({"kind": "nvlink_degraded", "node": "n0001", "start_step": 10},
               {"kind": "nic_contention", "node": "n0006", "start_step": 10})
    a, b = sim.step(20), sim.step(30)
    link_a, link_b = _node(a.telemetry, "n0001"), _node(b.telemetry, "n0001")
    assert (link_a.columns["nvlink_links_up"] < link_a.columns["nvlink_links_max"]).all()
    assert (link_b.columns["nvlink_crc_flit"] > link_a.columns["nvlink_crc_flit"]).all()
    assert _node(a.telemetry, "n0006").nic_util > 0.9 > _node(a.telemetry, "n0005").nic_util


def test_ecc_precursor_grows_then_fails_with_xids() -> None:
    sim = _sim({"kind": "ecc_precursor", "node": "n0004", "gpu": 2, "start_step": 50, "fail_step": 250})
    sbe = [_node(sim.step(s).telemetry, "n0004").columns["ecc_sbe_volatile"][2] for s in (60, 150, 240)]
    assert sbe[0] < sbe[1] < sbe[2]
    assert _node(sim.step(240).telemetry, "n0004").columns["remap_pending"][2] == 1
    xids = [e.code for s in sim.run() for e in s.events if e.kind is EventKind.XID]
    assert xids == [63, 48, 64, 79]
    assert 10 not in _node(sim.step(250).batches, "n0004").ranks.tolist()  # the lost GPU stops reporting
    assert _node(sim.step(300).telemetry, "n0004").columns["ecc_sbe_volatile"][2] < sbe[2]  # replaced


def test_hang_silences_the_node_and_reports_stacks() -> None:
    sim = _sim({"kind": "hang", "node": "n0002", "step": 100, "duration_s": 60, "restart_s": 30})
    assert "n0002" not in {b.node for b in sim.step(100).batches}
    ticks = [s for s in sim.run() if s.step is None]
    assert ticks and all(t.telemetry for t in ticks)
    kinds = [e.kind for t in ticks for e in t.events]
    assert EventKind.HANG_REPORT in kinds
    assert sim.step(101).ts - sim.step(100).ts > 90


def test_the_job_reports_its_life_and_the_simulator_writes_no_interruption() -> None:
    """A hang at step 110 (checkpoints every 25): the run fails when the hang's 60 s are up and restarts
    from the checkpoint at 100 after 70 % of its 30 s restart; a lost GPU at 300 fails at the next tick
    and restarts 420 s later from 300. The interruption itself is derived by the detectors."""
    sim = _sim({"kind": "hang", "node": "n0002", "step": 110, "duration_s": 60, "restart_s": 30},
               {"kind": "ecc_precursor", "node": "n0004", "gpu": 2, "start_step": 50, "fail_step": 300})
    events = [e for s in sim.run() for e in s.events]
    assert EventKind.INTERRUPTION not in {e.kind for e in events}
    life = [(e.kind.value, e.step, e.data.get("status"), e.data.get("resumed_from"), round(e.ts - sim.step_ts(0), 3))
            for e in events if e.kind in (EventKind.JOB_START, EventKind.JOB_EXIT)]
    t0, hang, lost = sim.step_ts(0), sim.step_ts(110) - sim.step_ts(0), sim.step_ts(300) - sim.step_ts(0)
    assert life == [
        ("job_start", 0, None, None, round(sim.scenario.start_ts - t0, 3)),
        ("job_exit", 110, "failed", None, round(hang + 60.0, 3)),
        ("job_start", 101, None, "ckpt://train-1/step-00000100", round(hang + 60.0 + 21.0, 3)),
        ("job_exit", 300, "failed", None, round(lost + 2.0, 3)),
        ("job_start", 301, None, "ckpt://train-1/step-00000300", round(lost + 2.0 + 420.0, 3)),
        ("job_exit", 399, "completed", None, round(sim.step_ts(399) - t0, 3)),
    ]
    assert all(e.node == "n0000" and e.rank == 0 for e in events if e.kind is EventKind.JOB_START)
    assert events[0].data["placement"][13] == "n0003" and events[0].data["world"] == 32


def test_sdc_records_transient_in_selfcheck_deterministic_in_replay() -> None:
    sim = _sim({"kind": "sdc_transient", "node": "n0001", "gpu": 0, "start_step": 120},
               {"kind": "sdc_deterministic", "node": "n0005", "gpu": 3, "start_step": 120},
               checks={"selfcheck_every": 50, "replay_every": 200})
    failed = [e for s in sim.run() for e in s.events if e.kind is EventKind.SDC_CHECK and not e.data["passed"]]
    by_check = {(e.data["check"], e.rank, e.step, e.data["classification"]) for e in failed}
    assert by_check == {("selfcheck", 4, 150, "transient"), ("replay", 23, 200, "persistent")}
    ckpt = [e for s in sim.run() for e in s.events if e.kind is EventKind.CHECKPOINT and e.step == 175]
    assert ckpt[0].data["last_verified_step"] == 100


def _jobs_sim(*faults: dict) -> FleetSim:
    return FleetSim(Scenario.from_obj({
        "seed": 11, "fleet": {"racks": 2, "nodes_per_rack": 4, "gpus_per_node": 4},
        "jobs": [{"id": "big", "nodes": "n0000..n0003", "steps": 60, "step_time_s": 2.0},
                 {"id": "small", "node_count": 2, "steps": 90, "step_time_s": 1.0}],  # n0004, n0005
        "faults": list(faults)}))  # n0006, n0007 idle


def test_several_jobs_each_on_its_own_nodes_keyed_by_job() -> None:
    from kafka.partitioner.default import murmur2  # what the producer's default partitioner hashes

    sim = _jobs_sim()
    ticks = list(sim.run())
    assert all(a.ts <= b.ts for a, b in zip(ticks, ticks[1:], strict=False))  # one stream in event time
    batches = [b for t in ticks for b in t.batches]
    assert {b.job for b in batches} == {"big", "small"}
    for job, nodes, steps, world in (("big", {"n0000", "n0001", "n0002", "n0003"}, 60, 16),
                                     ("small", {"n0004", "n0005"}, 90, 8)):
        mine = [b for b in batches if b.job == job]
        assert {b.node for b in mine} == nodes and len({b.step for b in mine}) == steps
        assert sorted({int(r) for b in mine for r in b.ranks}) == list(range(world))  # ranks from 0 in each job
        # fh.steps is keyed by job: every batch of a job lands on one partition of the topic
        assert {b.key for b in mine} == {job} and {b.TOPIC.value for b in mine} == {"fh.steps"}
        assert len({(murmur2(b.key.encode()) & 0x7FFFFFFF) % 4 for b in mine}) == 1
        life = [e for t in ticks for e in t.events if e.job == job and e.kind in (EventKind.JOB_START,
                                                                                   EventKind.JOB_EXIT)]
        first = min(nodes)
        assert [(e.kind, e.node, e.rank) for e in life] == [(EventKind.JOB_START, first, 0),
                                                            (EventKind.JOB_EXIT, first, 0)]
        assert life[0].data["world"] == world and set(life[0].data["placement"]) == nodes
        assert life[1].data["status"] == "completed" and life[1].step == steps - 1
    # every node reports telemetry; the idle ones only telemetry, at idle levels, every shortest step
    idle = [t for t in ticks if t.job is None]
    assert len(idle) == sim.scenario.idle_ticks == 120 and not any(t.batches for t in idle)
    assert {tel.node for t in ticks for tel in t.telemetry} == {f"n{i:04d}" for i in range(8)}
    idle_tel = [tel for t in idle for tel in t.telemetry]
    assert {tel.node for tel in idle_tel} == {"n0006", "n0007"}
    assert max(float(tel.columns["util_pct"].max()) for tel in idle_tel) == 0.0
    busy_tel = next(tel for t in ticks if t.job == "big" for tel in t.telemetry)
    assert float(busy_tel.columns["util_pct"].min()) > 80
    with pytest.raises(TypeError, match="sim.jobs"):
        sim.step(0)
    assert sim.sim_of("n0005") is sim.jobs["small"] and sim.sim_of("n0007").idle and _sim().sim_of("n0001").jobs == {}
    np.testing.assert_array_equal(sim.jobs["small"].step(7).batches[1].compute_s,
                                  next(t for t in ticks if t.job == "small" and t.step == 7).batches[1].compute_s)


def test_a_fault_belongs_to_the_job_on_its_node() -> None:
    """A hang stalls only its own job; a straggler slows its own job's ranks; an idle node's Xid has no job."""
    quiet = _jobs_sim()
    sim = _jobs_sim({"kind": "hang", "node": "n0005", "step": 30, "duration_s": 60, "restart_s": 30},
                    {"kind": "thermal_straggler", "node": "n0002", "gpu": 1, "start_step": 20},
                    {"kind": "xid", "node": "n0007", "gpu": 3, "step": 50, "code": 48})
    small, big = sim.jobs["small"], sim.jobs["big"]
    assert small.step_ts(31) - small.step_ts(30) > 90
    assert big.step_ts(19) == quiet.jobs["big"].step_ts(19)  # the other job's hang does not stop this one
    assert "n0005" not in {b.node for b in small.step(30).batches}
    compute = _node(big.step(40).batches, "n0002").compute_s
    assert compute[1] / np.median(compute) > 1.12
    assert _node(small.step(40).batches, "n0004").compute_s.max() < 1.0  # untouched
    ticks = list(sim.run())
    events = [e for t in ticks for e in t.events]
    hangs = {(e.job, e.node) for e in events if e.kind is EventKind.HANG_REPORT}
    assert hangs == {("small", "n0005"), ("small", "n0004")}  # the hung node and the job's rank 0
    exits = [(e.job, e.data["status"]) for e in events if e.kind is EventKind.JOB_EXIT]
    assert sorted(exits) == [("big", "completed"), ("small", "completed"), ("small", "failed")]
    xid = [e for e in events if e.kind is EventKind.XID]
    assert [(e.node, e.job, e.code) for e in xid] == [("n0007", None, 48)]
    assert xid[0].ts == pytest.approx(sim.scenario.start_ts + 51 * sim.scenario.idle_interval_s)


def test_a_one_job_scenario_is_unchanged_by_the_jobs_form() -> None:
    one = _sim({"kind": "thermal_straggler", "node": "n0003", "gpu": 1, "start_step": 10}, steps=40)
    same = FleetSim(Scenario.from_obj({"seed": 11, "fleet": {"racks": 2, "nodes_per_rack": 4, "gpus_per_node": 4},
                                       "jobs": [{"id": "train-1", "node_count": 8, "steps": 40}],
                                       "faults": [{"kind": "thermal_straggler", "node": "n0003", "gpu": 1,
                                                   "start_step": 10}]}))
    assert one.jobs == {} and [t.job for t in one.run()] == [None] * 40
    a, b = one.step(20), same.jobs["train-1"].step(20)
    assert a.ts == b.ts and [x.node for x in a.batches] == [x.node for x in b.batches]
    # the same GPUs (base levels drawn for the whole fleet), their own noise stream
    assert abs(np.median(a.telemetry[2].columns["temp_c"]) - np.median(b.telemetry[2].columns["temp_c"])) < 1.0
    assert a.telemetry[2].uuid == b.telemetry[2].uuid
