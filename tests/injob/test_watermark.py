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
    target = wm.rollback_target(book)
    assert target.step == 1632 and target.last_verified_step == 1000 and not target.verified
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
