"""What every rule reads and writes: the engine's memory as one dataclass, and the shared steps.

:class:`EngineState` is everything the policy engine remembers between decisions — the guards'
state, P(healthy), evictions awaiting their outcome, what it drained, quarantined and rolled back, the
jobs' checkpoints and verification marks — with :meth:`EngineState.state_dict` /
:meth:`EngineState.load_state_dict`, the JSON form the store's ``policy_state`` holds.

:class:`RuleContext` is what a rule is given: the engine's parameters, its ``state_`` and the steps
every rule shares — :meth:`~RuleContext.rec` (a recommendation with its evidence),
:meth:`~RuleContext.guarded` (the same-rack rule, corroboration and the breaker on a node-removing
action, with the page a tripping breaker sends) and :meth:`~RuleContext.next_boundary` (a job's next
checkpoint step). :class:`~fleethealth.policy.engine.PolicyEngine` is one; its ``name_`` attributes
(``drained_``, ``breaker_``, …) read and write the fields of ``state_``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from fleethealth.ids import derived
from fleethealth.nodename import known_rack
from fleethealth.payloads.checkpoint import CheckpointRecord
from fleethealth.policy.eviction import EvictionWatch, HealthyPosterior
from fleethealth.policy.guards import (
    CircuitBreaker,
    GuardName,
    JobRateLimiter,
    RackGuard,
    SeenFindings,
    uncorroborated,
)
from fleethealth.schema import Action, Finding, Guard, Recommendation

__all__ = ["EngineState", "RuleContext", "rack_of", "REMOVING", "FATAL", "MILD"]

FATAL = {"fatal", "critical"}
MILD = {"warning", "info", "informational"}
REMOVING = {Action.EVICT, Action.DRAIN, Action.QUARANTINE}
_MAX_HELD = 10_000  # removals the open breaker holds for its close (beyond: listed only when they came)


def rack_of(f: Finding) -> str | None:
    """The rack of a finding's node as the node reported it (``evidence["rack"]``: the detectors copy
    it from the node's telemetry, which takes it from the probe's configuration or a topology file),
    or None when unknown. Never derived from the node's name: an unknown rack is unknown, not a rack of
    its own, so the same-rack rule neither holds nor clears on it."""
    return known_rack(f.evidence.get("rack"))


@dataclasses.dataclass(eq=False)
class EngineState:
    """The policy engine's memory. The first five carry parameters (built by the engine); the rest start
    empty. Times are event times in seconds."""

    posterior: HealthyPosterior          # P(healthy) per diagnosis class
    watch: EvictionWatch                 # allowed straggler evictions awaiting their outcome
    rate: JobRateLimiter                 # one straggler eviction per job per window
    rack: RackGuard                      # the last node taken out, and its rack
    breaker: CircuitBreaker              # the fleet circuit breaker
    seen: SeenFindings = dataclasses.field(default_factory=SeenFindings)   # finding ids decided
    breaker_held: dict[str, tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=dict)
    """finding id -> (action, finding): removals the open breaker held, decided again at its close"""
    breaker_closed: bool = False         # reset since the last decide: the held removals are due
    facilities: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """rack -> (alerted ts, last seen ts) of a hot-aisle episode"""
    unknown_evicted: set[str] = dataclasses.field(default_factory=set)  # nodes evicted once for UNKNOWN
    evicted: dict[str, float] = dataclasses.field(default_factory=dict)   # node -> ts of allowed eviction
    held: dict[str, tuple[float, str]] = dataclasses.field(default_factory=dict)
    """node -> (ts, guard) of a held eviction"""
    drained: set[str] = dataclasses.field(default_factory=set)
    quarantined: set[str] = dataclasses.field(default_factory=set)
    rolled_back: set[str] = dataclasses.field(default_factory=set)   # "job@target_step"
    remaining: dict[str, float] = dataclasses.field(default_factory=dict)   # job -> run time left (s)
    checkpoints: dict[str, list[CheckpointRecord]] = dataclasses.field(default_factory=dict)
    """job -> its checkpoints, by step"""
    last_pass: dict[str, int] = dataclasses.field(default_factory=dict)          # job -> last passing check
    last_replay_pass: dict[str, int] = dataclasses.field(default_factory=dict)   # job -> last passing replay
    validations: dict[str, dict[int, tuple[bool, str]]] = dataclasses.field(default_factory=dict)
    """job -> step -> (valid, why not)"""

    def state_dict(self) -> dict[str, Any]:
        """Everything the engine remembers, as JSON-able data: the format ``policy_state`` holds (its keys
        and their forms are stored data: a state saved by an older build must load)."""
        return {
            "posterior": self.posterior.to_state(), "rate": self.rate.to_state(), "rack": self.rack.to_state(),
            "breaker": self.breaker.to_state(), "seen": self.seen.to_state(),
            "facilities": {k: list(v) for k, v in self.facilities.items()},
            "unknown_evicted": sorted(self.unknown_evicted), "evicted": dict(self.evicted),
            "held": {k: list(v) for k, v in self.held.items()},
            "drained": sorted(self.drained), "quarantined": sorted(self.quarantined),
            "rolled_back": sorted(self.rolled_back), "remaining": dict(self.remaining),
            "checkpoints": {j: [[c.step, c.uri, c.last_verified_step, c.last_replay_step] for c in cs]
                            for j, cs in self.checkpoints.items()},
            "last_pass": dict(self.last_pass), "last_replay_pass": dict(self.last_replay_pass),
            "validations": {j: [[s, v, why] for s, (v, why) in sorted(vs.items())]
                            for j, vs in self.validations.items()},
            "watch": self.watch.to_state(),
            "breaker_held": {k: [a, obj] for k, (a, obj) in self.breaker_held.items()},
            "breaker_closed": self.breaker_closed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` wrote, in place: the guards, the posterior and the watch keep the
        parameters they were built with."""
        self.posterior.load_state(state.get("posterior", {}))
        self.rate.load_state(state.get("rate", {}))
        self.rack.load_state(state.get("rack", {}))
        self.breaker.load_state(state.get("breaker", {}))
        self.seen.load_state(state.get("seen", {}))
        self.facilities = {k: (float(v[0]), float(v[1])) for k, v in state.get("facilities", {}).items()}
        self.unknown_evicted = set(state.get("unknown_evicted", ()))
        self.evicted = {k: float(v) for k, v in state.get("evicted", {}).items()}
        self.held = {k: (float(v[0]), str(v[1])) for k, v in state.get("held", {}).items()}
        self.drained = set(state.get("drained", ()))
        self.quarantined = set(state.get("quarantined", ()))
        self.rolled_back = set(state.get("rolled_back", ()))
        self.remaining = {k: float(v) for k, v in state.get("remaining", {}).items()}
        self.checkpoints = {j: [CheckpointRecord(int(c[0]), str(c[1]), c[2], c[3] if len(c) > 3 else None)
                                for c in cs]
                            for j, cs in state.get("checkpoints", {}).items()}
        self.last_pass = {k: int(v) for k, v in state.get("last_pass", {}).items()}
        self.watch.load_state(state.get("watch", {}))
        self.last_replay_pass = {k: int(v) for k, v in state.get("last_replay_pass", {}).items()}
        self.validations = {j: {int(r[0]): (bool(r[1]), str(r[2])) for r in rows}
                            for j, rows in state.get("validations", {}).items()}
        self.breaker_held = {str(k): (str(v[0]), dict(v[1])) for k, v in state.get("breaker_held", {}).items()}
        self.breaker_closed = bool(state.get("breaker_closed", False))


class _View:
    """``engine.name_`` reads and writes the field ``name`` of ``engine.state_``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = name.removesuffix("_")

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.state_, self.field)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.state_, self.field, value)


class RuleContext:
    """The engine as its rules see it: parameters, ``state_`` and the steps every rule shares."""

    state_: EngineState
    restart_s: float
    payback_margin: float
    default_remaining_s: float
    stale_after_s: float
    facilities_episode_s: float
    failure_risk_threshold: float
    dry_run: bool
    corroborate: bool
    require_validated: bool
    power_fault_share: float
    power_fault_min_slowdown: float

    # the memory under the names the engine has always had (``drained_``, ``breaker_``, ...)
    posterior_ = _View()
    watch_ = _View()
    rate_ = _View()
    rack_ = _View()
    breaker_ = _View()
    seen_ = _View()
    breaker_held_ = _View()
    breaker_closed_ = _View()
    facilities_ = _View()
    unknown_evicted_ = _View()
    evicted_ = _View()
    held_ = _View()
    drained_ = _View()
    quarantined_ = _View()
    rolled_back_ = _View()
    remaining_ = _View()
    checkpoints_ = _View()
    last_pass_ = _View()
    last_replay_pass_ = _View()
    validations_ = _View()

    def guarded(self, action: Action, f: Finding, now: float, reason: str, ev: dict[str, Any], *,
                fired: list[str] | None = None) -> list[Recommendation]:
        """Apply the same-rack rule to a drain and the breaker to a node-removing action; earlier guards in
        ``fired`` already decided (a straggler's eviction applies the rack rule itself)."""
        fired = list(fired or [])
        out: list[Recommendation] = []
        rack = None
        if action is Action.DRAIN:
            rack = rack_of(f)
            if rack is not None and self.state_.rack.blocks(rack):
                fired.append(GuardName.SAME_RACK)
                reason += (f"; the last node taken out ({self.state_.rack.last_node_}) was also in rack {rack}: "
                           "needs a human")
        alone = uncorroborated(f.kind.value, f.evidence) if self.corroborate and action in REMOVING else None
        if alone is not None:  # before the breaker: an event standing alone is never counted towards it
            fired.append(GuardName.UNCORROBORATED)
            reason += f"; not corroborated ({alone}): needs a human"
        if action in REMOVING:
            breaker_alone = not fired
            if self.state_.breaker.open_:
                fired.append(GuardName.BREAKER)
                reason += f"; fleet circuit breaker open since ts={self.state_.breaker.tripped_ts_:.0f}: needs a human"
            elif not fired and not self.state_.breaker.admit(f.node, now):
                fired.append(GuardName.BREAKER)
                reason += f"; this trips the fleet circuit breaker ({self.state_.breaker.reason_})"
                st = self.state_.breaker.status()
                out.append(Recommendation(
                    action=Action.PAGE, node=f.node, ts=now, guard=Guard.NEEDS_HUMAN, job=f.job,
                    finding_id=derived("breaker", f.id), dry_run=self.dry_run,
                    reason=f"fleet circuit breaker tripped: {st.reason}; automatic drain/evict/quarantine "
                           "stopped until a human resets it",
                    evidence={"guards_fired": [GuardName.BREAKER], "threshold": st.threshold,
                              "nodes_in_window": st.nodes_in_window + 1,
                              "window_s": self.state_.breaker.window_s}))
            if breaker_alone and fired and len(self.state_.breaker_held) < _MAX_HELD:  # due again at the close
                self.state_.breaker_held[f.id] = (action.value, f.to_obj())
        guard = Guard.ALLOWED
        if fired:
            guard = Guard.RATE_LIMITED if fired == [GuardName.RATE_LIMIT] else Guard.NEEDS_HUMAN
        elif rack is not None:
            self.state_.rack.note(rack, f.node)
        return [self.rec(action, f, now, reason, ev, fired=fired, guard=guard), *out]

    def rec(self, action: Action, f: Finding, now: float, reason: str, ev: Mapping[str, Any], *,
            fired: Sequence[str] = (), guard: Guard = Guard.ALLOWED) -> Recommendation:
        """The recommendation ``action`` on ``f``'s node at ``now``, its evidence ``ev`` with the finding's kind
        and time and the guards that fired (and ``dry_run`` when the engine is dry)."""
        evidence = {"finding_kind": f.kind.value, "finding_ts": f.ts, **ev, "guards_fired": list(fired)}
        if self.dry_run:
            evidence["guards_fired"].append(GuardName.DRY_RUN)
        return Recommendation(action=action, node=f.node, ts=now, reason=reason, guard=guard, job=f.job,
                              finding_id=f.id, dry_run=self.dry_run, evidence=evidence)

    def next_boundary(self, job: str | None) -> int | None:
        """The job's next checkpoint step: its newest plus the median spacing (None with fewer than two)."""
        book = self.state_.checkpoints.get(job or "", [])
        if len(book) < 2:
            return None
        steps = [c.step for c in book]
        gaps = sorted(b - a for a, b in zip(steps, steps[1:], strict=False))
        return steps[-1] + gaps[len(gaps) // 2]

