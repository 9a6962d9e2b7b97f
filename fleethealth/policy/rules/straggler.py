"""Stragglers: evict a slow node when the eviction pays back, alert facilities for a hot aisle.

Diagnosis ENVIRONMENTAL → ``alert_facilities`` once per rack episode, never evict; NODE_THERMAL /
NODE_LINK / NETWORK_CONTENTION (the last also "change placement") / UNKNOWN → ``evict`` when payback
R / (P(healthy) × slowdown) is well under the remaining run time; UNKNOWN only once per node; a
power-capped UNKNOWN (a node power fault) only when persistent and material.
"""

from __future__ import annotations

import math

from fleethealth.errors import ConfigError
from fleethealth.evidence import StragglerEvidence
from fleethealth.nodename import known_rack
from fleethealth.policy.eviction import payback
from fleethealth.policy.guards import GuardName
from fleethealth.policy.rules.context import RuleContext
from fleethealth.schema import Action, Diagnosis, Finding, Guard, Recommendation

__all__ = ["straggler", "facilities", "STRAGGLER_EVICT"]

STRAGGLER_EVICT = {Diagnosis.NODE_THERMAL, Diagnosis.NODE_LINK, Diagnosis.NETWORK_CONTENTION, Diagnosis.UNKNOWN}
"""The diagnoses a straggler may be evicted for."""


def straggler(ctx: RuleContext, f: Finding, now: float) -> list[Recommendation]:
    """A straggler: facilities for an environmental cause, else eviction when it pays back, under the
    guards (one per node, UNKNOWN once, the same rack, one per job per window, the breaker)."""
    diag = f.diagnosis or Diagnosis.UNKNOWN
    facts = StragglerEvidence.from_evidence(f.evidence)
    rack = known_rack(facts.rack)
    if diag is Diagnosis.ENVIRONMENTAL:
        return [facilities(ctx, f, now, rack)]
    if diag not in STRAGGLER_EVICT:
        raise ConfigError(f"unhandled diagnosis {diag}")
    slowdown = f.slowdown if f.slowdown is not None else facts.slowdown
    if not isinstance(slowdown, int | float) or isinstance(slowdown, bool) or not math.isfinite(slowdown):
        return [ctx.rec(Action.NONE, f, now, "straggler without a measured slowdown: no payback to "
                        "compute, reported only", {"diagnosis": diag.value})]
    power = diag is Diagnosis.UNKNOWN and facts.power_capped
    if power:
        share = facts.power_cap_share if facts.power_cap_share is not None else 0.0
        pev = {"diagnosis": diag.value, "power_fault": True, "power_cap_share": share,
               "power_fault_share": ctx.power_fault_share,
               "power_fault_min_slowdown": ctx.power_fault_min_slowdown}
        if share < ctx.power_fault_share or slowdown < ctx.power_fault_min_slowdown:
            return [ctx.rec(Action.NONE, f, now, f"power-capped straggler {slowdown:.0%} slow on {f.node}: a "
                            f"node power fault (its power limit or supply), capped {share:.0%} of the window; "
                            f"evicted only when persistent (>= {ctx.power_fault_share:.0%}) and material "
                            f"(>= {ctx.power_fault_min_slowdown:.0%} slower): reported", pev)]
    remaining = (facts.remaining_s if facts.remaining_s is not None
                 else ctx.state_.remaining.get(f.job or "", ctx.default_remaining_s))
    pb = payback(ctx.restart_s, ctx.state_.posterior.mean(diag), float(slowdown), remaining, ctx.payback_margin)
    ev = {"diagnosis": diag.value, "rack": rack, **pb.to_evidence(), "z": f.z,
          "p_healthy_counts": list(ctx.state_.posterior.counts(diag))}
    if diag is Diagnosis.NETWORK_CONTENTION:
        ev["placement"] = "change"
    if power:
        ev.update(pev)
    pretty = "never" if math.isinf(pb.payback_s) else f"{pb.payback_s / 60:.1f} min"
    if not pb.worth:
        return [ctx.rec(Action.NONE, f, now, f"{diag.value} straggler {slowdown:.0%} slow on {f.node}: "
                        f"eviction pays back in {pretty} at P(healthy)={pb.p_healthy:.2f}, not well "
                        f"under the {remaining / 3600:.1f} h left; keep running", ev)]
    if f.node in ctx.state_.evicted and f.ts - ctx.state_.evicted[f.node] < ctx.state_.rate.window_s:
        return [ctx.rec(Action.NONE, f, now, f"eviction of {f.node} already recommended at "
                        f"ts={ctx.state_.evicted[f.node]:.0f}", {**ev, "evicted_ts": ctx.state_.evicted[f.node]})]
    held = ctx.state_.held.get(f.node)
    if held is not None and f.ts - held[0] < ctx.state_.rate.window_s:
        return [ctx.rec(Action.NONE, f, now, f"eviction of {f.node} already recommended at ts={held[0]:.0f} "
                        f"and held ({held[1]}); one recommendation per node", {**ev, "held_ts": held[0]})]
    reason = (f"{diag.value} straggler {slowdown:.0%} slow on {f.node} (rank {f.rank}): eviction pays "
              f"back in {pretty} at P(healthy)={pb.p_healthy:.2f}, well under the "
              f"{remaining / 3600:.1f} h left; evict at the next checkpoint")
    if diag is Diagnosis.NETWORK_CONTENTION:
        reason += " and change placement (shared NIC)"
    if power:
        reason = (f"node power fault: GPU held at its power cap {pev['power_cap_share']:.0%} of the window, "
                  f"persistent and material; {reason}")
    fired: list[str] = []
    if diag is Diagnosis.UNKNOWN and f.node in ctx.state_.unknown_evicted:
        fired.append(GuardName.UNKNOWN_ONCE)
        reason += "; cause UNKNOWN and this node was already evicted once: a human must decide"
    if rack is not None and ctx.state_.rack.blocks(rack):
        fired.append(GuardName.SAME_RACK)
        reason += f"; the last eviction ({ctx.state_.rack.last_node_}) was also in rack {rack}: needs a human"
    job = f.job or ""
    since = ctx.state_.rate.since_last(job, now)
    if since is not None:
        fired.append(GuardName.RATE_LIMIT)
        ev["since_last_eviction_s"] = since
        reason += (f"; job {job} already had a straggler eviction {since:.0f} s ago "
                   f"(limit one per {ctx.state_.rate.window_s:.0f} s)")
    recs = ctx.guarded(Action.EVICT, f, now, reason, ev, fired=fired)
    if recs[0].guard is Guard.ALLOWED:
        ctx.state_.watch.issue(recs[0])
        ctx.state_.rate.note(job, now)
        if rack is not None:
            ctx.state_.rack.note(rack, f.node)
        ctx.state_.evicted[f.node] = f.ts
        if diag is Diagnosis.UNKNOWN:
            ctx.state_.unknown_evicted.add(f.node)
    else:
        ctx.state_.held[f.node] = (f.ts, recs[0].guard.value)
    return recs


def facilities(ctx: RuleContext, f: Finding, now: float, rack: str | None) -> Recommendation:
    """``alert_facilities`` once per rack episode (a rack not reported: the node's own episode)."""
    ev = {"diagnosis": Diagnosis.ENVIRONMENTAL.value, "rack": rack, "slowdown": f.slowdown}
    key = rack if rack is not None else f"?{f.node}"  # no rack reported: the episode is the node's own
    place = f"rack {rack}" if rack is not None else f"the rack of {f.node} (not reported)"
    alerted = ctx.state_.facilities.get(key)
    if alerted is not None and f.ts - alerted[1] < ctx.facilities_episode_s:
        ctx.state_.facilities[key] = (alerted[0], max(alerted[1], f.ts))
        return ctx.rec(Action.NONE, f, now, f"{place} environmental episode: facilities already "
                       f"alerted at ts={alerted[0]:.0f}; evicting would not help",
                       {**ev, "alerted_ts": alerted[0]})
    ctx.state_.facilities[key] = (f.ts, f.ts)
    return ctx.rec(Action.ALERT_FACILITIES, f, now, f"stragglers in {place} share an environmental "
                   f"cause (hot aisle / cooling): alert facilities; evicting {f.node} would only move "
                   "the symptom", ev)
