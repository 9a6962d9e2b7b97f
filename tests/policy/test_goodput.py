"""Goodput, ETTR and the interruption timeline with its four MTTR phases (seeds 000 and 002)."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.errors import ConfigError, SchemaError
from fleethealth.policy.goodput import (
    Interruption,
    distinct_stops,
    ettr,
    goodput,
    ideal_step_time,
    timeline,
    window_goodput,
)
from fleethealth.schema import Event, EventKind


def _event(ts, node, **data):
    base = {"cause": "gpu_fell_off_bus", "detected_by": "xid", "lost_steps": 100, "restart_s": 600.0,
            "detection_s": 30.0, "isolation_s": 120.0, "reconfiguration_s": 60.0, "reload_s": 390.0}
    return Event(node=node, ts=ts, kind=EventKind.INTERRUPTION, job="train-1", step=1000,
                 data={**base, **data})


def test_ideal_step_excludes_spikes_by_median_plus_3_mad():
    rng = np.random.default_rng(7)
    steps = 2.0 + rng.normal(0, 0.01, 1000)
    steps[::100] = 12.0   # a checkpoint stall every 100 steps
    ideal = ideal_step_time(steps)
    assert ideal == pytest.approx(2.0, abs=0.002)
    assert ideal == pytest.approx(steps[steps < 3].mean(), abs=0.002)    # the stalls are out
    r = goodput(steps)
    assert r.excluded_steps >= 10 and r.actual_step_s == pytest.approx(steps.mean())
    assert r.goodput == pytest.approx(ideal / steps.mean())
    assert goodput(steps, overhead=0.1).goodput == pytest.approx(0.9 * ideal / steps.mean())


def test_straggler_phase_shows_in_goodput():
    """Seed 000 §6: a 20 %-slow stretch costs goodput while every health check stays green."""
    steps = np.r_[np.full(800, 2.0), np.full(200, 2.4)]
    r = goodput(steps)
    assert r.ideal_step_s == 2.0                           # MAD 0: the slow stretch is excluded
    assert r.goodput == pytest.approx(2.0 / steps.mean())  # 1 / 1.04
    with pytest.raises(ConfigError):
        goodput([])
    with pytest.raises(ConfigError):
        goodput([2.0, float("nan")])
    with pytest.raises(ConfigError, match="overhead"):
        goodput([2.0], overhead=1.5)


def test_ettr_of_a_30_day_run_with_233_interruptions():
    """Seed 000: 233 interruptions at R = 600 s cost 5.39 % of a 30-day run by restart alone."""
    month = 30 * 86400.0
    recs = [Interruption(job="j", ts=k * month / 233, node=f"n{k:04d}", cause="gpu", detected_by="xid",
                         restart_s=600.0) for k in range(233)]
    tl = timeline("j", recs, 0.0, month)
    assert tl.restart_s == 233 * 600
    assert tl.ettr == pytest.approx(1 - 0.0539, abs=0.0001)
    assert ettr(0.9, 1.0) == pytest.approx(0.9)
    with pytest.raises(ConfigError):
        ettr(2.0, 1.0)


def test_timeline_holds_causes_and_four_phases():
    events = [_event(1000.0, "n0019"), _event(9000.0, "n0002", cause="hang", detected_by="watchdog",
                                              detection_s=90.0, reload_s=300.0, lost_steps=50),
              Event(node="n0003", ts=5000.0, kind=EventKind.XID, job="train-1", code=79),       # not an interruption
              _event(4000.0, "n0005").__class__(node="n0005", ts=4000.0, kind=EventKind.INTERRUPTION,
                                                job="other", data={"cause": "x"})]                # other job
    tl = timeline("train-1", events, 0.0, 36_000.0, ideal_step_s=2.0)
    assert [i.node for i in tl.interruptions] == ["n0019", "n0002"]
    first = tl.interruptions[0]
    assert first.cause == "gpu_fell_off_bus" and first.detected_by == "xid" and first.step == 1000
    assert first.mttr_s == 600.0
    assert tl.phase_totals() == {"detection_s": 120.0, "isolation_s": 240.0, "reconfiguration_s": 120.0,
                                 "reload_s": 690.0}
    assert tl.binding_phase == "reload_s"
    assert tl.lost_steps == 150 and tl.lost_work_s == 300.0
    assert tl.overhead == pytest.approx((600 + 600 + 300) / 36_000)
    obj = tl.to_obj()
    assert obj["interruptions"][1]["cause"] == "hang" and obj["nodes"] == {"n0019": 1, "n0002": 1}


def test_interruption_record_validation():
    with pytest.raises(SchemaError, match="data.restart_s"):
        Interruption.from_event(_event(1.0, "n1", restart_s=-5))
    with pytest.raises(SchemaError, match="data.lost_steps"):
        Interruption.from_event(_event(1.0, "n1", lost_steps=1.5))
    with pytest.raises(SchemaError, match="kind"):
        Interruption.from_event(Event(node="n1", ts=1.0, kind=EventKind.XID, job="j"))
    missing = Interruption.from_event(Event(node="n1", ts=1.0, kind=EventKind.INTERRUPTION, job="j",
                                            data={"detection_s": 10.0, "reload_s": 20.0}))
    assert missing.restart_s == 30.0 and missing.cause == "unknown"


def test_window_goodput_collapses_when_restarts_eat_the_hour():
    healthy = np.arange(1, 1801) * 2.0                       # 1800 steps of 2 s in the hour
    assert window_goodput(healthy, 2.0, [], now=3600.0) == pytest.approx(1.0)
    # two 25-minute outages: only 600 s of steps, 100 of them replayed
    broken = np.r_[np.arange(1, 151) * 2.0, 1800 + np.arange(1, 151) * 2.0]
    lost = [Interruption("j", 300.0, "n1", "gpu", "xid", lost_steps=50),
            Interruption("j", 2100.0, "n2", "gpu", "xid", lost_steps=50)]
    g = window_goodput(broken, 2.0, lost, now=3600.0)
    assert g == pytest.approx((300 - 100) * 2.0 / 3600)
    assert g < 0.3


def test_a_stop_derived_twice_is_counted_once_and_outside_records_each_count():
    first = _event(100.0, "n1", interruption_id="stop-a", detection_s=30.0)
    again = _event(140.0, "n1", interruption_id="stop-a", detection_s=70.0)  # re-derived after a restart
    other = _event(900.0, "n2", interruption_id="stop-b")
    outside = [_event(500.0, "n3"), _event(600.0, "n3")]  # no interruption id: each its own stop
    xid = Event(node="n1", ts=120.0, kind=EventKind.XID, job="train-1", code=79)
    kept = distinct_stops([other, again, xid, *outside, first])
    assert [e.ts for e in kept] == [100.0, 500.0, 600.0, 900.0]
    assert kept[0].data["detection_s"] == 30.0  # the first record of a stop is the one kept
    tl = timeline("train-1", kept, 0.0, 1000.0)
    assert len(tl.interruptions) == 4 and tl.lost_steps == 400
