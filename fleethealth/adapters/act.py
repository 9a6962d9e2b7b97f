"""``fleethealth act``: consume ``fh.recommendations`` and carry them out on a scheduler.

The :class:`Actor` stands between the recommendations and a :class:`SchedulerAdapter` and owns
the adapter's authority. For each recommendation, in this order:

1. a recommendation id already in the journal is a replay: nothing happens, nothing is recorded
   (a ``failed`` attempt does not count: a recommendation whose earlier attempts failed stays
   pending and is tried again, by :meth:`Actor.retry_due` after an exponential backoff or when it
   is delivered again, up to ``max_attempts`` attempts in all, then treated as a replay);
2. ``guard`` other than ``allowed`` → ``skipped_guard`` (the policy wants a human or is rate-limited);
3. an action the scheduler has no operation for → ``skipped_unsupported``;
   a recommendation older than ``max_age_s`` (when set) → ``skipped_stale``: a topic replayed
   after the journal was lost must not drain a node that has long recovered;
4. a node this actor already acted on within ``window_s`` → ``skipped_already``;
5. more than ``max_actions`` acted-on recommendations within ``window_s`` → ``rate_limited``
   (the adapter's own limit, independent of the policy's guards);
6. dry-run (the actor's or the recommendation's) → ``dry_run`` with the operations it would run;
7. otherwise the adapter applies it → ``done``, ``skipped_not_ours`` when the node opted out or
   another owner holds it (:class:`~fleethealth.adapters.base.LeftAlone`), or ``failed`` with the
   scheduler's refusal.

Every outcome is logged, appended to the journal (a JSON-lines file, so a restart or a replayed
topic never acts twice once the record is written) and handed to ``emit`` (the CLI publishes it on ``fh.events`` as a
``scheduler_action`` event). The bus is passed in, not imported: :func:`run_act` takes any
consumer with ``poll``/``commit``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson

from fleethealth.adapters.base import ActionRecord, LeftAlone, Outcome, SchedulerAdapter, SchedulerError
from fleethealth.errors import ConfigError
from fleethealth.schema import Guard, Recommendation

__all__ = ["Actor", "ActMetrics", "Journal", "run_act", "RecordSource", "DEFAULT_MAX_AGE_S"]

log = logging.getLogger("fleethealth.act")

DEFAULT_MAX_AGE_S = 1800.0
"""``fleethealth act``'s default staleness bound: twice the policy engine's default ``stale_after_s``
(900 s), so a recommendation the engine made in time is acted on, and one replayed from an old
topic is not."""


class Journal:
    """The actor's memory of handled recommendations: a set of ids, backed by a JSON-lines file.

    ``path=None`` keeps it in memory only. A line that does not parse (a torn last write) is
    skipped with a warning and ended with a newline; every complete line is kept. A ``failed``
    record does not mark its id handled; :meth:`failures` counts them, so the actor can retry.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = None if path is None else Path(path)
        self.records_: list[ActionRecord] = []
        self._ids: set[str] = set()
        self._failed: dict[str, int] = {}
        if self.path is not None and self.path.exists():
            data = self.path.read_bytes()
            if data and not data.endswith(b"\n"):
                with self.path.open("ab") as fh:  # end a torn last line, so the next record starts afresh
                    fh.write(b"\n")
            for lineno, line in enumerate(data.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    self._remember(ActionRecord.from_obj(orjson.loads(line)))
                except (orjson.JSONDecodeError, KeyError, ValueError, TypeError) as exc:
                    log.warning("journal %s line %d unreadable, skipped: %s", self.path, lineno, exc)

    def _remember(self, record: ActionRecord) -> None:
        self.records_.append(record)
        rid = record.recommendation_id
        if record.outcome is Outcome.FAILED:
            self._failed[rid] = self._failed.get(rid, 0) + 1
        else:
            self._ids.add(rid)

    def seen(self, recommendation_id: str) -> bool:
        """True when the recommendation was handled with any outcome but ``failed``."""
        return recommendation_id in self._ids

    def failures(self, recommendation_id: str) -> int:
        """How many attempts at the recommendation failed."""
        return self._failed.get(recommendation_id, 0)

    def add(self, record: ActionRecord) -> None:
        """Append ``record`` to the file, then to memory.

        The actor calls this after the scheduler call, so a crash between the two loses the record
        of an applied action and the redelivered recommendation is applied once more; the
        operations are idempotent (draining a drained node, cordoning a cordoned one)."""
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab") as fh:
                fh.write(orjson.dumps(record.to_obj()) + b"\n")
        self._remember(record)

    def acted_since(self, since: float) -> list[ActionRecord]:
        """Records that changed (or would have changed) the scheduler at or after ``since``."""
        return [r for r in self.records_ if r.acted and r.ts >= since]


class Actor:
    """Carry out allowed recommendations on one scheduler, within its own rate limit.

    Parameters
    ----------
    adapter:
        The scheduler (:class:`~fleethealth.adapters.slurm.SlurmAdapter`,
        :class:`~fleethealth.adapters.kubernetes.KubernetesAdapter`).
    journal:
        Where handled recommendations are remembered; default: in memory.
    dry_run:
        Record what would be done without touching the scheduler.
    max_actions, window_s:
        At most ``max_actions`` acted-on recommendations per ``window_s`` seconds.
    max_age_s:
        Recommendations whose event time is more than this many seconds behind ``clock`` are
        recorded, not acted on (``None``: no bound; simulated fleets run in their own time).
    max_attempts:
        A recommendation whose scheduler call failed stays pending and is tried again (see
        ``retry_backoff_s``, or when it is delivered again), up to this many attempts in all; later
        deliveries are replays.
    retry_backoff_s:
        The wait before the first retry of a failed recommendation, doubled for each further one
        (an unreachable controller, an API server that refuses, a drain a PodDisruptionBudget holds).
    emit:
        Called with each new :class:`ActionRecord` (e.g. to publish it on ``fh.events``).
    clock:
        Wall clock for the rate window (adapters act in real time); replaceable in tests.
    """

    def __init__(self, adapter: SchedulerAdapter, *, journal: Journal | None = None, dry_run: bool = False,
                 max_actions: int = 5, window_s: float = 3600.0, max_age_s: float | None = None,
                 max_attempts: int = 3, retry_backoff_s: float = 60.0,
                 emit: Callable[[ActionRecord], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if max_actions < 1 or window_s <= 0:
            raise ConfigError(f"rate limit needs max_actions >= 1 and window_s > 0, got {max_actions}, {window_s}")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ConfigError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        if max_age_s is not None and max_age_s <= 0:
            raise ConfigError(f"max_age_s must be > 0, got {max_age_s}")
        self.adapter = adapter
        self.journal = journal if journal is not None else Journal()
        self.dry_run = dry_run
        self.max_actions = max_actions
        self.window_s = window_s
        self.max_age_s = max_age_s
        self.max_attempts = max_attempts
        self.retry_backoff_s = retry_backoff_s
        self.emit = emit
        self.clock = clock
        self.counts_: dict[Outcome, int] = {o: 0 for o in Outcome}
        self.replays_ = 0
        self.pending_: dict[str, tuple[Recommendation, float]] = {}

    def handle(self, rec: Recommendation) -> ActionRecord | None:
        """Decide and act on one recommendation; ``None`` for a replay of one already handled (or
        one whose ``max_attempts`` attempts all failed)."""
        failed = self.journal.failures(rec.id)
        if self.journal.seen(rec.id) or failed >= self.max_attempts:
            self.replays_ += 1
            log.debug("recommendation %s already handled (%d failed attempts), skipped", rec.id, failed)
            return None
        now = self.clock()
        outcome, detail, ops = self._decide(rec, now)
        self.pending_.pop(rec.id, None)
        if outcome is Outcome.FAILED:
            left = self.max_attempts - failed - 1
            wait = self.retry_backoff_s * 2 ** failed
            detail = f"{detail} (attempt {failed + 1} of {self.max_attempts}" + (
                f"; retried in {wait:g} s)" if left else "; giving up)")
            if left:
                self.pending_[rec.id] = (rec, now + wait)
        record = ActionRecord(recommendation_id=rec.id, scheduler=self.adapter.name, node=rec.node,
                              action=rec.action, outcome=outcome, ts=now, rec_ts=rec.ts, job=rec.job,
                              detail=detail, operations=ops)
        self.journal.add(record)
        self.counts_[outcome] += 1
        level = logging.WARNING if outcome is Outcome.FAILED else logging.INFO
        log.log(level, "%s %s %s on %s: %s %s", self.adapter.name, outcome.value, rec.action.value, rec.node,
                detail, "; ".join(ops))
        if self.emit is not None:
            self.emit(record)
        return record

    def retry_due(self) -> list[ActionRecord]:
        """Try again the failed recommendations whose backoff has passed; return the new records."""
        now = self.clock()
        due = [rec for rec, at in self.pending_.values() if at <= now]
        return [r for r in map(self.handle, due) if r is not None]

    def handle_all(self, recs: Iterable[Recommendation]) -> list[ActionRecord]:
        return [r for r in map(self.handle, recs) if r is not None]

    def _decide(self, rec: Recommendation, now: float) -> tuple[Outcome, str, tuple[str, ...]]:
        if rec.guard is not Guard.ALLOWED:
            return Outcome.SKIPPED_GUARD, f"guard is {rec.guard.value}: not for automatic action", ()
        if not self.adapter.supports(rec.action):
            return Outcome.SKIPPED_UNSUPPORTED, f"{self.adapter.name} has no operation for {rec.action.value}", ()
        if self.max_age_s is not None and now - rec.ts > self.max_age_s:
            return (Outcome.SKIPPED_STALE,
                    f"recommendation is {now - rec.ts:.0f} s old (bound {self.max_age_s:g} s)", ())
        recent = self.journal.acted_since(now - self.window_s)
        same = [r for r in recent if r.node == rec.node]
        if same:
            return (Outcome.SKIPPED_ALREADY,
                    f"node already handled by recommendation {same[-1].recommendation_id} "
                    f"{now - same[-1].ts:.0f} s ago", ())
        if len(recent) >= self.max_actions:
            return (Outcome.RATE_LIMITED,
                    f"{len(recent)} actions in the last {self.window_s:g} s (limit {self.max_actions})", ())
        try:
            if self.dry_run or rec.dry_run:
                why = "actor" if self.dry_run else "recommendation"
                return Outcome.DRY_RUN, f"dry-run ({why}); would run", self.adapter.plan(rec)
            return Outcome.DONE, rec.reason, self.adapter.apply(rec)
        except LeftAlone as exc:
            return Outcome.SKIPPED_NOT_OURS, str(exc), ()
        except SchedulerError as exc:
            return Outcome.FAILED, str(exc), ()


class RecordSource(Protocol):
    """What :func:`run_act` reads from: a bus consumer (``fleethealth.bus.Consumer``)."""

    def poll(self, timeout_s: float = 1.0, max_records: int = 5000) -> Sequence[Any]: ...

    def commit(self) -> None: ...


def run_act(consumer: RecordSource, actor: Actor, stop: threading.Event, *, poll_s: float = 1.0,
            max_polls: int | None = None) -> int:
    """Poll recommendations and hand each to ``actor`` until ``stop`` is set; return records made.

    Offsets are committed after each polled batch is handled (and journaled), so a crash
    re-delivers at most one batch, which the journal then recognises as replays. Failed
    recommendations whose backoff has passed are tried again after each poll.
    """
    made = 0
    polls = 0
    while not stop.is_set() and (max_polls is None or polls < max_polls):
        polls += 1
        batch = consumer.poll(timeout_s=poll_s)
        for record in batch:
            msg = getattr(record, "msg", record)
            if isinstance(msg, Recommendation) and actor.handle(msg) is not None:
                made += 1
        if batch:
            consumer.commit()
        made += len(actor.retry_due())
    return made


class ActMetrics:
    """``fleethealth act``'s own metrics and health, served on ``/metrics`` and ``/healthz``.

    Counters: ``fleethealth_act_records_total{outcome}`` (every recommendation handled, by outcome;
    ``failed`` is the scheduler refusing), ``fleethealth_act_polls_total``. Gauges:
    ``fleethealth_act_last_poll_timestamp_seconds``, ``fleethealth_act_failed_in_a_row``.
    :meth:`degraded` names why ``/healthz`` answers 503: no poll for ``stall_s`` (the loop is stuck),
    or ``failures_degraded`` or more ``failed`` outcomes in a row (the scheduler keeps refusing).
    ``clock`` (monotonic) and ``wall_clock`` are replaceable in tests."""

    def __init__(self, *, stall_s: float = 60.0, failures_degraded: int = 3,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        from fleethealth.buildinfo import register as register_build_info

        self.stall_s = stall_s
        self.failures_degraded = failures_degraded
        self._clock = clock
        self._wall_clock = wall_clock
        self.registry = CollectorRegistry()
        self.records = Counter("fleethealth_act_records_total", "recommendations handled, by outcome", ["outcome"],
                               registry=self.registry)
        for outcome in Outcome:  # every outcome is 0 until it happens, never absent
            self.records.labels(outcome.value)
        self.polls = Counter("fleethealth_act_polls_total", "polls of fh.recommendations", registry=self.registry)
        self.last_poll = Gauge("fleethealth_act_last_poll_timestamp_seconds", "wall-clock time of the last poll",
                               registry=self.registry)
        self.failed_in_a_row = Gauge("fleethealth_act_failed_in_a_row", "failed outcomes since the last success",
                                     registry=self.registry)
        register_build_info(self.registry)
        self._polled_at = clock()
        self._failed_run = 0

    def observe(self, record: ActionRecord) -> None:
        """Count one handled recommendation."""
        self.records.labels(record.outcome.value).inc()
        if record.outcome is Outcome.FAILED:
            self._failed_run += 1
        elif record.acted:
            self._failed_run = 0
        self.failed_in_a_row.set(self._failed_run)

    def polled(self) -> None:
        """The loop came round: one poll of the recommendations finished."""
        self.polls.inc()
        self._polled_at = self._clock()
        self.last_poll.set(self._wall_clock())

    def degraded(self) -> list[str]:
        reasons = []
        since = self._clock() - self._polled_at
        if since > self.stall_s:
            reasons.append(f"no poll of fh.recommendations for {since:.0f} s (limit {self.stall_s:g} s)")
        if self._failed_run >= self.failures_degraded:
            reasons.append(f"the scheduler refused the last {self._failed_run} actions")
        return reasons

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
