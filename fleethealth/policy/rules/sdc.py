"""Silent data corruption: quarantine the node, roll the job back to a checkpoint that can be trusted.

``quarantine`` of the node (exempt from the same-rack rule: a node that corrupts results must leave
at once; the breaker still bounds it), ``page`` instead when the check failed deterministically
across ranks (data or code, not hardware), and ``rollback`` of the job to the newest checkpoint at or
before the mark that can vouch for the failure: the last passing check for a transient fault, the
last passing *replay* for any other; once the job reports ``checkpoint_validated`` results (or with
``require_validated``), only a checkpoint validated ``valid`` — an invalid one is refused and named.
"""

from __future__ import annotations

import contextlib
from typing import Any

from fleethealth.errors import SchemaError
from fleethealth.payloads.checkpoint import CheckpointRecord
from fleethealth.payloads.rollback import Marks, admissible, choose
from fleethealth.policy.rules.context import RuleContext
from fleethealth.schema import Action, Finding, Guard, Recommendation

__all__ = ["sdc", "rollback"]


def sdc(ctx: RuleContext, f: Finding, now: float) -> list[Recommendation]:
    """Silent data corruption: quarantine the node (page for data or code), and roll the job back."""
    out: list[Recommendation] = []
    cls = f.evidence.get("classification")
    if cls == "data_or_code":
        out.append(ctx.rec(Action.PAGE, f, now, "SDC check failed deterministically across ranks: data "
                           "or code, not this node's hardware; a human must look",
                           {"classification": cls}))
    elif f.node in ctx.state_.quarantined:
        out.append(ctx.rec(Action.NONE, f, now, f"{f.node} already quarantined for SDC",
                           {"classification": cls}))
    else:
        recs = ctx.guarded(Action.QUARANTINE, f, now, f"silent data corruption on {f.node} "
                           f"(GPU {f.gpu}, {cls or 'unclassified'}): quarantine until a full self-test "
                           "passes", {"classification": cls, "check": f.evidence.get("check")})
        if recs[0].guard is Guard.ALLOWED:
            ctx.state_.quarantined.add(f.node)
        out.extend(recs)
    if f.job is not None:
        out.extend(rollback(ctx, f, now))
    return out


def rollback(ctx: RuleContext, f: Finding, now: float) -> list[Recommendation]:
    """The job's rollback target (:func:`fleethealth.payloads.rollback.choose`), once per target."""
    job = f.job or ""
    book = list(ctx.state_.checkpoints.get(job, ()))
    for c in f.evidence.get("checkpoints", ()) or ():
        with contextlib.suppress(SchemaError):
            rec = CheckpointRecord.from_data(c)
            book.append(rec)
    ev = f.evidence

    def _step(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    seen = [Marks(_step(ctx.state_.last_pass.get(job)), _step(ctx.state_.last_replay_pass.get(job))),
            Marks(_step(ev.get("last_verified_step")), _step(ev.get("last_replay_step")))]
    seen += [c.marks for c in book]
    classification = ev.get("classification") if isinstance(ev.get("classification"), str) else None
    checked = ctx.state_.validations.get(job, {})
    validity = {step: valid for step, (valid, _) in checked.items()}
    marks, bound, target = choose(book, seen, classification, f.step, validity=validity,  # the guard's rule too
                                  require_validation=ctx.require_validated)
    vouching = "check" if classification == "transient" else "replay"
    watermark = -1 if bound is None else bound
    # what validation kept out: checkpoints the marks alone would have allowed, newer than the target
    _, refused = admissible(book, validity, require_validation=ctx.require_validated)
    floor = -1 if target is None else target.step
    passed_over = sorted({c.step for c in refused if floor < c.step <= watermark})
    refusals = [[s, checked.get(s, (False, "not validated"))[1] or "not validated"] for s in passed_over]
    validation = {"validation": "required" if validity or ctx.require_validated else "not_reported",
                  "refused_checkpoints": refusals}
    refused_text = "".join(f"; checkpoint step {s} refused ({why})" for s, why in refusals)
    if target is None:
        return [ctx.rec(Action.ROLLBACK, f, now, f"SDC in job {job} at step {f.step} "
                        f"({classification or 'unclassified'}): no {'validated ' if refusals else ''}"
                        f"checkpoint at or before a passing {vouching} is known{refused_text}; the run may "
                        "be unrecoverable, needs a human",
                        {"last_verified_step": marks.transient, "last_replay_step": marks.deterministic,
                         "classification": classification, "checkpoints_known": len(book), **validation},
                        fired=[], guard=Guard.NEEDS_HUMAN)]
    key = f"{job}@{target.step}"
    if key in ctx.state_.rolled_back:
        return []
    ctx.state_.rolled_back.add(key)
    discarded = sorted({c.step for c in book if c.step > target.step})
    return [ctx.rec(Action.ROLLBACK, f, now, f"SDC in job {job} at step {f.step} "
                    f"({classification or 'unclassified'}): roll back to checkpoint step {target.step} "
                    f"({target.uri or 'no uri'}), the newest at or before the last passing {vouching} "
                    f"(step {watermark}){refused_text}",
                    {**validation, "target_step": target.step, "target_uri": target.uri,
                     "last_verified_step": marks.transient,
                     "last_replay_step": marks.deterministic, "bound_step": watermark,
                     "classification": classification, "failed_step": f.step,
                     "discarded_checkpoints": discarded})]
