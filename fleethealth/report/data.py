"""What ``fleethealth report`` plots, read from the store once: :func:`load` -> :class:`ReportData`.

Everything comes through named queries of :class:`~fleethealth.store.protocol.StoreLike`; the
heatmap and the temperature map are aggregated in the store (a cell per rank and step bin, per
rack and time bin), so a report of a 256-GPU, 600-step job reads a few thousand rows.

The goodput waterfall follows seed 002's badput buckets over the job's wallclock:

* productive = distinct steps × ideal step time (:func:`fleethealth.policy.goodput.ideal_step_time`);
* stragglers = Σ over steps of (step time − ideal), the slowest rank setting a step's time;
* detection, diagnosis (isolation & scheduling), restart (reconfiguration + reload) from the
  ``interruption`` events' MTTR phases; recomputation = lost steps × ideal step time.

ETTR = productive / (productive + every bucket).

The checkpoint interval (:mod:`fleethealth.policy.interval`) is evaluated at :data:`INTERVAL_POINTS`
moments over the job's span and at each of its interruptions, from one read of the store: the last
is the interval the API recommends now, the series shows how it and its inputs moved.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fleethealth.errors import ConfigError, SchemaError
from fleethealth.evidence import MIN_COMPARABLE_RANKS
from fleethealth.policy.goodput import Interruption, distinct_stops, ideal_step_time
from fleethealth.policy.interval import CheckpointAdvice, IntervalEstimator, history
from fleethealth.schema import Action, Diagnosis, Event, EventKind, Finding, FindingKind, Recommendation

if TYPE_CHECKING:
    from fleethealth.store.protocol import StoreLike

__all__ = ["ReportData", "Goodput", "load", "MAX_STEP_BINS", "MAX_TIME_BINS"]

MAX_STEP_BINS = 300
"""The heatmap's columns at most: longer jobs average consecutive steps into one cell."""
MAX_TIME_BINS = 240
INTERVAL_POINTS = 60
"""Moments over the job's span at which the checkpoint interval is evaluated for the report's plot."""
_BREAKER = "fleet"


@dataclass(frozen=True)
class Goodput:
    """Seconds of the job's wallclock, productive and per badput bucket."""

    productive_s: float
    buckets: dict[str, float]
    ideal_step_s: float
    steps: int

    @property
    def available_s(self) -> float:
        return self.productive_s + sum(self.buckets.values())

    @property
    def ettr(self) -> float:
        return self.productive_s / self.available_s if self.available_s > 0 else math.nan

    def to_obj(self) -> dict[str, Any]:
        return {"productive_s": self.productive_s, "buckets": dict(self.buckets), "available_s": self.available_s,
                "ettr": self.ettr, "ideal_step_s": self.ideal_step_s, "steps": self.steps}


@dataclass
class ReportData:
    """One job's slice of the store, shaped for the plots."""

    job: str
    dsn: str
    first_step: int
    last_step: int
    t0: float
    t1: float
    step_bin: int
    ranks: np.ndarray                      # (r,) rank ids, ordered by rack, node, rank
    rank_nodes: list[str]                  # (r,)
    node_racks: dict[str, str]
    compute: np.ndarray                    # (r, bins) mean compute seconds, NaN where absent
    racks: list[str]
    time_bin_s: float
    temp_max: np.ndarray                   # (racks, tbins) °C
    reasons: np.ndarray                    # (racks, tbins) OR of clock-event reason bits
    steps: np.ndarray                      # (s,) step numbers
    step_s: np.ndarray                     # (s,) slowest rank's compute seconds
    step_end_ts: np.ndarray                # (s,)
    findings: list[Finding]
    recommendations: list[Recommendation]
    checks: list[Event]
    checkpoints: list[Event]
    interruptions: list[Interruption]
    breaker: list[dict[str, Any]]
    goodput: Goodput
    extra: dict[str, Any] = field(default_factory=dict)
    interval: list[CheckpointAdvice] = field(default_factory=list)
    """The checkpoint interval and its inputs over the job's span, oldest first (the last: now)."""

    @property
    def hot_aisles(self) -> list[Finding]:
        return [f for f in self.findings if f.diagnosis is Diagnosis.ENVIRONMENTAL]

    @property
    def rollbacks(self) -> list[Recommendation]:
        return [r for r in self.recommendations if r.action is Action.ROLLBACK]

    def step_at(self, ts: float) -> float:
        """The step a moment falls in (interpolated over the steps' completion times)."""
        if self.step_end_ts.size == 0:
            return float(self.first_step)
        return float(np.interp(ts, self.step_end_ts, self.steps))


def pick_job(store: StoreLike, job: str | None) -> str:
    """``job`` if the store holds step data for it, else the job with the most steps; a
    :class:`ConfigError` naming the cause when there is none."""
    jobs = store.report_jobs()
    if job is None:
        if not jobs:
            raise ConfigError(f"the store at {store.dsn} holds no job's steps (nothing to report)")
        return jobs[0][0]
    if not store.job_exists(job):
        known = ", ".join(j for j, _ in jobs[:5]) or "none"
        raise ConfigError(f"no job {job!r} in the store at {store.dsn} (jobs with steps: {known})")
    if job not in {j for j, _ in jobs}:
        raise ConfigError(f"job {job!r} has no step data in the store at {store.dsn} (nothing to plot)")
    return job


def load(store: StoreLike, job: str | None = None, *, min_group: int = MIN_COMPARABLE_RANKS,
         interval: IntervalEstimator | None = None) -> ReportData:
    """Read everything the report shows about ``job`` (default: the job with the most steps). A job with
    fewer ranks than ``min_group`` (``detect.straggler.min_group``) gets ``extra["unscored"]``, the note
    that its steps were not scored for stragglers. ``interval`` estimates the checkpoint interval."""
    job = pick_job(store, job)
    span = store.report_job_span(job)
    if span is None:  # pick_job saw steps; a concurrent delete is the only way here
        raise ConfigError(f"job {job!r} has no step data in the store at {store.dsn}")
    first, last, t0, t1 = span
    n_steps = last - first + 1
    step_bin = max(1, math.ceil(n_steps / MAX_STEP_BINS))
    cells = store.report_rank_compute(job, step_bin=step_bin)
    nodes = sorted({n for _, n, _, _ in cells})
    node_racks = store.report_node_racks(nodes)
    rank_node: dict[int, str] = {}
    for rank, node, _, _ in cells:
        rank_node.setdefault(rank, node)
    order = sorted(rank_node, key=lambda r: (node_racks.get(rank_node[r], "~"), rank_node[r], r))
    row = {r: i for i, r in enumerate(order)}
    b0 = first // step_bin
    n_bins = last // step_bin - b0 + 1
    compute = np.full((len(order), n_bins), np.nan)
    for rank, _, b, c in cells:
        compute[row[rank], b - b0] = c

    time_bin = max((t1 - t0) / MAX_TIME_BINS, 1.0)
    racks = sorted(set(node_racks.values()))
    n_t = int((t1 - t0) // time_bin) + 1
    temp = np.full((len(racks), n_t), np.nan)
    reasons = np.zeros((len(racks), n_t), dtype=np.int64)
    rack_row = {r: i for i, r in enumerate(racks)}
    for rack, b, _, hi, bits in store.report_rack_temperature(nodes, since=t0, until=t1, bin_s=time_bin):
        if rack in rack_row and 0 <= b < n_t:
            temp[rack_row[rack], b] = hi
            reasons[rack_row[rack], b] = bits

    times = store.job_step_times(job, limit=n_steps + 1)
    steps = np.array([int(s) for s, _, _ in times], dtype=np.int64)
    step_s = np.array([float(s) for _, s, _ in times])
    ends = np.array([float(e) for _, _, e in times])

    node_set = set(nodes)
    lo, hi = t0 - 3600.0, t1 + 3600.0
    findings = [f for f in store.findings(since=lo, until=hi)
                if f.job == job or (f.job is None and f.node in node_set)]
    recs = [r for r in store.recommendations(since=lo, until=hi)
            if r.job == job or (r.job is None and r.node in node_set)]
    events = store.events(job=job)
    checks = [e for e in events if e.kind is EventKind.SDC_CHECK]
    checkpoints = [e for e in events if e.kind is EventKind.CHECKPOINT]
    interruptions = []
    for e in distinct_stops(events):
        try:
            interruptions.append(Interruption.from_event(e))
        except SchemaError:  # a malformed record is left out of the sums, not fatal
            continue
    return ReportData(
        job=job, dsn=store.dsn, first_step=first, last_step=last, t0=t0, t1=t1, step_bin=step_bin,
        ranks=np.array(order, dtype=np.int64), rank_nodes=[rank_node[r] for r in order], node_racks=node_racks,
        compute=compute, racks=racks, time_bin_s=time_bin, temp_max=temp, reasons=reasons, steps=steps,
        step_s=step_s, step_end_ts=ends, findings=findings, recommendations=recs, checks=checks,
        checkpoints=checkpoints, interruptions=interruptions, breaker=store.breaker_history(_BREAKER),
        goodput=goodput_buckets(step_s, interruptions),
        interval=history(store, job, sorted({*np.linspace(t0, t1, INTERVAL_POINTS).tolist(),
                                             *(i.ts for i in interruptions if t0 <= i.ts <= t1)}),
                         estimator=interval),
        extra={} if len(order) >= min_group else {"unscored": (
            f"Not scored for stragglers: this job has {len(order)} rank(s), fewer than the {min_group} comparable "
            "ranks the straggler detector needs (detect.straggler.min_group); its hangs, SDC checks and node "
            "health are still watched.")})


def goodput_buckets(step_s: np.ndarray, interruptions: list[Interruption]) -> Goodput:
    """Productive seconds and seed 002's badput buckets (see the module docstring)."""
    positive = step_s[np.isfinite(step_s) & (step_s > 0)]
    if positive.size == 0:
        return Goodput(0.0, {k: 0.0 for k in ("detection", "diagnosis", "restart", "recomputation", "stragglers")},
                       math.nan, 0)
    ideal = ideal_step_time(positive)
    lost = sum(i.lost_steps for i in interruptions)
    buckets = {
        "detection": float(sum(i.detection_s for i in interruptions)),
        "diagnosis": float(sum(i.isolation_s for i in interruptions)),
        "restart": float(sum(i.reconfiguration_s + i.reload_s for i in interruptions)),
        "recomputation": float(lost * ideal),
        "stragglers": float(np.clip(positive - ideal, 0.0, None).sum()),
    }
    return Goodput(float(positive.size * ideal), buckets, ideal, int(positive.size))


def check_summary(checks: list[Event]) -> dict[tuple[int, str], tuple[int, int]]:
    """``(step, check) -> (ranks checked, failed)`` over the SDC check events."""
    out: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])
    for e in checks:
        key = (int(e.step or 0), str(e.data.get("check", "selfcheck")))
        out[key][0] += 1
        out[key][1] += 0 if e.data.get("passed", True) else 1
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


def stragglers(data: ReportData) -> list[Finding]:
    return [f for f in data.findings if f.kind is FindingKind.STRAGGLER]
