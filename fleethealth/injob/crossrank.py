"""The collective part of the cross-rank replay: move microbatches, recompute, gather, vote.

Round 1: every pair ``(source, partner)`` of :func:`~fleethealth.injob.replay.replay_pairs` computes the
source's microbatch (the source's batch and RNG snapshot travel point to point), fingerprints are
all-gathered and compared at the calibrated tolerance. Round 2, only for pairs that disagree: a third
rank computes the same microbatch and both members of the pair compute it again; the vote names the
liar and the repeat says whether the liar reproduces its own answer (``persistent``) or not
(``transient``). Point-to-point transfers run in one global order every rank follows, so they cannot
deadlock. Every rank calls :func:`run_replay` with the same plan; :func:`replay_results` turns a
round into this rank's check results, and :func:`calibrate` measures the healthy pair distances the
tolerance comes from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.distributed as dist

from fleethealth.injob.digest import fingerprint, fingerprint_distance
from fleethealth.injob.distributed import global_rank, to_cpu, to_device
from fleethealth.injob.recompute import Recompute
from fleethealth.injob.replay import ReplayCalibration, choose_judge, replay_pairs, vote
from fleethealth.injob.results import CheckResult, fingerprint_hex
from fleethealth.injob.watchdog import HangWatchdog
from fleethealth.payloads.sdc_check import CheckKind, Classification, classify

__all__ = ["ReplayPeers", "Incident", "ReplayRound", "replay_round_plan", "run_replay", "pair_distances",
           "replay_results", "calibrate"]

_log = logging.getLogger("fleethealth.injob")

Job = tuple[int, int]
"""``(source rank, computing rank)``: the computing rank recomputes the source's microbatch."""


@dataclass(frozen=True)
class ReplayPeers:
    """This rank's side of a replay: its recomputation, its index ``rank`` among ``world`` ranks of
    ``group`` (``None``: the default group), and the watchdog that is told each collective."""

    recompute: Recompute
    rank: int
    world: int
    group: Any = None
    watchdog: HangWatchdog | None = None


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


def _run_jobs(peers: ReplayPeers, batch: Any, jobs: list[Job]) -> dict[Job, np.ndarray]:
    """Move each source's batch to the ranks that need it, recompute, all-gather the fingerprints."""
    rng = peers.recompute.rng_snapshot()
    inputs: dict[int, tuple[Any, Any]] = {peers.rank: (batch, rng)}
    for src, dst in sorted({j for j in jobs if j[0] != j[1]}):
        if peers.watchdog is not None:
            peers.watchdog.collective(f"replay.send({src}->{dst})")
        if peers.rank == src:
            dist.send_object_list([(to_cpu(batch), rng)], dst=global_rank(peers.group, dst), group=peers.group)
        elif peers.rank == dst:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=global_rank(peers.group, src), group=peers.group)
            inputs[src] = (to_device(box[0][0], peers.recompute.device), box[0][1])
    local = {}
    for job in dict.fromkeys(jobs):
        if job[1] == peers.rank:
            src_batch, rng = inputs[job[0]]
            local[job] = fingerprint(peers.recompute(src_batch, rng=rng))
    if peers.watchdog is not None:
        peers.watchdog.collective("all_gather_object(replay fingerprints)")
    gathered: list[Any] = [None] * peers.world
    dist.all_gather_object(gathered, local, group=peers.group)
    out: dict[Job, np.ndarray] = {}
    for part in gathered:
        out.update(part)
    return out


def _first_round(peers: ReplayPeers, batch: Any, pairs: list[tuple[int, int]]
                 ) -> tuple[dict[Job, np.ndarray], dict[tuple[int, int], float]]:
    fp1 = _run_jobs(peers, batch, [(s, s) for s, _ in pairs] + list(pairs))
    return fp1, {pair: fingerprint_distance(fp1[(pair[0], pair[0])], fp1[pair]) for pair in pairs}


def pair_distances(peers: ReplayPeers, batch: Any, pairs: list[tuple[int, int]]) -> list[float]:
    """Each pair's replay distance on this step's microbatches (collective): what the replay
    compares with its tolerance, so the calibration measures exactly that quantity."""
    return list(_first_round(peers, batch, pairs)[1].values())


def run_replay(peers: ReplayPeers, batch: Any, pairs: list[tuple[int, int]], tolerance: float,
               domains: Sequence[int] | None = None) -> ReplayRound:
    """Replay ``pairs`` (collective), vote on disagreements, classify the liars."""
    t0 = time.perf_counter()
    fp1, distances = _first_round(peers, batch, pairs)
    bad = [pair for pair in pairs if not distances[pair] <= tolerance]
    judges = {pair: choose_judge(pair[0], pair[1], peers.world, domains) for pair in bad}
    fp2: dict[Job, np.ndarray] = {}
    if bad:
        jobs2: list[Job] = []
        for s, p in bad:
            jobs2 += [(s, s), (s, p)]
            if judges[(s, p)] is not None:
                jobs2.append((s, judges[(s, p)]))
        fp2 = _run_jobs(peers, batch, jobs2)
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


def replay_results(round_: ReplayRound, peers: ReplayPeers, *, step: int, job_rank: int,
                   tolerance: float) -> list[tuple[CheckResult, str]]:
    """This rank's result of each pair it took part in, with the message to report it under
    (empty when the pair agreed). Ranks in results are job (global) ranks."""
    out = []
    for incident in round_.incidents:
        if peers.rank not in incident.ranks:
            continue
        suspect = incident.culprit == peers.rank or (incident.culprit is None and not incident.agreed
                                                     and peers.rank in incident.pair)
        own = incident.fingerprints[peers.rank]
        others = tuple(r for r in incident.ranks if r != peers.rank)
        culprit = None if incident.culprit is None else global_rank(peers.group, incident.culprit)
        result = CheckResult(check=CheckKind.REPLAY, step=step, rank=job_rank, passed=not suspect,
                             classification=incident.classification,
                             digests=(fingerprint_hex(own), *(fingerprint_hex(incident.fingerprints[p])
                                                              for p in others)),
                             duration_s=round_.duration_s,
                             peer_ranks=tuple(global_rank(peers.group, p) for p in others),
                             culprit_rank=culprit, tolerance=tolerance)
        source = global_rank(peers.group, incident.pair[0])
        message = "" if incident.agreed else (
            f"replay of rank {source}'s microbatch disagrees (distance {incident.distance:.3g} "
            f"> {tolerance:.3g}); " + ("no majority" if culprit is None else f"the vote names rank {culprit}"))
        out.append((result, message))
    return out


def calibrate(peers: ReplayPeers, batch: Any, *, sigmas: float, margin: float, floor: float) -> ReplayCalibration:
    """The replay pairs (``r`` and ``r + world // 2``) each compute the source's microbatch, as a
    replay does (collective); their distances set the tolerance
    (:meth:`ReplayCalibration.from_pair_distances`)."""
    distances = pair_distances(peers, batch, replay_round_plan(peers.world))
    cal = ReplayCalibration.from_pair_distances(distances, sigmas=sigmas, margin=margin, floor=floor)
    _log.info("fleethealth: replay calibrated on %d pair distances (max %.3g): tolerance %.3g",
              len(distances), max(distances, default=0.0), cal.tolerance)
    return cal
