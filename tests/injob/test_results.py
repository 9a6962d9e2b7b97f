"""Check results: a result becomes the ``sdc_check`` event the probe receives, and a replay round
becomes each rank's own results (no process group needed to read a round)."""

from __future__ import annotations

import numpy as np
import torch

from fleethealth.injob.crossrank import Incident, ReplayPeers, ReplayRound, replay_results
from fleethealth.injob.recompute import Recompute
from fleethealth.injob.results import CheckResult, fingerprint_hex
from fleethealth.payloads.sdc_check import CheckKind, Classification, SdcCheck
from fleethealth.schema import Event, encode


def test_a_result_becomes_its_sdc_check_event() -> None:
    r = CheckResult(check=CheckKind.REPLAY, step=200, rank=3, passed=False, classification=Classification.PERSISTENT,
                    digests=("0a", "0b"), duration_s=0.25, peer_ranks=(1,), culprit_rank=3, tolerance=1e-6,
                    mismatched=("w",))
    e = r.to_event(10.0, "the vote names rank 3")
    assert (e.kind.value, e.rank, e.step, e.ts, e.message) == ("sdc_check", 3, 200, 10.0, "the vote names rank 3")
    assert SdcCheck.from_event(e) == SdcCheck(check=CheckKind.REPLAY, passed=False,
                                              classification=Classification.PERSISTENT, digests=("0a", "0b"),
                                              duration_s=0.25, peer_ranks=(1,), culprit_rank=3, tolerance=1e-6)
    assert encode(Event(**{**e.__dict__, "node": "n0000"})).endswith(
        b'"data":{"check":"replay","passed":false,"classification":"persistent","digests":["0a","0b"],'
        b'"duration_s":0.25,"peer_ranks":[1],"culprit_rank":3,"tolerance":1e-6}}')


def _round() -> ReplayRound:
    fps = {r: np.full(4, float(r)) for r in range(4)}
    bad = Incident(pair=(0, 2), judge=1, agreed=False, distance=0.5, culprit=2,
                   classification=Classification.PERSISTENT, fingerprints={0: fps[0], 2: fps[2], 1: fps[1]})
    good = Incident(pair=(1, 3), judge=None, agreed=True, distance=0.0, culprit=None, classification=None,
                    fingerprints={1: fps[1], 3: fps[3]})
    return ReplayRound(incidents=(bad, good), duration_s=0.3)


def _peers(rank: int) -> ReplayPeers:
    model = torch.nn.Linear(2, 1)
    return ReplayPeers(recompute=Recompute(model, list(model.parameters()), lambda m, b: m(b).sum()), rank=rank,
                       world=4)


def test_the_named_rank_fails_its_honest_peers_pass() -> None:
    (liar, msg), = replay_results(_round(), _peers(2), step=400, job_rank=2, tolerance=0.1)
    assert not liar.passed and liar.culprit_rank == 2 and liar.peer_ranks == (0, 1)
    assert liar.digests == tuple(fingerprint_hex(np.full(4, float(r))) for r in (2, 0, 1))
    assert liar.classification is Classification.PERSISTENT and liar.duration_s == 0.3 and liar.tolerance == 0.1
    assert "rank 0's microbatch disagrees" in msg and "the vote names rank 2" in msg
    judge = replay_results(_round(), _peers(1), step=400, job_rank=1, tolerance=0.1)
    assert [(r.passed, r.culprit_rank, m == "") for r, m in judge] == [(True, 2, False), (True, None, True)]
    (agreed, msg3), = replay_results(_round(), _peers(3), step=400, job_rank=3, tolerance=0.1)
    assert agreed.passed and agreed.peer_ranks == (1,) and msg3 == ""
