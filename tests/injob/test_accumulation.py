"""Gradient accumulation under 4-rank gloo DDP (see _accum_worker.py): 40 microbatches per step with
``no_sync``, the loop dividing the loss by 40. At the guard's defaults no SDC is reported (the
training pass's accumulated gradients are not compared with one microbatch's recomputation); an
injected transient in the checked microbatch is caught, the update is skipped on every rank, every
rank agrees on the verdict, and the loop rolls back by itself to the target the policy chooses from
the same events."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from fleethealth.policy.engine import PolicyEngine
from fleethealth.schema import Action, Event

sys.path.insert(0, str(Path(__file__).parent))
import _accum_worker as W  # noqa: E402
from _ranks import run_ranks  # noqa: E402

from detectors.sdc import SdcDetector  # noqa: E402

WORKER = Path(__file__).with_name("_accum_worker.py")
WORLD = 4


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(WORKER, WORLD, tmp_path_factory.mktemp("accum"), timeout_s=240)


def _sdc(phase: dict) -> list[dict]:
    return [e for e in phase["events"] if e["kind"] == "sdc_check"]


def test_accumulation_at_defaults_reports_no_sdc(ranks: list[dict]) -> None:
    for r in ranks:
        d = r["defaults"]
        checks = {(e["step"], e["data"]["check"]): e["data"]["passed"] for e in _sdc(d)}
        assert checks == {(0, "selfcheck"): True, (0, "replay"): True}, checks
        verdicts = [(v["step"], v["skip"], v["check"], v["microbatches"]) for v in d["verdicts"]]
        assert verdicts == [(0, False, None, W.ACCUM)]
        # the loop divides the loss by 40 and loss_fn does not: the recomputation learned the scale
        assert d["accumulation_scale"] == 1.0 / W.ACCUM


def test_transient_skips_the_update_everywhere_with_one_verdict(ranks: list[dict]) -> None:
    assert ranks[W.FAULT_RANK]["fault"]["fired_at"] == W.FAULT_STEP
    failing = [(r["rank"], e["step"]) for r in ranks for e in _sdc(r["fault"]) if not e["data"]["passed"]]
    assert failing == [(W.FAULT_RANK, W.FAULT_STEP)]
    verdicts = [next(v for v in r["fault"]["verdicts"] if v["step"] == W.FAULT_STEP) for r in ranks]
    assert all(v == {"step": W.FAULT_STEP, "skip": True, "check": "selfcheck", "culprits": [W.FAULT_RANK],
                     "classification": "transient", "microbatches": W.ACCUM,
                     "failed": ["selfcheck"] if r == W.FAULT_RANK else []}
               for r, v in enumerate(verdicts)), verdicts
    for r in ranks:  # no other step skipped
        assert [v["step"] for v in r["fault"]["verdicts"] if v["skip"]] == [W.FAULT_STEP]


def test_loop_rolls_back_to_the_policys_target_by_itself(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["fault"]["rollbacks"] == [{"at": W.FAULT_STEP, "target": 4, "same_as_rollback_target": True,
                                            "reason": f"selfcheck failed at step {W.FAULT_STEP} (transient)"}]
        # re-run from step 5; steps 5..7 twice, each once per pass
        assert [v["step"] for v in r["fault"]["verdicts"]] == [0, 1, 2, 3, 4, 5, 6, 5, 6, 7]
        assert 4 not in r["fault"]["pruned"][:2] and r["fault"]["pruned"][:2] == [0, 2]  # kept until no longer needed
    assert len({r["fault"]["weights"] for r in ranks}) == 1
    # the policy, given the same events (each rank on its own node), recommends the same target
    events = [Event.from_obj({**e, "node": f"node{r['rank']}"}) for r in ranks for e in r["fault"]["events"]]
    events = [e for e in sorted(events, key=lambda e: e.ts)]
    cut = next(e.ts for e in events if e.kind.value == "sdc_check" and not e.data["passed"])
    seen = [e for e in events if e.ts <= cut]  # what the stream held when the failure arrived
    findings = SdcDetector().check(seen)
    engine = PolicyEngine()
    engine.observe(seen)
    recs = [x for x in engine.decide(findings, time.time()) if x.action is Action.ROLLBACK]
    assert [(x.evidence["target_step"], x.guard.value) for x in recs] == [(4, "allowed")]
