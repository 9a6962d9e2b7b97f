"""Replay planning, the third-rank vote and the stored calibration (pure parts, no processes)."""

from __future__ import annotations

import pytest

from fleethealth.errors import ConfigError
from fleethealth.injob.crossrank import replay_round_plan
from fleethealth.injob.replay import ReplayCalibration, choose_judge, replay_pairs, vote


def test_pairs_cross_the_failure_domain_split() -> None:
    """Seed R1: partner r + world/2, so with 8 GPUs a node the pair sits on different nodes."""
    assert replay_pairs(1) == []
    assert replay_pairs(4) == [(0, 2), (1, 3)]
    pairs = replay_pairs(16)
    assert all(b - a == 8 for a, b in pairs) and all(a // 8 != b // 8 for a, b in pairs)
    assert replay_pairs(5) == [(0, 2), (1, 3), (0, 4)]  # odd: the last rank is covered too
    covered = {r for p in replay_pairs(7) for r in p}
    assert covered == set(range(7))
    assert replay_round_plan(8, [3, 3, 6]) == [(3, 7), (6, 2)]
    assert replay_round_plan(8) == replay_pairs(8)


def test_judge_comes_from_a_third_domain() -> None:
    nodes = [r // 4 for r in range(12)]  # 3 nodes of 4 GPUs
    j = choose_judge(0, 6, 12, nodes)
    assert nodes[j] not in (nodes[0], nodes[6])
    assert choose_judge(0, 1, 2) is None
    assert choose_judge(1, 3, 4) == 2
    assert choose_judge(0, 2, 4, [0, 0, 1, 1]) == 1  # no third domain: any other rank
    with pytest.raises(ConfigError):
        choose_judge(0, 1, 4, [0, 1])


@pytest.mark.parametrize(("da", "db", "culprit"), [
    (0.0, 1.0, 11),      # a agrees with the judge -> b lies
    (1.0, 0.0, 10),      # b agrees -> a lies
    (1.0, 1.0, None),    # nobody agrees: no majority
    (1e-7, 5e-7, 11),    # both within tolerance: the farther one
])
def test_vote(da: float, db: float, culprit: int | None) -> None:
    assert vote(10, 11, da, db, tolerance=1e-6).culprit == culprit


def test_calibration_tolerance_and_storage(tmp_path) -> None:
    healthy = [1e-7, 2e-7, 1.5e-7, 1.2e-7, 1.8e-7]
    cal = ReplayCalibration.from_distances(healthy)
    mean, std = sum(healthy) / 5, (sum((d - sum(healthy) / 5) ** 2 for d in healthy) / 5) ** 0.5
    assert cal.tolerance == pytest.approx(mean + 5 * std)
    path = tmp_path / "cal.json"
    cal.save(path)
    assert ReplayCalibration.load(path) == cal
    # one bad device among the calibration ranks widens a plain 5 sigma, not the robust one
    robust = ReplayCalibration.from_distances(healthy + [1e-3], robust=True)
    plain = ReplayCalibration.from_distances(healthy + [1e-3])
    assert robust.tolerance < 1e-6 < plain.tolerance
    assert ReplayCalibration.from_distances([0.0] * 4, floor=1e-9).tolerance == 1e-9


def test_calibration_bad_input(tmp_path) -> None:
    with pytest.raises(ConfigError):
        ReplayCalibration.from_distances([])
    with pytest.raises(ConfigError):
        ReplayCalibration.from_distances([float("nan")])
    bad = tmp_path / "bad.json"
    bad.write_text('{"center": 1.0}')
    with pytest.raises(ConfigError, match="cannot read"):
        ReplayCalibration.load(bad)
    bad.write_text('{"center": -1.0, "spread": 0, "samples": 3}')
    with pytest.raises(ConfigError, match="negative"):
        ReplayCalibration.load(bad)
