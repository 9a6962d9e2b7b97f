"""Return to pool: a quarantined node goes back only after passing the complete full suite.

:func:`release_decision` is the pure rule. A node is released when it is quarantined and its run
was the ``full`` suite, every test passed (no ``fail``, no ``slow``), and every test the full
suite holds for the devices it ran on is there (a run narrowed with ``--only`` cannot release a
node). The evidence handed to the quarantine book is one self-test record for the whole suite
(``suite: full``, ``test: suite``, ``verdict: pass``, no mismatches, the node and the time of its
last result, the devices and every ``[test, device]`` covered), with the event ids of the
individual results, so the release is recorded with what justified it; completeness is one rule
for both (:func:`fleethealth.policy.quarantine.full_suite_missing`).
:func:`apply_release` asks :func:`fleethealth.policy.quarantine.release`, which checks the
record again and logs the release, or the refusal and its reason (for a run that failed, was
slow or was incomplete the record's verdict says so, and the book refuses it). Given the scheduler
(``scheduler=``, a :class:`~fleethealth.adapters.slurm.SlurmAdapter`), a released node is resumed
there too, if fleethealth drained it: the node is really back in the pool, not only in the book.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleethealth.policy.quarantine import FULL_SUITE, SUITE_RECORD, full_suite_missing
from fleethealth.sweeps.launch import NodeRun, NodeStatus

if TYPE_CHECKING:
    from fleethealth.store.protocol import StoreLike

__all__ = ["FULL_SUITE", "ReleaseDecision", "release_decision", "apply_release"]

log = logging.getLogger("fleethealth.sweeps.release")


@dataclass(frozen=True)
class ReleaseDecision:
    """Whether ``node`` may return to the pool (``release``), why (``reason``), and the evidence."""

    node: str
    release: bool
    reason: str
    ts: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)


def release_decision(run: NodeRun, *, quarantined: bool) -> ReleaseDecision:
    """Decide from one node's run; see the module docstring. For a quarantined node the evidence is
    always filled in (verdict ``pass`` only when the node may go), so a refusal can be logged too."""
    node = run.node
    if not quarantined:
        return ReleaseDecision(node, False, "node is not quarantined")
    devices = sorted({r.device for r in run.results if "," not in r.device})
    have = {(r.test, r.device) for r in run.results}
    missing = full_suite_missing(devices, have) if devices else []
    if run.suite != FULL_SUITE:
        verdict, reason = "incomplete", f"suite {run.suite!r}: only a passing full suite releases a node"
    elif run.status is not NodeStatus.PASS:
        verdict = run.status.value
        reason = f"full suite {run.status.value}: {run.error or ', '.join(run.failing[:5])}"
    elif missing:
        verdict = "incomplete"
        names = ", ".join(f"{t}@{d}" for t, d in missing[:4])
        reason = f"incomplete full suite: {len(missing)} tests missing ({names})"
    else:
        verdict, reason = "pass", f"passed the full suite ({len(run.results)} tests)"
    ts = max((r.ts for r in run.results), default=0.0)
    mismatches = [m.to_obj() for r in run.results for m in r.mismatches][:16]
    evidence = {
        "suite": run.suite, "test": SUITE_RECORD, "device": ",".join(devices), "verdict": verdict,
        "mismatches": mismatches, "node": node, "ts": ts, "tests": len(run.results), "reason": reason,
        "devices": devices, "covered": [list(pair) for pair in sorted(have)],
        "results": [r.to_event(node).id for r in run.results],
    }
    return ReleaseDecision(node, verdict == "pass", reason, ts, evidence)


def apply_release(store: StoreLike, decision: ReleaseDecision, scheduler: Any = None) -> bool:
    """Hand the decision to the quarantine book; ``True`` when the node left quarantine. A refused
    decision with evidence is handed over too, so the book logs the refusal and its reason. With a
    ``scheduler``, a released node is resumed there (only if fleethealth drained it; a failure to
    resume is logged: the book's release stands, and an operator resumes the node)."""
    from fleethealth.adapters.base import SchedulerError
    from fleethealth.policy import quarantine

    if not decision.evidence:
        return False
    released = quarantine.release(store, decision.node, decision.ts, decision.evidence) and decision.release
    if released and scheduler is not None:
        try:
            done = scheduler.resume(decision.node)
            log.info("%s released: %s", decision.node, done or "not drained, nothing to resume")
        except SchedulerError as exc:
            log.error("%s released from quarantine but not resumed in %s: %s", decision.node,
                      getattr(scheduler, "name", "the scheduler"), exc)
    return released
