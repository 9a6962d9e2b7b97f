"""The quarantine book on a real chDB store (migration 003): records with runs affected, release
only on a passing full self-test taken after the quarantine, refusals logged with why."""

from __future__ import annotations

import pytest

from fleethealth.errors import ConfigError
from fleethealth.kernels.suite import expected_tests
from fleethealth.policy.quarantine import (
    QuarantineRecord,
    add_run,
    check_release,
    history,
    quarantine,
    quarantined,
    record,
    release,
)

T0 = 1_800_000_000.0
_COVERED = [list(pair) for pair in sorted(expected_tests("full", ["cpu"]))]
FULL_PASS = {"suite": "full", "test": "suite", "device": "cpu", "verdict": "pass", "mismatches": [],
             "node": "n1", "ts": T0 + 1, "devices": ["cpu"], "covered": _COVERED, "duration_s": 310.0}


def test_check_release_rules():
    """The pure rule: only a passing full suite, for this node, taken after the quarantine."""
    assert check_release("n1", T0, FULL_PASS) is None
    assert check_release("n1", T0, {**FULL_PASS, "ts": T0 + 10}) is None
    assert "suite is 'quick'" in check_release("n1", T0, {**FULL_PASS, "suite": "quick"})
    assert "verdict is 'fail'" in check_release("n1", T0, {**FULL_PASS, "verdict": "fail"})
    assert "verdict is 'slow'" in check_release("n1", T0, {**FULL_PASS, "verdict": "slow"})
    assert "2 mismatches" in check_release("n1", T0, {**FULL_PASS, "mismatches": [1, 2]})
    assert "not 'n1'" in check_release("n1", T0, {**FULL_PASS, "node": "n2"})
    assert "predates" in check_release("n1", T0, {**FULL_PASS, "ts": T0 - 1})
    assert "self-test record" in check_release("n1", T0, ["pass"])  # type: ignore[arg-type]
    # an event object carrying the record in data
    bare = {k: v for k, v in FULL_PASS.items() if k not in ("node", "ts")}
    event = {"kind": "selftest", "node": "n1", "ts": T0 + 5, "data": bare}
    assert check_release("n1", T0, event) is None
    assert "xid" in check_release("n1", T0, {"kind": "xid", "data": FULL_PASS})


def test_one_test_or_an_unbound_body_never_releases():
    """One passing test of the full suite, a hand-typed verdict without node or time, or a suite
    record missing a test are all refused; only the complete suite's own record releases."""
    assert "one test" in check_release("n1", T0, {**FULL_PASS, "test": "gemm_exact_fp32"})
    assert "names no node" in check_release("n1", T0, {"suite": "full", "verdict": "pass"})
    no_ts = {k: v for k, v in FULL_PASS.items() if k != "ts"}
    assert "no ts" in check_release("n1", T0, no_ts)
    no_node = {k: v for k, v in FULL_PASS.items() if k != "node"}
    assert "names no node" in check_release("n1", T0, no_node)
    assert "not a finite number" in check_release("n1", T0, {**FULL_PASS, "ts": float("nan")})
    short = {**FULL_PASS, "covered": [c for c in _COVERED if c[0] != "memory_checkerboard"]}
    assert "1 tests missing (memory_checkerboard@cpu)" in check_release("n1", T0, short)
    assert "no devices" in check_release("n1", T0, {**FULL_PASS, "devices": []})
    assert "covered" in check_release("n1", T0, {**FULL_PASS, "covered": "all"})
    gpus = {**FULL_PASS, "devices": ["cuda:0", "cuda:1"]}
    assert "tests missing" in check_release("n1", T0, gpus)  # the CPU run does not cover two GPUs
    # a per-test selftest event as stored (node and ts on the event) is not enough either
    per_test = {"kind": "selftest", "node": "n1", "ts": T0 + 5,
                "data": {"suite": "full", "test": "memory_walking_ones", "device": "cpu", "verdict": "pass"}}
    assert "one test" in check_release("n1", T0, per_test)


def test_quarantine_record_and_runs_affected(store):
    rec = quarantine(store, "n0417", "sdc: selfcheck mismatch on GPU 5", T0, finding_id="f1", runs=["train-1"])
    assert rec == QuarantineRecord("n0417", "sdc: selfcheck mismatch on GPU 5", T0, ("train-1",), "f1")
    for job in ("train-2", "train-3", "train-2", "train-4", "train-5", "train-6"):
        rec = add_run(store, "n0417", job, ts=T0 + 60)
    assert rec.runs_affected == ("train-1", "train-2", "train-3", "train-4", "train-5", "train-6")
    assert rec.summary == "node n0417 has killed 6 jobs"
    # quarantining again is idempotent: since, reason and finding kept, runs merged
    again = quarantine(store, "n0417", "another reason", T0 + 100, runs=["train-7"])
    assert again.since == T0 and again.reason.startswith("sdc") and again.finding_id == "f1"
    assert again.runs_affected[-1] == "train-7"
    quarantine(store, "n0011", "sdc: replay mismatch", T0 + 5)
    assert [r.node for r in quarantined(store)] == ["n0417", "n0011"]
    assert record(store, "n0011").reason == "sdc: replay mismatch"
    assert record(store, "n9999") is None
    with pytest.raises(ConfigError, match="unknown node"):
        add_run(store, "n9999", "train-1")
    with pytest.raises(ConfigError, match="reason"):
        quarantine(store, "n0001", "", T0)


def test_release_needs_a_passing_full_selftest_and_logs_refusals(store):
    quarantine(store, "n0030", "sdc", T0, runs=["train-1"])
    ours = {**FULL_PASS, "node": "n0030"}
    assert release(store, "n0030", T0 + 100, {**ours, "suite": "quick"}) is False
    assert release(store, "n0030", T0 + 200, {**ours, "verdict": "fail", "mismatches": [[3, 7]]}) is False
    assert release(store, "n0030", T0 + 250, {**ours, "ts": T0 - 3600}) is False
    assert release(store, "n0030", T0 + 260, {"suite": "full", "verdict": "pass"}) is False
    assert [r.node for r in quarantined(store)] == ["n0030"]
    assert release(store, "n0030", T0 + 300, {**ours, "ts": T0 + 290}) is True
    assert quarantined(store) == [] and record(store, "n0030") is None
    # releasing again, or an unknown node: refused and logged
    assert release(store, "n0030", T0 + 400, FULL_PASS) is False
    assert release(store, "n0404", T0 + 400, FULL_PASS) is False
    log = history(store, "n0030")
    assert [e.action for e in log] == ["quarantine", "release_refused", "release_refused", "release_refused",
                                       "release_refused", "release", "release_refused"]
    assert "suite is 'quick'" in log[1].detail and "verdict is 'fail'" in log[2].detail
    assert "predates" in log[3].detail and "names no node" in log[4].detail
    assert log[6].detail == "node is not quarantined"
    assert log[5].ts == pytest.approx(T0 + 300)
    assert history(store, "n0404")[0].detail == "unknown node 'n0404'"
    # a new episode starts a new since and keeps the node's earlier victims
    back = quarantine(store, "n0030", "sdc again", T0 + 1000, runs=["train-9"])
    assert back.since == T0 + 1000 and back.runs_affected == ("train-1", "train-9")
