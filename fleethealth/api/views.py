"""What the API reads from the store, as plain records: no HTTP and no SQL here, only arithmetic.

Each function takes a :class:`~fleethealth.store.StoreLike` (its named queries hold the SQL) and
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
from typing import TYPE_CHECKING, Any

import numpy as np

from fleethealth.errors import FleetHealthError
from fleethealth.policy import quarantine as qb
from fleethealth.policy.goodput import Interruption, Timeline, distinct_stops, goodput, ideal_step_time, timeline
from fleethealth.policy.interval import IntervalEstimator, advise
from fleethealth.schema import Event, EventKind
from fleethealth.store.columns import loads_lenient

if TYPE_CHECKING:
    from fleethealth.store.protocol import StoreLike

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


class NotFound(FleetHealthError, LookupError):
    """The node, job or recommendation asked for is not in the store."""


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
def node_exists(store: StoreLike, node: str) -> bool:
    return store.node_exists(node)


def job_exists(store: StoreLike, job: str) -> bool:
    return store.job_exists(job)


# ---------------------------------------------------------------- recommendations
def _rec_row(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "action": row["action"], "node": row["node"], "job": row["job"] or None,
            "reason": row["reason"], "guard": row["guard"], "ts": float(row["ts_s"]),
            "finding_id": row["finding_id"] or None, "dry_run": bool(row["dry_run"]),
            "evidence": loads_lenient(row["evidence"]), "acked_at": _epoch(row["acked_at"]),
            "acked_by": row["acked_by"] or None}


def recommendations(store: StoreLike, *, since: float | None = None, node: str | None = None, job: str | None = None,
                    action: str | None = None, guard: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """Recommendations, newest first, filtered by event time, node, job, action and guard."""
    rows = store.recommendation_rows(since=since, node=node, job=job, action=action, guard=guard, limit=limit)
    return [_rec_row(r) for r in rows]


def _rec_raw(store: StoreLike, rec_id: str) -> dict[str, Any]:
    row = store.recommendation_row(rec_id)
    if row is None:
        raise NotFound(f"no recommendation with id {rec_id!r}")
    return row


def recommendation(store: StoreLike, rec_id: str) -> dict[str, Any]:
    return _rec_row(_rec_raw(store, rec_id))


def ack(store: StoreLike, rec_id: str, by: str, now: float) -> tuple[dict[str, Any], bool]:
    """Acknowledge a recommendation; return it and whether this call acknowledged it.

    The row is written again with ``acked_at`` / ``acked_by`` set (the table keeps the last
    version of a row); an acknowledged recommendation keeps its first acknowledgement.
    """
    row = _rec_raw(store, rec_id)
    if row["acked_at"] is not None:
        return _rec_row(row), False
    stamped = {**row, "ts": float(row["ts_s"]), "acked_at": float(now), "acked_by": by}
    store.write_recommendation_row(stamped)
    return _rec_row(stamped), True


# ---------------------------------------------------------------- nodes
def nodes(store: StoreLike, *, limit: int = 1000) -> list[dict[str, Any]]:
    """Every node the store has heard of, with its latest telemetry and what is open against it."""
    latest = store.node_summaries()
    findings = store.finding_counts_by_node()
    recs = store.open_recommendations_by_node()
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


def _event_obj(ev: Event) -> dict[str, Any]:
    return {"id": ev.id, **{k: v for k, v in ev.to_obj().items() if k != "v"}}


def node_detail(store: StoreLike, node: str, *, limit: int = 50) -> dict[str, Any]:
    """One node: latest sample of each GPU, recent findings, recommendations, events, quarantine."""
    if not node_exists(store, node):
        raise NotFound(f"unknown node {node!r}")
    gpus = store.node_gpu_latest(node)
    findings = store.node_finding_rows(node, limit=limit)
    record = qb.record(store, node)
    return {
        "node": node,
        "rack": gpus[0]["rack"] if gpus else None,
        "gpus": [{k: (_finite(v) if k not in ("gpu", "rack") else v) for k, v in g.items() if k != "rack"}
                 for g in gpus],
        "findings": [{**{k: v for k, v in f.items() if k not in ("ts_s", "evidence", "job")},
                      "job": f["job"] or None, "ts": float(f["ts_s"]), "z": _finite(f["z"]),
                      "slowdown": _finite(f["slowdown"]), "probability": _finite(f["probability"]),
                      "evidence": loads_lenient(f["evidence"])} for f in findings],
        "recommendations": recommendations(store, node=node, limit=limit),
        "events": [_event_obj(e) for e in store.recent_events(node=node, limit=limit)],
        "quarantine": None if record is None else record.to_obj(),
        "quarantine_history": [{"ts": h.ts, "action": h.action, "detail": h.detail}
                               for h in qb.history(store, node)][-limit:],
    }


# ---------------------------------------------------------------- runs
def _step_times(store: StoreLike, job: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, step_s, end_ts) of the run's most recent :data:`MAX_STEPS` steps, oldest first."""
    rows = store.job_step_times(job, limit=MAX_STEPS)
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    arr = np.asarray(rows, dtype=np.float64)
    return arr[:, 0].astype(np.int64), arr[:, 1], arr[:, 2]


def _slowest_rank(store: StoreLike, job: str, last_step: int, window: int) -> dict[str, Any] | None:
    """The rank with the highest median compute time over the last ``window`` steps, and its ratio
    to the median rank (medians, so a checkpoint stall shared by all ranks does not dilute it)."""
    rows = store.rank_median_compute(job, after_step=last_step - window)
    if not rows:
        return None
    median = float(np.median([r["mean_s"] for r in rows]))
    top = rows[0]
    return {"rank": int(top["rank"]), "node": top["node"], "gpu": int(top["gpu"]),
            "median_compute_s": float(top["mean_s"]), "ratio_to_median": float(top["mean_s"]) / median
            if median > 0 else None, "window_steps": window}


def run_events(store: StoreLike, job: str, kind: EventKind, limit: int = 10_000) -> list[Event]:
    return store.recent_events(job=job, kind=kind.value, limit=limit)


def _timeline(store: StoreLike, job: str, step_s: np.ndarray, end_ts: np.ndarray) -> Timeline:
    events = distinct_stops(run_events(store, job, EventKind.INTERRUPTION))
    times = [*end_ts.tolist(), *(e.ts for e in events)]
    start = min(times)
    end = max(max(times), start + 1e-3)
    ideal = ideal_step_time(step_s) if step_s.size else None
    return timeline(job, events, start - (float(step_s[0]) if step_s.size else 0.0), end, ideal_step_s=ideal)


def run_timeline(store: StoreLike, job: str) -> dict[str, Any]:
    """Every interruption of the run with cause, node, detector, lost steps and the MTTR phases."""
    if not job_exists(store, job):
        raise NotFound(f"unknown job {job!r}")
    _, step_s, end_ts = _step_times(store, job)
    if not step_s.size and not run_events(store, job, EventKind.INTERRUPTION, limit=1):
        return {"job": job, "start": None, "end": None, "wall_s": 0.0, "interruptions": [], "restart_s": 0.0,
                "lost_steps": 0, "lost_work_s": 0.0, "overhead": 0.0, "ettr": None, "phase_totals": {},
                "binding_phase": None, "nodes": {}}
    return _timeline(store, job, step_s, end_ts).to_obj()


def _sdc_summary(store: StoreLike, job: str) -> dict[str, Any]:
    checks = run_events(store, job, EventKind.SDC_CHECK, limit=1)
    count, failed = store.sdc_check_counts(job)
    last = checks[0] if checks else None
    status = "none" if last is None else ("pass" if last.data.get("passed") else "fail")
    return {"last": None if last is None else _event_obj(last), "status": status, "count": count,
            "failed": failed}


def run_health(store: StoreLike, job: str, *, slow_window: int = 100,
               interval: IntervalEstimator | None = None) -> dict[str, Any]:
    """Step time p50/max, slowest rank, goodput, interruptions, quarantined nodes, last SDC check, and
    the checkpoint interval from the measured MTBF, checkpoint and restart costs (``interval`` sets
    how they are estimated: :mod:`fleethealth.policy.interval`)."""
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
                     for e in distinct_stops(run_events(store, job, EventKind.INTERRUPTION))]
    placed = store.job_nodes(job)
    out["interruptions"] = interruptions
    out["quarantined_nodes"] = [q.to_obj() for q in qb.quarantined(store)
                                if job in q.runs_affected or q.node in placed]
    out["sdc_checks"] = _sdc_summary(store, job)
    advice = advise(store, job, estimator=interval)
    out["checkpoint"] = None if advice is None else advice.to_obj()
    return out
