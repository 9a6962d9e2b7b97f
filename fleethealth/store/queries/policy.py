"""The policy's named queries (:class:`~fleethealth.store.protocol.PolicyStore`): its state,
eviction outcomes and the fleet breaker (``policy_state``, ``eviction_outcomes``, ``breaker``: rows
are versioned, a write takes the next version of its key), and the quarantine book (``quarantine``,
``quarantine_log``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from fleethealth.store.queries.sql import QueriesBase

__all__ = ["PolicyQueries", "QUARANTINE_COLUMNS"]

QUARANTINE_COLUMNS = ("node", "quarantined", "reason", "since", "finding_id", "runs_affected", "released_ts",
                      "release_evidence", "updated_ts", "version")
"""The columns of one ``quarantine`` row (the whole row is written again on each change)."""
_QUARANTINE_TIMES = {"since", "released_ts", "updated_ts"}
_QUARANTINE_SELECT = ", ".join(f"toFloat64({c}) AS {c}" if c in _QUARANTINE_TIMES else c
                               for c in QUARANTINE_COLUMNS)


class PolicyQueries(QueriesBase):
    """What the policy keeps."""

    # ================================================================ policy state, eviction outcomes, breaker
    def _next_version(self, table: str, key_col: str, key: str) -> int:
        res = self.query(f"SELECT max(version) FROM {table} WHERE {key_col} = {{k:String}}", {"k": key})
        top = res.rows[0][0] if res.rows else None
        return int(top or 0) + 1

    def policy_state(self, key: str) -> str | None:
        """The saved policy-engine state under ``key`` (JSON text), or ``None``."""
        res = self.query("SELECT state FROM policy_state FINAL WHERE key = {k:String}", {"k": key})
        return res.rows[0][0] if res.rows else None

    def write_policy_state(self, key: str, ts: float, state: str) -> None:
        """Save the policy-engine state (JSON text) under ``key`` at event time ``ts``."""
        self.insert("policy_state", {
            "key": [key], "ts": [float(ts)], "state": [state],
            "version": [self._next_version("policy_state", "key", key)],
        })

    def insert_eviction_outcome(self, *, ts: float, node: str, job: str, diagnosis: str, finding_id: str,
                                resolved: bool) -> None:
        """Append one eviction outcome to the history."""
        self.insert("eviction_outcomes", {
            "ts": [float(ts)], "node": [node], "job": [job], "diagnosis": [diagnosis], "finding_id": [finding_id],
            "resolved": [1 if resolved else 0],
        })

    def eviction_outcome_rows(self) -> list[dict[str, Any]]:
        """Every eviction outcome (``ts``, ``node``, ``job``, ``diagnosis``, ``finding_id``, ``resolved``),
        oldest first."""
        return self.query("SELECT toFloat64(ts) AS ts, node, job, diagnosis, finding_id, resolved "
                          "FROM eviction_outcomes ORDER BY ts, node").dicts()

    def breaker_row(self, name: str) -> dict[str, Any] | None:
        """The stored breaker ``name`` (``open``, ``tripped_ts``, ``reason``, ``reset_ts``, ``reset_by``,
        ``version``), or ``None`` when it was never written."""
        rows = self.query("SELECT open, toFloat64(tripped_ts) AS tripped_ts, reason, toFloat64(reset_ts) AS reset_ts, "
                          "reset_by, version FROM breaker FINAL "
                          "WHERE name = {n:String}", {"n": name}).dicts()
        return rows[0] if rows else None

    def write_breaker(self, name: str, *, open_: bool, tripped_ts: float | None, reason: str,
                      reset_ts: float | None, reset_by: str) -> None:
        """Write the breaker ``name`` again with the next version."""
        self.insert("breaker", {
            "name": [name], "open": [1 if open_ else 0], "tripped_ts": [tripped_ts], "reason": [reason],
            "reset_ts": [reset_ts], "reset_by": [reset_by],
            "version": [self._next_version("breaker", "name", name)],
        })

    # ================================================================ the quarantine book
    def quarantine_row(self, node: str) -> dict[str, Any] | None:
        """The node's ``quarantine`` row (:data:`QUARANTINE_COLUMNS`, times in s), or ``None``."""
        rows = self.query(f"SELECT {_QUARANTINE_SELECT} FROM quarantine FINAL WHERE node = {{node:String}}",
                          {"node": node}).dicts()
        return rows[0] if rows else None

    def quarantined_rows(self) -> list[dict[str, Any]]:
        """The rows of every node now in quarantine, oldest first."""
        return self.query(f"SELECT {_QUARANTINE_SELECT} FROM quarantine FINAL WHERE quarantined = 1 "
                          "ORDER BY since, node").dicts()

    def write_quarantine_row(self, row: Mapping[str, Any]) -> None:
        """Write a node's whole ``quarantine`` row (:data:`QUARANTINE_COLUMNS` of ``row``)."""
        self.insert("quarantine", {name: [row[name]] for name in QUARANTINE_COLUMNS})

    def append_quarantine_log(self, node: str, ts: float, action: str, detail: str,
                              evidence: Mapping[str, Any]) -> None:
        """Append one line to the node's quarantine log, numbered after its last one."""
        seq = self.query("SELECT count() FROM quarantine_log WHERE node = {node:String}", {"node": node}).rows[0][0]
        self.insert("quarantine_log", {
            "node": [node], "ts": [float(ts)], "action": [action], "detail": [detail],
            "evidence": [orjson.dumps(dict(evidence), default=str).decode()], "seq": [int(seq) + 1],
        })

    def quarantine_log_rows(self, node: str) -> list[dict[str, Any]]:
        """The node's quarantine log (``ts``, ``action``, ``detail``, ``evidence`` as JSON text), in order."""
        return self.query("SELECT node, toFloat64(ts) AS ts, action, detail, evidence FROM quarantine_log "
                          "WHERE node = {node:String} ORDER BY seq", {"node": node}).dicts()
