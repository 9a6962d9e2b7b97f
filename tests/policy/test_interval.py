"""The checkpoint interval from measured MTBF, checkpoint cost and restart cost (seed 000 §3, §6; seed 002)."""

from __future__ import annotations

import math

import pytest

from fleethealth.errors import ConfigError, SchemaError
from fleethealth.payloads.checkpoint import checkpoint_event
from fleethealth.payloads.checkpoint_cost import CheckpointCost, checkpoint_cost_event
from fleethealth.policy.budget import daly_interval, overhead_terms, young_interval
from fleethealth.policy.interval import IntervalEstimator, JobSpan
from fleethealth.schema import Event, EventKind

H = 3600.0
DAY = 86400.0


def _stop(job, ts, *, sid, restarted=True, phases=(30.0, 60.0, 300.0, 150.0)):
    d, i, c, r = phases
    return Event(node="gpu-a17", ts=ts, kind=EventKind.INTERRUPTION, job=job, step=100,
                 data={"interruption_id": sid, "cause": "hang", "detected_by": "hang", "restarted": restarted,
                       "detection_s": d, "isolation_s": i, "reconfiguration_s": c, "reload_s": r,
                       "restart_s": i + c + r})


def _costs(job, ts0, n, every, blocking, write=0.0):
    return [checkpoint_cost_event(ts=ts0 + k * every, step=100 * k, blocking_s=blocking, write_s=write, job=job,
                                  node="gpu-a17") for k in range(n)]


def _ckpts(job, ts0, n, every):
    return [checkpoint_event(ts=ts0 + k * every, step=100 * k, uri=f"s3://b/{k}", last_verified_step=None,
                             job=job, node="gpu-a17") for k in range(n)]


def test_mtbf_with_no_interruption_is_the_fleets_expectation_for_the_job_size():
    est = IntervalEstimator(prior_failures_per_node_day=6.5e-3, prior_weight_s=DAY, window_s=7 * DAY)
    span = JobSpan("llm", nodes=128, first_ts=0.0, last_ts=10 * H)
    a = est.estimate("llm", at=10 * H, spans=[span], interruptions=[])
    prior_mtbf = DAY / (6.5e-3 * 128)
    assert a.basis["mtbf"]["prior_mtbf_s"] == pytest.approx(prior_mtbf)
    assert a.mtbf_s == pytest.approx(prior_mtbf * (DAY + 10 * H) / DAY)   # finite; clean hours count, weighted
    assert a.basis["mtbf"]["naive_mtbf_s"] is None
    assert a.basis["c"]["source"] == "default" and a.c_s == 30.0
    assert a.basis["r"]["source"] == "default" and a.r_s == 600.0
    # twice the nodes, half the MTBF: a synchronous job fails when any node fails
    b = est.estimate("llm", at=10 * H, spans=[JobSpan("llm", 256, 0.0, 10 * H)], interruptions=[])
    assert b.mtbf_s == pytest.approx(a.mtbf_s / 2)


def test_the_jobs_own_interruptions_and_the_fleet_pool_into_the_mtbf():
    est = IntervalEstimator(prior_failures_per_node_day=6.5e-3, prior_node_days=1000.0, prior_weight_s=DAY,
                            window_s=7 * DAY)
    spans = [JobSpan("llm", 64, 0.0, 48 * H), JobSpan("other", 32, 0.0, 96 * H)]
    stops = [_stop("llm", 10 * H, sid="a"), _stop("llm", 20 * H, sid="b"), _stop("llm", 20 * H, sid="b"),
             _stop("other", 30 * H, sid="c"), _stop("other", 60 * H, sid="d", restarted=False)]
    a = est.estimate("llm", at=96 * H, spans=spans, interruptions=stops)
    lam_node = (6.5e-3 * 1000 + 2) / (1000 + 32 * 4)                 # per node-day: 32 nodes for 4 days
    prior_mtbf = DAY / (lam_node * 64)
    expected = (DAY + 48 * H) / (DAY / prior_mtbf + 2)               # the duplicate of "b" counts once
    assert a.mtbf_s == pytest.approx(expected)
    m = a.basis["mtbf"]
    assert (m["job_interruptions"], m["fleet_interruptions"], m["fleet_jobs"]) == (2, 2, 1)
    assert m["fleet_rate_per_node_day"] == pytest.approx(lam_node) and m["naive_mtbf_s"] == pytest.approx(24 * H)
    assert a.r_s == pytest.approx(30 + 60 + 300 + 150) and a.basis["r"] == {"source": "job", "samples": 2}
    # a job with no restart of its own takes the fleet's measured restarts ("d" did not restart)
    c = est.estimate("calm", at=96 * H, spans=[*spans, JobSpan("calm", 8, 0.0, 96 * H)], interruptions=stops)
    assert c.basis["r"] == {"source": "fleet", "samples": 3}


def test_recommended_interval_and_overheads_are_the_budget_arithmetic():
    est = IntervalEstimator(window_s=7 * DAY, min_interval_s=1.0)
    span = JobSpan("llm", 16, 0.0, 24 * H)
    stops = [_stop("llm", k * 4 * H, sid=str(k)) for k in range(1, 6)]
    costs = _costs("llm", 100.0, 30, 1800.0, blocking=2.0, write=40.0) + _costs("llm", 50.0, 1, 1.0, 2.0 + 30 * 4.0)
    a = est.estimate("llm", at=24 * H, spans=[span], interruptions=stops, costs=costs,
                     checkpoints=_ckpts("llm", 100.0, 30, 1800.0))
    # C: the mean blocking of the last 20 saves (the one early slow save has dropped out)
    assert a.c_s == pytest.approx(2.0) and a.basis["c"] == {"source": "measured", "samples": 20, "write_s_max": 40.0}
    assert a.interval_s_recommended == pytest.approx(young_interval(2.0, a.mtbf_s))
    assert a.basis["interval"]["daly_s"] == pytest.approx(daly_interval(2.0, a.mtbf_s))
    assert a.interval_s_now == pytest.approx(1800.0)
    assert a.overhead_now == pytest.approx(overhead_terms(2.0, 1800.0, a.mtbf_s, a.r_s).overhead)
    assert a.overhead_at_optimum == pytest.approx(overhead_terms(2.0, a.interval_s_recommended, a.mtbf_s,
                                                                 a.r_s).overhead)
    assert a.overhead_at_optimum < a.overhead_now
    assert a.restart_term == pytest.approx(a.r_s / a.mtbf_s)
    # the background write is a floor: no checkpoint before the last one is written
    slow = _costs("llm", 100.0, 5, 1800.0, blocking=0.01, write=900.0)
    b = est.estimate("llm", at=24 * H, spans=[span], interruptions=stops, costs=slow)
    assert young_interval(0.01, b.mtbf_s) < 900.0 and b.interval_s_recommended == 900.0


def test_a_flaky_rack_shortens_the_interval_as_its_stops_arrive():
    est = IntervalEstimator(window_s=7 * DAY)
    span = JobSpan("llm", 32, 0.0, 72 * H)
    costs = _costs("llm", 0.0, 100, 600.0, blocking=5.0)
    stops = [_stop("llm", 12 * H, sid="first")] + [_stop("llm", 40 * H + k * H, sid=f"rack{k}") for k in range(8)]
    seen = [est.estimate("llm", at=t * H, spans=[span], interruptions=stops, costs=costs)
            for t in (24, 40.5, 44, 48, 72)]
    intervals = [a.interval_s_recommended for a in seen]
    assert intervals[1] < intervals[0] and intervals[2] < intervals[1] and intervals[3] < intervals[2]
    assert intervals[3] < 0.5 * intervals[0]
    assert [a.basis["mtbf"]["job_interruptions"] for a in seen] == [1, 2, 6, 9, 9]


def test_old_records_leave_the_window():
    est = IntervalEstimator(window_s=24 * H)
    span = JobSpan("llm", 8, 0.0, 100 * H)
    a = est.estimate("llm", at=100 * H, spans=[span], interruptions=[_stop("llm", 10 * H, sid="old")])
    assert a.basis["mtbf"]["job_interruptions"] == 0 and a.basis["mtbf"]["job_exposure_s"] == pytest.approx(24 * H)


def test_unreadable_records_are_counted_not_raised():
    est = IntervalEstimator()
    bad_stop = Event(node="n", ts=5.0, kind=EventKind.INTERRUPTION, job="llm", data={"detection_s": -3})
    bad_cost = Event(node="n", ts=5.0, kind=EventKind.CHECKPOINT_COST, job="llm", step=1, data={"blocking_s": "x"})
    a = est.estimate("llm", at=10.0, spans=[JobSpan("llm", 1, 0.0, 10.0)], interruptions=[bad_stop],
                     costs=[bad_cost])
    assert a.basis["unreadable"] == 2 and a.basis["c"]["source"] == "default"


@pytest.mark.parametrize("params, name", [({"window_s": 0}, "window_s"), ({"recent": 0}, "recent"),
                                          ({"method": "guess"}, "method"),
                                          ({"prior_failures_per_node_day": -1}, "prior_failures_per_node_day"),
                                          ({"prior_weight_s": 0}, "prior_weight_s"),
                                          ({"min_interval_s": 10.0, "max_interval_s": 5.0}, "min_interval_s")])
def test_bad_parameters_name_themselves(params, name):
    with pytest.raises(ConfigError, match=name):
        IntervalEstimator(**params).estimate("llm", at=1.0, spans=[], interruptions=[])


def test_checkpoint_cost_record_round_trip_and_bad_values():
    ev = checkpoint_cost_event(ts=3.0, step=40, blocking_s=0.5, write_s=4.5, uri="s3://b/40", job="llm")
    assert ev.kind is EventKind.CHECKPOINT_COST and ev.step == 40
    assert CheckpointCost.from_event(ev) == CheckpointCost(40, 0.5, 4.5, "s3://b/40")
    for bad, name in (({"blocking_s": -1.0}, "blocking_s"), ({"blocking_s": math.nan}, "blocking_s"),
                      ({"blocking_s": 1.0, "write_s": True}, "write_s"), ({"blocking_s": 1.0, "step": -2}, "step")):
        with pytest.raises(SchemaError, match=name):
            CheckpointCost.from_data({"step": 1, **bad})
