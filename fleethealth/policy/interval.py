"""The checkpoint interval a job should use, from what the store measured (seed 000 §3 ``interval: "auto"``, §6).

The arithmetic lives in :mod:`fleethealth.policy.budget` (Young's T* = √(2CM), Daly's refinement, the
three overhead terms); this module measures its three inputs for one job and calls it.

**M, the job's MTBF**, over a window of event time (``window_s``, default 7 days, ending at the
job's newest record). A synchronous job stops when any of its nodes fails, so a fleet's failure rate
per node, times the job's node count, is the rate the job should expect. The estimate pools three
sources with a gamma–Poisson model (the conjugate prior of a Poisson rate: its posterior mean is
(prior events + events seen) / (prior exposure + exposure seen)), each level's posterior mean being the
next level's prior mean:

1. a configured rate per node (``prior_failures_per_node_day``, default 6.5 per 1,000 node-days:
   seed 002's RSC-1 figure), counted as ``prior_node_days`` of observation (default 1,000);
2. the fleet: the *other* jobs' interruptions in the window over their node-days (nodes × the span
   of their steps in the window)::

       λ_node = (rate_prior × prior_node_days + k_fleet) / (prior_node_days + node_days_fleet)

3. the job: the fleet's expectation for its size, ``M_prior`` = 1 / (λ_node × nodes), counted as
   ``prior_weight_s`` of the job's own running (default one day); with its own ``k`` interruptions
   over its exposure ``T`` (the span of its steps in the window)::

       M = (prior_weight_s + T) / (prior_weight_s / M_prior + k)

So a job with no interruption of its own gets a finite MTBF: the fleet's expectation for a job of its
size (never the infinity of T / 0), which its clean hours then lengthen only as they outweigh a day.
A job that stops often is soon ruled by its own count: a flaky rack's stops shorten the interval
within a few of them. Each interruption is counted once (:func:`fleethealth.policy.goodput.distinct_stops`).

**C, the checkpoint cost**: the mean ``blocking_s`` of the job's last ``recent`` ``checkpoint_cost``
records in the window (:mod:`fleethealth.payloads.checkpoint_cost`: how long each save held training
up). Their largest ``write_s`` (the background write) is a floor of the interval: a checkpoint cannot
begin before the previous one is written. With no record, ``default_checkpoint_s`` (seed 000 §6's
30 s), and the basis says so.

**R, the restart cost**: the mean of the four measured MTTR phases (seed 002: detection, isolation &
scheduling, reconfiguration, reload) of the job's restarted interruptions in the window
(:meth:`fleethealth.policy.goodput.Interruption.mttr_s`); with none, the other jobs'; with none
either, ``default_restart_s`` (seed 000 §6's 600 s). The restart term R/M is the part of the
overhead that no interval touches.

**The interval now**: the median spacing, in event time, of the job's last ``recent`` + 1
``checkpoint`` records in the window (None with fewer than two).

The recommended interval is Young's (``method = "young"``) or Daly's, clamped to
``[max(min_interval_s, largest write_s), max_interval_s]``; ``overhead_at_optimum`` is the overhead at
that interval, ``overhead_now`` at the interval now.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fleethealth.errors import ConfigError, SchemaError
from fleethealth.params import check_int, check_number
from fleethealth.payloads.checkpoint_cost import CheckpointCost
from fleethealth.policy.budget import auto_interval, daly_interval, overhead_terms, young_interval
from fleethealth.policy.goodput import Interruption, distinct_stops
from fleethealth.schema import Event, EventKind

if TYPE_CHECKING:
    from fleethealth.store.protocol import ApiStore

__all__ = ["JobSpan", "CheckpointAdvice", "IntervalEstimator", "advise", "history", "ESTIMATOR"]

ESTIMATOR = ("gamma-poisson posterior mean, pooled: a configured rate per node updated by the other jobs' "
             "interruptions per node-day; times the job's nodes, worth prior_weight_s of the job's running; updated "
             "by the job's own interruptions over the span of its steps in the window")
"""The estimator, in words, as the basis states it."""

_DAY_S = 86400.0
_MAX_RECORDS = 100_000
"""Most records of one kind :func:`advise` reads from the window, oldest first (a bound on one request's work)."""
_MIN_C_S = 1e-3
"""A checkpoint measured as free is priced at a millisecond: Young's formula needs C > 0."""


@dataclass(frozen=True)
class JobSpan:
    """Where a job ran: its node count and the event times of its first and last step rows."""

    job: str
    nodes: int
    first_ts: float
    last_ts: float

    def clipped(self, since: float, until: float) -> JobSpan | None:
        """This span within ``[since, until]``, or None when they do not overlap."""
        lo, hi = max(self.first_ts, since), min(self.last_ts, until)
        return None if hi < lo else JobSpan(self.job, self.nodes, lo, hi)

    @property
    def span_s(self) -> float:
        return max(0.0, self.last_ts - self.first_ts)


@dataclass(frozen=True)
class CheckpointAdvice:
    """The checkpoint interval for one job and what it was computed from (seconds; overheads as fractions).

    ``overhead_now`` / ``overhead_at_optimum``: the share of wall-clock lost to checkpoints, lost work
    and restarts at the interval now / recommended (0.05 = 5 %; lower is better); ``restart_term`` is
    R/M, in both and moved by no interval. ``interval_s_now`` and ``overhead_now`` are None when the
    job has fewer than two checkpoints in the window.
    """

    job: str
    at: float
    interval_s_now: float | None
    interval_s_recommended: float
    mtbf_s: float
    c_s: float
    r_s: float
    overhead_now: float | None
    overhead_at_optimum: float
    restart_term: float
    basis: dict[str, Any] = field(default_factory=dict)

    def to_obj(self) -> dict[str, Any]:
        return {"interval_s_now": self.interval_s_now, "interval_s_recommended": self.interval_s_recommended,
                "mtbf_s": self.mtbf_s, "c_s": self.c_s, "r_s": self.r_s, "overhead_now": self.overhead_now,
                "overhead_at_optimum": self.overhead_at_optimum, "restart_term": self.restart_term,
                "at": self.at, "basis": self.basis}

    def to_text(self) -> str:
        b = self.basis
        now = "unknown" if self.interval_s_now is None else f"{self.interval_s_now:.0f} s"
        at_now = "" if self.overhead_now is None else f" ({self.overhead_now:.2%} overhead)"
        return "\n".join([
            f"job {self.job}: checkpoint every {self.interval_s_recommended:.0f} s "
            f"({self.interval_s_recommended / 60:.1f} min, {b['interval']['method']}) at "
            f"{self.overhead_at_optimum:.2%} overhead; now every {now}{at_now}",
            f"MTBF {self.mtbf_s / 3600:.2f} h from {_n(b['mtbf']['job_interruptions'], 'interruption')} in "
            f"{b['mtbf']['job_exposure_s'] / 3600:.2f} h on {b['mtbf']['nodes']} nodes and the fleet's "
            f"{b['mtbf']['fleet_rate_per_node_day']:.3g} per node-day; window {b['window_s'] / 3600:g} h",
            f"C = {self.c_s:.3g} s ({b['c']['source']}, {_n(b['c']['samples'], 'save')}), R = {self.r_s:.3g} s "
            f"({b['r']['source']}, {_n(b['r']['samples'], 'restart')}); restart term R/M {self.restart_term:.2%}, "
            "which no interval changes",
        ])


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else math.nan


class IntervalEstimator:
    """Measure M, C and R for a job and recommend its checkpoint interval (see the module docstring).

    Parameters are stored as given and checked by :meth:`check`, which :meth:`estimate` calls (config keys
    ``policy.interval.*``).
    """

    def __init__(self, *, window_s: float = 7 * _DAY_S, prior_failures_per_node_day: float = 6.5e-3,
                 prior_node_days: float = 1000.0, prior_weight_s: float = _DAY_S,
                 default_checkpoint_s: float = 30.0, default_restart_s: float = 600.0, recent: int = 20,
                 method: str = "young", min_interval_s: float = 60.0, max_interval_s: float = 6 * 3600.0) -> None:
        self.window_s = window_s
        self.prior_failures_per_node_day = prior_failures_per_node_day
        self.prior_node_days = prior_node_days
        self.prior_weight_s = prior_weight_s
        self.default_checkpoint_s = default_checkpoint_s
        self.default_restart_s = default_restart_s
        self.recent = recent
        self.method = method
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s

    def check(self) -> IntervalEstimator:
        """Raise :class:`ConfigError` naming a bad parameter; return ``self`` (a service checks at start)."""
        check_number("window_s", self.window_s, above=0, owner=self)
        check_number("prior_failures_per_node_day", self.prior_failures_per_node_day, above=0, owner=self)
        check_number("prior_node_days", self.prior_node_days, above=0, owner=self)
        check_number("prior_weight_s", self.prior_weight_s, above=0, owner=self)
        check_number("default_checkpoint_s", self.default_checkpoint_s, above=0, owner=self)
        check_number("default_restart_s", self.default_restart_s, at_least=0, owner=self)
        check_int("recent", self.recent, at_least=1, owner=self)
        check_number("min_interval_s", self.min_interval_s, above=0, owner=self)
        check_number("max_interval_s", self.max_interval_s, above=0, owner=self)
        if self.min_interval_s > self.max_interval_s:
            raise ConfigError(f"IntervalEstimator: min_interval_s {self.min_interval_s:g} exceeds max_interval_s "
                              f"{self.max_interval_s:g}")
        if self.method not in ("young", "daly"):
            raise ConfigError(f"IntervalEstimator: unknown method {self.method!r} (known: young, daly)")
        return self

    def estimate(self, job: str, *, at: float, spans: Sequence[JobSpan], interruptions: Sequence[Event],
                 checkpoints: Sequence[Event] = (), costs: Sequence[Event] = ()) -> CheckpointAdvice:
        """The advice for ``job`` at event time ``at``, from the records of the window ending there.

        ``spans``: every job's step span (the job's own included; others give the fleet rate);
        ``interruptions``: ``interruption`` events of every job; ``checkpoints`` / ``costs``: the
        job's ``checkpoint`` and ``checkpoint_cost`` events. Records outside the window, or after
        ``at``, are left out, so a series of calls with growing ``at`` replays how the inputs moved.
        A record that cannot be read is skipped and counted in ``basis.unreadable``.
        """
        self.check()
        until = check_number("at", at)
        since = until - self.window_s
        unreadable = 0

        def inside(ev: Event) -> bool:
            return since <= ev.ts <= until

        mine = next((s for s in spans if s.job == job), None)
        mine = None if mine is None else mine.clipped(since, until)
        nodes = max(1, mine.nodes if mine is not None else 1)
        exposure = mine.span_s if mine is not None else 0.0
        others = [c for s in spans if s.job != job and (c := s.clipped(since, until)) is not None]
        fleet_node_s = float(sum(s.nodes * s.span_s for s in others))
        other_jobs = {s.job for s in others}

        stops: list[tuple[Interruption, bool]] = []  # (the stop, whether the job restarted after it)
        for ev in distinct_stops(e for e in interruptions if inside(e)):
            try:
                stops.append((Interruption.from_event(ev), ev.data.get("restarted", True) is not False))
            except SchemaError:
                unreadable += 1
        own = [s for s in stops if s[0].job == job]
        fleet = [s for s in stops if s[0].job in other_jobs]

        # M: the pooled gamma-Poisson estimate
        d0, fleet_node_days = float(self.prior_node_days), fleet_node_s / _DAY_S
        lam_node = (self.prior_failures_per_node_day * d0 + len(fleet)) / (d0 + fleet_node_days)  # per node-day
        prior_mtbf = _DAY_S / (lam_node * nodes)
        w = float(self.prior_weight_s)
        mtbf = (w + exposure) / (w / prior_mtbf + len(own))

        # C: the job's recent saves
        saves: list[CheckpointCost] = []
        for ev in sorted((e for e in costs if inside(e) and e.kind is EventKind.CHECKPOINT_COST),
                         key=lambda e: e.ts):
            try:
                saves.append(CheckpointCost.from_event(ev))
            except SchemaError:
                unreadable += 1
        saves = saves[-self.recent:]
        c_measured = _mean([s.blocking_s for s in saves])
        c_s = c_measured if saves else float(self.default_checkpoint_s)
        write_max = max((s.write_s for s in saves), default=0.0)

        # R: the measured MTTR phases, the job's own first
        r_own = [s.mttr_s for s, restarted in own if restarted]
        r_fleet = [s.mttr_s for s, restarted in fleet if restarted]
        r_source, r_samples = (("job", r_own) if r_own else ("fleet", r_fleet) if r_fleet else ("default", []))
        r_s = _mean(r_samples) if r_samples else float(self.default_restart_s)

        # the interval now: median spacing of the job's recent checkpoints
        ck_ts = sorted({e.ts for e in checkpoints if inside(e) and e.kind is EventKind.CHECKPOINT})
        ck_ts = ck_ts[-(self.recent + 1):]
        gaps = np.diff(np.asarray(ck_ts, dtype=np.float64))
        gaps = gaps[gaps > 0]
        now_s = float(np.median(gaps)) if gaps.size else None

        c_formula = max(c_s, _MIN_C_S)
        ceiling = float(self.max_interval_s)
        floor = min(max(float(self.min_interval_s), write_max), ceiling)
        auto = auto_interval(c_formula, mtbf_s=mtbf, method=self.method, min_s=floor, max_s=ceiling)
        at_opt = overhead_terms(c_formula, auto.interval_s, mtbf, r_s)
        at_now = None if now_s is None else overhead_terms(c_formula, now_s, mtbf, r_s)
        basis = {
            "window_s": float(self.window_s), "since": since, "until": until, "estimator": ESTIMATOR,
            "mtbf": {"job_interruptions": len(own), "job_exposure_s": exposure, "nodes": nodes,
                     "naive_mtbf_s": exposure / len(own) if own else None,
                     "fleet_jobs": len(other_jobs), "fleet_interruptions": len(fleet),
                     "fleet_node_days": fleet_node_days, "fleet_rate_per_node_day": lam_node,
                     "prior_failures_per_node_day": float(self.prior_failures_per_node_day),
                     "prior_node_days": d0, "prior_weight_s": w, "prior_mtbf_s": prior_mtbf},
            "c": {"source": "measured" if saves else "default", "samples": len(saves),
                  "write_s_max": write_max if saves else None},
            "r": {"source": r_source, "samples": len(r_samples)},
            "interval": {"method": self.method, "young_s": young_interval(c_formula, mtbf),
                         "daly_s": daly_interval(c_formula, mtbf), "floor_s": floor, "ceiling_s": ceiling,
                         "checkpoints": len(ck_ts)},
            "unreadable": unreadable,
        }
        return CheckpointAdvice(job=job, at=until, interval_s_now=now_s, interval_s_recommended=auto.interval_s,
                                mtbf_s=mtbf, c_s=c_s, r_s=r_s, overhead_now=None if at_now is None else at_now.overhead,
                                overhead_at_optimum=at_opt.overhead, restart_term=at_opt.restart_term, basis=basis)


# ---------------------------------------------------------------- the shell: the inputs from a store
def advise(store: ApiStore, job: str, *, estimator: IntervalEstimator | None = None,
           at: float | None = None) -> CheckpointAdvice | None:
    """The advice for ``job`` from the records in ``store`` (its named queries only), at event time ``at``
    (default: the job's newest step, else its newest record); None when the store knows nothing of the job."""
    if at is None:
        span = store.report_job_span(job)
        if span is not None:
            at = span[3]
        else:
            newest = store.recent_events(job=job, limit=1)
            if not newest:
                return None
            at = newest[0].ts
    return history(store, job, [at], estimator=estimator)[0]


def history(store: ApiStore, job: str, times: Sequence[float], *,
            estimator: IntervalEstimator | None = None) -> list[CheckpointAdvice]:
    """The advice for ``job`` at each of ``times`` (event time), from one read of the records of the
    windows they end: how the interval and its inputs moved (the report's plot). Each job's span is cut
    at each time, so a job counts only the running it had done by then."""
    est = estimator if estimator is not None else IntervalEstimator()
    est.check()
    if not times:
        return []
    first, last = min(times), max(times)
    since, until = first - est.window_s, last + 1e-3  # ``until`` is exclusive in the event queries
    spans = [JobSpan(j, n, lo, hi) for j, n, lo, hi in store.job_spans(since=since, until=last)]
    stops = store.events(EventKind.INTERRUPTION.value, since=since, until=until, limit=_MAX_RECORDS)
    checkpoints = store.events(EventKind.CHECKPOINT.value, job=job, since=since, until=until, limit=_MAX_RECORDS)
    costs = store.events(EventKind.CHECKPOINT_COST.value, job=job, since=since, until=until, limit=_MAX_RECORDS)
    return [est.estimate(job, at=t, spans=[c for s in spans if (c := s.clipped(since, t)) is not None],
                         interruptions=stops, checkpoints=checkpoints, costs=costs) for t in times]
