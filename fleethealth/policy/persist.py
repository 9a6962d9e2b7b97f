"""Thin store functions around the pure policy engine: its state, eviction outcomes and the breaker.

The engine itself does no I/O. A runner loads it with :func:`load_engine` (guard state from
``policy_state``, P(healthy) counts from the ``eviction_outcomes`` history, the breaker from the
``breaker`` table), calls ``decide``, and saves it with :func:`save_engine`. The ``breaker`` table
is the authority on open / closed: an operator's :func:`reset_breaker` (``POST /v1/breaker/reset``)
closes it there, and :func:`sync_breaker` carries that into a running engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from fleethealth.errors import StoreError
from fleethealth.policy.engine import PolicyEngine
from fleethealth.policy.eviction import EvictionOutcome
from fleethealth.schema import Diagnosis

__all__ = [
    "BreakerRecord",
    "save_engine",
    "load_engine",
    "record_outcome",
    "outcomes",
    "breaker_record",
    "reset_breaker",
    "sync_breaker",
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


def _next_version(store: Any, table: str, key_col: str, key: str) -> int:
    res = store.query(f"SELECT max(version) FROM {table} WHERE {key_col} = {{k:String}}", {"k": key})
    top = res.rows[0][0] if res.rows else None
    return int(top or 0) + 1


def record_outcome(store: Any, outcome: EvictionOutcome) -> None:
    """Append one eviction outcome to the history that P(healthy) is learned from."""
    store.insert("eviction_outcomes", {
        "ts": [float(outcome.ts)], "node": [outcome.node], "job": [outcome.job],
        "diagnosis": [Diagnosis(outcome.diagnosis).value], "finding_id": [outcome.finding_id],
        "resolved": [1 if outcome.resolved else 0],
    })


def outcomes(store: Any) -> list[EvictionOutcome]:
    """The recorded eviction outcomes, oldest first."""
    res = store.query("SELECT toFloat64(ts) AS ts, node, job, diagnosis, finding_id, resolved FROM eviction_outcomes "
                      "ORDER BY ts, node")
    return [EvictionOutcome(ts=float(r["ts"]), node=r["node"], job=r["job"], diagnosis=Diagnosis(r["diagnosis"]),
                            resolved=bool(r["resolved"]), finding_id=r["finding_id"]) for r in res.dicts()]


def breaker_record(store: Any) -> BreakerRecord | None:
    """The fleet breaker as stored, or None when it has never tripped."""
    res = store.query("SELECT open, toFloat64(tripped_ts) AS tripped_ts, reason, toFloat64(reset_ts) AS reset_ts, "
                      "reset_by, version FROM breaker FINAL "
                      "WHERE name = {n:String}", {"n": _BREAKER})
    rows = res.dicts()
    if not rows:
        return None
    r = rows[0]
    return BreakerRecord(open=bool(r["open"]), tripped_ts=r["tripped_ts"], reason=r["reason"],
                         reset_ts=r["reset_ts"], reset_by=r["reset_by"], version=int(r["version"]))


def _write_breaker(store: Any, *, open_: bool, tripped_ts: float | None, reason: str,
                   reset_ts: float | None, reset_by: str) -> None:
    store.insert("breaker", {
        "name": [_BREAKER], "open": [1 if open_ else 0], "tripped_ts": [tripped_ts], "reason": [reason],
        "reset_ts": [reset_ts], "reset_by": [reset_by], "version": [_next_version(store, "breaker", "name", _BREAKER)],
    })


def reset_breaker(store: Any, ts: float, by: str) -> BreakerRecord:
    """An explicit human reset of the fleet breaker at event time ``ts``, recorded with who did it."""
    old = breaker_record(store)
    _write_breaker(store, open_=False, tripped_ts=old.tripped_ts if old else None,
                   reason=old.reason if old else "", reset_ts=float(ts), reset_by=by)
    rec = breaker_record(store)
    if rec is None:
        raise StoreError("the breaker row written was not read back")
    return rec


def sync_breaker(store: Any, engine: PolicyEngine) -> None:
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


def save_engine(store: Any, engine: PolicyEngine, ts: float, *, key: str = "engine") -> None:
    """Write the engine's state (and a newly tripped breaker) to the store."""
    sync_breaker(store, engine)
    store.insert("policy_state", {
        "key": [key], "ts": [float(ts)], "state": [orjson.dumps(engine.to_state()).decode()],
        "version": [_next_version(store, "policy_state", "key", key)],
    })


def load_engine(store: Any, *, key: str = "engine", **params: Any) -> PolicyEngine:
    """A :class:`PolicyEngine` with ``params``, its saved state, the eviction history and the breaker."""
    engine = PolicyEngine(**params)
    res = store.query("SELECT state FROM policy_state FINAL WHERE key = {k:String}", {"k": key})
    if res.rows:
        engine.load_state(orjson.loads(res.rows[0][0]))
    engine.posterior_.load_state({})
    engine.settle(outcomes(store))
    sync_breaker(store, engine)
    return engine
