"""The rollback rule (seed 000 R6): the newest checkpoint at or before the last passing check."""

from __future__ import annotations

from fleethealth.payloads.checkpoint import CheckpointRecord
from fleethealth.payloads.rollback import rollback_target


def test_rollback_target_is_the_newest_checkpoint_at_or_before_the_last_pass() -> None:
    ckpts = [408, 816, 1224, 1632, 2040]
    assert rollback_target(ckpts, 1000) == 816
    assert rollback_target(ckpts, 1224) == 1224
    assert rollback_target(list(reversed(ckpts)), 2100) == 2040
    assert rollback_target(ckpts, 100) is None
    assert rollback_target(ckpts, None) is None
    records = [CheckpointRecord(s, f"ckpt://{s}", None) for s in ckpts]
    assert rollback_target(records, 1700).uri == "ckpt://1632"


# ------------------------------------------------------------------ the rollback never lands after the fault
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fleethealth.detectors.sdc import SdcDetector  # noqa: E402
from fleethealth.injob.watermark import Watermark  # noqa: E402
from fleethealth.payloads.checkpoint import checkpoint_event  # noqa: E402
from fleethealth.payloads.rollback import Marks, bound_for  # noqa: E402
from fleethealth.payloads.sdc_check import sdc_check_event  # noqa: E402
from fleethealth.policy.engine import PolicyEngine  # noqa: E402
from fleethealth.schema import Action, Guard  # noqa: E402


def _run(start: int, kind: str, every: int, replay_every: int, checkpoint_every: int, steps: int):
    """One job's checks as the in-job library runs them, until the first failure.

    A transient fault corrupts step ``start`` only and is seen by the first check at or after it (of
    either kind); a deterministic fault corrupts every step from ``start`` on and is seen only by a
    replay. Returns the watermark, its checkpoints, the events a rank emits, and the failing check.
    """
    wm, book, events, failed = Watermark(), [], [], None
    for step in range(1, steps + 1):
        check = "replay" if step % replay_every == 0 else "selfcheck" if step % every == 0 else None
        if check is not None:
            sees = (kind == "deterministic" and check == "replay" and step >= start) or \
                   (kind == "transient" and step >= start and wm.failed_step is None)
            wm.record(step, not sees, check)
            events.append(sdc_check_event(ts=float(step), check=check, passed=not sees, node="n0001", job="j",
                                          rank=0, gpu=0, step=step,
                                          classification=None if not sees else
                                          "transient" if check == "selfcheck" else "persistent"))
            if sees:
                failed = (step, check)
                break
        if step % checkpoint_every == 0:
            record = wm.checkpoint(step, f"ckpt://{step}")
            book.append(record)
            events.append(checkpoint_event(ts=step + 0.5, step=step, uri=record.uri, node="n0001", job="j",
                                           last_verified_step=record.last_verified_step,
                                           last_replay_step=record.last_replay_step))
    return wm, book, events, failed


@settings(max_examples=300, deadline=None, derandomize=True)
@given(start=st.integers(1, 2000), kind=st.sampled_from(["transient", "deterministic"]),
       every=st.integers(5, 200), replay_factor=st.integers(1, 20), checkpoint_every=st.integers(3, 300))
def test_the_rollback_target_is_never_after_the_fault_starts(start, kind, every, replay_factor, checkpoint_every):
    replay_every = every * replay_factor
    wm, book, events, failed = _run(start, kind, every, replay_every, checkpoint_every, steps=start + 2 * replay_every)
    if failed is None:
        return  # not detected within the run: nothing to roll back
    classification = "transient" if failed[1] == "selfcheck" else "persistent"
    # the in-job watermark
    target = wm.rollback_target(book, classification)
    assert target is None or target.step < start
    clean = [c for c in book if c.step < start]
    mark = bound_for(wm.marks, classification)
    if mark is not None and any(c.step <= mark for c in book):
        assert target is not None  # not vacuous: a clean checkpoint the mark vouches for is found
    # the streaming side: the SDC detector's finding, then the policy, from the same events
    finding = SdcDetector().check(events)
    assert len(finding) == 1
    recs = PolicyEngine().decide(finding, now=float(failed[0]))
    rollback = [r for r in recs if r.action is Action.ROLLBACK][0]
    if "target_step" in rollback.evidence:
        assert rollback.evidence["target_step"] < start
        assert target is not None and rollback.evidence["target_step"] == target.step
    else:
        assert rollback.guard is Guard.NEEDS_HUMAN and target is None
    del clean


def test_the_issue_case_a_deterministic_fault_before_the_first_replay_needs_a_human() -> None:
    """Fault from 120, self-checks every 50, replays every 200, checkpoints every 25: the replay fails
    at 200. The last passing self-check (150) vouches for nothing about a deterministic fault, so
    checkpoint 150 — written after the corruption began — is not a target: no clean checkpoint is known."""
    wm, book, events, failed = _run(120, "deterministic", 50, 200, 25, steps=400)
    assert failed == (200, "replay") and wm.last_verified_step == 150 and wm.last_replay_step is None
    assert wm.rollback_target(book, "persistent") is None
    assert wm.rollback_target(book, "transient").step == 150  # what the single watermark used to say
    recs = PolicyEngine().decide(SdcDetector().check(events), now=200.0)
    assert [r.guard for r in recs if r.action is Action.ROLLBACK] == [Guard.NEEDS_HUMAN]


def test_marks_before_a_failure_and_their_merge() -> None:
    from fleethealth.payloads.rollback import merge

    marks = merge([Marks(150, None), Marks(100, 100), Marks(None, 50)])
    assert marks == Marks(150, 100)
    assert marks.before(120) == Marks(None, 100) and marks.before(None) == marks
    assert bound_for(marks, "transient") == 150 and bound_for(marks, "persistent") == 100
    assert bound_for(marks, None) == 100 and bound_for(marks, "data_or_code") == 100
