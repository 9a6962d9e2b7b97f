"""SDC check events → sdc findings: one per (node, GPU, check) episode with the check record, the
rollback watermark and the checkpoints; the simulator's transient and deterministic faults."""

from __future__ import annotations

from fleethealth.detectors.sdc import SdcDetector
from fleethealth.payloads.checkpoint import checkpoint_event
from fleethealth.payloads.sdc_check import sdc_check_event
from fleethealth.schema import Event, EventKind, FindingKind


def _check(step, passed, *, check="selfcheck", rank=9, node="n0001", culprit=None, classification=None):
    return sdc_check_event(ts=100.0 + step, check=check, passed=passed, node=node, job="train-1", rank=rank,
                           gpu=rank % 8, step=step, classification=classification, culprit_rank=culprit,
                           digests=["ab", "cd"], peer_ranks=[] if check == "selfcheck" else [2, 3],
                           tolerance=None if check == "selfcheck" else 5.0)


def test_failed_selfcheck_names_node_gpu_rank_check_and_classification():
    det = SdcDetector()
    events = [_check(50, True), checkpoint_event(ts=160.0, step=60, uri="ckpt://60", last_verified_step=50,
                                                  node="n0000", job="train-1"),
              _check(100, True, rank=3), _check(100, False, classification="transient")]
    (f,) = det.check(events)
    assert f.kind is FindingKind.SDC and f.node == "n0001" and f.gpu == 1 and f.rank == 9 and f.step == 100
    assert f.detector == "sdc.selfcheck" and f.job == "train-1"
    ev = f.evidence
    assert ev["check"] == "selfcheck" and ev["classification"] == "transient" and ev["hardware"] is True
    assert ev["last_verified_step"] == 50 and ev["checkpoints"][0]["step"] == 60 and ev["digests"] == ["ab", "cd"]


def test_deterministic_replay_failures_are_one_episode_until_a_pass():
    """One finding standing alone, one more when a second check fails (corroborated), then none."""
    det = SdcDetector()
    fails = [_check(s, False, check="replay", culprit=9, classification="persistent") for s in (200, 400, 600)]
    found = det.check(fails)
    assert len(found) == 2 and found[0].rank == 9 and found[0].evidence["culprit_rank"] == 9
    assert [f.evidence["corroboration"]["by"] for f in found] == [[], ["second_check"]]
    assert [f.step for f in found] == [200, 400] and found[0].id != found[1].id
    assert det.failures_total_ == 3
    det.check([_check(800, True, check="replay")])
    assert len(det.check([_check(1000, False, check="replay", culprit=9)])) == 1


def test_peer_votes_do_not_move_the_watermark_and_data_or_code_is_not_hardware():
    det = SdcDetector()
    det.check([_check(50, True), _check(200, True, check="replay", rank=2, culprit=9)])
    (f,) = det.check([_check(200, False, check="replay", culprit=None, classification="data_or_code")])
    assert f.evidence["last_verified_step"] == 50 and f.evidence["hardware"] is False and f.rank == 9


def test_malformed_records_are_counted_and_skipped():
    det = SdcDetector()
    bad = [Event(node="n1", ts=1.0, kind=EventKind.SDC_CHECK, data={"check": "guess", "passed": False}),
           Event(node="n1", ts=2.0, kind=EventKind.SDC_CHECK, data={"check": "replay", "passed": "no"}),
           Event(node="n1", ts=3.0, kind=EventKind.CHECKPOINT, data={"step": "x"})]
    assert det.check(bad) == [] and det.invalid_total_ == 3


def test_simulated_sdc_faults():
    from fleethealth.sim.fleet import FleetSim
    from fleethealth.sim.scenario import Scenario

    sim = FleetSim(Scenario.from_obj({
        "seed": 2, "fleet": {"racks": 1, "nodes_per_rack": 4, "gpus_per_node": 8}, "job": {"steps": 420},
        "faults": [{"kind": "sdc_transient", "node": "n0001", "gpu": 5, "start_step": 120},
                   {"kind": "sdc_deterministic", "node": "n0003", "gpu": 2, "start_step": 100}]}))
    det = SdcDetector()
    found = []
    for step in range(0, 420, 50):
        found += det.check(sim.step(step).events)
    got = sorted((f.node, f.gpu, f.evidence["check"], f.step) for f in found)
    assert got == [("n0001", 5, "selfcheck", 150), ("n0003", 2, "replay", 200), ("n0003", 2, "replay", 400)]
    assert {f.evidence["classification"] for f in found} == {"transient", "persistent"}
