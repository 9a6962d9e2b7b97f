"""The policy engine: findings in, explained and guarded recommendations out.

``PolicyEngine(**params).decide(findings, now)`` is pure: no I/O and no clock (``now`` is the
decision's event time). Its memory — evictions per job, the last evicted rack, the breaker, the
finding ids already decided, P(healthy) counts, checkpoints and passing SDC checks seen through
:meth:`PolicyEngine.observe`, straggler evictions awaiting their outcome (``watch``, judged by
:meth:`PolicyEngine.judge`) — is one dataclass, ``state_``
(:class:`~fleethealth.policy.rules.context.EngineState`; its fields also read as ``name_``
attributes, ``drained_``, ``breaker_`` …), and round-trips through :meth:`PolicyEngine.to_state` /
:meth:`PolicyEngine.load_state` (see :mod:`fleethealth.policy.persist`). The engine keeps the
orchestration — idempotency, staleness, the breaker's held removals, the inputs other than findings
— and each finding kind's rule lives in :mod:`fleethealth.policy.rules`, one module a family. The
detector runner drives it through :class:`fleethealth.policy.stage.PolicyStage`.

What each finding becomes (seed 000 §7, R2, R6; docs/architecture.md "Findings and recommendations"):

=====================  ===========================================================================
straggler              diagnosis ENVIRONMENTAL → ``alert_facilities`` once per rack episode, never
                       evict; NODE_THERMAL / NODE_LINK / NETWORK_CONTENTION (the last also "change
                       placement") / UNKNOWN → ``evict`` when payback R / (P(healthy) × slowdown)
                       is well under the remaining run time; UNKNOWN only once per node.
sdc                    ``quarantine`` of the node and ``rollback`` of the job to the newest
                       checkpoint at or before the mark that can vouch for the failure: the last
                       passing check for a transient fault, the last passing *replay* for any
                       other (a self-check cannot see a deterministic fault); once the job reports
                       ``checkpoint_validated`` results (or with ``require_validated``), only a
                       checkpoint validated ``valid`` — an invalid one is refused and named
failure_risk           ``drain`` at the next checkpoint boundary when probability ≥ threshold
hang                   ``drain`` of the node named, so the restart does not land on it; a hang
                       with no culprit (every rank level) ``page``: no node is to blame
xid / ecc              ``drain`` for critical severity, a catalogue advice of ``drain`` (the
                       finding's ``evidence["action"]``; without one, the Xid rulebook
                       :mod:`fleethealth.xid` for the code) and uncorrectable errors; else ``none``
link (NVLink errors)   critical rate: ``drain`` at the next checkpoint boundary, as a failure
                       risk (NVLink errors climbing steadily precede hard failures), slow or
                       not; a warning rate ``none``: reported and watched
thermal / power_brake  ``none`` (a PCIe ``link`` too): reported; acted on through a straggler's
                       diagnosis
=====================  ===========================================================================

Never two evictions or drains in a row in one rack without a human (:class:`RackGuard`, shared by
both): two nodes of a rack failing one after the other points at what they share (power, cooling,
the top-of-rack switch), which taking out a second node does not fix and a human should look at; and
each one removed costs the rack's jobs a restart. A quarantine for SDC is exempt: a node that
corrupts results must leave at once, whatever its rack (the breaker still bounds it).

Every node-removing action passes the guards of :mod:`fleethealth.policy.guards`; a guard that
fires sets ``guard`` (``rate_limited`` / ``needs_human``) and is named in ``evidence["guards_fired"]``.
A ``none`` recommendation (stale, already decided, not worth it) keeps ``guard`` ``allowed``: there is
nothing to hold. While an eviction of a node is held, further findings on that node within the rate
window yield ``none``, so a node-level fault on eight ranks is one recommendation, not eight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from fleethealth.errors import ConfigError, SchemaError
from fleethealth.ids import derived
from fleethealth.params import check_number
from fleethealth.payloads.checkpoint import CheckpointRecord
from fleethealth.payloads.validation import CheckpointValidation
from fleethealth.policy.eviction import EvictionOutcome, EvictionWatch, HealthyPosterior
from fleethealth.policy.guards import (
    DEFAULT_MAX_SKEW_S,
    CircuitBreaker,
    GuardName,
    JobRateLimiter,
    RackGuard,
    is_stale,
)
from fleethealth.policy.rules import decide as decide_finding
from fleethealth.policy.rules.context import EngineState, RuleContext, rack_of
from fleethealth.schema import Action, Diagnosis, Event, EventKind, Finding, FindingKind, Guard, Recommendation

__all__ = ["PolicyEngine", "EngineState", "rack_of"]


class PolicyEngine(RuleContext):
    """Turns findings into recommendations under guards; pure, with its memory in ``state_``.

    Parameters (keyword-only): ``restart_s`` measured restart cost R (600); ``payback_margin``:
    evict when payback ≤ margin × remaining run time (0.25); ``default_remaining_s`` when neither the
    finding's ``evidence["remaining_s"]`` nor :meth:`set_remaining` says (86,400); ``prior_alpha`` /
    ``prior_beta`` the Beta prior of P(healthy) (3, 1); ``rate_window_s`` one straggler eviction per
    job per window (3,600); ``stale_after_s`` staleness bound (900); ``breaker_share`` /
    ``breaker_min_nodes`` / ``breaker_window_s`` / ``fleet_nodes`` the circuit breaker (0.1, 5,
    3,600, 0 = unknown) and ``breaker_max_nodes`` its absolute maximum of nodes removed per window
    whatever the fleet's size (0 = none); ``facilities_episode_s`` a hot-aisle episode ends
    after this long without an ENVIRONMENTAL finding in the rack (3,600); ``failure_risk_threshold``
    (0.5); ``dry_run`` marks every recommendation as not to be executed (False);
    ``outcome_settle_s`` / ``outcome_recur_share`` how an executed straggler eviction is judged
    (:class:`~fleethealth.policy.eviction.EvictionWatch`: 1,800, 0.5); ``corroborate``: an Xid, ECC or
    SDC finding removes a node automatically only with a supporting signal from the node's own stream
    (:func:`~fleethealth.policy.guards.uncorroborated`; True); ``power_fault_share`` /
    ``power_fault_min_slowdown``: a power-capped UNKNOWN straggler (a node power fault) is evicted only
    when its GPU was capped for at least that share of the diagnosis window (persistent; 0.9) and it is
    at least that much slower (material; 0.1), and the payback holds; ``max_skew_s``: a finding stamped
    more than this after the decision time is stale too (clock skew or a forged time; 60).
    """

    def __init__(self, *, restart_s: float = 600.0, payback_margin: float = 0.25,
                 default_remaining_s: float = 86_400.0, prior_alpha: float = 3.0, prior_beta: float = 1.0,
                 rate_window_s: float = 3600.0, stale_after_s: float = 900.0, breaker_share: float = 0.1,
                 breaker_min_nodes: int = 5, breaker_window_s: float = 3600.0, fleet_nodes: int = 0,
                 breaker_max_nodes: int = 0, facilities_episode_s: float = 3600.0,
                 failure_risk_threshold: float = 0.5, dry_run: bool = False, outcome_settle_s: float = 1800.0,
                 outcome_recur_share: float = 0.5, corroborate: bool = True,
                 require_validated: bool = False, power_fault_share: float = 0.9,
                 power_fault_min_slowdown: float = 0.1, max_skew_s: float = DEFAULT_MAX_SKEW_S) -> None:
        self.corroborate = bool(corroborate)
        self.require_validated = bool(require_validated)
        self.power_fault_share = check_number("power_fault_share", power_fault_share, above=0, at_most=1.0)
        self.power_fault_min_slowdown = check_number("power_fault_min_slowdown", power_fault_min_slowdown,
                                                     at_least=0)
        self.restart_s = check_number("restart_s", restart_s, at_least=0)
        self.payback_margin = check_number("payback_margin", payback_margin, above=0)
        self.default_remaining_s = check_number("default_remaining_s", default_remaining_s, at_least=0)
        self.stale_after_s = check_number("stale_after_s", stale_after_s, above=0)
        self.max_skew_s = check_number("max_skew_s", max_skew_s, at_least=0)
        self.facilities_episode_s = check_number("facilities_episode_s", facilities_episode_s, above=0)
        self.failure_risk_threshold = check_number("failure_risk_threshold", failure_risk_threshold, at_least=0)
        if self.failure_risk_threshold > 1:
            raise ConfigError(f"failure_risk_threshold is a probability, got {failure_risk_threshold}")
        self.dry_run = bool(dry_run)
        # an eviction waits for its execution report as long as `fleethealth act` would still carry it
        # out (adapters.act.DEFAULT_MAX_AGE_S is twice the staleness bound)
        self.state_ = EngineState(
            posterior=HealthyPosterior(alpha=prior_alpha, beta=prior_beta),
            watch=EvictionWatch(settle_s=outcome_settle_s, recur_share=outcome_recur_share,
                                max_wait_s=2 * self.stale_after_s),
            rate=JobRateLimiter(window_s=rate_window_s),
            rack=RackGuard(),
            breaker=CircuitBreaker(share=breaker_share, min_nodes=breaker_min_nodes, window_s=breaker_window_s,
                                   fleet_nodes=fleet_nodes, max_nodes=breaker_max_nodes))

    # ------------------------------------------------------------ inputs other than findings
    def observe(self, events: Sequence[Event]) -> int:
        """Learn checkpoints (with their watermark) and passing SDC checks from job events, and which
        issued evictions the scheduler carried out; returns how many evictions were reported executed."""
        noted = self.state_.watch.observe(events)
        for ev in events:
            if ev.job is None:
                continue
            if ev.kind is EventKind.CHECKPOINT:
                try:
                    rec = CheckpointRecord.from_event(ev)
                except SchemaError:
                    continue
                book = self.state_.checkpoints.setdefault(ev.job, [])
                if all(c.step != rec.step for c in book):
                    book.append(rec)
                    book.sort(key=lambda c: c.step)
            elif ev.kind is EventKind.CHECKPOINT_VALIDATED:
                try:
                    val = CheckpointValidation.from_event(ev)
                except SchemaError:
                    continue
                why = "" if val.valid else f"{val.result.value}: {val.reasons[0] if val.reasons else 'no reason'}"
                self.state_.validations.setdefault(ev.job, {})[val.step] = (val.valid, why)
            elif (ev.kind is EventKind.SDC_CHECK and ev.data.get("passed") is True and ev.step is not None
                  and ev.data.get("culprit_rank") is None):  # a vote against a peer is no clean step
                self.state_.last_pass[ev.job] = max(self.state_.last_pass.get(ev.job, -1), ev.step)
                if ev.data.get("check") == "replay":
                    replay = self.state_.last_replay_pass
                    replay[ev.job] = max(replay.get(ev.job, -1), ev.step)
        return noted

    def judge(self, findings: Sequence[Finding], now: float) -> list[EvictionOutcome]:
        """Outcomes of executed evictions that ``findings`` (new ones) or the time ``now`` decide; each
        moves P(healthy) at once. The caller records them (:func:`fleethealth.policy.persist.record_outcome`)."""
        outcomes = self.state_.watch.judge(findings, float(now))
        for o in outcomes:
            self.record_outcome(o)
        return outcomes

    def settle(self, outcomes: Sequence[EvictionOutcome]) -> None:
        """Count recorded outcomes into P(healthy), each eviction once, and stop watching those evictions."""
        unique = {o.key: o for o in outcomes}
        self.state_.posterior.record_all(unique.values())
        self.state_.watch.settled(set(unique))

    def record_outcome(self, outcome: EvictionOutcome) -> None:
        """Feed back whether an eviction resolved the straggle; moves P(healthy) for its class."""
        self.state_.posterior.record(outcome.diagnosis, outcome.resolved)

    def p_healthy(self, diagnosis: Diagnosis | str) -> float:
        return self.state_.posterior.mean(diagnosis)

    def release(self, node: str) -> None:
        """``node`` left the quarantine book (a release through the API or a sweep, after a passing full
        self-test): forget that it was quarantined or drained, so a new fault on it is decided afresh."""
        self.state_.quarantined.discard(node)
        self.state_.drained.discard(node)

    def forget_job(self, job: str) -> None:
        """Drop what the engine keeps per job once detection forgot the job as ended: checkpoints,
        verification marks, remaining time and its rollbacks (node-level memory is kept)."""
        self.state_.checkpoints.pop(job, None)
        self.state_.last_pass.pop(job, None)
        self.state_.last_replay_pass.pop(job, None)
        self.state_.validations.pop(job, None)
        self.state_.remaining.pop(job, None)
        self.state_.rolled_back = {k for k in self.state_.rolled_back if k.rpartition("@")[0] != job}

    def set_remaining(self, job: str, seconds: float) -> None:
        self.state_.remaining[job] = check_number("remaining seconds", seconds, at_least=0)

    def reset_breaker(self) -> None:
        """The explicit human reset; also clears the same-rack hold. The removals the open breaker held
        are decided again by the next :meth:`decide`, at its time (:meth:`_after_close`)."""
        self.state_.breaker.reset()
        self.state_.rack.acknowledge()
        self.state_.breaker_closed = bool(self.state_.breaker_held)

    def _after_close(self, now: float) -> list[Recommendation]:
        """The removals the breaker held, once it is closed: each finding still within ``stale_after_s``
        of ``now`` is decided afresh (every guard applies, the breaker too); an older one is never acted
        on — it is listed for a human (the held action, ``needs_human``, guards ``breaker`` and
        ``stale``)."""
        held, self.state_.breaker_held, self.state_.breaker_closed = self.state_.breaker_held, {}, False
        out: list[Recommendation] = []
        for fid, (action, obj) in sorted(held.items(), key=lambda kv: (kv[1][1]["ts"], kv[0])):
            f = Finding.from_obj(obj)
            if not is_stale(f.ts, now, self.stale_after_s, self.max_skew_s):
                if f.kind is FindingKind.STRAGGLER:
                    self.state_.held.pop(f.node, None)  # held by the breaker, not by a judgement of the node
                out.extend(decide_finding(self, f, now))
                continue
            rec = self.rec(Action(action), f, now, f"{action} of {f.node} was held by the open circuit breaker; "
                           f"the finding is {now - f.ts:.0f} s old now, beyond the {self.stale_after_s:.0f} s "
                           "staleness bound: listed for a human, not acted on",
                           {"age_s": now - f.ts, "stale_after_s": self.stale_after_s, "held_finding_id": fid},
                           fired=[GuardName.BREAKER, GuardName.STALE], guard=Guard.NEEDS_HUMAN)
            out.append(dataclasses.replace(rec, finding_id=derived("breaker_closed", fid)))
        return out

    def acknowledge_rack(self) -> None:
        """A human has looked at the last eviction; the next one may be in the same rack."""
        self.state_.rack.acknowledge()

    # ------------------------------------------------------------ decide
    def decide(self, findings: Sequence[Finding], now: float) -> list[Recommendation]:
        """Recommendations for ``findings`` at event time ``now``; a finding id seen before yields none."""
        now = float(now)
        out: list[Recommendation] = self._after_close(now) if self.state_.breaker_closed else []
        for f in sorted(findings, key=lambda f: (f.ts, f.id)):
            fid = f.id
            if fid in self.state_.seen:
                continue
            self.state_.seen.add(fid, f.ts)
            if is_stale(f.ts, now, self.stale_after_s, self.max_skew_s):
                age = now - f.ts
                why = (f"finding is {age:.0f} s old, beyond the {self.stale_after_s:.0f} s staleness bound"
                       if age >= 0 else f"finding is stamped {-age:.0f} s after the decision time, beyond "
                       f"the {self.max_skew_s:.0f} s clock-skew bound")
                out.append(self.rec(Action.NONE, f, now, f"{why}: recorded, not acted on",
                                    {"age_s": age, "stale_after_s": self.stale_after_s,
                                     "max_skew_s": self.max_skew_s}, fired=[GuardName.STALE]))
                continue
            out.extend(decide_finding(self, f, now))
        self.state_.seen.prune(now - 2 * self.stale_after_s)
        return out

    # ------------------------------------------------------------ persistence (pure halves)
    def to_state(self) -> dict[str, Any]:
        """Everything the engine remembers, as JSON-able data (:meth:`EngineState.state_dict`)."""
        return self.state_.state_dict()

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`to_state` wrote (parameters stay as constructed)."""
        self.state_.load_state_dict(state)
