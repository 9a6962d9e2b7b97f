"""The report's named queries and the long-range ones (:class:`~fleethealth.store.protocol.ApiStore`,
with :mod:`~fleethealth.store.queries.api`): aggregates for ``fleethealth report``'s plots, and the
range queries that read the coarsest rollup that answers their range (``gpu_samples_rack_1m``,
``gpu_samples_1h``, ``gpu_samples_1m``; :meth:`ReportQueries.range_table`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fleethealth.errors import ConfigError
from fleethealth.store.queries.sql import TS, QueriesBase, dec

__all__ = ["ReportQueries", "ROLLUP_AFTER_S"]

ROLLUP_AFTER_S = 3600.0
"""Ranges of samples longer than this (seconds) are read from the rollups in whole minutes, whatever
their ends; a shorter range is read from them only when it starts and ends on whole minutes."""
_SPAN = ("ts >= fromUnixTimestamp64Milli(toInt64({since_ms:Int64})) "
         "AND ts < fromUnixTimestamp64Milli(toInt64({until_ms:Int64}))")
_MINUTES = ("minute >= toStartOfMinute(fromUnixTimestamp64Milli(toInt64({since_ms:Int64}))) "
            "AND minute < fromUnixTimestamp64Milli(toInt64({until_ms:Int64}))")


class ReportQueries(QueriesBase):
    """What the report and the long-range views read."""

    # ================================================================ report views (``fleethealth report``)
    # Aggregated for plotting: a heatmap cell per (rank, step bin), a temperature cell per (rack, time bin).
    def report_jobs(self) -> list[tuple[str, int]]:
        """``(job, distinct steps)`` of every job with step rows, most steps first."""
        res = self.query("SELECT job, uniqExact(step) AS steps FROM rank_steps GROUP BY job ORDER BY steps DESC, job")
        return [(str(job), int(n)) for job, n in res.rows]

    def report_job_span(self, job: str) -> tuple[int, int, float, float] | None:
        """``(first step, last step, first ts, last ts)`` of ``job``'s step rows, or ``None``."""
        res = self.query(f"SELECT min(step), max(step), min({TS}), max({TS}), count() FROM rank_steps "
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
                f"/ {{bin:Float64}}))) AS b, avgMerge(temp_c_avg), {dec('max(temp_c_max)')}, "
                "groupBitOr(clock_reasons_or) FROM gpu_samples_1m WHERE node IN {nodes:Array(String)} "
                f"AND {_MINUTES} GROUP BY rack, b ORDER BY rack, b",
                {"nodes": list(nodes), "since": float(since), "bin": float(bin_s), **_span(since, until + 60.0)})
            return [(str(r), int(b), float(m), float(x), int(c)) for r, b, m, x, c in res.rows]
        res = self.query(
            f"SELECT rack, toInt64(floor(({TS} - {{since:Float64}}) / {{bin:Float64}})) AS b, avg(temp_c), "
            f"{dec('max(temp_c)')}, groupBitOr(toUInt64(if(isNaN(clock_reasons), 0, clock_reasons))) FROM gpu_samples "
            f"WHERE node IN {{nodes:Array(String)}} AND {TS} >= {{since:Float64}} AND {TS} <= {{until:Float64}} "
            "GROUP BY rack, b ORDER BY rack, b",
            {"nodes": list(nodes), "since": float(since), "until": float(until), "bin": float(bin_s)})
        return [(str(r), int(b), float(m), float(x), int(c)) for r, b, m, x, c in res.rows]

    def breaker_history(self, name: str) -> list[dict[str, Any]]:
        """Every stored version of the breaker ``name`` (``open``, ``tripped_ts``, ``reset_ts``,
        ``reason``, ``version``), oldest first."""
        return self.query("SELECT open, toFloat64(tripped_ts) AS tripped_ts, toFloat64(reset_ts) AS reset_ts, "
                          "reason, version FROM breaker WHERE name = {n:String} ORDER BY version",
                          {"n": name}).dicts()

    # ================================================================ long ranges: the rollups
    # gpu_samples_1m (007) per GPU per minute, and cascaded from it (013) gpu_samples_1h per GPU per hour
    # and gpu_samples_rack_1m per rack per minute. Each query reads the coarsest table that answers the
    # range at its resolution (:meth:`range_table`); ``source`` "raw" / "rollup" forces the raw samples
    # or the coarsest rollup. All compute the same aggregates the same way (bfloat16 quantiles over the
    # Float32 the rollups hold, NaN = not reported skipped), so a range answers the same from any of
    # them, to the minute: a rollup counts whole minutes.
    def range_table(self, query: str, *, since: float, until: float, source: str = "auto") -> str:
        """The table the named range query ``query`` (``rack_temperature``, ``hot_gpus``, ``gpu_minutes``)
        reads for ``since <= ts < until``: its coarsest rollup whose grain the range is a whole number
        of (a range longer than :data:`ROLLUP_AFTER_S` may start and end mid-minute: it is read in whole
        minutes), else ``gpu_samples``. ``hot_gpus`` reads ``gpu_samples_1h`` for the whole hours of
        the range and the minute rollup for the minutes at either end."""
        if source not in ("auto", "raw", "rollup"):
            raise ConfigError(f"source must be 'auto', 'raw' or 'rollup', got {source!r}")
        try:
            tables = _RANGE_TABLES[query]
        except KeyError:
            raise ConfigError(f"no named range query {query!r} (known: {', '.join(_RANGE_TABLES)})") from None
        if source == "raw":
            return "gpu_samples"
        if source == "rollup":
            return tables[0]
        minutes = until - since > ROLLUP_AFTER_S or (_whole(since, 60.0) and _whole(until, 60.0))
        if not minutes:
            return "gpu_samples"
        if tables[0] == "gpu_samples_1h":
            lo, hi = _hours(since, until)
            return tables[0] if hi > lo else tables[1]
        return tables[0]

    def rack_temperature(self, *, since: float, until: float,
                         source: str = "auto") -> list[tuple[str, float, float, float]]:
        """``(rack, minute start s, mean temp_c, max temp_c)`` per rack per minute, ``since <= ts < until``."""
        if self.range_table("rack_temperature", since=since, until=until, source=source) != "gpu_samples":
            sql = (f"SELECT rack, toUnixTimestamp(minute) AS m, avgMerge(temp_c_avg) AS mean, "
                   f"{dec('max(temp_c_max)')} AS hi FROM gpu_samples_rack_1m WHERE {_MINUTES} "
                   "GROUP BY rack, m ORDER BY rack, m")
        else:
            sql = (f"SELECT rack, toUnixTimestamp(toStartOfMinute(ts)) AS m, avg({_nn('temp_c')}) AS mean, "
                   f"{dec('max(' + _nn('temp_c') + ')')} AS hi FROM gpu_samples WHERE {_SPAN} "
                   "GROUP BY rack, m ORDER BY rack, m")
        res = self.query(sql, _span(since, until))
        return [(str(r), float(m), _float(mean), _float(hi)) for r, m, mean, hi in res.rows]

    def hot_gpus(self, *, since: float, until: float, limit: int = 20,
                 source: str = "auto") -> list[dict[str, Any]]:
        """The ``limit`` GPUs with the highest p99 temperature over ``since <= ts < until``: ``node``,
        ``gpu``, ``p50_temp_c``, ``p99_temp_c``, ``max_temp_c``, ``samples``; hottest first."""
        table = self.range_table("hot_gpus", since=since, until=until, source=source)
        params: dict[str, Any] = {**_span(since, until), "limit": int(limit)}
        if table == "gpu_samples":
            sql = (f"SELECT node, gpu, quantilesBFloat16(0.5, 0.9, 0.99)({_nn('temp_c')}) AS q, "
                   f"{dec('max(' + _nn('temp_c') + ')')} AS max_temp_c, count() AS samples FROM gpu_samples "
                   f"WHERE {_SPAN} GROUP BY node, gpu")
        else:  # whole hours from the hourly rollup, the minutes at either end from the minute one
            lo, hi = _hours(since, until) if table == "gpu_samples_1h" else (float(since), float(since))
            params.update(h0=int(lo), h1=int(hi))
            hours = "toDateTime({h0:Int64}) AND minute < toDateTime({h1:Int64})"
            parts = []
            if not (hi > lo and lo == float(since) and hi == float(until)):  # minutes outside the whole hours
                parts.append("SELECT node, gpu, temp_c_q AS q, temp_c_max AS x, samples AS n FROM gpu_samples_1m "
                             f"WHERE {_MINUTES} AND NOT (minute >= {hours})")
            if hi > lo:
                parts.append("SELECT node, gpu, temp_c_q AS q, temp_c_max AS x, samples AS n FROM gpu_samples_1h "
                             "WHERE hour >= toDateTime({h0:Int64}) AND hour < toDateTime({h1:Int64})")
            sql = ("SELECT node, gpu, quantilesBFloat16Merge(0.5, 0.9, 0.99)(q) AS q, "
                   f"{dec('max(x)')} AS max_temp_c, sum(n) AS samples FROM ({' UNION ALL '.join(parts)}) "
                   "GROUP BY node, gpu")
        res = self.query(f"SELECT node, gpu, {dec('q[1]')} AS p50_temp_c, {dec('q[3]')} AS p99_temp_c, "
                         f"max_temp_c, samples FROM ({sql}) ORDER BY p99_temp_c DESC, max_temp_c DESC, node, gpu "
                         "LIMIT {limit:UInt32}", params)
        return res.dicts()

    def gpu_minutes(self, node: str, gpu: int, *, since: float, until: float,
                    source: str = "auto") -> list[dict[str, Any]]:
        """One GPU per minute over ``since <= ts < until``, oldest first: ``minute`` (s), ``samples``,
        ``<f>_min`` / ``<f>_max`` / ``<f>_avg`` / ``<f>_p99`` of temp_c, power_w, sm_clock_mhz and
        util_pct, and ``clock_reasons`` (the OR of the minute's reasons)."""
        gauges = ("temp_c", "power_w", "sm_clock_mhz", "util_pct")
        if self.range_table("gpu_minutes", since=since, until=until, source=source) != "gpu_samples":
            parts = [f"{dec(f'min({g}_min)')} AS {g}_min, {dec(f'max({g}_max)')} AS {g}_max, "
                     f"avgMerge({g}_avg) AS {g}_avg, "
                     f"{dec(f'quantilesBFloat16Merge(0.5, 0.9, 0.99)({g}_q)[3]')} AS {g}_p99" for g in gauges]
            sql = (f"SELECT toUnixTimestamp(minute) AS minute, sum(samples) AS samples, {', '.join(parts)}, "
                   "groupBitOr(clock_reasons_or) AS clock_reasons FROM gpu_samples_1m "
                   f"WHERE node = {{node:String}} AND gpu = {{gpu:UInt16}} AND {_MINUTES} "
                   "GROUP BY minute ORDER BY minute")
        else:
            parts = [f"{dec(f'min({_nn(g)})')} AS {g}_min, {dec(f'max({_nn(g)})')} AS {g}_max, "
                     f"avg({_nn(g)}) AS {g}_avg, "
                     f"{dec(f'quantilesBFloat16(0.5, 0.9, 0.99)({_nn(g)})[3]')} AS {g}_p99" for g in gauges]
            sql = (f"SELECT toUnixTimestamp(toStartOfMinute(ts)) AS minute, count() AS samples, {', '.join(parts)}, "
                   "groupBitOr(toUInt64(if(isNaN(clock_reasons), 0, clock_reasons))) AS clock_reasons FROM gpu_samples "
                   f"WHERE node = {{node:String}} AND gpu = {{gpu:UInt16}} AND {_SPAN} GROUP BY minute ORDER BY minute")
        return self.query(sql, {**_span(since, until), "node": node, "gpu": int(gpu)}).dicts()


_RANGE_TABLES: dict[str, tuple[str, ...]] = {
    "rack_temperature": ("gpu_samples_rack_1m",),
    "hot_gpus": ("gpu_samples_1h", "gpu_samples_1m"),
    "gpu_minutes": ("gpu_samples_1m",),
}
"""Each named range query's rollups, coarsest first (``deploy/clickhouse/007`` and ``013``)."""


def _whole(t: float, grain: float) -> bool:
    return float(t) % grain == 0.0


def _hours(since: float, until: float) -> tuple[float, float]:
    """The whole hours ``[lo, hi)`` inside the minutes a rollup reads for ``[since, until)``."""
    first_minute = math.floor(float(since) / 60.0) * 60.0
    return math.ceil(first_minute / 3600.0) * 3600.0, math.floor(float(until) / 3600.0) * 3600.0


def _span(since: float, until: float) -> dict[str, Any]:
    return {"since_ms": int(round(float(since) * 1000)), "until_ms": int(round(float(until) * 1000))}


def _nn(column: str) -> str:
    """A gauge with NaN (not reported) as NULL, so aggregates skip it as the rollup does, and as the
    Float32 the rollup's states hold (its minute view casts the same way)."""
    return f"if(isNaN({column}), NULL, toFloat32({column}))"


def _float(value: Any) -> float:
    return float("nan") if value is None else float(value)
