"""What the API reads from the store, as plain records: no HTTP here, only SQL and arithmetic.

Each function takes a :class:`~fleethealth.store.Store` (anything with ``query`` / ``insert``) and
returns JSON-ready objects (``dict`` rows with named fields, documented by the response models
in :mod:`fleethealth.api.models`). Unknown nodes and jobs raise :class:`NotFound`; the routes
turn it into 404.

Times are event time in epoch seconds (``ts_s`` columns, or ``ts`` converted exactly). The step
time of a synchronous job is the slowest rank's pre-collective compute time of that step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC
from typing import Any

import numpy as np
import orjson

from fleethealth.errors import FleetHealthError
from fleethealth.policy import quarantine as qb
from fleethealth.policy.goodput import Interruption, Timeline, goodput, ideal_step_time, timeline
from fleethealth.schema import Event, EventKind

__all__ = [
    "NotFound",
    "node_exists",
    "job_exists",
    "recommendations",
    "recommendation",
    "ack",
    "nodes",
    "node_detail",
    "run_health",
    "run_timeline",
    "run_events",
    "MAX_STEPS",
]

MAX_STEPS = 200_000
"""A run's health reads at most this many most recent steps."""

_TS = "toFloat64(toUnixTimestamp64Milli(ts)) / 1000"
_REC_COLUMNS = ("id", "action", "node", "job", "reason", "guard", "ts_s", "finding_id", "dry_run", "evidence",
                "acked_at", "acked_by")
_EVENT_COLUMNS = "id, node, ts_s, kind, job, gpu, rank, step, code, message, data"
_EVENT_KINDS = frozenset(k.value for k in EventKind)


class NotFound(FleetHealthError, LookupError):
    """The node, job or recommendation asked for is not in the store."""


def _json(text: str) -> Any:
    if not text:
        return {}
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return {"unparsed": text}


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _epoch(value: Any) -> float | None:
    """A DateTime64 value (naive UTC or aware datetime) as epoch seconds."""
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        if getattr(value, "tzinfo", None) is None:
            value = value.replace(tzinfo=UTC)
        return float(value.timestamp())
    return float(value)


# ---------------------------------------------------------------- existence
def node_exists(store: Any, node: str) -> bool:
    sql = " UNION ALL ".join(
        f"SELECT 1 FROM (SELECT node FROM {t} WHERE node = {{node:String}} LIMIT 1)"
        for t in ("gpu_samples", "events", "findings", "recommendations", "quarantine", "rank_steps"))
    return bool(store.query(sql, {"node": node}).rows)


def job_exists(store: Any, job: str) -> bool:
    sql = " UNION ALL ".join(
        f"SELECT 1 FROM (SELECT job FROM {t} WHERE job = {{job:String}} LIMIT 1)"
        for t in ("rank_steps", "events", "findings", "recommendations"))
    return bool(store.query(sql, {"job": job}).rows)


# ---------------------------------------------------------------- recommendations
def _rec_row(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "action": row["action"], "node": row["node"], "job": row["job"] or None,
            "reason": row["reason"], "guard": row["guard"], "ts": float(row["ts_s"]),
            "finding_id": row["finding_id"] or None, "dry_run": bool(row["dry_run"]),
            "evidence": _json(row["evidence"]), "acked_at": _epoch(row["acked_at"]),
            "acked_by": row["acked_by"] or None}


def recommendations(store: Any, *, since: float | None = None, node: str | None = None, job: str | None = None,
                    action: str | None = None, guard: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """Recommendations, newest first, filtered by event time, node, job, action and guard."""
    where, params = ["1"], {"limit": int(limit)}
    for name, value, cond in (("since", since, "ts_s >= {since:Float64}"), ("node", node, "node = {node:String}"),
                              ("job", job, "job = {job:String}"), ("action", action, "action = {action:String}"),
                              ("guard", guard, "guard = {guard:String}")):
        if value is not None:
            where.append(cond)
            params[name] = value
    res = store.query(f"SELECT {', '.join(_REC_COLUMNS)} FROM recommendations FINAL WHERE {' AND '.join(where)} "
                      "ORDER BY ts_s DESC, id LIMIT {limit:UInt32}", params)
    return [_rec_row(r) for r in res.dicts()]


def _rec_raw(store: Any, rec_id: str) -> dict[str, Any]:
    cols = ("id", "action", "node", "job", "reason", "guard", "ts", "ts_s", "finding_id", "dry_run", "evidence",
            "acked_at", "acked_by")
    res = store.query(f"SELECT {', '.join(cols)} FROM recommendations FINAL WHERE id = {{id:String}} "
                      "ORDER BY ts_s DESC LIMIT 1", {"id": rec_id})
    rows = res.dicts()
    if not rows:
        raise NotFound(f"no recommendation with id {rec_id!r}")
    return rows[0]


def recommendation(store: Any, rec_id: str) -> dict[str, Any]:
    return _rec_row(_rec_raw(store, rec_id))


def ack(store: Any, rec_id: str, by: str, now: float) -> tuple[dict[str, Any], bool]:
    """Acknowledge a recommendation; return it and whether this call acknowledged it.

    The row is written again with ``acked_at`` / ``acked_by`` set (the table keeps the last
    version of a row); an acknowledged recommendation keeps its first acknowledgement.
    """
    row = _rec_raw(store, rec_id)
    if row["acked_at"] is not None:
        return _rec_row(row), False
    stamped = {**row, "ts": float(row["ts_s"]), "acked_at": float(now), "acked_by": by}
    store.insert("recommendations", {k: [v] for k, v in stamped.items()})
    return _rec_row(stamped), True


# ---------------------------------------------------------------- nodes
def nodes(store: Any, *, limit: int = 1000) -> list[dict[str, Any]]:
    """Every node the store has heard of, with its latest telemetry and what is open against it."""
    latest = store.query(
        f"SELECT node, any(rack) AS rack, count() AS gpus, max(last_ts) AS last_seen, max(temp_c) AS max_temp_c "
        f"FROM (SELECT node, gpu, any(rack) AS rack, max({_TS}) AS last_ts, argMax(temp_c, ts) AS temp_c "
        "FROM gpu_samples GROUP BY node, gpu) GROUP BY node").dicts()
    findings = dict(store.query("SELECT node, count() FROM findings FINAL GROUP BY node").rows)
    recs = dict(store.query("SELECT node, countIf(acked_at IS NULL) FROM recommendations FINAL "
                            "GROUP BY node").rows)
    held = {q.node for q in qb.quarantined(store)}
    out: dict[str, dict[str, Any]] = {}
    for row in latest:
        out[row["node"]] = {"node": row["node"], "rack": row["rack"] or None, "gpus": int(row["gpus"]),
                            "last_seen": _finite(row["last_seen"]), "max_temp_c": _finite(row["max_temp_c"])}
    for name in set(findings) | set(recs) | held:
        out.setdefault(name, {"node": name, "rack": None, "gpus": 0, "last_seen": None, "max_temp_c": None})
    for name, item in out.items():
        item["findings"] = int(findings.get(name, 0))
        item["open_recommendations"] = int(recs.get(name, 0))
        item["quarantined"] = name in held
    return [out[name] for name in sorted(out)][:limit]


def _events(store: Any, where: str, params: Mapping[str, Any], limit: int) -> list[Event]:
    res = store.query(f"SELECT {_EVENT_COLUMNS} FROM events FINAL WHERE {where} ORDER BY ts_s DESC, id "
                      f"LIMIT {int(limit)}", params)
    out = []
    for r in res.dicts():
        if r["kind"] not in _EVENT_KINDS:
            continue  # written by a newer version: not this build's to show
        out.append(Event(node=r["node"], ts=float(r["ts_s"]), kind=EventKind(r["kind"]), job=r["job"] or None,
                         gpu=r["gpu"], rank=r["rank"], step=r["step"], code=r["code"], message=r["message"],
                         data=_json(r["data"])))
    return out


def _event_obj(ev: Event) -> dict[str, Any]:
    return {"id": ev.id, **{k: v for k, v in ev.to_obj().items() if k != "v"}}


def node_detail(store: Any, node: str, *, limit: int = 50) -> dict[str, Any]:
    """One node: latest sample of each GPU, recent findings, recommendations, events, quarantine."""
    if not node_exists(store, node):
        raise NotFound(f"unknown node {node!r}")
    gpus = store.query(
        f"SELECT gpu, argMax(rack, ts) AS rack, max({_TS}) AS last_ts, argMax(temp_c, ts) AS temp_c, "
        "argMax(power_w, ts) AS power_w, argMax(sm_clock_mhz, ts) AS sm_clock_mhz, "
        "argMax(util_pct, ts) AS util_pct, argMax(clock_reasons, ts) AS clock_reasons, "
        "argMax(ecc_dbe_volatile, ts) AS ecc_dbe_volatile, argMax(nvlink_links_up, ts) AS nvlink_links_up "
        "FROM gpu_samples WHERE node = {node:String} GROUP BY gpu ORDER BY gpu", {"node": node}).dicts()
    findings = store.query(
        "SELECT id, kind, detector, job, gpu, rank, step, ts_s, diagnosis, z, slowdown, probability, evidence "
        "FROM findings FINAL WHERE node = {node:String} ORDER BY ts_s DESC, id LIMIT {limit:UInt32}",
        {"node": node, "limit": limit}).dicts()
    record = qb.record(store, node)
    return {
        "node": node,
        "rack": gpus[0]["rack"] if gpus else None,
        "gpus": [{k: (_finite(v) if k not in ("gpu", "rack") else v) for k, v in g.items() if k != "rack"}
                 for g in gpus],
        "findings": [{**{k: v for k, v in f.items() if k not in ("ts_s", "evidence", "job")},
                      "job": f["job"] or None, "ts": float(f["ts_s"]), "z": _finite(f["z"]),
                      "slowdown": _finite(f["slowdown"]), "probability": _finite(f["probability"]),
                      "evidence": _json(f["evidence"])} for f in findings],
        "recommendations": recommendations(store, node=node, limit=limit),
        "events": [_event_obj(e) for e in _events(store, "node = {node:String}", {"node": node}, limit)],
        "quarantine": None if record is None else record.to_obj(),
        "quarantine_history": [{"ts": h.ts, "action": h.action, "detail": h.detail}
                               for h in qb.history(store, node)][-limit:],
    }


# ---------------------------------------------------------------- runs
def _step_times(store: Any, job: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, step_s, end_ts) of the run's most recent :data:`MAX_STEPS` steps, oldest first."""
    res = store.query(
        f"SELECT step, max(compute_s) AS step_s, max({_TS}) AS end_ts FROM rank_steps WHERE job = {{job:String}} "
        "GROUP BY step ORDER BY step DESC LIMIT {limit:UInt32}", {"job": job, "limit": MAX_STEPS})
    rows = res.rows[::-1]
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    arr = np.asarray(rows, dtype=np.float64)
    return arr[:, 0].astype(np.int64), arr[:, 1], arr[:, 2]


def _slowest_rank(store: Any, job: str, last_step: int, window: int) -> dict[str, Any] | None:
    """The rank with the highest median compute time over the last ``window`` steps, and its ratio
    to the median rank (medians, so a checkpoint stall shared by all ranks does not dilute it)."""
    rows = store.query(
        "SELECT rank, any(node) AS node, any(gpu) AS gpu, quantileExact(0.5)(compute_s) AS mean_s FROM rank_steps "
        "WHERE job = {job:String} AND step > {lo:Int64} GROUP BY rank ORDER BY mean_s DESC",
        {"job": job, "lo": last_step - window}).dicts()
    if not rows:
        return None
    median = float(np.median([r["mean_s"] for r in rows]))
    top = rows[0]
    return {"rank": int(top["rank"]), "node": top["node"], "gpu": int(top["gpu"]),
            "median_compute_s": float(top["mean_s"]), "ratio_to_median": float(top["mean_s"]) / median
            if median > 0 else None, "window_steps": window}


def run_events(store: Any, job: str, kind: EventKind, limit: int = 10_000) -> list[Event]:
    return _events(store, "job = {job:String} AND kind = {kind:String}", {"job": job, "kind": kind.value}, limit)


def _timeline(store: Any, job: str, step_s: np.ndarray, end_ts: np.ndarray) -> Timeline:
    events = run_events(store, job, EventKind.INTERRUPTION)
    times = [*end_ts.tolist(), *(e.ts for e in events)]
    start = min(times)
    end = max(max(times), start + 1e-3)
    ideal = ideal_step_time(step_s) if step_s.size else None
    return timeline(job, events, start - (float(step_s[0]) if step_s.size else 0.0), end, ideal_step_s=ideal)


def run_timeline(store: Any, job: str) -> dict[str, Any]:
    """Every interruption of the run with cause, node, detector, lost steps and the MTTR phases."""
    if not job_exists(store, job):
        raise NotFound(f"unknown job {job!r}")
    _, step_s, end_ts = _step_times(store, job)
    if not step_s.size and not run_events(store, job, EventKind.INTERRUPTION, limit=1):
        return {"job": job, "start": None, "end": None, "wall_s": 0.0, "interruptions": [], "restart_s": 0.0,
                "lost_steps": 0, "lost_work_s": 0.0, "overhead": 0.0, "ettr": None, "phase_totals": {},
                "binding_phase": None, "nodes": {}}
    return _timeline(store, job, step_s, end_ts).to_obj()


def _sdc_summary(store: Any, job: str) -> dict[str, Any]:
    checks = run_events(store, job, EventKind.SDC_CHECK, limit=1)
    counts = store.query(
        "SELECT count() AS n, countIf(JSONExtractBool(data, 'passed') = 0) AS failed FROM events FINAL "
        "WHERE job = {job:String} AND kind = 'sdc_check'", {"job": job}).dicts()[0]
    last = checks[0] if checks else None
    status = "none" if last is None else ("pass" if last.data.get("passed") else "fail")
    return {"last": None if last is None else _event_obj(last), "status": status, "count": int(counts["n"]),
            "failed": int(counts["failed"])}


def run_health(store: Any, job: str, *, slow_window: int = 100) -> dict[str, Any]:
    """Step time p50/max, slowest rank, goodput, interruptions, quarantined nodes, last SDC check."""
    if not job_exists(store, job):
        raise NotFound(f"unknown job {job!r}")
    steps, step_s, end_ts = _step_times(store, job)
    out: dict[str, Any] = {"job": job, "steps": int(steps.size), "first_step": None, "last_step": None,
                           "step_time_p50": None, "step_time_max": None, "slowest_rank": None, "goodput": None,
                           "ettr": None}
    if steps.size:
        tl = _timeline(store, job, step_s, end_ts)
        out.update(first_step=int(steps[0]), last_step=int(steps[-1]),
                   step_time_p50=float(np.median(step_s)), step_time_max=float(step_s.max()),
                   slowest_rank=_slowest_rank(store, job, int(steps[-1]), slow_window),
                   goodput=goodput(step_s, overhead=tl.overhead).to_obj(), ettr=tl.ettr)
    interruptions = [Interruption.from_event(e).to_obj()
                     for e in sorted(run_events(store, job, EventKind.INTERRUPTION), key=lambda e: e.ts)]
    placed = {r[0] for r in store.query("SELECT DISTINCT node FROM rank_steps WHERE job = {job:String}",
                                        {"job": job}).rows}
    out["interruptions"] = interruptions
    out["quarantined_nodes"] = [q.to_obj() for q in qb.quarantined(store)
                                if job in q.runs_affected or q.node in placed]
    out["sdc_checks"] = _sdc_summary(store, job)
    return out
