"""The policy engine: findings in, explained and guarded recommendations out.

``PolicyEngine(**params).decide(findings, now)`` is pure: no I/O and no clock (``now`` is the
decision's event time). Its memory — evictions per job, the last evicted rack, the breaker, the
finding ids already decided, P(healthy) counts, checkpoints and passing SDC checks seen through
:meth:`PolicyEngine.observe`, straggler evictions awaiting their outcome (``watch_``, judged by
:meth:`PolicyEngine.judge`) — lives in ``name_`` attributes and round-trips through
:meth:`PolicyEngine.to_state` / :meth:`PolicyEngine.load_state` (see :mod:`fleethealth.policy.persist`).
The detector runner drives it through :class:`fleethealth.policy.stage.PolicyStage`.

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

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fleethealth.errors import ConfigError, SchemaError
from fleethealth.evidence import EccEvidence, StragglerEvidence, XidEvidence
from fleethealth.ids import derived
from fleethealth.nodename import known_rack
from fleethealth.params import check_number
from fleethealth.payloads.checkpoint import CheckpointRecord
from fleethealth.payloads.rollback import Marks, admissible, choose
from fleethealth.payloads.validation import CheckpointValidation
from fleethealth.policy.eviction import EvictionOutcome, EvictionWatch, HealthyPosterior, payback
from fleethealth.policy.guards import (
    DEFAULT_MAX_SKEW_S,
    CircuitBreaker,
    GuardName,
    JobRateLimiter,
    RackGuard,
    SeenFindings,
    is_stale,
    uncorroborated,
)
from fleethealth.schema import Action, Diagnosis, Event, EventKind, Finding, FindingKind, Guard, Recommendation
from fleethealth.xid import lookup as xid_lookup

__all__ = ["PolicyEngine", "rack_of"]

_FATAL = {"fatal", "critical"}
_MILD = {"warning", "info", "informational"}
_REMOVING = {Action.EVICT, Action.DRAIN, Action.QUARANTINE}
_STRAGGLER_EVICT = {Diagnosis.NODE_THERMAL, Diagnosis.NODE_LINK, Diagnosis.NETWORK_CONTENTION, Diagnosis.UNKNOWN}


def rack_of(f: Finding) -> str | None:
    """The rack of a finding's node as the node reported it (``evidence["rack"]``: the detectors copy
    it from the node's telemetry, which takes it from the probe's configuration or a topology file),
    or None when unknown. Never derived from the node's name: an unknown rack is unknown, not a rack of
    its own, so the same-rack rule neither holds nor clears on it."""
    return known_rack(f.evidence.get("rack"))


class PolicyEngine:
    """Turns findings into recommendations under guards; pure, with state in ``name_`` attributes.

    Parameters (keyword-only): ``restart_s`` measured restart cost R (600); ``payback_margin``:
    evict when payback ≤ margin × remaining run time (0.25); ``default_remaining_s`` when neither the
    finding's ``evidence["remaining_s"]`` nor :meth:`set_remaining` says (86,400); ``prior_alpha`` /
    ``prior_beta`` the Beta prior of P(healthy) (3, 1); ``rate_window_s`` one straggler eviction per
    job per window (3,600); ``stale_after_s`` staleness bound (900); ``breaker_share`` /
    ``breaker_min_nodes`` / ``breaker_window_s`` / ``fleet_nodes`` the circuit breaker (0.1, 5,
    3,600, 0 = unknown); ``facilities_episode_s`` a hot-aisle episode ends
    after this long without an ENVIRONMENTAL finding in the rack (3,600); ``failure_risk_threshold``
    (0.5); ``dry_run`` marks every recommendation as not to be executed (False);
    ``outcome_settle_s`` / ``outcome_recur_share`` how an executed straggler eviction is judged
    (:class:`~fleethealth.policy.eviction.EvictionWatch`: 1,800, 0.5); ``corroborate``: an Xid, ECC or
    SDC finding removes a node automatically only with a supporting signal from the node's own stream
    (:func:`~fleethealth.policy.guards.uncorroborated`; True).
    """

    def __init__(self, *, restart_s: float = 600.0, payback_margin: float = 0.25,
                 default_remaining_s: float = 86_400.0, prior_alpha: float = 3.0, prior_beta: float = 1.0,
                 rate_window_s: float = 3600.0, stale_after_s: float = 900.0, breaker_share: float = 0.1,
                 breaker_min_nodes: int = 5, breaker_window_s: float = 3600.0, fleet_nodes: int = 0,
                 facilities_episode_s: float = 3600.0,
                 failure_risk_threshold: float = 0.5, dry_run: bool = False, outcome_settle_s: float = 1800.0,
                 outcome_recur_share: float = 0.5, corroborate: bool = True,
                 require_validated: bool = False) -> None:
        self.corroborate = bool(corroborate)
        self.require_validated = bool(require_validated)
        self.restart_s = check_number("restart_s", restart_s, at_least=0)
        self.payback_margin = check_number("payback_margin", payback_margin, above=0)
        self.default_remaining_s = check_number("default_remaining_s", default_remaining_s, at_least=0)
        self.stale_after_s = check_number("stale_after_s", stale_after_s, above=0)
        self.facilities_episode_s = check_number("facilities_episode_s", facilities_episode_s, above=0)
        self.failure_risk_threshold = check_number("failure_risk_threshold", failure_risk_threshold, at_least=0)
        if self.failure_risk_threshold > 1:
            raise ConfigError(f"failure_risk_threshold is a probability, got {failure_risk_threshold}")
        self.dry_run = bool(dry_run)
        self.posterior_ = HealthyPosterior(alpha=prior_alpha, beta=prior_beta)
        # an eviction waits for its execution report as long as `fleethealth act` would still carry it
        # out (adapters.act.DEFAULT_MAX_AGE_S is twice the staleness bound)
        self.watch_ = EvictionWatch(settle_s=outcome_settle_s, recur_share=outcome_recur_share,
                                    max_wait_s=2 * self.stale_after_s)
        self.rate_ = JobRateLimiter(window_s=rate_window_s)
        self.rack_ = RackGuard()
        self.breaker_ = CircuitBreaker(share=breaker_share, min_nodes=breaker_min_nodes,
                                       window_s=breaker_window_s, fleet_nodes=fleet_nodes)
        self.seen_ = SeenFindings()
        self.facilities_: dict[str, tuple[float, float]] = {}   # rack -> (alerted ts, last seen ts)
        self.unknown_evicted_: set[str] = set()
        self.evicted_: dict[str, float] = {}                   # node -> ts of allowed eviction
        self.held_: dict[str, tuple[float, str]] = {}          # node -> (ts, guard) of a held eviction
        self.drained_: set[str] = set()
        self.quarantined_: set[str] = set()
        self.rolled_back_: set[str] = set()                    # "job@target_step"
        self.remaining_: dict[str, float] = {}
        self.checkpoints_: dict[str, list[CheckpointRecord]] = {}  # job -> its checkpoints, by step
        self.last_pass_: dict[str, int] = {}
        self.last_replay_pass_: dict[str, int] = {}
        self.validations_: dict[str, dict[int, tuple[bool, str]]] = {}  # job -> step -> (valid, why not)

    # ------------------------------------------------------------ inputs other than findings
    def observe(self, events: Sequence[Event]) -> int:
        """Learn checkpoints (with their watermark) and passing SDC checks from job events, and which
        issued evictions the scheduler carried out; returns how many evictions were reported executed."""
        noted = self.watch_.observe(events)
        for ev in events:
            if ev.job is None:
                continue
            if ev.kind is EventKind.CHECKPOINT:
                try:
                    rec = CheckpointRecord.from_event(ev)
                except SchemaError:
                    continue
                book = self.checkpoints_.setdefault(ev.job, [])
                if all(c.step != rec.step for c in book):
                    book.append(rec)
                    book.sort(key=lambda c: c.step)
            elif ev.kind is EventKind.CHECKPOINT_VALIDATED:
                try:
                    val = CheckpointValidation.from_event(ev)
                except SchemaError:
                    continue
                why = "" if val.valid else f"{val.result.value}: {val.reasons[0] if val.reasons else 'no reason'}"
                self.validations_.setdefault(ev.job, {})[val.step] = (val.valid, why)
            elif (ev.kind is EventKind.SDC_CHECK and ev.data.get("passed") is True and ev.step is not None
                  and ev.data.get("culprit_rank") is None):  # a vote against a peer is no clean step
                self.last_pass_[ev.job] = max(self.last_pass_.get(ev.job, -1), ev.step)
                if ev.data.get("check") == "replay":
                    self.last_replay_pass_[ev.job] = max(self.last_replay_pass_.get(ev.job, -1), ev.step)
        return noted

    def judge(self, findings: Sequence[Finding], now: float) -> list[EvictionOutcome]:
        """Outcomes of executed evictions that ``findings`` (new ones) or the time ``now`` decide; each
        moves P(healthy) at once. The caller records them (:func:`fleethealth.policy.persist.record_outcome`)."""
        outcomes = self.watch_.judge(findings, float(now))
        for o in outcomes:
            self.record_outcome(o)
        return outcomes

    def settle(self, outcomes: Sequence[EvictionOutcome]) -> None:
        """Count recorded outcomes into P(healthy), each eviction once, and stop watching those evictions."""
        unique = {o.key: o for o in outcomes}
        self.posterior_.record_all(unique.values())
        self.watch_.settled(set(unique))

    def record_outcome(self, outcome: EvictionOutcome) -> None:
        """Feed back whether an eviction resolved the straggle; moves P(healthy) for its class."""
        self.posterior_.record(outcome.diagnosis, outcome.resolved)

    def p_healthy(self, diagnosis: Diagnosis | str) -> float:
        return self.posterior_.mean(diagnosis)

    def release(self, node: str) -> None:
        """``node`` left the quarantine book (a release through the API or a sweep, after a passing full
        self-test): forget that it was quarantined or drained, so a new fault on it is decided afresh."""
        self.quarantined_.discard(node)
        self.drained_.discard(node)

    def forget_job(self, job: str) -> None:
        """Drop what the engine keeps per job once detection forgot the job as ended: checkpoints,
        verification marks, remaining time and its rollbacks (node-level memory is kept)."""
        self.checkpoints_.pop(job, None)
        self.last_pass_.pop(job, None)
        self.last_replay_pass_.pop(job, None)
        self.validations_.pop(job, None)
        self.remaining_.pop(job, None)
        self.rolled_back_ = {k for k in self.rolled_back_ if k.rpartition("@")[0] != job}

    def set_remaining(self, job: str, seconds: float) -> None:
        self.remaining_[job] = check_number("remaining seconds", seconds, at_least=0)

    def reset_breaker(self) -> None:
        """The explicit human reset; also clears the same-rack hold."""
        self.breaker_.reset()
        self.rack_.acknowledge()

    def acknowledge_rack(self) -> None:
        """A human has looked at the last eviction; the next one may be in the same rack."""
        self.rack_.acknowledge()

    # ------------------------------------------------------------ decide
    def decide(self, findings: Sequence[Finding], now: float) -> list[Recommendation]:
        """Recommendations for ``findings`` at event time ``now``; a finding id seen before yields none."""
        now = float(now)
        out: list[Recommendation] = []
        for f in sorted(findings, key=lambda f: (f.ts, f.id)):
            fid = f.id
            if fid in self.seen_:
                continue
            self.seen_.add(fid, f.ts)
            if is_stale(f.ts, now, self.stale_after_s):
                age = now - f.ts
                why = (f"finding is {age:.0f} s old, beyond the {self.stale_after_s:.0f} s staleness bound"
                       if age >= 0 else f"finding is stamped {-age:.0f} s after the decision time, beyond "
                       f"the {DEFAULT_MAX_SKEW_S:.0f} s clock-skew bound")
                out.append(self._rec(Action.NONE, f, now, f"{why}: recorded, not acted on",
                                     {"age_s": age, "stale_after_s": self.stale_after_s,
                                      "max_skew_s": DEFAULT_MAX_SKEW_S}, fired=[GuardName.STALE]))
                continue
            out.extend(self._decide_one(f, now))
        self.seen_.prune(now - 2 * self.stale_after_s)
        return out

    def _decide_one(self, f: Finding, now: float) -> list[Recommendation]:
        kind = f.kind
        if kind is FindingKind.STRAGGLER:
            return self._straggler(f, now)
        if kind is FindingKind.SDC:
            return self._sdc(f, now)
        if kind is FindingKind.FAILURE_RISK:
            return self._failure_risk(f, now)
        if kind is FindingKind.HANG:
            return self._hang(f, now)
        if kind in (FindingKind.XID, FindingKind.ECC):
            return self._hardware_error(f, now)
        if kind is FindingKind.LINK and f.evidence.get("rule") == "nvlink":
            return self._link_errors(f, now)
        return [self._rec(Action.NONE, f, now, f"{kind.value} finding reported; a node is acted on "
                          "through a straggler's diagnosis, not this signal alone", {})]

    # ------------------------------------------------------------ stragglers
    def _straggler(self, f: Finding, now: float) -> list[Recommendation]:
        diag = f.diagnosis or Diagnosis.UNKNOWN
        facts = StragglerEvidence.from_evidence(f.evidence)
        rack = known_rack(facts.rack)
        if diag is Diagnosis.ENVIRONMENTAL:
            return [self._facilities(f, now, rack)]
        if diag not in _STRAGGLER_EVICT:
            raise ConfigError(f"unhandled diagnosis {diag}")
        slowdown = f.slowdown if f.slowdown is not None else facts.slowdown
        if not isinstance(slowdown, int | float) or isinstance(slowdown, bool) or not math.isfinite(slowdown):
            return [self._rec(Action.NONE, f, now, "straggler without a measured slowdown: no payback to "
                              "compute, reported only", {"diagnosis": diag.value})]
        remaining = (facts.remaining_s if facts.remaining_s is not None
                     else self.remaining_.get(f.job or "", self.default_remaining_s))
        pb = payback(self.restart_s, self.posterior_.mean(diag), float(slowdown), remaining, self.payback_margin)
        ev = {"diagnosis": diag.value, "rack": rack, **pb.to_evidence(), "z": f.z,
              "p_healthy_counts": list(self.posterior_.counts(diag))}
        if diag is Diagnosis.NETWORK_CONTENTION:
            ev["placement"] = "change"
        pretty = "never" if math.isinf(pb.payback_s) else f"{pb.payback_s / 60:.1f} min"
        if not pb.worth:
            return [self._rec(Action.NONE, f, now, f"{diag.value} straggler {slowdown:.0%} slow on {f.node}: "
                              f"eviction pays back in {pretty} at P(healthy)={pb.p_healthy:.2f}, not well "
                              f"under the {remaining / 3600:.1f} h left; keep running", ev)]
        if f.node in self.evicted_ and f.ts - self.evicted_[f.node] < self.rate_.window_s:
            return [self._rec(Action.NONE, f, now, f"eviction of {f.node} already recommended at "
                              f"ts={self.evicted_[f.node]:.0f}", {**ev, "evicted_ts": self.evicted_[f.node]})]
        held = self.held_.get(f.node)
        if held is not None and f.ts - held[0] < self.rate_.window_s:
            return [self._rec(Action.NONE, f, now, f"eviction of {f.node} already recommended at ts={held[0]:.0f} "
                              f"and held ({held[1]}); one recommendation per node", {**ev, "held_ts": held[0]})]
        reason = (f"{diag.value} straggler {slowdown:.0%} slow on {f.node} (rank {f.rank}): eviction pays "
                  f"back in {pretty} at P(healthy)={pb.p_healthy:.2f}, well under the "
                  f"{remaining / 3600:.1f} h left; evict at the next checkpoint")
        if diag is Diagnosis.NETWORK_CONTENTION:
            reason += " and change placement (shared NIC)"
        fired: list[str] = []
        if diag is Diagnosis.UNKNOWN and f.node in self.unknown_evicted_:
            fired.append(GuardName.UNKNOWN_ONCE)
            reason += "; cause UNKNOWN and this node was already evicted once: a human must decide"
        if rack is not None and self.rack_.blocks(rack):
            fired.append(GuardName.SAME_RACK)
            reason += f"; the last eviction ({self.rack_.last_node_}) was also in rack {rack}: needs a human"
        job = f.job or ""
        since = self.rate_.since_last(job, now)
        if since is not None:
            fired.append(GuardName.RATE_LIMIT)
            ev["since_last_eviction_s"] = since
            reason += (f"; job {job} already had a straggler eviction {since:.0f} s ago "
                       f"(limit one per {self.rate_.window_s:.0f} s)")
        recs = self._guarded(Action.EVICT, f, now, reason, ev, fired=fired)
        if recs[0].guard is Guard.ALLOWED:
            self.watch_.issue(recs[0])
            self.rate_.note(job, now)
            if rack is not None:
                self.rack_.note(rack, f.node)
            self.evicted_[f.node] = f.ts
            if diag is Diagnosis.UNKNOWN:
                self.unknown_evicted_.add(f.node)
        else:
            self.held_[f.node] = (f.ts, recs[0].guard.value)
        return recs

    def _facilities(self, f: Finding, now: float, rack: str | None) -> Recommendation:
        ev = {"diagnosis": Diagnosis.ENVIRONMENTAL.value, "rack": rack, "slowdown": f.slowdown}
        key = rack if rack is not None else f"?{f.node}"  # no rack reported: the episode is the node's own
        place = f"rack {rack}" if rack is not None else f"the rack of {f.node} (not reported)"
        alerted = self.facilities_.get(key)
        if alerted is not None and f.ts - alerted[1] < self.facilities_episode_s:
            self.facilities_[key] = (alerted[0], max(alerted[1], f.ts))
            return self._rec(Action.NONE, f, now, f"{place} environmental episode: facilities already "
                             f"alerted at ts={alerted[0]:.0f}; evicting would not help",
                             {**ev, "alerted_ts": alerted[0]})
        self.facilities_[key] = (f.ts, f.ts)
        return self._rec(Action.ALERT_FACILITIES, f, now, f"stragglers in {place} share an environmental "
                         f"cause (hot aisle / cooling): alert facilities; evicting {f.node} would only move "
                         "the symptom", ev)

    # ------------------------------------------------------------ SDC, risk, hardware errors
    def _sdc(self, f: Finding, now: float) -> list[Recommendation]:
        out: list[Recommendation] = []
        cls = f.evidence.get("classification")
        if cls == "data_or_code":
            out.append(self._rec(Action.PAGE, f, now, "SDC check failed deterministically across ranks: data "
                                 "or code, not this node's hardware; a human must look",
                                 {"classification": cls}))
        elif f.node in self.quarantined_:
            out.append(self._rec(Action.NONE, f, now, f"{f.node} already quarantined for SDC",
                                 {"classification": cls}))
        else:
            recs = self._guarded(Action.QUARANTINE, f, now, f"silent data corruption on {f.node} "
                                 f"(GPU {f.gpu}, {cls or 'unclassified'}): quarantine until a full self-test "
                                 "passes", {"classification": cls, "check": f.evidence.get("check")})
            if recs[0].guard is Guard.ALLOWED:
                self.quarantined_.add(f.node)
            out.extend(recs)
        if f.job is not None:
            out.extend(self._rollback(f, now))
        return out

    def _rollback(self, f: Finding, now: float) -> list[Recommendation]:
        job = f.job or ""
        book = list(self.checkpoints_.get(job, ()))
        for c in f.evidence.get("checkpoints", ()) or ():
            with contextlib.suppress(SchemaError):
                rec = CheckpointRecord.from_data(c)
                book.append(rec)
        ev = f.evidence

        def _step(v: Any) -> int | None:
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

        seen = [Marks(_step(self.last_pass_.get(job)), _step(self.last_replay_pass_.get(job))),
                Marks(_step(ev.get("last_verified_step")), _step(ev.get("last_replay_step")))]
        seen += [c.marks for c in book]
        classification = ev.get("classification") if isinstance(ev.get("classification"), str) else None
        checked = self.validations_.get(job, {})
        validity = {step: valid for step, (valid, _) in checked.items()}
        marks, bound, target = choose(book, seen, classification, f.step, validity=validity,  # the guard's rule too
                                      require_validation=self.require_validated)
        vouching = "check" if classification == "transient" else "replay"
        watermark = -1 if bound is None else bound
        # what validation kept out: checkpoints the marks alone would have allowed, newer than the target
        _, refused = admissible(book, validity, require_validation=self.require_validated)
        floor = -1 if target is None else target.step
        passed_over = sorted({c.step for c in refused if floor < c.step <= watermark})
        refusals = [[s, checked.get(s, (False, "not validated"))[1] or "not validated"] for s in passed_over]
        validation = {"validation": "required" if validity or self.require_validated else "not_reported",
                      "refused_checkpoints": refusals}
        refused_text = "".join(f"; checkpoint step {s} refused ({why})" for s, why in refusals)
        if target is None:
            return [self._rec(Action.ROLLBACK, f, now, f"SDC in job {job} at step {f.step} "
                              f"({classification or 'unclassified'}): no {'validated ' if refusals else ''}"
                              f"checkpoint at or before a passing {vouching} is known{refused_text}; the run may "
                              "be unrecoverable, needs a human",
                              {"last_verified_step": marks.transient, "last_replay_step": marks.deterministic,
                               "classification": classification, "checkpoints_known": len(book), **validation},
                              fired=[], guard=Guard.NEEDS_HUMAN)]
        key = f"{job}@{target.step}"
        if key in self.rolled_back_:
            return []
        self.rolled_back_.add(key)
        discarded = sorted({c.step for c in book if c.step > target.step})
        return [self._rec(Action.ROLLBACK, f, now, f"SDC in job {job} at step {f.step} "
                          f"({classification or 'unclassified'}): roll back to checkpoint step {target.step} "
                          f"({target.uri or 'no uri'}), the newest at or before the last passing {vouching} "
                          f"(step {watermark}){refused_text}",
                          {**validation, "target_step": target.step, "target_uri": target.uri,
                           "last_verified_step": marks.transient,
                           "last_replay_step": marks.deterministic, "bound_step": watermark,
                           "classification": classification, "failed_step": f.step,
                           "discarded_checkpoints": discarded})]

    def _failure_risk(self, f: Finding, now: float) -> list[Recommendation]:
        p = f.probability
        ev: dict[str, Any] = {"probability": p, "threshold": self.failure_risk_threshold}
        if p is None or p < self.failure_risk_threshold:
            return [self._rec(Action.NONE, f, now, f"failure risk {p} on {f.node} below the "
                              f"{self.failure_risk_threshold} threshold", ev)]
        if f.node in self.drained_:
            return [self._rec(Action.NONE, f, now, f"{f.node} already draining", ev)]
        return self._planned_drain(f, now, f"failure risk {p:.2f} on {f.node} (GPU {f.gpu})", ev)

    def _planned_drain(self, f: Finding, now: float, what: str, ev: dict[str, Any]) -> list[Recommendation]:
        """Drain ``f.node`` at the job's next checkpoint boundary: a planned restart instead of an interruption."""
        at = self._next_boundary(f.job)
        ev["at_step"] = at
        where = f"step {at}" if at is not None else "the next checkpoint"
        recs = self._guarded(Action.DRAIN, f, now, f"{what}: drain at the next checkpoint boundary ({where}), a "
                             "planned restart instead of an interruption", {**ev, "planned": True})
        if recs[0].guard is Guard.ALLOWED:
            self.drained_.add(f.node)
        return recs

    def _link_errors(self, f: Finding, now: float) -> list[Recommendation]:
        """NVLink error counters climbing steadily: a failure risk of its own (seed 000 §9.6), slow or not."""
        rate = f.evidence.get("errors_per_min")
        severity = f.evidence.get("severity")
        ev: dict[str, Any] = {"errors_per_min": rate, "rule": "nvlink", "severity": severity}
        if severity not in _FATAL:
            return [self._rec(Action.NONE, f, now, f"NVLink errors climbing at {rate}/min on {f.node}: reported and "
                              "watched; a critical rate drains the node as a failure risk, a slow rank through "
                              "its straggler's NODE_LINK diagnosis", ev)]
        if f.node in self.drained_:
            return [self._rec(Action.NONE, f, now, f"{f.node} already draining", ev)]
        held = self.held_.get(f.node)
        if held is not None and f.ts - held[0] < self.rate_.window_s:
            # a drain restarts the job the node runs just as the held eviction would: the same hold applies
            return [self._rec(Action.NONE, f, now, f"NVLink errors climbing at {rate}/min on {f.node}: its eviction "
                              f"was recommended at ts={held[0]:.0f} and held ({held[1]}); one recommendation per "
                              "node", {**ev, "held_ts": held[0]})]
        return self._planned_drain(f, now, f"NVLink errors climbing at {rate}/min on {f.node} (GPU {f.gpu}): "
                                   "a failure risk", ev)

    def _hang(self, f: Finding, now: float) -> list[Recommendation]:
        ev = {"step": f.step}
        if f.evidence.get("culprit") is False:
            return [self._rec(Action.PAGE, f, now, f"job {f.job} hung at step {f.step} with every rank level "
                              "(a network or storage hang?): no rank to blame, so no node is drained; a human "
                              "must look", {**ev, "culprit": False})]
        if f.node in self.drained_:
            return [self._rec(Action.NONE, f, now, f"hang attributed to {f.node}: already draining", ev)]
        recs = self._guarded(Action.DRAIN, f, now, f"hang attributed to {f.node}: drain it so the restart "
                             "does not land on the same node", ev)
        if recs[0].guard is Guard.ALLOWED:
            self.drained_.add(f.node)
        return recs

    def _hardware_error(self, f: Finding, now: float) -> list[Recommendation]:
        code: int | None = None
        if f.kind is FindingKind.XID:
            xid = XidEvidence.from_evidence(f.evidence)
            sev, code, advised = xid.severity, xid.code, xid.action  # advised: the detector's catalog advice
            if advised in (Action.DRAIN, Action.NONE) and sev not in _FATAL:
                fatal = advised is Action.DRAIN
            else:  # no advice given: the same rulebook the detector reads (fleethealth.xid)
                fatal = sev in _FATAL or (sev not in _MILD and code is not None and xid_lookup(code).drains)
            what = f"Xid {code}" + (f" ({sev})" if sev else "")
        else:
            ecc = EccEvidence.from_evidence(f.evidence)
            sev = ecc.severity
            fatal = sev in _FATAL or (sev not in _MILD and ecc.uncorrectable_seen) or ecc.remap_failure
            what = "ECC " + (sev or ("uncorrectable" if fatal else "correctable")) + " errors"
        ev = {"code": code, "severity": sev or None}
        if not fatal:
            return [self._rec(Action.NONE, f, now, f"{what} on {f.node}: not a node fault by severity; reported",
                              ev)]
        if f.node in self.drained_:
            return [self._rec(Action.NONE, f, now, f"{what} on {f.node}: already draining", ev)]
        recs = self._guarded(Action.DRAIN, f, now, f"{what} on {f.node} (GPU {f.gpu}): drain the node", ev)
        if recs[0].guard is Guard.ALLOWED:
            self.drained_.add(f.node)
        return recs

    # ------------------------------------------------------------ helpers
    def _guarded(self, action: Action, f: Finding, now: float, reason: str, ev: dict[str, Any], *,
                 fired: list[str] | None = None) -> list[Recommendation]:
        """Apply the same-rack rule to a drain and the breaker to a node-removing action; earlier guards in
        ``fired`` already decided (a straggler's eviction applies the rack rule itself)."""
        fired = list(fired or [])
        out: list[Recommendation] = []
        rack = None
        if action is Action.DRAIN:
            rack = rack_of(f)
            if rack is not None and self.rack_.blocks(rack):
                fired.append(GuardName.SAME_RACK)
                reason += (f"; the last node taken out ({self.rack_.last_node_}) was also in rack {rack}: "
                           "needs a human")
        alone = uncorroborated(f.kind.value, f.evidence) if self.corroborate and action in _REMOVING else None
        if alone is not None:  # before the breaker: an event standing alone is never counted towards it
            fired.append(GuardName.UNCORROBORATED)
            reason += f"; not corroborated ({alone}): needs a human"
        if action in _REMOVING:
            if self.breaker_.open_:
                fired.append(GuardName.BREAKER)
                reason += f"; fleet circuit breaker open since ts={self.breaker_.tripped_ts_:.0f}: needs a human"
            elif not fired and not self.breaker_.admit(f.node, now):
                fired.append(GuardName.BREAKER)
                reason += f"; this trips the fleet circuit breaker ({self.breaker_.reason_})"
                st = self.breaker_.status()
                out.append(Recommendation(
                    action=Action.PAGE, node=f.node, ts=now, guard=Guard.NEEDS_HUMAN, job=f.job,
                    finding_id=derived("breaker", f.id), dry_run=self.dry_run,
                    reason=f"fleet circuit breaker tripped: {st.reason}; automatic drain/evict/quarantine "
                           "stopped until a human resets it",
                    evidence={"guards_fired": [GuardName.BREAKER], "threshold": st.threshold,
                              "nodes_in_window": st.nodes_in_window + 1,
                              "window_s": self.breaker_.window_s}))
        guard = Guard.ALLOWED
        if fired:
            guard = Guard.RATE_LIMITED if fired == [GuardName.RATE_LIMIT] else Guard.NEEDS_HUMAN
        elif rack is not None:
            self.rack_.note(rack, f.node)
        return [self._rec(action, f, now, reason, ev, fired=fired, guard=guard), *out]

    def _rec(self, action: Action, f: Finding, now: float, reason: str, ev: Mapping[str, Any], *,
             fired: Sequence[str] = (), guard: Guard = Guard.ALLOWED) -> Recommendation:
        evidence = {"finding_kind": f.kind.value, "finding_ts": f.ts, **ev, "guards_fired": list(fired)}
        if self.dry_run:
            evidence["guards_fired"].append(GuardName.DRY_RUN)
        return Recommendation(action=action, node=f.node, ts=now, reason=reason, guard=guard, job=f.job,
                              finding_id=f.id, dry_run=self.dry_run, evidence=evidence)

    def _next_boundary(self, job: str | None) -> int | None:
        book = self.checkpoints_.get(job or "", [])
        if len(book) < 2:
            return None
        steps = [c.step for c in book]
        gaps = sorted(b - a for a, b in zip(steps, steps[1:], strict=False))
        return steps[-1] + gaps[len(gaps) // 2]

    # ------------------------------------------------------------ persistence (pure halves)
    def to_state(self) -> dict[str, Any]:
        """Everything the engine remembers, as JSON-able data."""
        return {
            "posterior": self.posterior_.to_state(), "rate": self.rate_.to_state(), "rack": self.rack_.to_state(),
            "breaker": self.breaker_.to_state(), "seen": self.seen_.to_state(),
            "facilities": {k: list(v) for k, v in self.facilities_.items()},
            "unknown_evicted": sorted(self.unknown_evicted_), "evicted": dict(self.evicted_),
            "held": {k: list(v) for k, v in self.held_.items()},
            "drained": sorted(self.drained_), "quarantined": sorted(self.quarantined_),
            "rolled_back": sorted(self.rolled_back_), "remaining": dict(self.remaining_),
            "checkpoints": {j: [[c.step, c.uri, c.last_verified_step, c.last_replay_step] for c in cs]
                            for j, cs in self.checkpoints_.items()},
            "last_pass": dict(self.last_pass_), "last_replay_pass": dict(self.last_replay_pass_),
            "validations": {j: [[s, v, why] for s, (v, why) in sorted(vs.items())]
                            for j, vs in self.validations_.items()},
            "watch": self.watch_.to_state(),
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`to_state` wrote (parameters stay as constructed)."""
        self.posterior_.load_state(state.get("posterior", {}))
        self.rate_.load_state(state.get("rate", {}))
        self.rack_.load_state(state.get("rack", {}))
        self.breaker_.load_state(state.get("breaker", {}))
        self.seen_.load_state(state.get("seen", {}))
        self.facilities_ = {k: (float(v[0]), float(v[1])) for k, v in state.get("facilities", {}).items()}
        self.unknown_evicted_ = set(state.get("unknown_evicted", ()))
        self.evicted_ = {k: float(v) for k, v in state.get("evicted", {}).items()}
        self.held_ = {k: (float(v[0]), str(v[1])) for k, v in state.get("held", {}).items()}
        self.drained_ = set(state.get("drained", ()))
        self.quarantined_ = set(state.get("quarantined", ()))
        self.rolled_back_ = set(state.get("rolled_back", ()))
        self.remaining_ = {k: float(v) for k, v in state.get("remaining", {}).items()}
        self.checkpoints_ = {j: [CheckpointRecord(int(c[0]), str(c[1]), c[2], c[3] if len(c) > 3 else None) for c in cs]
                             for j, cs in state.get("checkpoints", {}).items()}
        self.last_pass_ = {k: int(v) for k, v in state.get("last_pass", {}).items()}
        self.watch_.load_state(state.get("watch", {}))
        self.last_replay_pass_ = {k: int(v) for k, v in state.get("last_replay_pass", {}).items()}
        self.validations_ = {j: {int(r[0]): (bool(r[1]), str(r[2])) for r in rows}
                             for j, rows in state.get("validations", {}).items()}
