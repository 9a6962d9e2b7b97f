"""Thin store functions around the pure policy engine: its state, eviction outcomes and the breaker.

The engine itself does no I/O. A runner loads it with :func:`load_engine` (guard state from
``policy_state``, P(healthy) counts from the ``eviction_outcomes`` history, the breaker from the
``breaker`` table), calls ``decide``, and saves it with :func:`save_engine`. The ``breaker`` table
is the authority on open / closed: an operator's :func:`reset_breaker` (``POST /v1/breaker/reset``)
closes it there, and :func:`sync_breaker` carries that into a running engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from fleethealth.errors import StoreError
from fleethealth.policy.engine import PolicyEngine
from fleethealth.policy.eviction import EvictionOutcome
from fleethealth.schema import Diagnosis

if TYPE_CHECKING:
    from fleethealth.store.protocol import PolicyStore

__all__ = [
    "BreakerRecord",
    "save_engine",
    "load_engine",
    "record_outcome",
    "outcomes",
    "breaker_record",
    "reset_breaker",
    "sync_breaker",
    "sync_quarantine",
]

_BREAKER = "fleet"


@dataclass(frozen=True)
class BreakerRecord:
    """The stored breaker: ``open`` stops automatic node removal until an explicit reset."""

    open: bool
    tripped_ts: float | None
    reason: str
    reset_ts: float | None
    reset_by: str
    version: int

    def to_obj(self) -> dict[str, Any]:
        return {"open": self.open, "tripped_ts": self.tripped_ts, "reason": self.reason,
                "reset_ts": self.reset_ts, "reset_by": self.reset_by}


def record_outcome(store: PolicyStore, outcome: EvictionOutcome) -> None:
    """Append one eviction outcome to the history that P(healthy) is learned from."""
    store.insert_eviction_outcome(ts=float(outcome.ts), node=outcome.node, job=outcome.job,
                                  diagnosis=Diagnosis(outcome.diagnosis).value, finding_id=outcome.finding_id,
                                  resolved=bool(outcome.resolved))


def outcomes(store: PolicyStore) -> list[EvictionOutcome]:
    """The recorded eviction outcomes, oldest first."""
    return [EvictionOutcome(ts=float(r["ts"]), node=r["node"], job=r["job"], diagnosis=Diagnosis(r["diagnosis"]),
                            resolved=bool(r["resolved"]), finding_id=r["finding_id"])
            for r in store.eviction_outcome_rows()]


def breaker_record(store: PolicyStore) -> BreakerRecord | None:
    """The fleet breaker as stored, or None when it has never tripped."""
    r = store.breaker_row(_BREAKER)
    if r is None:
        return None
    return BreakerRecord(open=bool(r["open"]), tripped_ts=r["tripped_ts"], reason=r["reason"],
                         reset_ts=r["reset_ts"], reset_by=r["reset_by"], version=int(r["version"]))


def _write_breaker(store: PolicyStore, *, open_: bool, tripped_ts: float | None, reason: str,
                   reset_ts: float | None, reset_by: str) -> None:
    store.write_breaker(_BREAKER, open_=open_, tripped_ts=tripped_ts, reason=reason, reset_ts=reset_ts,
                        reset_by=reset_by)


def reset_breaker(store: PolicyStore, ts: float, by: str) -> BreakerRecord:
    """An explicit human reset of the fleet breaker at event time ``ts``, recorded with who did it."""
    old = breaker_record(store)
    _write_breaker(store, open_=False, tripped_ts=old.tripped_ts if old else None,
                   reason=old.reason if old else "", reset_ts=float(ts), reset_by=by)
    rec = breaker_record(store)
    if rec is None:
        raise StoreError("the breaker row written was not read back")
    return rec


def sync_breaker(store: PolicyStore, engine: PolicyEngine) -> None:
    """Reconcile the engine's breaker with the stored one (the store wins for a later reset)."""
    rec = breaker_record(store)
    b = engine.breaker_
    if b.open_:
        if rec is not None and not rec.open and rec.reset_ts is not None \
                and rec.reset_ts >= (b.tripped_ts_ or 0.0):
            engine.reset_breaker()
        elif rec is None or not rec.open:
            _write_breaker(store, open_=True, tripped_ts=b.tripped_ts_, reason=b.reason_, reset_ts=None,
                           reset_by="")
    elif rec is not None and rec.open:
        b.trip(rec.tripped_ts or 0.0, rec.reason)


def sync_quarantine(store: PolicyStore, engine: PolicyEngine) -> list[str]:
    """Reconcile the engine's memory of quarantined and drained nodes with the quarantine book (the book
    wins: a node released through the API or a sweep is forgotten by the engine). Reads the book only
    while the engine remembers a node. Returns the nodes released."""
    held = engine.quarantined_ | engine.drained_
    if not held:
        return []
    booked = {row["node"] for row in store.quarantined_rows()}
    released = sorted(held - booked)
    for node in released:
        engine.release(node)
    return released


def save_engine(store: PolicyStore, engine: PolicyEngine, ts: float, *, key: str = "engine") -> None:
    """Write the engine's state (and a newly tripped breaker) to the store."""
    sync_breaker(store, engine)
    store.write_policy_state(key, float(ts), orjson.dumps(engine.to_state()).decode())


def load_engine(store: PolicyStore, *, key: str = "engine", **params: Any) -> PolicyEngine:
    """A :class:`PolicyEngine` with ``params``, its saved state, the eviction history and the breaker."""
    engine = PolicyEngine(**params)
    state = store.policy_state(key)
    if state is not None:
        engine.load_state(orjson.loads(state))
    engine.posterior_.load_state({})
    engine.settle(outcomes(store))
    sync_breaker(store, engine)
    return engine
