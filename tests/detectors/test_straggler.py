"""Straggler detectors on generated step times (fleethealth.detectors.synth): latency, false alarms,
groups, episodes and bad input. Numbers are the issue's targets at 4,096 ranks and 2 % jitter."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.detectors.straggler import SeedRule, StragglerDetector, robust_z, siegmund_rate, siegmund_threshold
from fleethealth.detectors.synth import FleetNoise, FleetSteps, StepNoise, step_times
from fleethealth.errors import ConfigError, SchemaError
from fleethealth.schema import FindingKind

R = 4096


def _run(det, steps, *, slow=None, noise=None, seed=0, n=R, start=0):
    rng = np.random.default_rng(seed)
    noise = noise or StepNoise.plain()
    ranks = np.arange(n)
    drift = 0.0
    found = []
    for step in range(start, start + steps):
        t, drift = step_times(rng, n, noise, drift=drift, slowdown=slow)
        found += det.check(step, ranks, t)
    return found


def _slow(ranks, amount, n=R):
    s = np.zeros(n)
    s[list(ranks)] = amount
    return s


def _fleet(det, steps, *, n=512, seed=0, slow_from=None, slow=None, start=0, gen=None):
    """Feed ``steps`` steps of the real-fleet null (FleetSteps); ``slow`` applies from ``slow_from``."""
    gen = gen or FleetSteps(np.random.default_rng(seed), n, FleetNoise())
    found = []
    for step in range(start, start + steps):
        on = slow is not None and (slow_from is None or step >= slow_from)
        ranks, t, groups = gen.draw(slow if on else None)
        found += det.check(step, ranks, t, groups)
    return found


@pytest.mark.parametrize(("amount", "bound", "warmup", "slack"),
                         [(0.20, 5, 200, 1.0), (0.05, 15, 500, 1.1), (0.02, 60, 1000, 1.5), (0.01, 250, 4096, 1.5)])
def test_change_after_warmup_meets_latency_targets_without_false_ranks(amount, bound, warmup, slack):
    """After a warm-up (the baseline), a slowdown on the real-fleet null is found within the
    issue's bound (the median straggler; at the false-alarm budget 2 % and 1 % have a tail to
    1.5x, and 5 % after only 500 steps of baseline one step past 15, see StragglerDetector);
    nothing else is flagged during the warm-up or after."""
    n = 512
    gen = FleetSteps(np.random.default_rng(int(amount * 1000)), n, FleetNoise())
    at_or_above_peers = np.flatnonzero(gen.peer_offset() >= 0.0)  # else a 1 % slowdown may stay faster
    stragglers = at_or_above_peers[[3, 60, 120, 180]].tolist()
    found = _fleet(StragglerDetector(), warmup + int(slack * bound), gen=gen, slow_from=warmup,
                   slow=_slow(stragglers, amount, n))
    assert sorted(f.rank for f in found) == stragglers
    latency = sorted(f.step - warmup + 1 for f in found)
    assert latency[1] <= bound and latency[-1] <= slack * bound
    for f in found:
        assert f.kind is FindingKind.STRAGGLER and f.node == "" and f.ts == 0.0
        assert f.step >= warmup and f.detector == "straggler.cusum"
        assert f.evidence["persistent"] is False
        # the alarming arm's window mean: within half the change or three of its standard errors
        stderr = f.evidence["scale_log"] / np.sqrt(f.evidence["window_steps"])
        assert f.evidence["change"] == pytest.approx(amount, abs=max(0.5 * amount, 3 * stderr, 0.006))
        assert f.z > 0 and {"arm", "drift", "threshold", "window_steps", "baseline"} <= set(f.evidence)


def test_plain_jitter_twenty_percent_from_step_zero_is_persistent_within_five_steps():
    stragglers = [5, 1000, 4000]
    found = _run(StragglerDetector(), 5, slow=_slow(stragglers, 0.2))
    assert sorted(f.rank for f in found) == stragglers
    assert all(f.evidence["persistent"] and f.slowdown == pytest.approx(0.2, abs=0.05) for f in found)


def test_seed_rule_needs_100_steps_and_misses_five_percent():
    det = SeedRule()
    found = _run(det, 120, slow=_slow([7], 0.20) + _slow([9], 0.05))
    assert [(f.rank, f.step) for f in found] == [(7, 99)]
    assert found[0].slowdown == pytest.approx(0.2, abs=0.01)
    assert found[0].evidence["run_steps"] == 100


def test_no_false_rank_under_heavy_null_model():
    """Node-correlated noise, whole-step drift and 0.1 % hiccups of 1.5-10x: 2M rank-steps, none
    flagged, and every arm's statistic stays well under its threshold."""
    det = StragglerDetector()
    peak = np.zeros(4)
    rng = np.random.default_rng(11)
    drift = 0.0
    ranks = np.arange(R)
    for step in range(500):
        t, drift = step_times(rng, R, StepNoise(), drift=drift)
        assert det.check(step, ranks, t) == []
        peak = np.maximum(peak, det.stat_.max(axis=1) / det.h_[:, 0])
    assert peak.max() < 0.8


def test_single_hiccup_and_whole_step_drift_do_not_trip():
    det = StragglerDetector()
    rng = np.random.default_rng(3)
    ranks = np.arange(512)
    for step in range(60):
        t = 2.0 * np.exp(0.02 * rng.standard_normal(512))
        if step == 10:
            t[17] *= 50.0  # one OS hiccup
        if step == 20:
            t *= 3.0  # everyone slow: a data or network phase, not a straggler
        assert det.check(step, ranks, t) == []


def test_groups_compare_within_stage_only():
    rng = np.random.default_rng(4)
    n = 1024
    ranks = np.arange(n)
    groups = (ranks // 256).astype(np.int32)
    det = StragglerDetector()
    found = []
    for step in range(20):
        t = 2.0 * np.exp(0.02 * rng.standard_normal(n)) * (1.0 + 0.3 * (groups == 3))
        t[300] *= 1.2
        found += det.check(step, ranks, t, groups)
    assert [f.rank for f in found] == [300]
    ungrouped = StragglerDetector()
    t = 2.0 * np.exp(0.02 * rng.standard_normal(n)) * (1.0 + 0.3 * (groups == 3))
    assert len(sum((ungrouped.check(s, ranks, t) for s in range(5)), [])) == 256


def test_flagged_once_per_episode_cleared_on_recovery_and_reflagged():
    det = StragglerDetector()
    n = 512
    slow = _slow([42], 0.2, n)
    first = _run(det, 40, slow=slow, n=n, seed=1)
    assert [f.rank for f in first] == [42] and det.flagged().tolist() == [42]
    assert _run(det, 400, n=n, seed=2, start=40) == []
    assert det.flagged().tolist() == []
    again = _run(det, 10, slow=slow, n=n, seed=3, start=440)
    assert [f.rank for f in again] == [42] and again[0].step >= 440


def test_seed_rule_clears_when_z_drops():
    det = SeedRule(consecutive=5)
    n = 64
    assert [f.rank for f in _run(det, 10, slow=_slow([3], 0.3, n), n=n)] == [3]
    _run(det, 1, n=n, seed=5, start=10)
    assert det.flagged().tolist() == []


def test_missing_and_new_ranks_grow_state_and_do_not_update():
    det = StragglerDetector()
    rng = np.random.default_rng(8)
    found = []
    for step in range(12):
        ranks = np.arange(64) if step < 4 else np.r_[np.arange(0, 64, 2), 100_000 + np.arange(64)]
        t = 2.0 * np.exp(0.02 * rng.standard_normal(ranks.size))
        t[ranks == 100_010] *= 1.3
        found += det.check(step, ranks, t)
    assert [f.rank for f in found] == [100_010]
    assert det.capacity_ > 100_063
    assert det.last_step_[1] == 3


def test_bad_values_are_dropped_and_counted():
    det = StragglerDetector()
    ranks = np.arange(16)
    t = np.full(16, 2.0)
    t[[1, 2, 3, 4]] = [np.nan, -1.0, np.inf, 1e9]
    assert det.check(0, ranks, t) == []
    assert det.rejected_total_ == 4
    assert det.last_step_[1] == -1 and det.last_step_[0] == 0


def test_identical_times_do_not_divide_by_zero():
    det = StragglerDetector()
    t = np.full(32, 2.0)
    t[5] = 2.2
    found = sum((det.check(s, np.arange(32), t) for s in range(5)), [])
    assert [f.rank for f in found] == [5]


def test_out_of_order_and_duplicate_steps_are_ignored_per_rank():
    det = StragglerDetector()
    ranks = np.arange(16)
    det.check(5, ranks, np.full(16, 2.0))
    before = det.stat_.copy()
    assert det.check(5, ranks, np.full(16, 9.0)) == []
    assert det.check(3, ranks, np.full(16, 9.0)) == []
    assert det.stale_total_ == 32
    np.testing.assert_array_equal(det.stat_, before)


@pytest.mark.parametrize("make", [StragglerDetector, SeedRule])
def test_malformed_calls_raise_schema_errors(make):
    det = make()
    with pytest.raises(SchemaError, match="compute_s"):
        det.check(0, np.arange(4), np.ones(3))
    with pytest.raises(SchemaError, match="groups"):
        det.check(0, np.arange(4), np.ones(4), np.zeros(3, dtype=int))
    with pytest.raises(SchemaError, match="duplicate"):
        det.check(0, np.array([1, 1, 2]), np.ones(3))
    with pytest.raises(SchemaError, match="rank ids"):
        det.check(0, np.array([-1, 2]), np.ones(2))
    with pytest.raises(SchemaError, match="step"):
        det.check(-1, np.arange(4), np.ones(4))
    with pytest.raises(SchemaError, match="ranks"):
        det.check(0, np.array([0.5, 1.5]), np.ones(2))


@pytest.mark.parametrize("params", [{"clip": 0.1}, {"drifts": (1.0,), "thresholds": (1.0, 2.0)},
                                    {"min_group": 1}, {"thresholds": (-1.0, 2.0, 3.0, 4.0)},
                                    {"min_scale": 0.0}, {"max_rank": -3}, {"clip_margin": 0.0},
                                    {"min_effect": -0.01}, {"baseline_steps": 0}, {"persistent_min": 0.0},
                                    {"freeze_at": 1.5}, {"init_steps": 0}, {"false_rate": 0.0},
                                    {"false_rate": 0.5}, {"shares": (1.0, 1.0)}, {"shares": (0.0, 1.0, 1.0, 1.0)},
                                    {"sigma_prior_steps": 0}, {"thresholds": (1.0, 2.0)}])
def test_bad_parameters_raise_config_error_on_first_update(params):
    det = StragglerDetector(**params)  # construction only stores
    with pytest.raises(ConfigError, match="StragglerDetector"):
        det.check(0, np.arange(8), np.ones(8))


def test_seed_rule_bad_parameters():
    with pytest.raises(ConfigError, match="consecutive"):
        SeedRule(consecutive=0).check(0, np.arange(8), np.ones(8))
    with pytest.raises(ConfigError, match="z must"):
        SeedRule(z=float("nan")).check(0, np.arange(8), np.ones(8))


def test_robust_z_grouped_matches_per_group_numpy():
    rng = np.random.default_rng(2)
    x = rng.normal(size=300)
    g = rng.integers(0, 5, 300)
    z, med, scale = robust_z(x, g)
    for label in range(5):
        m = g == label
        ref_med = np.median(x[m])
        ref_scale = 1.4826 * np.median(np.abs(x[m] - ref_med))
        np.testing.assert_allclose(z[m], (x[m] - ref_med) / ref_scale)
        np.testing.assert_allclose(med[m], ref_med)
        np.testing.assert_allclose(scale[m], ref_scale)
    z1, _, _ = robust_z(np.array([1.0, 2.0]), min_group=3)
    assert np.isnan(z1).all()


@pytest.mark.parametrize("make", [StragglerDetector, lambda: SeedRule(consecutive=5)])
def test_with_a_placement_a_finding_comes_out_complete(make):
    """Given the step's placement the detector names the job, node, GPU and time itself."""
    from fleethealth.detectors.assembly import AssembledStep

    rng = np.random.default_rng(3)
    det, found = make(), []
    ranks = np.arange(16)
    nodes, gpus = np.array([f"n{r // 8:04d}" for r in ranks]), (ranks % 8).astype(np.int16)
    for step in range(60):
        t = 1.0 + 0.01 * rng.standard_normal(16)
        t[11] *= 1.3
        placed = AssembledStep(job="train-1", step=step, ts=1000.0 + step, ranks=ranks, gpus=gpus, nodes=nodes,
                               compute_s=t, groups=None, complete=True)
        found += det.check(step, ranks, t, placement=placed)
    [f] = found
    assert (f.rank, f.node, f.gpu, f.job) == (11, "n0001", 3, "train-1") and f.ts == 1000.0 + f.step


# ---------------------------------------------------------------- the straggler definition on a real fleet's spread
def _steady(gen, ranks):
    """Put ``ranks`` at their stage's median speed, so an added slowdown is exactly their offset."""
    peer = gen.peer_offset()
    gen.offset_[ranks] -= peer[ranks]


def test_healthy_fleet_with_speed_bins_and_power_cap_dips_gives_no_finding():
    """512 GPUs, 1,500 steps: speed bins (σ 0.8 %, some GPUs 2 % slower than their peers for ever),
    warm slots, a third of the GPUs at their power limit dipping 0.5-3 % for up to 8 steps,
    hiccups, drift, stage offsets and missing samples. A detector without a per-rank baseline
    would see the 2 % GPUs as slow all the time; this one reports nothing."""
    noise = FleetNoise(speed_sigma=0.008, cap_frac=0.33, cap_rate=0.01)
    gen = FleetSteps(np.random.default_rng(21), 512, noise)
    assert gen.peer_offset().max() > 0.02 and gen.capped_.sum() > 120
    det = StragglerDetector()
    assert _fleet(det, 1500, gen=gen) == []
    assert det.flagged().size == 0
    assert (det.stat_.max(axis=1) / det.h_[:, 0]).max() < 1.0


def test_always_slower_gpus_persistent_stragglers_and_a_change_after_warmup():
    """0.7 % and 1 % slower from the start: not stragglers. 4 % slower from the start: a persistent
    straggler (flagged as such). 5 % slower from step 1,000: a change, found within 15 steps."""
    n = 512
    gen = FleetSteps(np.random.default_rng(22), n, FleetNoise())
    _steady(gen, [10, 20, 30, 40])
    slow = _slow([10, 20, 30], 0.0, n)
    slow[[10, 20, 30]] = [0.007, 0.01, 0.04]
    det = StragglerDetector()
    found = _fleet(det, 1000, gen=gen, slow=slow)
    assert [(f.rank, f.evidence["persistent"]) for f in found] == [(30, True)]
    assert found[0].slowdown == pytest.approx(0.04, abs=0.015) and found[0].step < 200
    slow[40] = 0.05
    later = _fleet(det, 500, gen=gen, slow=slow, start=1000)
    assert [(f.rank, f.evidence["persistent"]) for f in later] == [(40, False)]
    assert later[0].step < 1000 + 15
    assert later[0].evidence["change"] == pytest.approx(0.05, abs=0.02)
    assert later[0].evidence["baseline"] == pytest.approx(0.0, abs=0.003)


def test_power_cap_dips_and_hiccups_after_warmup_do_not_accumulate():
    """After warm-up, rank 7 dips 3 % for 8 steps every 100 steps and rank 9 has a 10x hiccup every
    50 steps: sustained evidence never builds, nothing is reported."""
    n = 512
    gen = FleetSteps(np.random.default_rng(23), n, FleetNoise(hiccup_p=0.0, cap_frac=0.0))
    det = StragglerDetector()
    assert _fleet(det, 1000, gen=gen) == []
    for step in range(1000, 3000):
        slow = np.zeros(n)
        slow[7] = 0.03 / 0.97 if step % 100 < 8 else 0.0
        slow[9] = 9.0 if step % 50 == 0 else 0.0
        ranks, t, groups = gen.draw(slow)
        assert det.check(step, ranks, t, groups) == []
    assert det.stat_[:, [7, 9]].max() < 0.5 * det.h_.min()


# ---------------------------------------------------------------- the false-alarm budget and each rank's own scale
def test_thresholds_follow_the_false_alarm_budget_by_siegmund():
    """Each arm's threshold is where Siegmund's run length meets its share of ``false_rate``;
    explicit thresholds override the budget."""
    assert siegmund_rate(0.5, siegmund_threshold(0.5, 1e9)) == pytest.approx(1e-9, rel=1e-3)
    det = StragglerDetector()
    det.check(0, np.arange(8), np.ones(8))
    shares = np.asarray(det.shares) / np.sum(det.shares)
    np.testing.assert_allclose(det.rate_, det.false_rate * shares, rtol=1e-3)
    assert det.rate_.sum() * 16384 * 10 * 86400 < 1.0  # under one a job-day at 16,384 ranks, 10 steps/s
    stricter = StragglerDetector(false_rate=det.false_rate / 10)
    stricter.check(0, np.arange(8), np.ones(8))
    assert (stricter.h_ > det.h_).all()
    fixed = StragglerDetector(thresholds=(48.0, 20.0, 9.5, 6.5))
    fixed.check(0, np.arange(8), np.ones(8))
    assert fixed.h_[:, 0].tolist() == [48.0, 20.0, 9.5, 6.5]


def _noisy_fleet(det, steps, sigma, *, slow=None, slow_from=0, seed=31, start=0):
    rng = np.random.default_rng(seed)
    n = sigma.size
    found = []
    for step in range(start, start + steps):
        t = 2.0 * np.exp(sigma * rng.standard_normal(n))
        if slow is not None and step >= slow_from:
            t *= 1.0 + slow
        found += det.check(step, np.arange(n), t)
    return found


def test_a_noisier_rank_is_scored_on_its_own_scale_and_a_quieter_one_is_found_sooner():
    """256 ranks at 2 % jitter, 16 at 5 % and 16 at 0.5 %: against the group's spread the noisy
    ranks would alarm all the time; on their own residual scale they do not. A 2 % change on a quiet
    rank (4 of its sigmas) is found within a dozen steps, far inside the 60 of a 2 % rank."""
    sigma = np.full(288, 0.02)
    sigma[256:272], sigma[272:] = 0.05, 0.005
    det = StragglerDetector()
    assert _noisy_fleet(det, 2000, sigma) == []
    own = np.sqrt(det.sig2_[:288])
    np.testing.assert_allclose(own[:272], sigma[:272], rtol=0.15)
    # the quiet ones still carry some of the group's spread they started from (64 steps' weight)
    assert (own[272:] > 0.005).all() and (own[272:] < 0.008).all()
    found = _noisy_fleet(det, 30, sigma, slow=_slow([280], 0.02, 288), slow_from=2000, start=2000, seed=32)
    assert [f.rank for f in found] == [280] and found[0].step < 2000 + 12


def test_a_storm_of_hiccups_does_not_accumulate():
    """Rank 5 has a 2-10x hiccup on one step in twenty for 1,000 steps after its baseline (a flaky
    host, 50 times the null model's rate): winsorised at each arm's clip, every hiccup adds at most
    ``clip_margin`` and the arms drain at ``k`` per step in between, so the storm cannot add up to
    a finding. (One step in five would: 20 % of steps at 2-10x is a rank slowing the job.)"""
    n = 256
    sigma = np.full(n, 0.02)
    det = StragglerDetector()
    assert _noisy_fleet(det, 1000, sigma) == []
    rng = np.random.default_rng(33)
    peak = 0.0
    for step in range(1000, 2000):
        t = 2.0 * np.exp(0.02 * rng.standard_normal(n))
        if step % 20 == 0:
            t[5] *= rng.uniform(2.0, 10.0)
        assert det.check(step, np.arange(n), t) == []
        peak = max(peak, float((det.stat_[:, 5] / det.h_[:, 0]).max()))
    assert peak < 0.5
