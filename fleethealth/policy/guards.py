"""Guards on the engine's own authority: every automatic action is rate-limited and leaves a record.

Seed 000 R2: at most one straggler eviction per hour per job, and never two consecutive evictions
in the same rack without a human. Beyond the seed, from field reports of remediation systems
(loops with no cap, a stale event replayed after a restart rebooting a busy node):

* a fleet circuit breaker — more than a share of the fleet's nodes (and never more than an absolute
  number, whatever the fleet's size) recommended for drain, evict or quarantine inside a window trips
  it, and only an explicit reset closes it; closing it re-decides the removals it held, except those
  older than the staleness bound by then, which are listed for a human and never acted on;
* idempotency — a finding id seen before yields nothing the second time;
* corroboration — an automatic removal on an Xid, ECC or SDC finding needs a supporting signal in the
  node's own stream (:func:`uncorroborated`); without one it waits for a human, and the breaker never
  counts it, so forged events for other nodes can neither remove them nor trip it;
* staleness — a finding older than a bound (against the decision time), or stamped further in the
  future than a clock-skew bound, is recorded, not acted on.

Each guard is a small object with its state in ``name_`` attributes and a JSON-able
``to_state()`` / ``load_state()`` pair, so the engine can be saved to and restored from the store.
All times are event times in seconds; nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fleethealth.errors import ConfigError
from fleethealth.evidence import Corroboration
from fleethealth.params import check_number

__all__ = [
    "GuardName",
    "is_stale",
    "DEFAULT_MAX_SKEW_S",
    "SeenFindings",
    "JobRateLimiter",
    "RackGuard",
    "CircuitBreaker",
    "BreakerStatus",
    "CORROBORATED_KINDS",
    "uncorroborated",
]


class GuardName:
    """The names recorded in a recommendation's ``evidence["guards_fired"]``."""

    RATE_LIMIT = "rate_limit"
    SAME_RACK = "same_rack"
    BREAKER = "breaker"
    STALE = "stale"
    UNKNOWN_ONCE = "unknown_once"
    DRY_RUN = "dry_run"
    UNCORROBORATED = "uncorroborated"


CORROBORATED_KINDS = frozenset({"xid", "ecc", "sdc"})
"""Finding kinds raised by one event or sample, whose removals need a supporting signal."""


def uncorroborated(kind: str, evidence: Mapping[str, Any]) -> str | None:
    """Why a removal on this finding may not be automatic (None: it may). A finding of
    :data:`CORROBORATED_KINDS` needs ``evidence["corroboration"]["by"]`` to name a supporting signal
    from the node's own stream (:class:`fleethealth.evidence.Corroboration`); other kinds are
    judged from a stream already (a straggler's steps, a hang's silence, a risk's history)."""
    if kind not in CORROBORATED_KINDS:
        return None
    c = Corroboration.from_evidence(evidence)
    if c.by:
        return None
    return c.missing or "no supporting signal in the node's own stream"




DEFAULT_MAX_SKEW_S = 60.0
"""How far past the decision time a finding may be stamped (clock skew) before it counts as stale."""


def is_stale(finding_ts: float, now: float, bound_s: float, skew_s: float = DEFAULT_MAX_SKEW_S) -> bool:
    """True when the finding is more than ``bound_s`` seconds older than the decision time, or stamped
    more than ``skew_s`` seconds after it (a clock far ahead or a forged time must not escape the
    bound, nor the rate limits that count from event time)."""
    return now - finding_ts > bound_s or finding_ts - now > skew_s


class SeenFindings:
    """Finding ids already decided, with their event time; ids older than the staleness bound are
    forgotten (a replay of one of those is stale, so it is recorded and not acted on anyway)."""

    def __init__(self) -> None:
        self.seen_: dict[str, float] = {}

    def __contains__(self, finding_id: str) -> bool:
        return finding_id in self.seen_

    def add(self, finding_id: str, ts: float) -> None:
        self.seen_[finding_id] = ts

    def prune(self, before: float) -> None:
        self.seen_ = {k: v for k, v in self.seen_.items() if v >= before}

    def to_state(self) -> dict[str, Any]:
        return {"seen": dict(self.seen_)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.seen_ = {str(k): float(v) for k, v in state.get("seen", {}).items()}


class JobRateLimiter:
    """At most one allowed action per job per ``window_s`` (default one straggler eviction an hour).

    Times are decision times (the engine's ``now``), never a finding's own stamp, so a finding dated
    ahead cannot open the window early. A last action recorded after ``now`` counts as inside it."""

    def __init__(self, *, window_s: float = 3600.0) -> None:
        self.window_s = check_number("window_s", window_s, above=0)
        self.last_: dict[str, float] = {}

    def since_last(self, job: str, now: float) -> float | None:
        """Seconds since the job's last allowed action when that is inside the window, else None."""
        last = self.last_.get(job)
        if last is None or now - last >= self.window_s:
            return None
        return max(now - last, 0.0)

    def note(self, job: str, ts: float) -> None:
        self.last_[job] = ts

    def to_state(self) -> dict[str, Any]:
        return {"last": dict(self.last_)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.last_ = {str(k): float(v) for k, v in state.get("last", {}).items()}


class RackGuard:
    """Never two consecutive evictions or drains in the same rack without a human: ``last_rack_`` is the
    rack of the last allowed one; :meth:`acknowledge` (a human) clears it."""

    def __init__(self) -> None:
        self.last_rack_: str | None = None
        self.last_node_: str | None = None

    def blocks(self, rack: str) -> bool:
        return self.last_rack_ is not None and self.last_rack_ == rack

    def note(self, rack: str, node: str) -> None:
        self.last_rack_ = rack
        self.last_node_ = node

    def acknowledge(self) -> None:
        self.last_rack_ = None
        self.last_node_ = None

    def to_state(self) -> dict[str, Any]:
        return {"last_rack": self.last_rack_, "last_node": self.last_node_}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.last_rack_ = state.get("last_rack")
        self.last_node_ = state.get("last_node")


@dataclass(frozen=True)
class BreakerStatus:
    """The breaker as an operator reads it: ``open`` stops every automatic drain/evict/quarantine."""

    open: bool
    tripped_ts: float | None
    reason: str
    nodes_in_window: int
    threshold: float


class CircuitBreaker:
    """Trips when more than ``max(min_nodes, share × fleet_nodes)`` distinct nodes — capped at
    ``max_nodes`` when that is set — are recommended for a node-removing action inside ``window_s``;
    holds until :meth:`reset`.

    ``fleet_nodes`` of 0 means the fleet size is unknown and only ``min_nodes`` counts. ``max_nodes``
    is the absolute maximum an operator can state without knowing the fleet's size (0: none): at
    10 % of 20,000 nodes the share alone would allow 2,000 removals an hour.
    """

    def __init__(self, *, share: float = 0.1, min_nodes: int = 5, window_s: float = 3600.0,
                 fleet_nodes: int = 0, max_nodes: int = 0) -> None:
        self.share = check_number("breaker_share", share, above=0)
        if self.share > 1:
            raise ConfigError(f"breaker_share is a fraction of the fleet, got {share}")
        self.min_nodes = int(check_number("breaker_min_nodes", min_nodes, above=0))
        self.window_s = check_number("breaker_window_s", window_s, above=0)
        self.fleet_nodes = int(check_number("fleet_nodes", fleet_nodes, at_least=0))
        self.max_nodes = int(check_number("breaker_max_nodes", max_nodes, at_least=0))
        self.recent_: dict[str, float] = {}
        self.open_ = False
        self.tripped_ts_: float | None = None
        self.reason_ = ""

    @property
    def threshold(self) -> float:
        share = max(float(self.min_nodes), self.share * self.fleet_nodes)
        return min(share, float(self.max_nodes)) if self.max_nodes else share

    def _prune(self, ts: float) -> None:
        self.recent_ = {n: t for n, t in self.recent_.items() if ts - t < self.window_s}

    def admit(self, node: str, ts: float) -> bool:
        """Count ``node`` for an action at ``ts``; False (and trip) when that would exceed the share."""
        if self.open_:
            return False
        self._prune(ts)
        if node in self.recent_:
            return True
        if len(self.recent_) + 1 > self.threshold:
            self.open_ = True
            self.tripped_ts_ = ts
            capped = " (the absolute maximum)" if self.max_nodes and self.threshold == self.max_nodes else ""
            self.reason_ = (f"{len(self.recent_) + 1} nodes recommended for removal within "
                            f"{self.window_s:.0f} s exceeds the limit of {self.threshold:g}{capped}")
            return False
        self.recent_[node] = ts
        return True

    def trip(self, ts: float, reason: str) -> None:
        self.open_ = True
        self.tripped_ts_ = ts
        self.reason_ = reason

    def reset(self) -> None:
        """An explicit human reset: close the breaker and forget the window."""
        self.open_ = False
        self.tripped_ts_ = None
        self.reason_ = ""
        self.recent_ = {}

    def status(self) -> BreakerStatus:
        return BreakerStatus(open=self.open_, tripped_ts=self.tripped_ts_, reason=self.reason_,
                             nodes_in_window=len(self.recent_), threshold=self.threshold)

    def to_state(self) -> dict[str, Any]:
        return {"recent": dict(self.recent_), "open": self.open_, "tripped_ts": self.tripped_ts_,
                "reason": self.reason_}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.recent_ = {str(k): float(v) for k, v in state.get("recent", {}).items()}
        self.open_ = bool(state.get("open", False))
        tripped = state.get("tripped_ts")
        self.tripped_ts_ = None if tripped is None else float(tripped)
        self.reason_ = str(state.get("reason", ""))
