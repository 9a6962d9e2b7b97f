"""The HTTP API's named queries (:class:`~fleethealth.store.protocol.ApiStore`, with
:mod:`~fleethealth.store.queries.report`): the core tables read back as schema messages (``FINAL``:
one row per natural key even before a merge), the node and run views, the acknowledgements, and the
spans of jobs the checkpoint interval reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fleethealth import schema
from fleethealth.errors import ConfigError
from fleethealth.schema import GPU_FIELDS, Event, EventKind, Finding, Recommendation, StepBatch, Telemetry
from fleethealth.store.columns import FLOAT32_FIELDS, decimal_floats, loads_lenient, row_object, segments
from fleethealth.store.queries.sql import TS, QueriesBase, dec

__all__ = ["ApiQueries"]

_REC_COLUMNS = ("id", "action", "node", "job", "reason", "guard", "ts_s", "finding_id", "dry_run", "evidence",
                "acked_at", "acked_by")
_EVENT_COLUMNS = "id, node, ts_s, kind, job, gpu, rank, step, code, message, data"
_EVENT_KINDS = frozenset(k.value for k in EventKind)


class ApiQueries(QueriesBase):
    """What the HTTP API reads (and its acknowledgements write)."""

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
            f"{dec('max(temp_c)')} AS max_temp_c "
            f"FROM (SELECT node, gpu, argMax(rack, ts) AS rack, max({TS}) AS last_ts, argMax(temp_c, ts) AS temp_c "
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
            f"SELECT gpu, argMax(rack, ts) AS rack, max({TS}) AS last_ts, {dec('argMax(temp_c, ts)')} AS temp_c, "
            f"{dec('argMax(power_w, ts)')} AS power_w, {dec('argMax(sm_clock_mhz, ts)')} AS sm_clock_mhz, "
            f"{dec('argMax(util_pct, ts)')} AS util_pct, argMax(clock_reasons, ts) AS clock_reasons, "
            "argMax(ecc_dbe_volatile, ts) AS ecc_dbe_volatile, "
            f"{dec('argMax(nvlink_links_up, ts)')} AS nvlink_links_up "
            f"FROM {_latest_table(source)} WHERE node = {{node:String}} GROUP BY gpu ORDER BY gpu",
            {"node": node}).dicts()

    def node_finding_rows(self, node: str, *, limit: int = 50) -> list[dict[str, Any]]:
        """The ``limit`` most recent finding rows of ``node``, newest first (``evidence`` as JSON text)."""
        return self.query(
            "SELECT id, kind, detector, job, gpu, rank, step, ts_s, diagnosis, z, slowdown, probability, evidence "
            "FROM findings FINAL WHERE node = {node:String} ORDER BY ts_s DESC, id LIMIT {limit:UInt32}",
            {"node": node, "limit": limit}).dicts()

    def job_step_times(self, job: str, *, limit: int, source: str = "rollup") -> list[tuple[Any, ...]]:
        """``(step, step_s, end_ts)`` of the ``limit`` most recent steps of ``job``, oldest first: the
        step time is the slowest rank's compute time, ``end_ts`` the latest rank's event time (s). Read
        from the per-step rollup ``job_steps`` (``deploy/clickhouse/014_job_steps.sql``: one row per
        step, the same maxima), or with ``source="raw"`` from every rank-step."""
        if source not in ("rollup", "raw"):
            raise ConfigError(f"source must be 'rollup' or 'raw', got {source!r}")
        if source == "rollup":
            sql = ("SELECT step, max(step_s) AS step_s, toFloat64(toUnixTimestamp64Milli(max(end_ts))) / 1000 "
                   "AS end_ts FROM job_steps WHERE job = {job:String} GROUP BY step ORDER BY step DESC "
                   "LIMIT {limit:UInt32}")
        else:
            sql = (f"SELECT step, max(compute_s) AS step_s, max({TS}) AS end_ts FROM rank_steps "
                   "WHERE job = {job:String} GROUP BY step ORDER BY step DESC LIMIT {limit:UInt32}")
        return self.query(sql, {"job": job, "limit": limit}).rows[::-1]

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


def _latest_table(source: str) -> str:
    """Where the latest sample of each GPU is read: its own table, or every raw sample."""
    if source not in ("latest", "raw"):
        raise ConfigError(f"source must be 'latest' or 'raw', got {source!r}")
    return "gpu_latest" if source == "latest" else "gpu_samples"


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
