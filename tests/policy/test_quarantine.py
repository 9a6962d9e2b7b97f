"""The quarantine book on a real chDB store (migration 003): records with runs affected, release
only on a passing full self-test taken after the quarantine, refusals logged with why."""

from __future__ import annotations

import pytest

from fleethealth.errors import ConfigError
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
FULL_PASS = {"suite": "full", "test": "all", "device": "GPU5", "verdict": "pass", "mismatches": [],
             "max_error": 0.0, "duration_s": 310.0, "throughput": 0.0, "unit": ""}


def test_check_release_rules():
    """The pure rule: only a passing full suite, for this node, taken after the quarantine."""
    assert check_release("n1", T0, FULL_PASS) is None
    assert check_release("n1", T0, {**FULL_PASS, "ts": T0 + 10, "node": "n1"}) is None
    assert "suite is 'quick'" in check_release("n1", T0, {**FULL_PASS, "suite": "quick"})
    assert "verdict is 'fail'" in check_release("n1", T0, {**FULL_PASS, "verdict": "fail"})
    assert "verdict is 'slow'" in check_release("n1", T0, {**FULL_PASS, "verdict": "slow"})
    assert "2 mismatches" in check_release("n1", T0, {**FULL_PASS, "mismatches": [1, 2]})
    assert "not 'n1'" in check_release("n1", T0, {**FULL_PASS, "node": "n2"})
    assert "predates" in check_release("n1", T0, {**FULL_PASS, "ts": T0 - 1})
    assert "self-test record" in check_release("n1", T0, ["pass"])  # type: ignore[arg-type]
    # an event object carrying the record in data
    event = {"kind": "selftest", "node": "n1", "ts": T0 + 5, "data": FULL_PASS}
    assert check_release("n1", T0, event) is None
    assert "xid" in check_release("n1", T0, {"kind": "xid", "data": FULL_PASS})


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
    assert release(store, "n0030", T0 + 100, {**FULL_PASS, "suite": "quick"}) is False
    assert release(store, "n0030", T0 + 200, {**FULL_PASS, "verdict": "fail", "mismatches": [[3, 7]]}) is False
    assert release(store, "n0030", T0 + 250, {**FULL_PASS, "ts": T0 - 3600}) is False
    assert [r.node for r in quarantined(store)] == ["n0030"]
    assert release(store, "n0030", T0 + 300, {**FULL_PASS, "ts": T0 + 290, "node": "n0030"}) is True
    assert quarantined(store) == [] and record(store, "n0030") is None
    # releasing again, or an unknown node: refused and logged
    assert release(store, "n0030", T0 + 400, FULL_PASS) is False
    assert release(store, "n0404", T0 + 400, FULL_PASS) is False
    log = history(store, "n0030")
    assert [e.action for e in log] == ["quarantine", "release_refused", "release_refused", "release_refused",
                                       "release", "release_refused"]
    assert "suite is 'quick'" in log[1].detail and "verdict is 'fail'" in log[2].detail
    assert "predates" in log[3].detail and log[5].detail == "node is not quarantined"
    assert log[4].ts == pytest.approx(T0 + 300)
    assert history(store, "n0404")[0].detail == "unknown node 'n0404'"
    # a new episode starts a new since and keeps the node's earlier victims
    back = quarantine(store, "n0030", "sdc again", T0 + 1000, runs=["train-9"])
    assert back.since == T0 + 1000 and back.runs_affected == ("train-1", "train-9")
