"""Finding ids name the episode, not the moment a detector concluded (issue 12 §3).

A restart starts every detector empty and replays from the last commit: it detects a fault that is
still there again, at another step and time. Its finding must carry the same id, so the store keeps
one row, the policy sees a finding it has decided before (or decides the same recommendation id
again), and ``fleethealth act`` drops the republished copy — not a second rollback or drain.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fleethealth.detectors.hang import HangDetector
from fleethealth.detectors.straggler import SeedRule, StragglerDetector
from fleethealth.schema import Finding, FindingKind, StepBatch, decode, encode

GPUS = 4


def _step(step: int, ts: float, nodes: int = 3, skip_node: int | None = None, slow_rank: int | None = None,
          job: str = "ep") -> list[StepBatch]:
    out = []
    for n in range(nodes):
        if n == skip_node:
            continue
        ranks = np.arange(n * GPUS, (n + 1) * GPUS, dtype=np.int32)
        compute = np.full(GPUS, 1.0)
        if slow_rank is not None and slow_rank in ranks:
            compute[slow_rank - n * GPUS] = 1.3
        out.append(StepBatch(job=job, step=step, node=f"n{n:04d}", ts=ts, ranks=ranks,
                             gpus=np.arange(GPUS, dtype=np.int16), compute_s=compute))
    return out


def test_the_id_names_the_episode_start_not_the_conclusion():
    f = Finding(kind=FindingKind.HANG, node="n0001", ts=1300.0, job="j", step=41, detector="hang",
                episode_ts=1200.0)
    later = dataclasses.replace(f, ts=1390.5, step=44, evidence={"stalled_s": 190.5})
    other = dataclasses.replace(f, episode_ts=1500.0)
    assert f.id == later.id != other.id
    assert decode(Finding, encode(f)) == f and decode(Finding, encode(f)).id == f.id
    legacy = dataclasses.replace(f, episode_ts=None)  # a message from before episodes were named
    assert legacy.id != f.id and legacy.id != dataclasses.replace(legacy, ts=1390.5).id


class _Placed:
    def __init__(self, job: str, ts: float, ranks: np.ndarray) -> None:
        self.job, self.ts, self.ranks = job, ts, ranks
        self.nodes = np.array([f"n{int(r) // GPUS:04d}" for r in ranks])
        self.gpus = (ranks % GPUS).astype(np.int16)


def _stragglers(det, steps: int, slow_from: int) -> list[Finding]:
    ranks = np.arange(12)
    out = []
    for s in range(steps):
        compute = np.full(12, 1.0) + 0.001 * np.sin(np.arange(12) + s)
        if s >= slow_from:
            compute[5] = 1.25
        out += det.check(s, ranks, compute, placement=_Placed("ep", 1000.0 + 10.0 * s, ranks))
    return out


def test_a_straggler_concluded_at_another_step_has_the_same_id():
    """Two detectors that need different evidence conclude on the same slow rank at different steps
    (as a restarted one would): the finding names the step where the slow run began, so one id."""
    [early] = _stragglers(SeedRule(consecutive=5), 80, slow_from=40)
    [late] = _stragglers(SeedRule(consecutive=12), 80, slow_from=40)
    assert early.step != late.step and early.ts != late.ts
    assert early.episode_ts == late.episode_ts == 1000.0 + 10.0 * 40
    assert early.id == late.id
    [cusum] = _stragglers(StragglerDetector(), 200, slow_from=120)
    assert cusum.episode_ts is not None and cusum.episode_ts <= cusum.ts
    assert cusum.episode_ts >= 1000.0 + 10.0 * 120  # the excursion began with the slowdown, not before


def test_a_hang_detected_again_with_less_history_has_the_same_id():
    """A detector that saw the job's slow early steps estimates a longer timeout than one restarted
    at the end (the step durations it knows are shorter): they conclude at different times on the
    same stall, which began at the job's last progress — one id."""
    def run(first: int) -> list[Finding]:
        det = HangDetector()
        out = []
        for s in range(first, 40):
            ts = 1000.0 + (40.0 * s if s < 10 else 400.0 + 20.0 * (s - 10))
            out += det.check(_step(s, ts), [], ts)
        stall = 1000.0 + 400.0 + 20.0 * 30
        out += det.check(_step(40, stall, skip_node=1), [], stall)
        for k in range(1, 60):
            out += det.check([], [], stall + 10.0 * k)
        return out

    [full] = run(0)
    [restarted] = run(38)
    assert full.ts != restarted.ts  # another timeout, another deadline
    assert full.node == restarted.node == "n0001" and full.step == restarted.step == 40
    assert full.episode_ts == restarted.episode_ts == 1000.0 + 400.0 + 20.0 * 30
    assert full.id == restarted.id


def test_the_store_keeps_one_row_per_finding_id(store):
    """The same episode concluded twice (another step, another time): one row under FINAL, read
    back with its episode start and its id."""
    f = Finding(kind=FindingKind.HANG, node="n0009", ts=1300.0, job="j", step=41, detector="hang",
                episode_ts=1200.0, evidence={"why": "timeout"})
    again = dataclasses.replace(f, ts=1390.5, step=44, evidence={"why": "resumed"})
    store.insert_findings([f])
    store.insert_findings([again])
    [row] = store.findings(node="n0009")
    assert row.id == f.id and row.episode_ts == 1200.0 and row.ts == 1390.5
    assert store.query("SELECT count() FROM findings FINAL WHERE node = 'n0009'").rows[0][0] == 1
