"""Verification watermark (and the rollback target it picks) and retention against seed 000 revision R6's numbers."""

from __future__ import annotations

import pytest

from fleethealth.errors import ConfigError
from fleethealth.injob.watermark import Watermark, retention


def test_retention_matches_the_seed_worked_example() -> None:
    """Checks every 33 min (1,000 steps at 2 s), checkpoints every 13.6 min: 3 x 33/13.6 + 2 = 9.28 -> 10."""
    r = retention(33.0, 13.6)
    assert r.ratio == pytest.approx(9.279, abs=1e-3)
    assert r.rolling == 10 and r.milestones == 0 and int(r) == 10
    # the same in seconds and in steps gives the same answer: the rule is unit-free
    assert retention(33 * 60, 13.6 * 60).rolling == 10
    assert retention(1000, 408).rolling == 10


def test_retention_with_the_tightened_check_and_milestones() -> None:
    """R6 change 3: checks every 100 steps (~3.3 min) -> 3 x 3.3/13.6 + 2 = 2.73 -> keep 3; a 30-day run
    keeps a milestone every 6 hours on top: 120."""
    r = retention(100 * 2.0, 13.6 * 60, run_length=30 * 86400.0)
    assert r.rolling == 3 and r.milestones == 120 and r.total == 123
    assert retention(13.6, 13.6).rolling == 5  # an exact integer is not rounded up further


@pytest.mark.parametrize("bad", [0.0, -5.0, float("nan"), float("inf")])
def test_retention_rejects_bad_intervals(bad: float) -> None:
    with pytest.raises(ConfigError):
        retention(bad, 13.6)
    with pytest.raises(ConfigError):
        retention(33.0, bad)


def test_watermark_records_checks_and_freezes_at_the_first_failure() -> None:
    """The C6 scenario: checks every 1,000 steps, checkpoints every 408; corruption caught at 3,000."""
    wm = Watermark()
    book = []
    for step in range(0, 4001, 4):
        if step % 1000 == 0 and step:
            wm.record(step, passed=step < 3000)
        if step % 408 == 0 and step:
            book.append(wm.checkpoint(step, f"ckpt://{step}"))
    assert wm.last_verified_step == 2000 and wm.failed_step == 3000 and wm.suspect
    # a pass after the failure does not advance it: the weights may already hold the corruption
    wm.record(4000, True)
    assert wm.last_verified_step == 2000
    target = wm.rollback_target(book, "transient")
    assert target.step == 1632 and target.last_verified_step == 1000 and not target.verified
    assert wm.rollback_target(book, "persistent") is None  # no replay ever passed: nothing vouches against it
    assert [c.step for c in book if c.step > 2000] == [2040, 2448, 2856, 3264, 3672]
    # three checkpoints sit in the suspect window between the last pass and the failure
    assert len([c for c in book if 2000 < c.step < 3000]) == 3
    wm.reset(target.step)
    assert not wm.suspect and wm.record(target.step + 1000, True) == 2632


def test_checkpoint_record_marks_verified_only_when_a_pass_covers_it() -> None:
    wm = Watermark()
    assert wm.checkpoint(100, "u").last_verified_step is None
    wm.record(200, True)
    assert wm.checkpoint(200, "u").verified
    assert not wm.checkpoint(250, "u").verified


def test_a_deterministic_fault_rolls_back_past_the_last_passing_replay() -> None:
    """Self-checks every 50, replays every 200, checkpoints every 25, a deterministic fault from 230:
    self-checks at 250…350 pass (they cannot see it), the replay at 400 fails. The transient mark
    says 350; only the replay mark (200) vouches for the weights."""
    wm = Watermark()
    book = []
    for step in range(1, 401):
        if step % 200 == 0:
            wm.record(step, step < 230, "replay")
        elif step % 50 == 0:
            wm.record(step, True, "selfcheck")
        if step % 25 == 0 and step < 400:
            book.append(wm.checkpoint(step, f"ckpt://{step}"))
    assert (wm.last_verified_step, wm.last_replay_step, wm.failed_step) == (350, 200, 400)
    assert wm.rollback_target(book, "persistent").step == 200
    assert wm.rollback_target(book, "transient").step == 350  # the old single watermark's answer
    assert book[-1].last_replay_step == 200 and book[-1].last_verified_step == 350
    # retention keeps the clean ancestor of each mark and everything newer than the check mark
    assert [c.step for c in wm.keep(book)] == [200, 350, 375]
    wm.reset(200)
    assert (wm.last_verified_step, wm.last_replay_step, wm.suspect) == (200, 200, False)


def test_retention_reaches_back_past_the_last_passing_replay() -> None:
    """Seed 000 R6 with both cadences: self-checks every 33 min keep 10; a replay every 333 min keeps 76."""
    assert retention(33.0, 13.6).rolling == 10
    both = retention(33.0, 13.6, replay_interval=10_000 * 2.0 / 60)
    assert both.rolling == 76 and round(both.ratio, 1) == 75.5 and round(both.transient_ratio, 2) == 9.28
    assert retention(33.0, 13.6, replay_interval=10.0).rolling == 10  # a replay faster than the self-check
    with pytest.raises(ConfigError):
        retention(33.0, 13.6, replay_interval=0.0)


def test_a_record_names_its_check() -> None:
    with pytest.raises(ConfigError, match="selfcheck"):
        Watermark().record(1, True, "bitwise")
