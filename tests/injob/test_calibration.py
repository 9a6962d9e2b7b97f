"""The replay tolerance is calibrated on the replay pairs' own distances (gloo processes on 127.0.0.1).

Healthy ranks that differ in the last bits (see _calib_worker.py): two ranks, and four of which three
are bitwise equal. Neither may raise a false alarm at any replay, a slow replay must not trip the
hang watchdog, and a real deterministic corruption must still be named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleethealth.injob.replay import MIN_REPLAY_TOLERANCE, ReplayCalibration

WORKER = Path(__file__).with_name("_calib_worker.py")
sys.path.insert(0, str(WORKER.parent))
import _calib_worker as W  # noqa: E402

from fleethealth.broker import free_port  # noqa: E402


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[int, list[dict]]:
    """Both jobs (world 2 and world 4) run at once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for world in (2, 4):
        out = tmp_path_factory.mktemp(f"calib{world}")
        port = free_port()
        runs[world] = (out, [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(port), str(out)],
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
                             for r in range(world)])
    results = {}
    try:
        for world, (out, procs) in runs.items():
            for r, p in enumerate(procs):
                log = p.communicate(timeout=150)[0].decode(errors="replace")
                assert p.returncode == 0, f"world {world} rank {r} failed:\n{log[-3000:]}"
            results[world] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    finally:
        for _, procs in runs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
    return results


def _replays(rank: dict, step: int) -> list[dict]:
    return [e for e in rank["events"] if e["data"]["check"] == "replay" and e["step"] == step]


def test_two_ranks_that_differ_healthily_never_false_alarm(jobs: dict[int, list[dict]]) -> None:
    ranks = jobs[2]
    for r in ranks:
        for step in (0, W.SLOW_STEP, W.BAD_STEP):
            (event,) = _replays(r, step)
            assert event["data"]["passed"], event["message"]
        assert r["tolerance"] >= MIN_REPLAY_TOLERANCE and r["tolerance"] == ranks[0]["tolerance"]
    assert {e["data"]["tolerance"] for r in ranks for e in r["events"]} == {ranks[0]["tolerance"]}


def test_mostly_identical_ranks_do_not_false_alarm_and_corruption_is_still_named(
        jobs: dict[int, list[dict]]) -> None:
    ranks = jobs[4]
    for r in ranks:
        early = [e for step in (0, W.SLOW_STEP) for e in _replays(r, step)]
        assert early and all(e["data"]["passed"] for e in early), [e["message"] for e in early]
    (bad,) = _replays(ranks[3], W.BAD_STEP)
    assert not bad["data"]["passed"] and bad["data"]["culprit_rank"] == 3
    assert bad["data"]["classification"] == "persistent"
    assert all(e["data"]["passed"] for r in ranks[:3] for e in _replays(r, W.BAD_STEP))


def test_slow_replay_does_not_trip_the_hang_watchdog(jobs: dict[int, list[dict]]) -> None:
    """Each recomputation of the step-3 replay sleeps past the 1 s step timeout; abort=True."""
    assert W.SLOW_S > W.TIMEOUT_S
    for world, ranks in jobs.items():
        for r in ranks:
            assert r["hangs"] == [] and r["aborted"] == [], (world, r["rank"])
            assert _replays(r, W.SLOW_STEP)


def test_pair_calibration_covers_one_pair_and_mostly_zero_pairs() -> None:
    """Torch-free: one pair (robust spread 0) and pairs that are mostly bitwise equal (median and MAD
    0) both give a tolerance above every healthy distance; all-equal pairs get the documented floor."""
    d = 3e-4
    assert ReplayCalibration.from_pair_distances([d]).tolerance == pytest.approx(10 * d)
    assert ReplayCalibration.from_pair_distances([0.0, 0.0, 0.0, d]).tolerance > d
    assert ReplayCalibration.from_pair_distances([0.0, 0.0]).tolerance == MIN_REPLAY_TOLERANCE
    assert ReplayCalibration.from_pair_distances([1e-9], margin=2.0, floor=0.0).tolerance == pytest.approx(2e-9)
