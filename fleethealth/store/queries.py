"""Every named application query of fleethealth, and only here.

:class:`NamedQueries` holds them as methods over the small contract (``query`` / ``insert``); the
store class mixes it in, so a caller holding a :class:`~fleethealth.store.protocol.StoreLike` calls
``store.quarantine_row(node)`` and never writes SQL. The sections follow the tables they read:

* core tables: typed writers and readers (``FINAL``: one row per natural key even before a merge);
* nodes, runs and the API's views (``gpu_samples``, ``rank_steps``, ``events``, ``findings``,
  ``recommendations``);
* policy state, eviction outcomes and the fleet breaker (``policy_state``, ``eviction_outcomes``,
  ``breaker``): rows are versioned, a write takes the next version of its key;
* the quarantine book (``quarantine``, ``quarantine_log``);
* self-test baselines (``selftest`` events);
* the report's views (aggregates for ``fleethealth report``'s plots).

* the outbox (``outbox``): findings and recommendations stored before they are published;
* detector snapshots (``detector_snapshots``): each stream stage's state per input partition.

The only other SQL is the analyst's own, through :mod:`fleethealth.api.sqlgate` (and
``fleethealth query``), and the migrations in ``deploy/clickhouse/``. Times are event time in
epoch seconds.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from fleethealth import schema
from fleethealth.errors import ConfigError, StoreError
from fleethealth.schema import GPU_FIELDS, Event, EventKind, Finding, Recommendation, StepBatch, Telemetry
from fleethealth.store.columns import (
    FLOAT32_FIELDS,
    decimal_floats,
    event_columns,
    finding_columns,
    loads_lenient,
    recommendation_columns,
    row_object,
    segments,
    step_columns,
    telemetry_columns,
)

if TYPE_CHECKING:
    from fleethealth.store.protocol import QueryResult

__all__ = ["NamedQueries", "QUARANTINE_COLUMNS", "ROLLUP_AFTER_S"]

_TS = "toFloat64(toUnixTimestamp64Milli(ts)) / 1000"
"""A DateTime64 ``ts`` as exact epoch seconds."""


def _dec(expr: str) -> str:
    """A Float32 expression as the float64 of its shortest decimal (71.3 reads 71.3, not 71.30000305)."""
    return f"toFloat64(toString({expr}))"


_ENGINE_METRICS = {"MemoryTracking": "tracked", "MarkCacheBytes": "mark_cache", "PrimaryIndexCacheBytes": "pk_cache",
                   "QueryConditionCacheBytes": "condition_cache", "UncompressedCacheBytes": "uncompressed_cache",
                   "CompiledExpressionCacheBytes": "compiled_cache", "QueryCacheBytes": "query_cache",
                   "MergesMutationsMemoryTracking": "merges"}
_JEMALLOC = re.compile(r"Allocated: (\d+), active: (\d+), metadata: (\d+).*?resident: (\d+), mapped: (\d+), "
                       r"retained: (\d+)")

_REC_COLUMNS = ("id", "action", "node", "job", "reason", "guard", "ts_s", "finding_id", "dry_run", "evidence",
                "acked_at", "acked_by")
_EVENT_COLUMNS = "id, node, ts_s, kind, job, gpu, rank, step, code, message, data"
_EVENT_KINDS = frozenset(k.value for k in EventKind)

QUARANTINE_COLUMNS = ("node", "quarantined", "reason", "since", "finding_id", "runs_affected", "released_ts",
                      "release_evidence", "updated_ts", "version")
"""The columns of one ``quarantine`` row (the whole row is written again on each change)."""
_QUARANTINE_TIMES = {"since", "released_ts", "updated_ts"}
_QUARANTINE_SELECT = ", ".join(f"toFloat64({c}) AS {c}" if c in _QUARANTINE_TIMES else c
                               for c in QUARANTINE_COLUMNS)


class NamedQueries:
    """The named queries, as methods of a store that has ``query`` and ``insert``."""

    if TYPE_CHECKING:
        def query(self, sql: str, parameters: Mapping[str, Any] | None = None, *,
                  readonly: bool = False) -> QueryResult: ...

        def insert(self, table: str, columns: Mapping[str, Any], *, dedup_token: str | None = None) -> int: ...

    # ================================================================ core tables: typed writers
    # columnar: one insert per call, NumPy columns concatenated over messages
    def insert_telemetry(self, samples: Sequence[Telemetry], *, dedup_token: str | None = None) -> int:
        if not samples:
            return 0
        return self.insert("gpu_samples", telemetry_columns(samples), dedup_token=dedup_token)

    def insert_steps(self, batches: Sequence[StepBatch], *, dedup_token: str | None = None) -> int:
        if not batches:
            return 0
        return self.insert("rank_steps", step_columns(batches), dedup_token=dedup_token)

    def insert_events(self, events: Sequence[Event], *, dedup_token: str | None = None) -> int:
        return self.insert("events", event_columns(events), dedup_token=dedup_token)

    def insert_findings(self, findings: Sequence[Finding], *, dedup_token: str | None = None) -> int:
        return self.insert("findings", finding_columns(findings), dedup_token=dedup_token)

    def insert_recommendations(self, recs: Sequence[Recommendation], *, dedup_token: str | None = None) -> int:
        return self.insert("recommendations", recommendation_columns(recs), dedup_token=dedup_token)

    # ================================================================ core tables: typed readers
    def findings(self, *, kind: str | None = None, node: str | None = None, job: str | None = None,
                 since: float | None = None, until: float | None = None,
                 limit: int | None = None) -> list[Finding]:
        """Findings ordered by event time, filtered by any of kind, node, job and ``since <= ts < until``."""
        where, params = _filters(kind=kind, node=node, job=job, since=since, until=until)
        res = self.query(
            "SELECT kind, node, ts_s AS ts, nullIf(job, '') AS job, gpu, rank, step, diagnosis, z, slowdown, "
            "probability, detector, evidence, episode_ts_s AS episode_ts "
            f"FROM findings FINAL {where} ORDER BY ts_s, id{_limit(limit)}", params)
        return [schema.decode(Finding, row_object(res.columns, row, "evidence")) for row in res.rows]

    def recommendations(self, *, node: str | None = None, job: str | None = None, action: str | None = None,
                        since: float | None = None, until: float | None = None,
                        limit: int | None = None) -> list[Recommendation]:
        """Recommendations ordered by event time, filtered by any of node, job, action and time."""
        where, params = _filters(node=node, job=job, action=action, since=since, until=until)
        res = self.query(
            "SELECT action, node, ts_s AS ts, reason, guard, nullIf(job, '') AS job, "
            "nullIf(finding_id, '') AS finding_id, dry_run, evidence "
            f"FROM recommendations FINAL {where} ORDER BY ts_s, id{_limit(limit)}", params)
        return [schema.decode(Recommendation, row_object(res.columns, row, "evidence")) for row in res.rows]

    def events(self, kind: str | None = None, node: str | None = None, *, job: str | None = None,
               since: float | None = None, until: float | None = None, limit: int | None = None) -> list[Event]:
        """Events ordered by event time, filtered by any of kind, node, job and time."""
        where, params = _filters(kind=kind, node=node, job=job, since=since, until=until)
        res = self.query(
            "SELECT node, ts_s AS ts, kind, nullIf(job, '') AS job, gpu, rank, step, code, message, data "
            f"FROM events FINAL {where} ORDER BY ts_s, id{_limit(limit)}", params)
        return [schema.decode(Event, row_object(res.columns, row, "data")) for row in res.rows]

    def steps(self, job: str, *, first_step: int = 0, last_step: int | None = None,
              node: str | None = None) -> list[StepBatch]:
        """One :class:`StepBatch` per (step, node) of ``job``, ranks ascending, ``ts`` to the millisecond."""
        clauses = ["job = {job:String}", "step >= {first:UInt64}"]
        params: dict[str, Any] = {"job": job, "first": first_step}
        if last_step is not None:
            clauses.append("step <= {last:UInt64}")
            params["last"] = last_step
        if node is not None:
            clauses.append("node = {node:String}")
            params["node"] = node
        res = self.query("SELECT step, node, toUnixTimestamp64Milli(ts) AS ms, rank, gpu, compute_s, rank_group "
                         f"FROM rank_steps FINAL WHERE {' AND '.join(clauses)} ORDER BY step, node, rank", params)
        if not res.rows:
            return []
        step, node_col, ms, rank, gpu, compute, group = (np.asarray(c) for c in zip(*res.rows, strict=True))
        out = []
        for lo, hi in segments(step, node_col):
            groups = group[lo:hi].astype(np.int32)
            out.append(StepBatch(job=job, step=int(step[lo]), node=str(node_col[lo]), ts=float(ms[lo]) / 1000.0,
                                 ranks=rank[lo:hi].astype(np.int32), gpus=gpu[lo:hi].astype(np.int16),
                                 compute_s=compute[lo:hi].astype(np.float64),
                                 groups=None if (groups < 0).all() else groups))
        return out

    def telemetry(self, *, node: str | None = None, since: float | None = None,
                  until: float | None = None) -> list[Telemetry]:
        """One :class:`Telemetry` per (node, ts), ordered by node then time, GPUs ascending, ``ts`` to the
        millisecond; ``since <= ts < until``."""
        clauses, params = [], {}
        if node is not None:
            clauses.append("node = {node:String}")
            params["node"] = node
        if since is not None:
            clauses.append("ts >= fromUnixTimestamp64Milli(toInt64({since_ms:Int64}))")
            params["since_ms"] = int(round(since * 1000))
        if until is not None:
            clauses.append("ts < fromUnixTimestamp64Milli(toInt64({until_ms:Int64}))")
            params["until_ms"] = int(round(until * 1000))
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        fields = list(GPU_FIELDS)
        res = self.query("SELECT node, toUnixTimestamp64Milli(ts) AS ms, rack, model, nic_util, gpu, uuid, "
                         f"{', '.join(fields)} FROM gpu_samples FINAL {where} ORDER BY node, ts, gpu", params)
        if not res.rows:
            return []
        cols = [np.asarray(c) for c in zip(*res.rows, strict=True)]
        node_col, ms, rack, model, nic, gpu, uuid = cols[:7]
        nic = decimal_floats(nic)
        values = [decimal_floats(v) if f in FLOAT32_FIELDS else v for f, v in zip(fields, cols[7:], strict=True)]
        out = []
        for lo, hi in segments(node_col, ms):
            uuids = tuple(str(u) for u in uuid[lo:hi])
            out.append(Telemetry(node=str(node_col[lo]), rack=str(rack[lo]), ts=float(ms[lo]) / 1000.0,
                                 gpu=gpu[lo:hi].astype(np.int16),
                                 columns={f: v[lo:hi].astype(np.float64) for f, v in zip(fields, values, strict=True)},
                                 nic_util=float(nic[lo]), model=str(model[lo]),
                                 uuid=uuids if any(uuids) else ()))
        return out

    # ================================================================ nodes, runs and the API's views
    def ping(self) -> None:
        """Raise :class:`~fleethealth.errors.StoreError` unless the store answers a trivial query."""
        self.query("SELECT 1")

    def explain_ast(self, statement: str) -> str:
        """ClickHouse's parse of ``statement`` (``EXPLAIN AST``), one node a line: parsing runs no
        function and opens no table, so the analyst-SQL gate can walk what the engine would run."""
        return "\n".join(str(row[0]) for row in self.query(f"EXPLAIN AST {statement}").rows)

    def engine_memory(self) -> dict[str, float]:
        """What the engine holds, bytes: its memory tracker and each cache (``system.metrics``),
        jemalloc's allocated, metadata, resident and retained bytes (where the engine reports them)
        and the active parts (a count) — to tell the engine's memory from its host process's."""
        names = ", ".join(f"'{m}'" for m in _ENGINE_METRICS)
        out = {_ENGINE_METRICS[m]: float(v) for m, v in
               self.query(f"SELECT metric, value FROM system.metrics WHERE metric IN ({names})").rows}
        try:
            stats = self.query("SELECT stats FROM system.jemalloc_stats").rows
        except StoreError:  # a server without the table
            stats = []
        match = _JEMALLOC.search(stats[0][0]) if stats else None
        if match:
            allocated, metadata, resident, retained = (float(match.group(i)) for i in (1, 3, 4, 6))
            out.update(jemalloc_allocated=allocated, jemalloc_metadata=metadata, jemalloc_resident=resident,
                       jemalloc_retained=retained)
        out["active_parts"] = float(self.query("SELECT count() FROM system.parts WHERE active").rows[0][0])
        return out

    def node_exists(self, node: str) -> bool:
        """Whether any table holds a row about ``node``."""
        sql = " UNION ALL ".join(
            f"SELECT 1 FROM (SELECT node FROM {t} WHERE node = {{node:String}} LIMIT 1)"
            for t in ("gpu_samples", "events", "findings", "recommendations", "quarantine", "rank_steps"))
        return bool(self.query(sql, {"node": node}).rows)

    def job_exists(self, job: str) -> bool:
        """Whether any table holds a row about ``job``."""
        sql = " UNION ALL ".join(
            f"SELECT 1 FROM (SELECT job FROM {t} WHERE job = {{job:String}} LIMIT 1)"
            for t in ("rank_steps", "events", "findings", "recommendations"))
        return bool(self.query(sql, {"job": job}).rows)

    def job_nodes(self, job: str) -> set[str]:
        """The nodes that ran a rank of ``job``."""
        return {r[0] for r in self.query("SELECT DISTINCT node FROM rank_steps WHERE job = {job:String}",
                                         {"job": job}).rows}

    def rank_step_count(self, job: str, *, first_step: int = 0) -> int:
        """Stored ``rank_steps`` rows of ``job`` at or after ``first_step`` (replays not collapsed)."""
        return int(self.query("SELECT count() FROM rank_steps WHERE job = {j:String} AND step >= {first:UInt64}",
                              {"j": job, "first": first_step}).rows[0][0])

    def recommendation_rows(self, *, since: float | None = None, node: str | None = None, job: str | None = None,
                            action: str | None = None, guard: str | None = None,
                            limit: int = 100) -> list[dict[str, Any]]:
        """Recommendation rows (``id``, ``action``, ..., ``ts_s``, ``acked_at``, ``acked_by``), newest first,
        filtered by event time, node, job, action and guard."""
        where, params = ["1"], {"limit": int(limit)}
        for name, value, cond in (("since", since, "ts_s >= {since:Float64}"), ("node", node, "node = {node:String}"),
                                  ("job", job, "job = {job:String}"), ("action", action, "action = {action:String}"),
                                  ("guard", guard, "guard = {guard:String}")):
            if value is not None:
                where.append(cond)
                params[name] = value
        res = self.query(f"SELECT {', '.join(_REC_COLUMNS)} FROM recommendations FINAL WHERE {' AND '.join(where)} "
                         "ORDER BY ts_s DESC, id LIMIT {limit:UInt32}", params)
        return res.dicts()

    def recommendation_row(self, rec_id: str) -> dict[str, Any] | None:
        """The whole stored row of one recommendation (every column :meth:`write_recommendation_row`
        takes back), or ``None``."""
        cols = ("id", "action", "node", "job", "reason", "guard", "ts", "ts_s", "finding_id", "dry_run", "evidence",
                "acked_at", "acked_by")
        res = self.query(f"SELECT {', '.join(cols)} FROM recommendations FINAL WHERE id = {{id:String}} "
                         "ORDER BY ts_s DESC LIMIT 1", {"id": rec_id})
        rows = res.dicts()
        return rows[0] if rows else None

    def write_recommendation_row(self, row: Mapping[str, Any]) -> None:
        """Write one recommendation row again (the table keeps the last version of a row); ``ts`` and
        ``acked_at`` in epoch seconds."""
        self.insert("recommendations", {k: [v] for k, v in row.items()})

    def node_summaries(self, *, source: str = "latest") -> list[dict[str, Any]]:
        """Per node with telemetry: ``rack``, ``gpus``, ``last_seen`` (s) and ``max_temp_c`` of the
        latest sample of each GPU. ``source``: ``"latest"`` reads the latest-sample table
        ``gpu_latest`` (009_gpu_latest.sql), ``"raw"`` scans every retained raw sample (the same
        answer, slower by the retained rows per GPU; for comparison)."""
        return self.query(
            "SELECT node, any(rack) AS rack, count() AS gpus, max(last_ts) AS last_seen, "
            f"{_dec('max(temp_c)')} AS max_temp_c "
            f"FROM (SELECT node, gpu, argMax(rack, ts) AS rack, max({_TS}) AS last_ts, argMax(temp_c, ts) AS temp_c "
            f"FROM {_latest_table(source)} GROUP BY node, gpu) GROUP BY node").dicts()

    def finding_counts_by_node(self) -> dict[str, int]:
        return dict(self.query("SELECT node, count() FROM findings FINAL GROUP BY node").rows)

    def open_recommendations_by_node(self) -> dict[str, int]:
        """Recommendations not yet acknowledged, per node."""
        return dict(self.query("SELECT node, countIf(acked_at IS NULL) FROM recommendations FINAL "
                               "GROUP BY node").rows)

    def recent_events(self, *, node: str | None = None, job: str | None = None, kind: str | None = None,
                      limit: int = 10_000) -> list[Event]:
        """The ``limit`` newest events, filtered by node, job and kind; kinds this build does not know
        (written by a newer version) are then left out, and a ``data`` that is not JSON reads as
        ``{"unparsed": text}``."""
        clauses, params = [], {}
        for name, value in (("node", node), ("job", job), ("kind", kind)):
            if value is not None:
                clauses.append(f"{name} = {{{name}:String}}")
                params[name] = value
        res = self.query(f"SELECT {_EVENT_COLUMNS} FROM events FINAL WHERE {' AND '.join(clauses) or '1'} "
                         f"ORDER BY ts_s DESC, id LIMIT {int(limit)}", params)
        out = []
        for r in res.dicts():
            if r["kind"] not in _EVENT_KINDS:
                continue  # written by a newer version: not this build's to show
            out.append(Event(node=r["node"], ts=float(r["ts_s"]), kind=EventKind(r["kind"]), job=r["job"] or None,
                             gpu=r["gpu"], rank=r["rank"], step=r["step"], code=r["code"], message=r["message"],
                             data=loads_lenient(r["data"])))
        return out

    def node_gpu_latest(self, node: str, *, source: str = "latest") -> list[dict[str, Any]]:
        """The latest sample of each GPU of ``node`` (``gpu``, ``rack``, ``last_ts`` and the health
        fields the API shows), GPUs ascending; ``source`` as :meth:`node_summaries`."""
        return self.query(
            f"SELECT gpu, argMax(rack, ts) AS rack, max({_TS}) AS last_ts, {_dec('argMax(temp_c, ts)')} AS temp_c, "
            f"{_dec('argMax(power_w, ts)')} AS power_w, {_dec('argMax(sm_clock_mhz, ts)')} AS sm_clock_mhz, "
            f"{_dec('argMax(util_pct, ts)')} AS util_pct, argMax(clock_reasons, ts) AS clock_reasons, "
            "argMax(ecc_dbe_volatile, ts) AS ecc_dbe_volatile, "
            f"{_dec('argMax(nvlink_links_up, ts)')} AS nvlink_links_up "
            f"FROM {_latest_table(source)} WHERE node = {{node:String}} GROUP BY gpu ORDER BY gpu",
            {"node": node}).dicts()

    def node_finding_rows(self, node: str, *, limit: int = 50) -> list[dict[str, Any]]:
        """The ``limit`` most recent finding rows of ``node``, newest first (``evidence`` as JSON text)."""
        return self.query(
            "SELECT id, kind, detector, job, gpu, rank, step, ts_s, diagnosis, z, slowdown, probability, evidence "
            "FROM findings FINAL WHERE node = {node:String} ORDER BY ts_s DESC, id LIMIT {limit:UInt32}",
            {"node": node, "limit": limit}).dicts()

    def job_step_times(self, job: str, *, limit: int) -> list[tuple[Any, ...]]:
        """``(step, step_s, end_ts)`` of the ``limit`` most recent steps of ``job``, oldest first: the
        step time is the slowest rank's compute time, ``end_ts`` the latest rank's event time (s)."""
        res = self.query(
            f"SELECT step, max(compute_s) AS step_s, max({_TS}) AS end_ts FROM rank_steps WHERE job = {{job:String}} "
            "GROUP BY step ORDER BY step DESC LIMIT {limit:UInt32}", {"job": job, "limit": limit})
        return res.rows[::-1]

    def job_spans(self, *, since: float, until: float) -> list[tuple[str, int, float, float]]:
        """``(job, nodes, first ts, last ts)`` of every job with steps in the hours that ``[since, until]``
        (event time, s) touches: its distinct nodes and the first and last step time there, from the
        hourly rollup ``job_node_hours`` (``deploy/clickhouse/012_job_node_hours.sql``), so a span may
        reach into the hours at either end (a caller clips it). The checkpoint interval's exposure."""
        res = self.query(
            "SELECT job, uniqExact(node), toFloat64(toUnixTimestamp64Milli(min(lo))) / 1000, "
            "toFloat64(toUnixTimestamp64Milli(max(hi))) / 1000 FROM job_node_hours "
            "WHERE hour >= toStartOfHour(toDateTime(toUInt32(greatest({lo:Float64}, 0)), 'UTC')) "
            "AND hour <= toDateTime(toUInt32(greatest({hi:Float64}, 0)), 'UTC') GROUP BY job ORDER BY job",
            {"lo": since, "hi": until})
        return [(str(j), int(n), float(a), float(b)) for j, n, a, b in res.rows]

    def rank_median_compute(self, job: str, *, after_step: int) -> list[dict[str, Any]]:
        """Per rank of ``job`` over the steps after ``after_step``: ``node``, ``gpu`` and the median
        compute time ``mean_s``, slowest first."""
        return self.query(
            "SELECT rank, any(node) AS node, any(gpu) AS gpu, quantileExact(0.5)(compute_s) AS mean_s FROM rank_steps "
            "WHERE job = {job:String} AND step > {lo:Int64} GROUP BY rank ORDER BY mean_s DESC",
            {"job": job, "lo": after_step}).dicts()

    def sdc_check_counts(self, job: str) -> tuple[int, int]:
        """``(checks, failed)``: the SDC check events of ``job`` and how many of them did not pass."""
        counts = self.query(
            "SELECT count() AS n, countIf(JSONExtractBool(data, 'passed') = 0) AS failed FROM events FINAL "
            "WHERE job = {job:String} AND kind = 'sdc_check'", {"job": job}).dicts()[0]
        return int(counts["n"]), int(counts["failed"])

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

    # ================================================================ self-test baselines
    def selftest_throughput_medians(self, *, since: float | None = None) -> list[tuple[str, str, str, float, int]]:
        """``(model, suite, test, median throughput, count)`` over the ``selftest`` events with verdict
        ``pass`` or ``slow`` and a positive throughput, at or after event time ``since``."""
        where = "" if since is None else " AND ts_s >= {since:Float64}"
        res = self.query(
            "SELECT JSONExtractString(data, 'model') AS model, JSONExtractString(data, 'suite') AS suite, "
            "JSONExtractString(data, 'test') AS test, median(JSONExtractFloat(data, 'throughput')) AS value, "
            "count() AS n FROM events FINAL WHERE kind = 'selftest' "
            "AND JSONExtractString(data, 'verdict') IN ('pass', 'slow') "
            f"AND JSONExtractFloat(data, 'throughput') > 0{where} GROUP BY model, suite, test",
            None if since is None else {"since": float(since)})
        return [(str(model), str(suite), str(test), float(value), int(n)) for model, suite, test, value, n in res.rows]

    # ================================================================ the outbox (to publish, then published)
    def write_outbox(self, rows: Sequence[tuple[str, str, str, float, str]], *, published: bool,
                     dedup_token: str | None = None) -> int:
        """Write outbox rows ``(topic, id, key, ts_s, payload)``: pending (``published`` False, version 0)
        or acknowledged by the broker (True, version 1, which wins under ``FINAL``)."""
        if not rows:
            return 0
        topic, ids, keys, ts, payload = (list(c) for c in zip(*rows, strict=True))
        flag = int(bool(published))
        return self.insert("outbox", {"id": ids, "topic": topic, "key": keys, "ts_s": ts, "payload": payload,
                                      "published": [flag] * len(ids), "version": [flag] * len(ids)},
                           dedup_token=dedup_token)

    def pending_outbox(self, *, limit: int = 10_000) -> list[tuple[str, str, str, float, str]]:
        """Outbox rows not yet acknowledged, ``(topic, id, key, ts_s, payload)``, oldest decision first."""
        res = self.query("SELECT topic, id, key, ts_s, payload FROM outbox FINAL WHERE published = 0 "
                         "ORDER BY ts_s, topic, id LIMIT {limit:UInt32}", {"limit": int(limit)})
        return [(str(t), str(i), str(k), float(ts), str(p)) for t, i, k, ts, p in res.rows]


    # ================================================================ detector snapshots (one per group and partition)
    def save_snapshot(self, group: str, partition: int, seq: int, ts: float,
                      offsets: Mapping[tuple[str, int], int], blob: bytes) -> None:
        """Store the snapshot ``blob`` of consumer group ``group``'s input ``partition``, version ``seq``
        (the greatest is kept), reflecting event time ``ts`` and the input ``offsets``
        (``{(topic, partition): next offset}``). The bytes are stored as given.

        ``seq`` must grow with the state's progress whoever writes it (e.g. the next offset of the
        partition's main input): a replica that lost the partition in a rebalance and still writes
        then cannot replace the new owner's newer snapshot with its older one."""
        for name, value in (("partition", partition), ("seq", seq)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StoreError(f"save_snapshot: {name} must be an int >= 0, got {value!r}")
        if not isinstance(blob, bytes | bytearray):
            raise StoreError(f"save_snapshot: blob must be bytes, got {type(blob).__name__}")
        pairs = sorted([str(topic), int(part), int(offset)] for (topic, part), offset in offsets.items())
        self.insert("detector_snapshots", {
            "consumer_group": [group], "partition": [partition], "seq": [seq], "ts": [float(ts)],
            "offsets": [orjson.dumps(pairs).decode()], "blob": [bytes(blob)],
        })

    def load_snapshot(self, group: str, partition: int) -> tuple[int, dict[tuple[str, int], int], bytes] | None:
        """The newest snapshot of ``group``'s input ``partition``: ``(seq, offsets, blob)``, or ``None``."""
        res = self.query("SELECT seq, offsets, base64Encode(blob) AS blob FROM detector_snapshots FINAL "
                         "WHERE consumer_group = {g:String} AND partition = {p:UInt32} ORDER BY seq DESC LIMIT 1",
                         {"g": group, "p": int(partition)})
        if not res.rows:
            return None
        seq, offsets, blob = res.rows[0]
        return (int(seq), {(str(t), int(p)): int(o) for t, p, o in orjson.loads(offsets)},
                base64.b64decode(blob, validate=True))

    # ================================================================ report views (``fleethealth report``)
    # Aggregated for plotting: a heatmap cell per (rank, step bin), a temperature cell per (rack, time bin).
    def report_jobs(self) -> list[tuple[str, int]]:
        """``(job, distinct steps)`` of every job with step rows, most steps first."""
        res = self.query("SELECT job, uniqExact(step) AS steps FROM rank_steps GROUP BY job ORDER BY steps DESC, job")
        return [(str(job), int(n)) for job, n in res.rows]

    def report_job_span(self, job: str) -> tuple[int, int, float, float] | None:
        """``(first step, last step, first ts, last ts)`` of ``job``'s step rows, or ``None``."""
        res = self.query(f"SELECT min(step), max(step), min({_TS}), max({_TS}), count() FROM rank_steps "
                         "WHERE job = {job:String}", {"job": job})
        if not res.rows or not int(res.rows[0][4]):
            return None
        lo, hi, t0, t1, _ = res.rows[0]
        return int(lo), int(hi), float(t0), float(t1)

    def report_rank_compute(self, job: str, *, step_bin: int = 1) -> list[tuple[int, str, int, float]]:
        """``(rank, node, step bin, mean compute_s)`` of ``job``, the bin being ``step // step_bin``."""
        res = self.query(
            "SELECT rank, any(node) AS node, intDiv(step, {bin:UInt64}) AS b, avg(compute_s) AS c FROM rank_steps "
            "WHERE job = {job:String} GROUP BY rank, b ORDER BY rank, b", {"job": job, "bin": max(1, int(step_bin))})
        return [(int(r), str(n), int(b), float(c)) for r, n, b, c in res.rows]

    def report_node_racks(self, nodes: Sequence[str]) -> dict[str, str]:
        """The rack of each of ``nodes`` that has telemetry (its latest sample's)."""
        res = self.query("SELECT node, argMax(rack, ts) FROM gpu_samples WHERE node IN {nodes:Array(String)} "
                         "GROUP BY node", {"nodes": list(nodes)})
        return {str(n): str(r) for n, r in res.rows}

    def report_rack_temperature(self, nodes: Sequence[str], *, since: float, until: float,
                                bin_s: float) -> list[tuple[str, int, float, float, int]]:
        """``(rack, time bin, mean temp_c, max temp_c, OR of clock_reasons)`` over the GPUs of ``nodes``
        with ``since <= ts <= until``; the bin is ``(ts - since) // bin_s``."""
        if until - since > ROLLUP_AFTER_S and bin_s >= 60.0:  # the 1-minute rollup, bins of whole minutes
            res = self.query(
                "SELECT rack, greatest(toInt64(0), toInt64(floor((toUnixTimestamp(minute) - {since:Float64}) "
                f"/ {{bin:Float64}}))) AS b, avgMerge(temp_c_avg), {_dec('max(temp_c_max)')}, "
                "groupBitOr(clock_reasons_or) FROM gpu_samples_1m WHERE node IN {nodes:Array(String)} "
                f"AND {_MINUTES} GROUP BY rack, b ORDER BY rack, b",
                {"nodes": list(nodes), "since": float(since), "bin": float(bin_s), **_span(since, until + 60.0)})
            return [(str(r), int(b), float(m), float(x), int(c)) for r, b, m, x, c in res.rows]
        res = self.query(
            f"SELECT rack, toInt64(floor(({_TS} - {{since:Float64}}) / {{bin:Float64}})) AS b, avg(temp_c), "
            f"{_dec('max(temp_c)')}, groupBitOr(toUInt64(if(isNaN(clock_reasons), 0, clock_reasons))) FROM gpu_samples "
            f"WHERE node IN {{nodes:Array(String)}} AND {_TS} >= {{since:Float64}} AND {_TS} <= {{until:Float64}} "
            "GROUP BY rack, b ORDER BY rack, b",
            {"nodes": list(nodes), "since": float(since), "until": float(until), "bin": float(bin_s)})
        return [(str(r), int(b), float(m), float(x), int(c)) for r, b, m, x, c in res.rows]

    def breaker_history(self, name: str) -> list[dict[str, Any]]:
        """Every stored version of the breaker ``name`` (``open``, ``tripped_ts``, ``reset_ts``,
        ``reason``, ``version``), oldest first."""
        return self.query("SELECT open, toFloat64(tripped_ts) AS tripped_ts, toFloat64(reset_ts) AS reset_ts, "
                          "reason, version FROM breaker WHERE name = {n:String} ORDER BY version",
                          {"n": name}).dicts()

    # ================================================================ long ranges: the 1-minute rollup
    # ``gpu_samples_1m`` (007_samples_at_scale.sql) per GPU per minute; ranges longer than
    # ROLLUP_AFTER_S read it, shorter ones the raw samples (``source`` "raw" / "rollup" forces one).
    # Both compute the same aggregates the same way (bfloat16 quantiles, NaN = not reported skipped),
    # so a range answers the same from either, to the minute: the rollup counts whole minutes.
    def rack_temperature(self, *, since: float, until: float,
                         source: str = "auto") -> list[tuple[str, float, float, float]]:
        """``(rack, minute start s, mean temp_c, max temp_c)`` per rack per minute, ``since <= ts < until``."""
        if self._rollup(since, until, source):
            sql = (f"SELECT rack, toUnixTimestamp(minute) AS m, avgMerge(temp_c_avg) AS mean, "
                   f"{_dec('max(temp_c_max)')} AS hi FROM gpu_samples_1m WHERE {_MINUTES} "
                   "GROUP BY rack, m ORDER BY rack, m")
        else:
            sql = (f"SELECT rack, toUnixTimestamp(toStartOfMinute(ts)) AS m, avg({_nn('temp_c')}) AS mean, "
                   f"{_dec('max(' + _nn('temp_c') + ')')} AS hi FROM gpu_samples WHERE {_SPAN} "
                   "GROUP BY rack, m ORDER BY rack, m")
        res = self.query(sql, _span(since, until))
        return [(str(r), float(m), _float(mean), _float(hi)) for r, m, mean, hi in res.rows]

    def hot_gpus(self, *, since: float, until: float, limit: int = 20,
                 source: str = "auto") -> list[dict[str, Any]]:
        """The ``limit`` GPUs with the highest p99 temperature over ``since <= ts < until``: ``node``,
        ``gpu``, ``p50_temp_c``, ``p99_temp_c``, ``max_temp_c``, ``samples``; hottest first."""
        if self._rollup(since, until, source):
            sql = ("SELECT node, gpu, quantilesBFloat16Merge(0.5, 0.9, 0.99)(temp_c_q) AS q, "
                   f"{_dec('max(temp_c_max)')} AS max_temp_c, sum(samples) AS samples FROM gpu_samples_1m "
                   f"WHERE {_MINUTES} GROUP BY node, gpu")
        else:
            sql = (f"SELECT node, gpu, quantilesBFloat16(0.5, 0.9, 0.99)({_nn('temp_c')}) AS q, "
                   f"{_dec('max(' + _nn('temp_c') + ')')} AS max_temp_c, count() AS samples FROM gpu_samples "
                   f"WHERE {_SPAN} GROUP BY node, gpu")
        res = self.query(f"SELECT node, gpu, {_dec('q[1]')} AS p50_temp_c, {_dec('q[3]')} AS p99_temp_c, "
                         f"max_temp_c, samples FROM ({sql}) ORDER BY p99_temp_c DESC, max_temp_c DESC, node, gpu "
                         "LIMIT {limit:UInt32}", {**_span(since, until), "limit": int(limit)})
        return res.dicts()

    def gpu_minutes(self, node: str, gpu: int, *, since: float, until: float,
                    source: str = "auto") -> list[dict[str, Any]]:
        """One GPU per minute over ``since <= ts < until``, oldest first: ``minute`` (s), ``samples``,
        ``<f>_min`` / ``<f>_max`` / ``<f>_avg`` / ``<f>_p99`` of temp_c, power_w, sm_clock_mhz and
        util_pct, and ``clock_reasons`` (the OR of the minute's reasons)."""
        gauges = ("temp_c", "power_w", "sm_clock_mhz", "util_pct")
        if self._rollup(since, until, source):
            parts = [f"{_dec(f'min({g}_min)')} AS {g}_min, {_dec(f'max({g}_max)')} AS {g}_max, "
                     f"avgMerge({g}_avg) AS {g}_avg, "
                     f"{_dec(f'quantilesBFloat16Merge(0.5, 0.9, 0.99)({g}_q)[3]')} AS {g}_p99" for g in gauges]
            sql = (f"SELECT toUnixTimestamp(minute) AS minute, sum(samples) AS samples, {', '.join(parts)}, "
                   "groupBitOr(clock_reasons_or) AS clock_reasons FROM gpu_samples_1m "
                   f"WHERE node = {{node:String}} AND gpu = {{gpu:UInt16}} AND {_MINUTES} "
                   "GROUP BY minute ORDER BY minute")
        else:
            parts = [f"{_dec(f'min({_nn(g)})')} AS {g}_min, {_dec(f'max({_nn(g)})')} AS {g}_max, "
                     f"avg({_nn(g)}) AS {g}_avg, "
                     f"{_dec(f'quantilesBFloat16(0.5, 0.9, 0.99)({_nn(g)})[3]')} AS {g}_p99" for g in gauges]
            sql = (f"SELECT toUnixTimestamp(toStartOfMinute(ts)) AS minute, count() AS samples, {', '.join(parts)}, "
                   "groupBitOr(toUInt64(if(isNaN(clock_reasons), 0, clock_reasons))) AS clock_reasons FROM gpu_samples "
                   f"WHERE node = {{node:String}} AND gpu = {{gpu:UInt16}} AND {_SPAN} GROUP BY minute ORDER BY minute")
        return self.query(sql, {**_span(since, until), "node": node, "gpu": int(gpu)}).dicts()

    @staticmethod
    def _rollup(since: float, until: float, source: str) -> bool:
        if source not in ("auto", "raw", "rollup"):
            raise ConfigError(f"source must be 'auto', 'raw' or 'rollup', got {source!r}")
        return source == "rollup" or (source == "auto" and until - since > ROLLUP_AFTER_S)

    # ================================================================ storage accounting (bench/store_scale.py)
    def optimize_final(self, table: str) -> None:
        """Merge every part of ``table`` (``OPTIMIZE TABLE ... FINAL``): what compression gives at rest."""
        self.command(f"OPTIMIZE TABLE {_table_name(table)} FINAL")

    def wide_parts(self, table: str) -> None:
        """Store ``table``'s new parts column by column however small (``min_bytes_for_wide_part = 0``),
        so :meth:`column_bytes` sizes every column: a small part is compact and has no per-column sizes."""
        self.command(f"ALTER TABLE {_table_name(table)} MODIFY SETTING min_bytes_for_wide_part = 0")

    def column_bytes_as(self, column_type: str, values: Any) -> int:
        """Compressed bytes of ``values`` stored, in the order given, as one column of ``column_type``
        (a type with its codec, e.g. ``Float32 CODEC(ZSTD(6))``): what another type would cost."""
        if not _COLUMN_TYPE.fullmatch(column_type):
            raise ConfigError(f"not a column type: {column_type!r}")
        self.command("DROP TABLE IF EXISTS what_if_column")
        self.command(f"CREATE TABLE what_if_column (v {column_type}) ENGINE = MergeTree ORDER BY tuple() "
                     "SETTINGS min_bytes_for_wide_part = 0")
        try:
            self.insert("what_if_column", {"v": values})
            self.optimize_final("what_if_column")
            return sum(compressed for compressed, _ in self.column_bytes("what_if_column").values())
        finally:
            self.command("DROP TABLE IF EXISTS what_if_column")

    def column_bytes(self, table: str) -> dict[str, tuple[int, int]]:
        """``column -> (compressed, uncompressed bytes)`` of ``table``'s active parts."""
        res = self.query("SELECT name, data_compressed_bytes, data_uncompressed_bytes FROM system.columns "
                         "WHERE database = currentDatabase() AND table = {t:String}", {"t": table})
        return {str(n): (int(c), int(u)) for n, c, u in res.rows}

    def table_rows(self, table: str) -> int:
        """Rows in ``table``'s active parts."""
        res = self.query("SELECT sum(rows) FROM system.parts WHERE database = currentDatabase() "
                         "AND table = {t:String} AND active", {"t": table})
        return int(res.rows[0][0] or 0) if res.rows else 0


_COLUMN_TYPE = re.compile(r"[A-Za-z0-9_]+(\(\d+\))?( CODEC\([A-Za-z0-9_(), ]+\))?")

ROLLUP_AFTER_S = 3600.0
"""Ranges of samples longer than this (seconds) are read from the 1-minute rollup ``gpu_samples_1m``."""
_SPAN = ("ts >= fromUnixTimestamp64Milli(toInt64({since_ms:Int64})) "
         "AND ts < fromUnixTimestamp64Milli(toInt64({until_ms:Int64}))")
_MINUTES = ("minute >= toStartOfMinute(fromUnixTimestamp64Milli(toInt64({since_ms:Int64}))) "
            "AND minute < fromUnixTimestamp64Milli(toInt64({until_ms:Int64}))")


def _latest_table(source: str) -> str:
    """Where the latest sample of each GPU is read: its own table, or every raw sample."""
    if source not in ("latest", "raw"):
        raise ConfigError(f"source must be 'latest' or 'raw', got {source!r}")
    return "gpu_latest" if source == "latest" else "gpu_samples"


def _span(since: float, until: float) -> dict[str, Any]:
    return {"since_ms": int(round(float(since) * 1000)), "until_ms": int(round(float(until) * 1000))}


def _nn(column: str) -> str:
    """A gauge with NaN (not reported) as NULL, so aggregates skip it as the rollup does."""
    return f"if(isNaN({column}), NULL, {column})"


def _float(value: Any) -> float:
    return float("nan") if value is None else float(value)


def _table_name(table: str) -> str:
    if not table.replace("_", "a").isalnum() or not table[:1].isalpha():
        raise ConfigError(f"not a table name: {table!r}")
    return table


def _filters(**conds: Any) -> tuple[str, dict[str, Any]]:
    clauses: list[str] = []
    params: dict[str, Any] = {}
    for name, value in conds.items():
        if value is None:
            continue
        if name == "since":
            clauses.append("ts_s >= {since:Float64}")
        elif name == "until":
            clauses.append("ts_s < {until:Float64}")
        else:
            clauses.append(f"{name} = {{{name}:String}}")
            value = str(value)
        params[name] = value
    return ("WHERE " + " AND ".join(clauses) if clauses else ""), params


def _limit(limit: int | None) -> str:
    if limit is None:
        return ""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ConfigError(f"limit must be a non-negative integer, got {limit!r}")
    return f" LIMIT {limit}"
