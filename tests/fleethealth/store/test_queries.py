"""The named queries on real chDB: the typed writers and readers of every core table (columnar
inserts, regrouped reads, filters), and the named application queries."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fleethealth.errors import ConfigError
from fleethealth.schema import (
    Action,
    ClockReason,
    Event,
    EventKind,
    Finding,
    FindingKind,
    Guard,
    Recommendation,
    StepBatch,
    Telemetry,
)
from fleethealth.store import Store


# ---------------------------------------------------------------- round trips
def test_telemetry_round_trip(store: Store) -> None:
    samples = [Telemetry.from_columns(f"n{i:04d}", "r00", 1_700_000_000.5 + i, [0, 1, 2], nic_util=0.25,
                                      model="H100", uuid=("u0", "u1", "u2"), temp_c=[60.0, 61.0, 90.0 + i],
                                      clock_reasons=[0, 0, float(ClockReason.HW_THERMAL)])
               for i in range(4)]
    assert store.insert_telemetry(samples) == 12
    res = store.query("SELECT node, gpu, toUnixTimestamp64Milli(ts) AS ms, uuid, nic_util, temp_c, clock_reasons, "
                      "power_w FROM gpu_samples ORDER BY node, gpu")
    rows = res.dicts()
    assert len(rows) == 12
    assert rows[2] == {"node": "n0000", "gpu": 2, "ms": 1_700_000_000_500, "uuid": "u2", "nic_util": 0.25,
                       "temp_c": 90.0, "clock_reasons": 64.0, "power_w": rows[2]["power_w"]}
    assert math.isnan(rows[2]["power_w"])  # not reported stays NaN
    assert res.column("temp_c")[-1] == 93.0


def test_steps_round_trip_columnar(store: Store, make_batches: Callable[..., list[StepBatch]]) -> None:
    batches = make_batches()
    assert store.insert_steps(batches) == 5 * 3 * 8
    res = store.query("SELECT step, rank, node, gpu, compute_s, rank_group, toUnixTimestamp64Milli(ts) "
                      "FROM rank_steps WHERE job = {j:String} ORDER BY step, rank", {"j": "train-1"})
    step, rank, node, gpu, compute, group, ms = map(np.array, zip(*res.rows, strict=True))
    np.testing.assert_array_equal(compute, np.concatenate([b.compute_s for b in batches]))
    np.testing.assert_array_equal(rank, np.concatenate([b.ranks for b in batches]))
    assert set(group[node == "n0000"]) == {0} and set(group[node != "n0000"]) == {-1}
    assert ms[-1] == 1_700_000_008_000 and step[-1] == 4 and gpu[-1] == 7


def test_steps_reader_regroupsmake_batches(store: Store, make_batches: Callable[..., list[StepBatch]]) -> None:
    batches = make_batches(steps=4, nodes=3)
    store.insert_steps(batches)
    store.insert_steps(batches[:3])  # a replayed step: FINAL keeps one copy per (job, step, rank)
    back = store.steps("train-1")
    assert [(b.step, b.node) for b in back] == [(b.step, b.node) for b in batches]
    for got, sent in zip(back, batches, strict=True):
        np.testing.assert_array_equal(got.ranks, sent.ranks)
        np.testing.assert_array_equal(got.gpus, sent.gpus)
        np.testing.assert_array_equal(got.compute_s, sent.compute_s)
        assert got.ts == sent.ts and (got.groups is None) == (sent.groups is None)
    assert [b.step for b in store.steps("train-1", first_step=1, last_step=2, node="n0002")] == [1, 2]
    assert store.steps("other-job") == []


def test_telemetry_reader_regroups_samples(store: Store) -> None:
    samples = [Telemetry.from_columns(f"n{i % 2:04d}", "r00", 100.0 + i, [0, 1], nic_util=0.5, model="H100",
                                      temp_c=[60.0 + i, 70.0 + i]) for i in range(4)]
    store.insert_telemetry(samples)
    back = store.telemetry(node="n0001")
    assert [t.ts for t in back] == [101.0, 103.0]
    np.testing.assert_array_equal(back[1].columns["temp_c"], [63.0, 73.0])
    assert math.isnan(back[0].columns["power_w"][0]) and back[0].uuid == () and back[0].model == "H100"
    window = store.telemetry(since=101.0, until=103.0)  # ordered by node, then time
    assert [(t.node, t.ts) for t in window] == [("n0000", 102.0), ("n0001", 101.0)]


@pytest.mark.parametrize("dedup", [True, False])
def test_events_round_trip(store: Store, dedup: bool) -> None:
    events = [Event(node="n0019", ts=640.0, kind=EventKind.XID, gpu=6, code=79, data={"severity": "fatal"}),
              Event(node="n0030", ts=600.25, kind=EventKind.SDC_CHECK, job="train-1", gpu=5, rank=245, step=300,
                    message="selfcheck mismatch", data={"check": "selfcheck", "passed": False,
                                                        "digests": ["aa", "bb"], "tolerance": None})]
    store.insert_events(events, dedup_token="ev-1" if dedup else None)
    store.insert_events(events, dedup_token="ev-1" if dedup else None)  # a replay
    assert store.events() == sorted(events, key=lambda e: e.ts)
    assert store.events(kind="xid") == [events[0]]
    assert store.events(node="n0030", job="train-1") == [events[1]]
    assert store.events(kind="hang_report") == []


def test_findings_round_trip_keep_ids_and_filter(store: Store, make_finding: Callable[..., Finding]) -> None:
    findings = [make_finding(), make_finding("n0021", 150), make_finding("n0007", 50, FindingKind.FAILURE_RISK)]
    assert store.insert_findings(findings) == 3
    store.insert_findings(findings[:1])  # replayed without a token: ReplacingMergeTree keeps one
    back = store.findings()
    assert back == sorted(findings, key=lambda f: (f.ts, f.id))
    assert [f.id for f in store.findings(node="n0013")] == [findings[0].id]
    stored_ids = set(store.query("SELECT id FROM findings").column("id"))
    assert stored_ids == {f.id for f in findings}  # ids survive the exact event time (ts_s)
    assert store.findings(kind="failure_risk") == [findings[2]]
    assert store.findings(since=1_700_000_398.2) == []
    assert len(store.findings(until=1_700_000_399.0, limit=2)) == 2
    with pytest.raises(ConfigError):
        store.findings(limit=-1)


def test_recommendations_round_trip(store: Store, make_finding: Callable[..., Finding]) -> None:
    recs = [Recommendation(action=Action.EVICT, node="n0013", ts=400.0, reason="thermal straggler",
                           guard=Guard.ALLOWED, job="train-1", finding_id=make_finding().id,
                           evidence={"payback_s": 90}),
            Recommendation(action=Action.ALERT_FACILITIES, node="n0016", ts=401.0, reason="hot aisle r02",
                           guard=Guard.NEEDS_HUMAN, dry_run=True)]
    store.insert_recommendations(recs)
    assert store.recommendations() == recs
    assert store.recommendations(action="alert_facilities") == [recs[1]]
    acked = store.query("SELECT acked_at, acked_by FROM recommendations ORDER BY ts").rows
    assert acked == [(None, ""), (None, "")]


def test_deadletter_round_trip(store: Store) -> None:
    store.insert("deadletter", {"ts": [1_700_000_000.25], "topic": ["fh.steps"], "partition": [2], "offset": [41],
                                "key": ["train-1"], "reason": ["compute_s: must be >= 0"], "raw": ["{}"],
                                "raw_base64": [False]})
    row = store.query("SELECT toUnixTimestamp64Milli(ts), topic, partition, offset, reason, raw_base64 "
                      "FROM deadletter").rows
    assert row == [(1_700_000_000_250, "fh.steps", 2, 41, "compute_s: must be >= 0", False)]




# ---------------------------------------------------------------- named queries
def test_run_queries_read_steps_per_job(store: Store, make_batches: Callable[..., list[StepBatch]]) -> None:
    batches = make_batches(steps=5, nodes=3)
    store.insert_steps(batches)
    store.insert_steps(make_batches(job="other", steps=2, nodes=1))
    assert store.job_exists("train-1") and not store.job_exists("nowhere")
    assert store.node_exists("n0002") and not store.node_exists("n9999")
    assert store.job_nodes("train-1") == {"n0000", "n0001", "n0002"} and store.job_nodes("other") == {"n0000"}
    assert store.rank_step_count("train-1") == 5 * 3 * 8
    assert store.rank_step_count("train-1", first_step=2) == 3 * 3 * 8
    times = store.job_step_times("train-1", limit=2)  # the two latest, oldest first
    assert [int(t[0]) for t in times] == [3, 4]
    slowest = max(float(b.compute_s.max()) for b in batches if b.step == 4)
    assert times[1][1] == pytest.approx(slowest) and times[1][2] == pytest.approx(1_700_000_008.0)
    medians = store.rank_median_compute("train-1", after_step=2)
    assert len(medians) == 3 * 8
    assert [r["mean_s"] for r in medians] == sorted((r["mean_s"] for r in medians), reverse=True)
    store.ping()


def test_recent_events_newest_first_leave_out_unknown_kinds(store: Store) -> None:
    from fleethealth.store.columns import event_columns

    old = Event(node="n0001", ts=10.0, kind=EventKind.XID, code=79, data={"severity": "fatal"})
    new = Event(node="n0001", ts=20.0, kind=EventKind.SDC_CHECK, job="train-1", data={"passed": False})
    store.insert_events([old, new])
    future = event_columns([Event(node="n0001", ts=30.0, kind=EventKind.XID)])
    future.update(id=["future"], kind=["from_a_newer_version"])
    garbled = event_columns([Event(node="n0001", ts=5.0, kind=EventKind.XID)])
    garbled.update(id=["garbled"], data=["not json"])
    store.insert("events", future)
    store.insert("events", garbled)
    got = store.recent_events(node="n0001")
    assert [e.ts for e in got] == [20.0, 10.0, 5.0] and got[2].data == {"unparsed": "not json"}
    assert store.recent_events(job="train-1", kind="sdc_check") == [new]
    assert store.recent_events(node="n0001", limit=2) == [new]  # the limit counts the unknown kind too
    assert store.sdc_check_counts("train-1") == (1, 1) and store.sdc_check_counts("nowhere") == (0, 0)


def test_recommendation_rows_filter_and_write_back(store: Store) -> None:
    recs = [Recommendation(action=Action.EVICT, node="n0013", ts=400.0, reason="r", guard=Guard.ALLOWED,
                           job="train-1"),
            Recommendation(action=Action.PAGE, node="n0014", ts=401.0, reason="r", guard=Guard.NEEDS_HUMAN)]
    store.insert_recommendations(recs)
    assert [r["node"] for r in store.recommendation_rows()] == ["n0014", "n0013"]  # newest first
    assert [r["id"] for r in store.recommendation_rows(guard="allowed", since=400.0)] == [recs[0].id]
    assert store.recommendation_row("0" * 16) is None
    row = store.recommendation_row(recs[0].id)
    assert row is not None and row["acked_at"] is None
    assert store.open_recommendations_by_node() == {"n0013": 1, "n0014": 1}
    store.write_recommendation_row({**row, "ts": float(row["ts_s"]), "acked_at": 450.0, "acked_by": "op"})
    assert store.recommendation_row(recs[0].id)["acked_by"] == "op"
    assert store.open_recommendations_by_node() == {"n0013": 0, "n0014": 1}


def test_versioned_policy_rows_keep_the_latest(store: Store) -> None:
    assert store.breaker_row("fleet") is None and store.policy_state("engine") is None
    store.write_breaker("fleet", open_=True, tripped_ts=5.0, reason="too many evictions", reset_ts=None,
                        reset_by="")
    store.write_breaker("fleet", open_=False, tripped_ts=5.0, reason="too many evictions", reset_ts=9.0,
                        reset_by="op")
    assert store.breaker_row("fleet") == {"open": 0, "tripped_ts": 5.0, "reason": "too many evictions",
                                          "reset_ts": 9.0, "reset_by": "op", "version": 2}
    store.write_policy_state("engine", 1.0, '{"a": 1}')
    store.write_policy_state("engine", 2.0, '{"a": 2}')
    assert store.policy_state("engine") == '{"a": 2}'
    store.insert_eviction_outcome(ts=3.0, node="n0002", job="j", diagnosis="NODE_THERMAL", finding_id="f",
                                  resolved=True)
    assert store.eviction_outcome_rows() == [{"ts": 3.0, "node": "n0002", "job": "j", "diagnosis": "NODE_THERMAL",
                                              "finding_id": "f", "resolved": 1}]


def test_quarantine_log_lines_are_numbered_in_order(store: Store) -> None:
    assert store.quarantine_row("n0003") is None and store.quarantine_log_rows("n0003") == []
    store.append_quarantine_log("n0003", 2.0, "quarantine", "hot", {"where": Path("/x")})
    store.append_quarantine_log("n0003", 1.0, "release_refused", "no test", {})
    rows = store.quarantine_log_rows("n0003")
    assert [r["action"] for r in rows] == ["quarantine", "release_refused"]  # by sequence, not time
    assert rows[0]["evidence"] == '{"where":"/x"}'
