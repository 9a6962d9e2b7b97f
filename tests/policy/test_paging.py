"""Paging on patterns (seed 000 R5): each rule and its negative case; independent failures are
counted and never paged."""

from __future__ import annotations

import pytest

from fleethealth.errors import ConfigError
from fleethealth.policy.goodput import Interruption
from fleethealth.policy.paging import Pager, PageRule
from fleethealth.schema import Action, Guard

H = 3600.0
BASE = 1 / 3.1   # seed 000: one interruption every 3.1 h at 16,384 GPUs


def _i(ts, node, step, job="train-1", cause="gpu"):
    return Interruption(job=job, ts=ts, node=node, cause=cause, detected_by="watchdog", step=step,
                        lost_steps=10, restart_s=600.0)


def _rules(report):
    return [p.rule for p in report.pages]


def test_independent_hardware_failures_are_counted_not_paged():
    """Four failures in 12 h on four nodes at four steps: routine at MTBF 3.1 h."""
    history = [_i(k * 3 * H, f"n{k:04d}", 1000 + 500 * k) for k in range(4)]
    report = Pager(baseline_per_h=BASE).evaluate(history, now=12 * H, goodput_1h=0.9)
    assert report.pages == ()
    assert report.interruptions == 4 and report.independent == 4
    assert report.to_recommendations(12 * H) == []


def test_same_node_twice_pages_quarantine_ineffective():
    history = [_i(0, "n0417", 100, job="a"), _i(5 * H, "n0003", 900), _i(8 * H, "n0417", 2000, job="b")]
    report = Pager(baseline_per_h=BASE).evaluate(history, now=9 * H)
    assert _rules(report) == [PageRule.QUARANTINE_INEFFECTIVE]
    page = report.pages[0]
    assert page.node == "n0417" and "quarantine ineffective" in page.reason
    assert page.evidence["count"] == 2 and page.evidence["jobs"] == ["a", "b"]
    assert report.independent == 1
    [rec] = report.to_recommendations(9 * H)
    assert rec.action is Action.PAGE and rec.guard is Guard.NEEDS_HUMAN and rec.node == "n0417"


def test_same_node_twice_negative_outside_recent_window():
    history = [_i(0, "n0417", 100), _i(30 * H, "n0417", 2000)]
    assert Pager(baseline_per_h=BASE, recent_s=24 * H).evaluate(history, now=31 * H).pages == ()


def test_failure_rate_beyond_five_times_baseline_pages():
    history = [_i(H + k * 600, f"n{k:04d}", 100 * k + 7) for k in range(4)]   # 4 in the last hour
    report = Pager(baseline_per_h=BASE).evaluate(history, now=H + 3000)
    assert _rules(report) == [PageRule.FAILURE_RATE_ANOMALY]
    ev = report.pages[0].evidence
    assert ev["observed_per_h"] == pytest.approx(4.0) and ev["observed_per_h"] > 5 * BASE
    assert report.independent == 0


def test_failure_rate_negative_at_baseline():
    """One failure an hour is ~3x the baseline: counted, not paged; two coincident ones do not page either."""
    history = [_i(k * H, f"n{k:04d}", 100 * k + 7) for k in range(6)]
    assert Pager(baseline_per_h=BASE).evaluate(history, now=5.5 * H).pages == ()
    pair = [_i(10 * H, "n0001", 5), _i(10 * H + 60, "n0002", 9)]
    assert Pager(baseline_per_h=BASE).evaluate(pair, now=10.5 * H).pages == ()


def test_failure_rate_baseline_estimated_from_history():
    old = [_i(k * 3.1 * H, f"n{k:04d}", 11 * k + 1) for k in range(10)]       # ~1 per 3.1 h for 31 h
    burst = [_i(40 * H + k * 300, f"n{50 + k:04d}", 7000 + k) for k in range(4)]
    pager = Pager()
    report = pager.evaluate(old + burst, now=40 * H + 1500)
    assert _rules(report) == [PageRule.FAILURE_RATE_ANOMALY]
    assert report.baseline_rate_per_h == pytest.approx(10 / (40 * H + 1500 - H) * H, rel=1e-6)
    # too little history: no baseline, no rate page
    assert Pager().evaluate(burst, now=40 * H + 1500).pages == ()


def test_same_step_repeatedly_is_deterministic_data_or_code():
    history = [_i(0, "n0001", 4711), _i(2 * H, "n0002", 4711), _i(4 * H, "n0003", 4711)]
    report = Pager(baseline_per_h=BASE).evaluate(history, now=5 * H)
    assert _rules(report) == [PageRule.DETERMINISTIC_FAILURE]
    assert "data or code" in report.pages[0].reason and report.pages[0].evidence["step"] == 4711


def test_same_step_negative_other_jobs_or_steps():
    history = [_i(0, "n0001", 4711, job="a"), _i(2 * H, "n0002", 4711, job="b"), _i(4 * H, "n0003", 4712, job="a")]
    assert Pager(baseline_per_h=BASE).evaluate(history, now=5 * H).pages == ()


def test_goodput_collapse_and_negative():
    history = [_i(0, "n0001", 10)]
    assert _rules(Pager(baseline_per_h=BASE).evaluate(history, now=H, goodput_1h=0.25)) == [PageRule.GOODPUT_COLLAPSE]
    assert Pager(baseline_per_h=BASE).evaluate(history, now=H, goodput_1h=0.35).pages == ()
    assert Pager(baseline_per_h=BASE).evaluate(history, now=H, goodput_1h=None).pages == ()


def test_a_pattern_pages_once_then_is_suppressed():
    pager = Pager(baseline_per_h=BASE)
    history = [_i(0, "n0417", 100), _i(H, "n0417", 200)]
    assert len(pager.evaluate(history, now=2 * H).pages) == 1
    again = pager.evaluate(history, now=3 * H)
    assert again.pages == () and again.suppressed == 1
    restored = Pager(baseline_per_h=BASE)
    restored.load_state(pager.to_state())
    assert restored.evaluate(history, now=3 * H).pages == ()


def test_future_interruptions_ignored_and_params_checked():
    assert Pager(baseline_per_h=BASE).evaluate([_i(10 * H, "n1", 1), _i(11 * H, "n1", 2)], now=H).interruptions == 0
    with pytest.raises(ConfigError, match="rate_factor"):
        Pager(rate_factor=0)


def test_a_lasting_anomaly_or_collapse_pages_once_per_repage_interval_not_hourly():
    """The anomaly and goodput-collapse keys used to carry the hour, so each new hour paged again."""
    pager = Pager(baseline_per_h=BASE, repage_after_s=24 * H)
    sent = []
    for hour in range(1, 30):       # a failure every 10 min for 29 hours, goodput low throughout
        now = hour * H + 3000
        history = [_i(t, f"n{int(t) // 600:05d}", int(t) // 600 * 100 + 7) for t in range(0, int(now), 600)]
        sent += [(hour, p.rule) for p in pager.evaluate(history, now=now, goodput_1h=0.2).pages]
    assert [r for h, r in sent if h < 25] == [PageRule.FAILURE_RATE_ANOMALY, PageRule.GOODPUT_COLLAPSE]
    assert sorted(h for h, _ in sent) == [1, 1, 25, 25]   # again only after repage_after_s
    assert len(pager.paged_) == 2                         # one key per rule, old entries pruned


def test_a_repage_is_a_new_recommendation():
    pager = Pager(baseline_per_h=BASE, repage_after_s=H)
    history = [_i(0, "n0417", 100), _i(H, "n0417", 200)]
    first = pager.evaluate(history, now=H).to_recommendations(H)
    later = pager.evaluate(history, now=2.5 * H).to_recommendations(2.5 * H)
    assert len(first) == len(later) == 1 and first[0].id != later[0].id


def test_paged_entries_older_than_the_repage_interval_are_pruned():
    pager = Pager(baseline_per_h=BASE, repage_after_s=2 * H)
    pager.evaluate([_i(0, "n0417", 100), _i(H, "n0417", 200)], now=H)
    assert list(pager.paged_) == ["quarantine_ineffective:n0417"]
    pager.evaluate([], now=4 * H)
    assert pager.paged_ == {}


def test_a_page_decided_again_after_a_restart_has_the_same_id():
    """A restarted runner's pager starts empty and sees the same interruptions at another decision
    time (its batches end elsewhere): the page is the same recommendation, not a second one."""
    history = [_i(0, "n0417", 100), _i(H, "n0417", 200)]
    first = Pager(baseline_per_h=BASE).evaluate(history, now=H).to_recommendations(H)
    again = Pager(baseline_per_h=BASE).evaluate(history, now=H + 17.3).to_recommendations(H + 17.3)
    assert len(first) == len(again) == 1
    assert first[0].id == again[0].id and first[0].ts != again[0].ts
