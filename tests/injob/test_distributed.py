"""Four gloo processes on 127.0.0.1 train a small DDP model with injected faults (see _dist_worker.py).

One launch serves every test here: each asserts one fault is caught, attributed to the right rank
and classified, and that the healthy checks around it raised no alarm.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fleethealth.injob.replay import MIN_REPLAY_TOLERANCE

WORKER = Path(__file__).with_name("_dist_worker.py")
WORLD = 4
sys.path.insert(0, str(WORKER.parent))
import _dist_worker as W  # noqa: E402
from _ranks import run_ranks  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(WORKER, WORLD, tmp_path_factory.mktemp("dist"), timeout_s=150)


def _sdc(rank: dict, check: str | None = None) -> list[dict]:
    return [e for e in rank["events"] if e["kind"] == "sdc_check" and (check is None or e["data"]["check"] == check)]


def test_healthy_steps_raise_no_alarm(ranks: list[dict]) -> None:
    for r in ranks:
        early = [e for e in _sdc(r) if e["step"] < W.FLIP_STEP]
        assert len(early) >= 3 and all(e["data"]["passed"] for e in early)
        # same CPU kernels: bitwise equal pairs, so the calibration sets the documented floor
        assert r["startup"] is True and r["replay_tolerance"] == MIN_REPLAY_TOLERANCE
    # replays at steps 0 and 10 covered every rank, all agreeing
    replays = [e for r in ranks for e in _sdc(r, "replay") if e["step"] in (0, 10)]
    assert {e["rank"] for e in replays} == set(range(WORLD)) and all(e["data"]["passed"] for e in replays)


def test_single_bit_flip_is_caught_by_that_ranks_self_check(ranks: list[dict]) -> None:
    failing = [(r["rank"], e) for r in ranks for e in _sdc(r, "selfcheck") if not e["data"]["passed"]
               and e["step"] == W.FLIP_STEP]
    assert [rank for rank, _ in failing] == [W.FLIP_RANK]
    event = failing[0][1]
    assert event["rank"] == W.FLIP_RANK and event["gpu"] == W.FLIP_RANK
    assert event["data"]["classification"] == "transient" and "0.weight" in event["message"]
    for r in ranks:  # every rank's watermark stops at the last passing check before the flip
        assert r["watermark"] == 10 and r["failed_step"] == W.FLIP_STEP


def test_deterministic_corruption_passes_self_check_and_replay_vote_names_it(ranks: list[dict]) -> None:
    bad = ranks[W.DET_RANK]
    own = [e for e in _sdc(bad, "selfcheck") if W.DET_FROM <= e["step"] <= W.DET_UNTIL]
    assert own and all(e["data"]["passed"] for e in own)  # the same wrong answer twice
    replay_step = 20
    events = {r["rank"]: [e for e in _sdc(r, "replay") if e["step"] == replay_step] for r in ranks}
    (culprit_event,) = events[W.DET_RANK]
    assert not culprit_event["data"]["passed"] and culprit_event["data"]["culprit_rank"] == W.DET_RANK
    assert culprit_event["data"]["classification"] == "persistent"
    partner, judge = culprit_event["data"]["peer_ranks"]
    assert partner == W.DET_RANK + WORLD // 2 and judge not in (W.DET_RANK, partner)
    for rank in (partner, judge):  # the honest ranks pass and name the same culprit
        (e,) = [e for e in events[rank] if W.DET_RANK in e["data"]["peer_ranks"]]
        assert e["data"]["passed"] and e["data"]["culprit_rank"] == W.DET_RANK
    assert culprit_event["data"]["tolerance"] == MIN_REPLAY_TOLERANCE and len(culprit_event["data"]["digests"]) == 3
    # the other pair (0, 2) agreed
    assert all(e["data"]["passed"] for e in events[0] if e["data"]["culprit_rank"] is None)


def test_nan_loss_from_data_is_skipped_everywhere_and_classified_data_or_code(ranks: list[dict]) -> None:
    for r in ranks:
        verdict = r["verdicts"][W.NAN_STEP]
        assert verdict["skip"] and verdict["classification"] == "data_or_code"
        assert r["nonfinite"] == [{"step": W.NAN_STEP, "classification": "data_or_code"}]


def test_sleeping_rank_yields_stack_dumps_naming_it(ranks: list[dict]) -> None:
    reports = {r["rank"]: [e for e in r["events"] if e["kind"] == "hang_report" and e["step"] == W.HANG_STEP - 1]
               for r in ranks}
    assert all(len(v) == 1 for v in reports.values()), {k: len(v) for k, v in reports.items()}
    sleeper = reports[W.HANG_RANK][0]
    assert "_stall_before_backward" in sleeper["data"]["stacks"] and sleeper["rank"] == W.HANG_RANK
    for rank, (e,) in reports.items():
        if rank != W.HANG_RANK:  # the others wait inside DDP's all-reduce, and say so
            assert "_stall_before_backward" not in e["data"]["stacks"]
            assert e["data"]["last_collective"].startswith("ddp.all_reduce")


def test_gradient_spike_is_skipped_and_traced_to_its_rank(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["verdicts"][W.SPIKE_STEP]["skip"] and r["verdicts"][W.SPIKE_STEP]["classification"] == "transient"
        assert r["spikes"] == 1
    failing = [r["rank"] for r in ranks for e in _sdc(r, "selfcheck")
               if e["step"] == W.SPIKE_STEP and not e["data"]["passed"]]
    assert failing == [W.SPIKE_RANK]
