"""The collective part of the cross-rank replay: move microbatches, recompute, gather, vote.

Round 1: every pair ``(source, partner)`` of :func:`~fleethealth.injob.replay.replay_pairs` computes the
source's microbatch (the source's batch and RNG snapshot travel point to point), fingerprints are
all-gathered and compared at the calibrated tolerance. Round 2, only for pairs that disagree: a third
rank computes the same microbatch and both members of the pair compute it again; the vote names the
liar and the repeat says whether the liar reproduces its own answer (``persistent``) or not
(``transient``). Point-to-point transfers run in one global order every rank follows, so they cannot
deadlock. Every rank calls :func:`run_replay` with the same plan.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch.distributed as dist

from fleethealth.injob.digest import fingerprint, fingerprint_distance
from fleethealth.injob.records import Classification, classify
from fleethealth.injob.replay import choose_judge, replay_pairs, vote

if TYPE_CHECKING:
    from fleethealth.injob.guard import SdcGuard

__all__ = ["Incident", "ReplayRound", "replay_round_plan", "run_replay", "pair_distances"]

Job = tuple[int, int]
"""``(source rank, computing rank)``: the computing rank recomputes the source's microbatch."""


@dataclass(frozen=True)
class Incident:
    """One pair's replay. ``agreed`` when the pair's distance is within tolerance; otherwise ``judge``
    computed it too and ``culprit`` is the rank the vote names (``None``: no majority).
    ``fingerprints`` maps each rank taking part to its fingerprint of the source's microbatch."""

    pair: tuple[int, int]
    judge: int | None
    agreed: bool
    distance: float
    culprit: int | None
    classification: Classification | None
    fingerprints: dict[int, np.ndarray]

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.pair if self.judge is None else (*self.pair, self.judge)


@dataclass(frozen=True)
class ReplayRound:
    """Every pair's incident at one replay step, identical on every rank."""

    incidents: tuple[Incident, ...]
    duration_s: float

    @property
    def all_agreed(self) -> bool:
        return all(i.agreed for i in self.incidents)


def replay_round_plan(world: int, sources: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The pairs to replay: all of :func:`replay_pairs` when ``sources`` is ``None``, else each source
    with its failure-domain partner ``(source + world // 2) % world``."""
    if world < 2:
        return []
    if sources is None:
        return replay_pairs(world)
    half = world // 2
    return [(int(s), (int(s) + half) % world) for s in dict.fromkeys(sources)]


def _run_jobs(guard: SdcGuard, batch: Any, jobs: list[Job]) -> dict[Job, np.ndarray]:
    """Move each source's batch to the ranks that need it, recompute, all-gather the fingerprints."""
    from fleethealth.injob.guard import _global, _to_cpu, _to_device

    rng = guard.rng_snapshot()
    inputs: dict[int, tuple[Any, Any]] = {guard.rank: (batch, rng)}
    for src, dst in sorted({j for j in jobs if j[0] != j[1]}):
        if guard.watchdog is not None:
            guard.watchdog.collective(f"replay.send({src}->{dst})")
        if guard.rank == src:
            dist.send_object_list([(_to_cpu(batch), rng)], dst=_global(guard.group, dst), group=guard.group)
        elif guard.rank == dst:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=_global(guard.group, src), group=guard.group)
            inputs[src] = (_to_device(box[0][0], guard.device), box[0][1])
    local = {}
    for job in dict.fromkeys(jobs):
        if job[1] == guard.rank:
            src_batch, rng = inputs[job[0]]
            local[job] = fingerprint(guard._recompute(src_batch, rng=rng))
    if guard.watchdog is not None:
        guard.watchdog.collective("all_gather_object(replay fingerprints)")
    gathered: list[Any] = [None] * guard.world
    dist.all_gather_object(gathered, local, group=guard.group)
    out: dict[Job, np.ndarray] = {}
    for part in gathered:
        out.update(part)
    return out


def _first_round(guard: SdcGuard, batch: Any, pairs: list[tuple[int, int]]
                 ) -> tuple[dict[Job, np.ndarray], dict[tuple[int, int], float]]:
    fp1 = _run_jobs(guard, batch, [(s, s) for s, _ in pairs] + list(pairs))
    return fp1, {pair: fingerprint_distance(fp1[(pair[0], pair[0])], fp1[pair]) for pair in pairs}


def pair_distances(guard: SdcGuard, batch: Any, pairs: list[tuple[int, int]]) -> list[float]:
    """Each pair's replay distance on this step's microbatches (collective): what the replay
    compares with its tolerance, so the calibration measures exactly that quantity."""
    return list(_first_round(guard, batch, pairs)[1].values())


def run_replay(guard: SdcGuard, batch: Any, pairs: list[tuple[int, int]], tolerance: float,
               domains: Sequence[int] | None = None) -> ReplayRound:
    """Replay ``pairs`` (collective), vote on disagreements, classify the liars."""
    t0 = time.perf_counter()
    fp1, distances = _first_round(guard, batch, pairs)
    bad = [pair for pair in pairs if not distances[pair] <= tolerance]
    judges = {pair: choose_judge(pair[0], pair[1], guard.world, domains) for pair in bad}
    fp2: dict[Job, np.ndarray] = {}
    if bad:
        jobs2: list[Job] = []
        for s, p in bad:
            jobs2 += [(s, s), (s, p)]
            if judges[(s, p)] is not None:
                jobs2.append((s, judges[(s, p)]))
        fp2 = _run_jobs(guard, batch, jobs2)
    incidents = []
    for s, p in pairs:
        fps = {s: fp1[(s, s)], p: fp1[(s, p)]}
        judge = judges.get((s, p))
        culprit, classification = None, None
        if (s, p) in judges and judge is not None:
            ref = fp2[(s, judge)]
            fps[judge] = ref
            v = vote(s, p, fingerprint_distance(fps[s], ref), fingerprint_distance(fps[p], ref), tolerance)
            culprit = v.culprit
            if culprit is not None:
                again = fp2[(s, culprit)]
                classification = classify(np.array_equal(fps[culprit], again, equal_nan=True), False)
        incidents.append(Incident(pair=(s, p), judge=judge, agreed=(s, p) not in judges,
                                  distance=distances[(s, p)], culprit=culprit, classification=classification,
                                  fingerprints=fps))
    return ReplayRound(incidents=tuple(incidents), duration_s=time.perf_counter() - t0)
