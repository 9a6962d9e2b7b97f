"""The closed loop's accounting on a hand-computed two-fault case, and the three policies side by side."""

from __future__ import annotations

import pytest

from fleethealth.sim import Scenario
from fleethealth.sim.closedloop import Act, LoopParams, account, seed_rule_acts

# 2 nodes × 1 GPU, 10 steps of 1 s, a checkpoint every 5 steps.
# n0001 runs 50 % slow from step 2: a step then takes 1 × (0.2 + 0.8 × 1.5) = 1.4 s.
# n0000 corrupts every step from 6; with no detection the loss diverges at step 8.
TWO = Scenario.from_obj({
    "seed": 1, "fleet": {"racks": 1, "nodes_per_rack": 2, "gpus_per_node": 1},
    "job": {"id": "j", "steps": 10, "step_time_s": 1.0, "jitter": 0.02},
    "checks": {"selfcheck_every": 2, "replay_every": 4, "checkpoint_every": 5},
    "faults": [{"kind": "thermal_straggler", "node": "n0001", "gpu": 0, "start_step": 2, "slowdown": 0.5},
               {"kind": "sdc_deterministic", "node": "n0000", "gpu": 0, "start_step": 6, "diverge_step": 8}],
}, name="two")
P = LoopParams(diagnosis_s=4.0, restart_s=6.0, facilities_delay_s=0.0)  # a restart costs 10 s


def test_acting_on_both_faults_by_hand() -> None:
    # evict n0001 decided at step 3 -> it leaves at checkpoint 5 (one 10 s restart, nothing lost);
    # rollback decided at step 7 to target 5 -> steps 5..7 redone (3 s) and one 10 s restart
    r = account(TWO, [Act(3, "n0001", "evict"), Act(7, "n0000", "rollback", target_step=5)], policy="a", params=P)
    forward = 2 * 1.0 + 3 * 1.4 + 5 * 1.0            # steps 0-1 nominal, 2-4 slow, 5-9 nominal
    assert r.forward_s == pytest.approx(forward)
    assert (r.restart_s, r.recompute_s, r.stall_s) == pytest.approx((20.0, 3.0, 0.0))
    assert r.wall_s == pytest.approx(forward + 23.0)
    assert r.correct_steps == 10 and r.evictions == 1
    assert r.goodput == pytest.approx(10.0 / (forward + 23.0))
    assert r.ettr == pytest.approx(forward / (forward + 23.0))
    assert r.correct_per_accel_hour == pytest.approx(10 / ((forward + 23.0) * 2 / 3600))


def test_no_detection_by_hand() -> None:
    # the straggler runs its course (steps 2-9 slow); the SDC is found at step 8 and rolled back to
    # the last checkpoint before it began (5): steps 5..8 redone (4 s) and a 10 s restart
    r = account(TWO, [], policy="c", params=P, detect_sdc=False)
    forward = 2 * 1.0 + 8 * 1.4
    assert r.forward_s == pytest.approx(forward)
    assert (r.restart_s, r.recompute_s) == pytest.approx((10.0, 4.0))
    assert r.correct_steps == 10 and r.evictions == 0
    # no diverge step: every step from 6 on stays corrupt
    silent = Scenario.from_obj({**_obj(TWO), "faults": [{"kind": "sdc_deterministic", "node": "n0000", "gpu": 0,
                                                         "start_step": 6}]})
    assert account(silent, [], policy="c", params=P, detect_sdc=False).correct_steps == 6


def test_seed_rule_evicts_after_its_window_and_every_node_of_a_hot_rack() -> None:
    acts = seed_rule_acts(TWO, window=3)
    assert acts == [Act(5, "n0001", "evict")]
    hot = Scenario.from_obj({**_obj(TWO), "faults": [{"kind": "hot_aisle", "rack": "r00", "start_step": 1}]})
    assert sorted(a.node for a in seed_rule_acts(hot, window=3)) == ["n0000", "n0001"]
    r = account(hot, seed_rule_acts(hot, window=3), policy="b", params=P)
    assert r.evictions == 2 and r.restart_s == pytest.approx(10.0)  # both leave at checkpoint 5: one restart


def _obj(s: Scenario) -> dict:
    return {"seed": s.seed, "fleet": vars(s.fleet), "job": vars(s.job), "checks": vars(s.checks)}


def test_a_rollback_cleans_only_the_corruption_it_answers() -> None:
    # two SDCs: n0000 from step 6 (rolled back at 7 to 5), n0001 from step 3 (never found): the redone
    # steps 5..7 run beside n0001 again, so they stay corrupt; only steps 0-2 are correct
    both = Scenario.from_obj({**_obj(TWO), "faults": [
        {"kind": "sdc_deterministic", "node": "n0000", "gpu": 0, "start_step": 6},
        {"kind": "sdc_transient", "node": "n0001", "gpu": 0, "start_step": 3}]})
    r = account(both, [Act(7, "n0000", "rollback", target_step=5)], policy="a", params=P)
    assert r.correct_steps == 3
    alone = Scenario.from_obj({**_obj(TWO), "faults": [
        {"kind": "sdc_deterministic", "node": "n0000", "gpu": 0, "start_step": 6}]})
    assert account(alone, [Act(7, "n0000", "rollback", target_step=5)], policy="a", params=P).correct_steps == 10
