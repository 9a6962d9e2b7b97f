"""Job lifecycle: ``interruption`` events derived from what a job and the detectors report.

Nothing upstream writes an ``interruption``: :class:`LifecycleTracker` follows each job's life
from real signals and emits **one** ``interruption`` event per stop, with the four MTTR phases of
seed 002 (detection, isolation & scheduling, reconfiguration, reload & replay) measured on one
incident timeline from the signals' event times.

Signals, per job:

* step batches (:class:`~fleethealth.schema.StepBatch`): the run's progress — its high-water step
  ``H`` and the event time it was reached (the *last good step*), and its step time (median of the
  recent per-step durations);
* ``job_exit`` (:mod:`fleethealth.payloads.job`): ``failed`` or ``halted`` stops the run (the
  exit's reason is a diagnosis); ``completed`` ends it without an interruption;
* ``job_start``: a start for a job that made progress since its last start, or exited, is a
  restart; its ``first_step`` (one past the checkpoint it resumed from) gives the steps lost;
* the step counter going back — a batch of an earlier step than ``H`` with an event time after
  the last good step (by more than ``rewind_gap_s``) — is a restart seen without a ``job_start``
  (a job without the in-job library, or whose start record was lost), resuming at that step; so is
  the first batch after a failed exit when no start came;
* findings: a ``hang`` finding (``why`` ``timeout`` or ``interrupted``) is a stop known at its
  deadline and diagnosed at the finding (cause ``hang``, the culprit rank's node when it names
  one); an ``xid`` finding of a code the Xid rulebook drains for (:data:`fleethealth.xid.DRAIN_CODES`:
  a GPU lost, an uncontained error) on the job or one of its nodes, from ``cause_window_s`` before
  the last good step until the restart, diagnoses ``gpu_failure`` on that node and GPU; an ``sdc``
  finding of the job in that window diagnoses ``sdc`` (a run halted by its own failed check).

A stop's timeline and the phases (``data`` keys of the event, the contract of
:class:`fleethealth.policy.goodput.Interruption`)::

    last good step ─detect─▶ known ─diagnose─▶ diagnosed ─restart─▶ job_start ─reload─▶ first step ─recompute─▶ past H

* ``detection_s``: last good step → the stop was known: the first of the step timeout running out
  (last good step + the job's step timeout, by the hang detector's rule), the hang finding's
  deadline, the exit record, the restart;
* ``isolation_s``: known → diagnosed: the hang finding, the draining Xid finding, the SDC finding
  or the exit's reason (the one that names the cause best, in that order; 0 when the cause was
  known first);
* ``reconfiguration_s``: diagnosed → the restart (the ``job_start``; without one, the first batch
  of the new run less one step time);
* ``reload_s``: restart → the new run's first step, less that step's own time;
* ``recompute_s``: the new run's time from its first step until it passes ``H`` — measured when
  it replays those steps, else (a run resumed past them, as the simulator's) ``lost_steps`` × step
  time; ``lost_steps`` = ``H`` − (``first_step`` − 1), the steps trained twice;
* ``restart_s`` = isolation + reconfiguration + reload, the restart cost; the replay is accounted
  as ``lost_steps`` × the ideal step time by the goodput figures, as before.

Seed 002's "reload & replay" is ``reload_s`` + ``recompute_s``. The event is emitted once the
resumed run passes ``H`` (all phases known), or when the job stops again before that (the phases
measured so far, ``passed`` false), or without a restart after ``restart_wait_s`` of event time, when
the job is forgotten, or at the end of the input (``Batch(final=True)``; ``restarted`` false: no restart
phases, no lost steps). Its ``ts`` is when the stop was known, ``step`` the high-water step ``H``,
``node`` / ``gpu`` / ``rank`` the culprit when one is named (``data.culprit`` true; else the node of
the job's lifecycle records, rank 0's, with ``culprit`` false and no GPU or rank), and
``data.interruption_id`` (:func:`fleethealth.ids.interruption`, from the job, ``H`` and the last
good step's time) names the stop itself: several signals of one stop (a hang finding, the failed
exit, the restart) make one event, a redelivered record makes none, and a replay of the same input
derives the same event, byte for byte, so the same :attr:`Event.id`.

Bad input has a defined behaviour, never an exception: a ``job_exit`` of a job never started or
seen is taken at its word (a failed one still opens a stop, at its ``last_step``; counted in
``unstarted_exits_total_``); a second ``job_start`` with no step or exit since the first (a
duplicate, or a redelivery) is dropped (``duplicate_starts_total_``); a resumed start of a job
whose earlier run was never seen derives nothing (``unseen_restarts_total_``); steps going back
without a start are a restart (``rewinds_total_``); records older than the job's current run are
stale (``stale_total_``); a batch stamped after the job's exit with a step no newer than the
exit's ``last_step`` is the exited run's own (its ranks' last steps and rank 0's exit arrive in any
order) and never opens a new run — after a ``completed`` exit whenever it comes, after a failed one
within ``rewind_gap_s`` of the exit (``late_after_exit_total_``); malformed ``job_start`` /
``job_exit`` data is counted in
``invalid_total_``; a stop whose steps then move past ``H`` with no restart was a stall that
cleared, not an interruption (``stalls_cleared_total_``). Beyond ``max_jobs`` jobs, records naming a
new job are ignored (``over_limit_total_``).

Per message the work is constant (a dict lookup and a few comparisons per step batch, never a loop
over ranks). The pipeline calls :meth:`LifecycleTracker.update` with each step batch and lifecycle
event in its own event-time loop, with ``Batch(conclude=False)`` (a restart must reset step assembly
before the new run's batches are assembled: the restart markers it returns say when), and once more
with the feed's findings and clock to conclude; ``check(batches, events, now, findings=...)`` folds
in and concludes a stretch of input at once, returning the ``interruption`` events alone.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from fleethealth.detectors.batch import Batch, expect
from fleethealth.detectors.hang import StepTimeout
from fleethealth.detectors.state import Stateful, names
from fleethealth.errors import ConfigError, SchemaError
from fleethealth.ids import interruption as interruption_id
from fleethealth.params import check_int, check_number
from fleethealth.payloads.job import ExitStatus, JobExit, JobStart
from fleethealth.schema import Event, EventKind, Finding, FindingKind, StepBatch, StepBlock
from fleethealth.xid import DRAIN_CODES

__all__ = ["LifecycleTracker"]

_PRIORITY = {"hang": 0, "gpu_failure": 1, "sdc": 2}
"""Which diagnosis names a stop's cause best (lower first); an exit's reason comes after these."""
_KNOWN_BY = {"hang": 0, "job_exit": 1, "step_rewind": 2, "job_start": 3, "batch_after_exit": 3, "step_timeout": 4}
"""Which signal is named as the one that made a stop known when two have the same time (lower first)."""


@dataclass
class _Cause:
    ts: float
    cause: str
    by: str
    node: str = ""
    gpu: int | None = None
    rank: int | None = None
    reason: str = ""

    @property
    def priority(self) -> int:
        return _PRIORITY.get(self.cause, 9)


@dataclass
class _Stop:
    """One stop of a job, from its last good step until the resumed run passes it."""

    high: int
    good_ts: float
    known_ts: float
    how: str
    step_s: float
    causes: list[_Cause] = field(default_factory=list)
    exit_status: str | None = None
    restart_ts: float = math.nan
    restart_by: str = ""
    first_step: int | None = None
    resumed_from: str | None = None
    first_ts: float = math.nan
    first_seen_step: int | None = None
    top_ts: float = math.nan
    passed_ts: float = math.nan

    @property
    def restarted(self) -> bool:
        return not math.isnan(self.restart_ts)

    def know(self, ts: float, how: str) -> None:
        """A signal that the run had stopped, at event time ``ts`` (never before the last good step)."""
        ts = max(ts, self.good_ts)
        if ts < self.known_ts or (ts == self.known_ts and _KNOWN_BY.get(how, 9) < _KNOWN_BY.get(self.how, 9)):
            self.known_ts, self.how = ts, how

    def fits(self, ts: float, window_s: float) -> bool:
        """Whether a diagnosis at ``ts`` belongs to this stop: from ``window_s`` before the last good
        step until the restart."""
        return ts >= self.good_ts - window_s and (not self.restarted or ts <= self.restart_ts)


@dataclass
class _Job:
    """One job's current run (mutable; private to the tracker)."""

    top: int = -1
    top_ts: float = math.nan
    run_ts: float = -math.inf  # when the current run started (its start record, or its first batch)
    started: bool = False  # a job_start opened the current run
    start_id: str = ""
    progressed: bool = False  # a batch arrived since the current run's start
    exit: str | None = None  # the current run's exit status, once it exited
    exit_ts: float = math.nan
    exit_step: int = -1  # the exited run's last step (the exit's ``last_step``, else the high-water step then)
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=512))
    nodes: set[str] = field(default_factory=set)
    stop: _Stop | None = None
    closing: list[_Stop] = field(default_factory=list)  # complete, emitted once this batch's findings are in
    recent: deque[_Cause] = field(default_factory=lambda: deque(maxlen=16))
    emitted: deque[str] = field(default_factory=lambda: deque(maxlen=8))
    seen_ts: float = -math.inf
    home: str = ""  # the node its lifecycle records come from (rank 0's)


_Plan = tuple[_Job, int, float, list[float], list[float]]
"""How a block folds in whole: its job, the new top step and its time, the step durations, the step times."""


class LifecycleTracker(Stateful):
    """One ``interruption`` event per stop of a job, with its MTTR phases (see the module docstring).

    Parameters (keyword-only, checked on first use, :class:`~fleethealth.errors.ConfigError`): a
    job's step timeout is ``step_timeout`` (:class:`~fleethealth.detectors.hang.StepTimeout`, the hang
    detector's rule: one definition, set by the ``detect.hang`` keys; the pipeline hands its hang
    detector's rule over, and refuses a different one), applied to the tracker's own step times, so it
    does not depend on how the input was batched; ``rewind_gap_s`` how far after the last good step an earlier
    step must arrive to be a restart (clock skew between nodes stays below it); ``cause_window_s``
    how long before the last good step a draining Xid still diagnoses the stop; ``restart_wait_s``
    how long after the stop was known to wait for a restart; ``max_jobs`` jobs tracked at once.
    """

    name = "lifecycle"
    _state_skip = ("_planned",)
    _planned: tuple[StepBlock, _Plan | None] | None = None
    """:meth:`takes_whole`'s answer for the block it was asked about, used by the fold that follows at once
    (the pipeline asks, then updates with the same block): not state, dropped by any other call."""

    def __init__(self, *, step_timeout: StepTimeout | None = None, rewind_gap_s: float = 1.0,
                 cause_window_s: float = 60.0, restart_wait_s: float = 6 * 3600.0, max_jobs: int = 20_000) -> None:
        self.step_timeout = step_timeout
        self.rewind_gap_s = rewind_gap_s
        self.cause_window_s = cause_window_s
        self.restart_wait_s = restart_wait_s
        self.max_jobs = max_jobs

    # ------------------------------------------------------------------ state
    def _start(self) -> None:
        if self.step_timeout is None:
            self.step_timeout = StepTimeout()
        if not isinstance(self.step_timeout, StepTimeout):
            raise ConfigError(f"LifecycleTracker: step_timeout must be a StepTimeout, got {self.step_timeout!r}")
        check_number("rewind_gap_s", self.rewind_gap_s, at_least=0, owner=self)
        check_number("cause_window_s", self.cause_window_s, at_least=0, owner=self)
        check_number("restart_wait_s", self.restart_wait_s, above=0, owner=self)
        check_int("max_jobs", self.max_jobs, at_least=1, owner=self)
        self.jobs_: dict[str, _Job] = {}
        self.node_jobs_: dict[str, set[str]] = {}
        self.ready_: list[Event] = []
        self.waiting_: set[str] = set()  # jobs with a stop open
        self.closing_: set[str] = set()  # jobs with complete stops not emitted yet
        self.emitted_total_ = 0
        self.unstarted_exits_total_ = 0
        self.duplicate_starts_total_ = 0
        self.unseen_restarts_total_ = 0
        self.rewinds_total_ = 0
        self.stale_total_ = 0
        self.invalid_total_ = 0
        self.stalls_cleared_total_ = 0
        self.duplicate_exits_total_ = 0
        self.late_after_exit_total_ = 0
        self.over_limit_total_ = 0

    def _job(self, name: str) -> _Job | None:
        job = self.jobs_.get(name)
        if job is None:
            if len(self.jobs_) >= self.max_jobs:
                self.over_limit_total_ += 1
                return None
            job = self.jobs_[name] = _Job(durations=deque(maxlen=self.step_timeout.window))
        return job

    def _timeout(self, name: str) -> float:
        job = self.jobs_.get(name)
        rule = self.step_timeout
        if job is None:
            return float(rule.floor_s)
        return rule.of(np.fromiter(job.durations, dtype=np.float64, count=len(job.durations)))

    @staticmethod
    def _step_s(job: _Job) -> float:
        if not job.durations:
            return 0.0
        return float(np.median(np.fromiter(job.durations, dtype=np.float64, count=len(job.durations))))

    # ------------------------------------------------------------------ input
    def update(self, batch: Batch, now: float) -> list[Event]:
        """Fold in ``batch.steps`` and ``batch.events`` in event-time order (a step block whole when
        :meth:`takes_whole`, else its steps one by one), then ``batch.findings``; return one restart
        marker per record that began a new run of its job (a ``job_start`` a nanosecond before it, for
        the hang detector alone: never stored or published), then, with ``batch.conclude``, the
        ``interruption`` events concluded at ``now`` (and at ``batch.final`` every open stop's)."""
        batch = expect(batch, self)
        if not hasattr(self, "jobs_"):
            self._start()
        markers = self._fold(batch.steps, batch.events)
        if batch.findings:
            for f in sorted(batch.findings, key=lambda f: f.ts):
                self._finding(f)
        if not batch.conclude:
            return markers
        out = markers + self._conclude(now)
        if batch.final:
            out += self._drain()
        return out

    def _fold(self, batches: Sequence[StepBatch | StepBlock], events: Sequence[Event]) -> list[Event]:
        ordered: Sequence[StepBatch | StepBlock | Event]
        if len(batches) + len(events) == 1:  # one record (a pipeline feeds them one by one): no order to find
            ordered = batches or events
        else:
            items: list[tuple[float, int, int, StepBatch | StepBlock | Event]] = [
                (b.ts, 0, i, b) for i, b in enumerate(batches)]
            items += [(e.ts, 1, i, e) for i, e in enumerate(events)]
            ordered = [item for _, _, _, item in sorted(items, key=lambda x: x[:3])]
        markers: list[Event] = []
        planned, self._planned = self._planned, None
        for k, item in enumerate(ordered):
            if type(item) is StepBlock:  # the plan asked for just before holds for the first record alone
                known = planned is not None and k == 0 and planned[0] is item
                if self._whole(item, planned[1] if known else self._plan(item)):  # type: ignore[index]
                    continue
                parts: Iterable[StepBatch | Event] = item.split()
            else:
                parts = (item,)
            for part in parts:
                if self._observe(part):
                    markers.append(_restart_marker(part))
        return markers

    def _observe(self, msg: StepBatch | Event) -> bool:
        """Fold in one step batch or event (in event-time order). Returns True when it starts a new
        run of its job after a stop — the caller's step assembly must restart for that job."""
        if not hasattr(self, "jobs_"):
            self._start()
        if isinstance(msg, StepBatch):
            return self._batch(msg)
        if msg.kind is EventKind.JOB_START and msg.job is not None:
            return self._job_start(msg)
        if msg.kind is EventKind.JOB_EXIT and msg.job is not None:
            self._job_exit(msg)
        return False

    def takes_whole(self, block: StepBlock) -> bool:
        """Whether :meth:`update` folds ``block`` in whole: no step of it can start a new run or touch a
        stop (the job is known, running, has not exited, and the block neither rewinds the step counter
        nor is older than the run). Changes nothing; a block it does not take whole is folded in step
        by step, so a caller that assembles steps can restart the assembly between them."""
        if not hasattr(self, "jobs_"):
            self._start()
        plan = self._plan(block)
        self._planned = (block, plan)
        return plan is not None

    def _plan(self, block: StepBlock) -> _Plan | None:
        job = self.jobs_.get(block.job)
        if job is None or job.stop is not None or job.exit is not None:
            return None
        steps, stamps = block.steps.tolist(), block.step_ts.tolist()
        if min(stamps) < job.run_ts:
            return None
        top, top_ts, gap = job.top, job.top_ts, self.rewind_gap_s
        durations = []
        for step, ts in zip(steps, stamps, strict=True):  # the steps in order, unless one rewinds the counter
            if step > top:
                if top >= 0 and ts > top_ts:
                    durations.append((ts - top_ts) / (step - top))
                top, top_ts = step, ts
            elif step == top:
                top_ts = max(top_ts, ts)
            elif top >= 0 and ts > top_ts + gap:
                return None
        return job, top, top_ts, durations, stamps

    def _whole(self, block: StepBlock, plan: _Plan | None) -> bool:
        """Fold in every step of ``block`` at once by its ``plan`` (:meth:`_plan`): exactly :meth:`_observe`
        of its steps in order. False, having changed nothing, when there is none: the steps must be
        observed one by one."""
        if plan is None:
            return False
        job, top, top_ts, durations, stamps = plan
        if block.node not in job.nodes:
            job.nodes.add(block.node)
            self.node_jobs_.setdefault(block.node, set()).add(block.job)
        job.seen_ts = max(job.seen_ts, max(stamps))
        job.progressed = True
        job.top, job.top_ts = top, top_ts
        job.durations.extend(durations)
        return True

    def _batch(self, b: StepBatch) -> bool:
        job = self._job(b.job)
        if job is None:
            return False
        if b.node not in job.nodes:
            job.nodes.add(b.node)
            self.node_jobs_.setdefault(b.node, set()).add(b.job)
        job.seen_ts = max(job.seen_ts, b.ts)
        if b.ts < job.run_ts:
            self.stale_total_ += 1  # a late batch of a run that was already restarted
            return False
        if job.exit is not None and b.ts > job.exit_ts and self._late(job, b):
            self.late_after_exit_total_ += 1  # the exited run's own step, stamped after the exit: no new run
            return False
        restart = False
        stop = job.stop
        if job.exit is not None and b.ts > job.exit_ts:
            # a batch after the run exited: a new run, started without a start record
            if stop is not None and not stop.restarted:
                self._restart(job, stop, b.ts - self._step_s(job), b.step, None, "batch_after_exit")
                restart = True
            else:
                self._new_run(job, b.ts, started=False)
        elif (stop is None and job.top >= 0 and b.step < job.top
              and b.ts > job.top_ts + self.rewind_gap_s):
            # the step counter went back: a restart without a start record
            self.rewinds_total_ += 1
            step_s = self._step_s(job)
            stop = self._open(b.job, job, job.top, job.top_ts, [(b.ts, "step_rewind")])
            self._restart(job, stop, max(b.ts - step_s, job.top_ts), b.step, None, "step_rewind")
            restart = True
        elif stop is not None and not stop.restarted and b.ts > stop.good_ts + self.rewind_gap_s:
            if b.step < stop.high:  # a hang's stop, and the run came back from an earlier step
                self.rewinds_total_ += 1
                self._restart(job, stop, max(b.ts - self._step_s(job), stop.good_ts), b.step, None, "step_rewind")
                restart = True
            elif b.step > job.top:  # progress past H with no restart: a stall that cleared
                self.stalls_cleared_total_ += 1
                job.stop = stop = None
        job.progressed = True
        stop = job.stop
        if stop is not None and stop.restarted:
            if math.isnan(stop.first_ts):
                stop.first_ts, stop.first_seen_step = b.ts, b.step
            stop.top_ts = b.ts if math.isnan(stop.top_ts) else max(stop.top_ts, b.ts)
            if b.step > stop.high and math.isnan(stop.passed_ts):
                stop.passed_ts = b.ts
                self._close(b.job, job, stop)
        if b.step > job.top:
            if job.top >= 0 and b.ts > job.top_ts:
                job.durations.append((b.ts - job.top_ts) / (b.step - job.top))
            job.top, job.top_ts = b.step, b.ts
        elif b.step == job.top:
            job.top_ts = max(job.top_ts, b.ts)
        return restart

    def _late(self, job: _Job, b: StepBatch) -> bool:
        """Whether a batch stamped after its job's exit is the exited run's own: a step no newer than the
        exit's last step, after a completed exit always (a finished job is not reopened by its ranks'
        last batches, whatever order they and rank 0's exit arrive in), after a failed one when stamped
        within ``rewind_gap_s`` of the exit (clock skew between nodes; later, an earlier step is a restart)."""
        if b.step > job.exit_step:
            return False
        return job.exit == ExitStatus.COMPLETED.value or b.ts <= job.exit_ts + self.rewind_gap_s

    def _job_start(self, e: Event) -> bool:
        try:
            rec = JobStart.from_event(e)
        except SchemaError:
            self.invalid_total_ += 1
            return False
        job = self._job(e.job or "")
        if job is None:
            return False
        job.seen_ts = max(job.seen_ts, e.ts)
        job.home = e.node or job.home
        if e.id == job.start_id or (job.started and not job.progressed and job.exit is None and job.stop is None):
            self.duplicate_starts_total_ += 1  # redelivered, or a second start with nothing in between
            return False
        if e.ts < job.run_ts:
            self.stale_total_ += 1
            return False
        stop = job.stop
        known_run = job.top >= 0 or job.exit is not None or stop is not None
        if not known_run:  # the first run we see of this job
            if rec.first_step > 0 or rec.resumed_from is not None:
                self.unseen_restarts_total_ += 1
            self._new_run(job, e.ts, started=True, start_id=e.id)
            return False
        if stop is not None and stop.restarted:
            if math.isnan(stop.first_ts):  # the earlier restart never trained a step: this one counts
                stop.restart_ts, stop.first_step, stop.resumed_from = e.ts, rec.first_step, rec.resumed_from
                stop.restart_by = "job_start"
                self._new_run(job, e.ts, started=True, start_id=e.id)
                return True
            self._close(e.job or "", job, stop)  # stopped again during the replay: what was measured so far
            stop = None
        if stop is None:
            if job.top < 0:  # an exit and a start, never a step: nothing to account
                self._new_run(job, e.ts, started=True, start_id=e.id)
                return True
            stop = self._open(e.job or "", job, job.top, job.top_ts, [(e.ts, "job_start")])
        self._restart(job, stop, e.ts, rec.first_step, rec.resumed_from, "job_start", start_id=e.id)
        return True

    def _job_exit(self, e: Event) -> None:
        try:
            rec = JobExit.from_event(e)
        except SchemaError:
            self.invalid_total_ += 1
            return
        name = e.job or ""
        job = self._job(name)
        if job is None:
            return
        job.seen_ts = max(job.seen_ts, e.ts)
        job.home = e.node or job.home
        if e.ts < job.run_ts:
            self.stale_total_ += 1
            return
        if job.exit is not None:
            self.duplicate_exits_total_ += 1  # this run already exited (a redelivered or repeated exit)
            return
        if not job.started and job.top < 0 and job.stop is None:
            self.unstarted_exits_total_ += 1
        stop = job.stop
        if stop is not None and stop.restarted:  # the resumed run failed before passing H
            self._close(name, job, stop)
            stop = None
        job.exit, job.exit_ts = rec.status.value, e.ts
        job.exit_step = job.top if rec.last_step is None else rec.last_step
        if rec.status is ExitStatus.COMPLETED:
            if stop is not None:  # a stall that ended in a clean finish
                self.stalls_cleared_total_ += 1
                job.stop = None
            return
        high = max(job.top, -1 if rec.last_step is None else rec.last_step)
        if stop is None:
            good = job.top_ts if job.top >= 0 and job.top_ts <= e.ts else e.ts
            stop = self._open(name, job, high, good, [(e.ts, "job_exit")])
        else:
            stop.know(e.ts, "job_exit")
        stop.exit_status = rec.status.value
        cause = "sdc_halt" if rec.status is ExitStatus.HALTED else "job_failed"
        stop.causes.append(_Cause(ts=e.ts, cause=cause, by="job_exit", reason=rec.reason))

    def _open(self, name: str, job: _Job, high: int, good_ts: float, known: list[tuple[float, str]]) -> _Stop:
        """A stop after step ``high`` (reached at ``good_ts``), known by the signals ``known`` or, if
        earlier, by the step timeout running out."""
        self.waiting_.add(name)
        stop = job.stop = _Stop(high=high, good_ts=good_ts, known_ts=good_ts + self._timeout(name),
                                how="step_timeout", step_s=self._step_s(job))
        for ts, how in known:
            stop.know(ts, how)
        stop.causes += [c for c in job.recent if stop.fits(c.ts, self.cause_window_s)]
        return stop

    def _close(self, name: str, job: _Job, stop: _Stop) -> None:
        """The stop is complete (or will learn no more): emitted by the next concluding :meth:`update`, once the
        findings of the same input are in."""
        job.closing.append(stop)
        self.closing_.add(name)
        if job.stop is stop:
            job.stop = None

    def _restart(self, job: _Job, stop: _Stop, ts: float, first_step: int, resumed_from: str | None, by: str,
                 start_id: str = "") -> None:
        stop.restart_ts, stop.first_step, stop.resumed_from, stop.restart_by = ts, first_step, resumed_from, by
        self._new_run(job, ts, started=by == "job_start", start_id=start_id)

    @staticmethod
    def _new_run(job: _Job, ts: float, *, started: bool, start_id: str = "") -> None:
        job.top, job.top_ts = -1, math.nan
        job.run_ts, job.started, job.start_id = ts, started, start_id
        job.progressed, job.exit, job.exit_step = False, None, -1

    # ------------------------------------------------------------------ findings
    def _finding(self, f: Finding) -> None:
        if f.kind is FindingKind.HANG:
            job = self.jobs_.get(f.job) if f.job is not None else None
            if job is None or f.evidence.get("why") not in ("timeout", "interrupted"):
                return
            culprit = bool(f.evidence.get("culprit"))
            cause = _Cause(ts=f.ts, cause="hang", by="hang", node=f.node if culprit else "",
                           gpu=f.gpu if culprit else None, rank=f.rank if culprit else None)
            good = _number(f.evidence.get("last_progress_ts"), job.top_ts)
            deadline = good + _number(f.evidence.get("timeout_s"), self._timeout(f.job or ""))
            for stop in (*job.closing, job.stop):
                if stop is not None and stop.fits(f.ts, 0.0):
                    stop.causes.append(cause)
                    stop.know(deadline, "hang")
                    return
            if job.stop is None and job.top >= 0 and job.exit is None and not math.isnan(good):
                stop = self._open(f.job or "", job, max(job.top, int(_number(f.evidence.get("max_step"), job.top))),
                                  good, [(deadline, "hang")])
                stop.causes.append(cause)
            return
        if f.kind is FindingKind.SDC:
            cause = _Cause(ts=f.ts, cause="sdc", by="sdc", node=f.node, gpu=f.gpu, rank=f.rank,
                           reason=f"failed {f.detector.removeprefix('sdc.')} check at step {f.step}")
        elif f.kind is FindingKind.XID:
            code = f.evidence.get("code")
            if not isinstance(code, int) or code not in DRAIN_CODES:
                return
            cause = _Cause(ts=f.ts, cause="gpu_failure", by="xid", node=f.node, gpu=f.gpu, rank=f.rank,
                           reason=f"xid {code}")
        else:
            return
        names = [f.job] if f.job is not None and f.job in self.jobs_ else sorted(self.node_jobs_.get(f.node, ()))
        for name in names:
            job = self.jobs_[name]
            job.recent.append(cause)
            for stop in (*job.closing, job.stop):
                if stop is not None and stop.fits(f.ts, self.cause_window_s):
                    stop.causes.append(cause)

    # ------------------------------------------------------------------ output
    def _emit(self, name: str, job: _Job, stop: _Stop) -> None:
        sid = interruption_id(name, stop.high, stop.good_ts)
        if sid in job.emitted:
            return
        job.emitted.append(sid)
        causes = sorted(stop.causes, key=lambda c: (c.priority, c.ts))
        best = causes[0] if causes else _Cause(ts=stop.known_ts, cause="unknown", by="")
        exit_reason = next((c.reason for c in causes if c.by == "job_exit"), "")
        culprit = next((c for c in causes if c.node), None)
        detection = max(0.0, stop.known_ts - stop.good_ts)
        diagnosed = max(best.ts, stop.known_ts)
        isolation = diagnosed - stop.known_ts
        step_s = stop.step_s
        lost = reconf = reload = recompute = 0.0
        measured = passed = False
        if stop.restarted:
            first = stop.first_step if stop.first_step is not None else stop.high + 1
            lost = float(max(0, stop.high - first + 1))
            reconf = max(0.0, stop.restart_ts - diagnosed)
            if not math.isnan(stop.first_ts):
                reload = max(0.0, stop.first_ts - stop.restart_ts - step_s)
                passed = not math.isnan(stop.passed_ts)
                replayed = stop.first_seen_step is not None and stop.first_seen_step <= stop.high
                if replayed:
                    measured = True
                    recompute = max(0.0, (stop.passed_ts if passed else stop.top_ts) - stop.first_ts)
                else:
                    recompute = lost * step_s
        data = {
            "interruption_id": sid, "culprit": culprit is not None, "cause": best.cause, "detected_by": stop.how,
            "diagnosed_by": best.by,
            "lost_steps": int(lost), "restart_s": _r(isolation + reconf + reload),
            "detection_s": _r(detection), "isolation_s": _r(isolation), "reconfiguration_s": _r(reconf),
            "reload_s": _r(reload), "recompute_s": _r(recompute), "recompute_measured": measured,
            "step_s": _r(step_s), "last_good_ts": stop.good_ts, "known_ts": stop.known_ts, "diagnosed_ts": diagnosed,
            "restarted": stop.restarted, "restarted_by": stop.restart_by or None,
            "restart_ts": None if not stop.restarted else stop.restart_ts,
            "first_step": stop.first_step, "resumed_from": stop.resumed_from,
            "passed": passed, "passed_ts": None if not passed else stop.passed_ts,
            "exit_status": stop.exit_status, "reason": exit_reason or best.reason,
        }
        where = f" on {culprit.node}" if culprit is not None else ""
        node = culprit.node if culprit is not None else job.home or min(job.nodes, default="") or "unknown"
        again = (f", resumed at step {stop.first_step} ({int(lost)} steps lost)" if stop.restarted
                 else ", not restarted")
        self.ready_.append(Event(
            node=node, ts=float(stop.known_ts), kind=EventKind.INTERRUPTION,
            job=name, gpu=culprit.gpu if culprit is not None else None,
            rank=culprit.rank if culprit is not None else None, step=max(stop.high, 0),
            message=f"job {name} stopped after step {stop.high}{where}: {best.cause}{again}", data=data))
        self.emitted_total_ += 1

    def check(self, batches: Sequence[StepBatch | StepBlock], events: Sequence[Event], now: float | None = None, *,
              findings: Sequence[Finding] = ()) -> list[Event]:
        """Fold in step batches and events (in event-time order), then ``findings``; return the
        ``interruption`` events concluded, oldest first (the restart markers of :meth:`update` are left
        out). ``now`` (event time) lets a stop that waited ``restart_wait_s`` without a restart conclude;
        it must be finite when given."""
        if not hasattr(self, "jobs_"):
            self._start()
        self._fold(batches, events)
        for f in sorted(findings, key=lambda f: f.ts):
            self._finding(f)
        return self._conclude(now)

    def _conclude(self, now: float | None) -> list[Event]:
        if now is not None and (isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now)):
            raise SchemaError("now", f"expected a finite event time, got {now!r}")
        for name in sorted(self.waiting_):
            job = self.jobs_.get(name)
            stop = None if job is None else job.stop
            if stop is None:
                self.waiting_.discard(name)
            elif now is not None and not stop.restarted and now > stop.known_ts + self.restart_wait_s:
                self._close(name, job, stop)  # type: ignore[arg-type]
        for name in sorted(self.closing_):
            job = self.jobs_.get(name)
            if job is not None:
                for done in job.closing:
                    self._emit(name, job, done)
                job.closing.clear()
        self.closing_.clear()
        out, self.ready_ = self.ready_, []
        return sorted(out, key=lambda e: (e.ts, e.job or ""))

    def forget_idle(self, before: float) -> None:
        """Forget jobs with no record since event time ``before``; a stop still open is concluded with
        what is known first (its event comes out of the next concluding :meth:`update`)."""
        if not hasattr(self, "jobs_"):
            return
        self.forget(jobs=[n for n, j in self.jobs_.items() if j.seen_ts < before])

    def forget(self, jobs: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        """Drop ``jobs`` (ended, or idle; an open stop is concluded with what is known, its event out of the
        next concluding :meth:`update`) and ``nodes`` from the nodes each job ran on."""
        gone_jobs, gone_nodes = names("jobs", jobs), names("nodes", nodes)
        self._planned = None
        if not hasattr(self, "jobs_"):
            return
        for name in sorted(gone_jobs):
            self._forget_job(name)
        for node in gone_nodes:
            for name in self.node_jobs_.pop(node, ()):
                job = self.jobs_.get(name)
                if job is not None:
                    job.nodes.discard(node)

    def _forget_job(self, name: str) -> None:
        job = self.jobs_.pop(name, None)
        self.waiting_.discard(name)
        self.closing_.discard(name)
        if job is None:
            return
        for stop in (*job.closing, job.stop):
            if stop is not None:
                self._emit(name, job, stop)
        for node in job.nodes:
            jobs = self.node_jobs_.get(node)
            if jobs is not None:
                jobs.discard(name)
                if not jobs:
                    del self.node_jobs_[node]

    def _drain(self) -> list[Event]:
        """End of input: conclude every open stop with what is known."""
        if not hasattr(self, "jobs_"):
            return []
        for name, job in self.jobs_.items():
            for stop in (*job.closing, job.stop):
                if stop is not None:
                    self._emit(name, job, stop)
            job.closing.clear()
            job.stop = None
        out, self.ready_ = self.ready_, []
        return sorted(out, key=lambda e: (e.ts, e.job or ""))


def _restart_marker(msg: StepBatch | Event) -> Event:
    """A ``job_start`` for the hang detector alone (never stored or published), just before the record
    that showed a run restarted without its own start record, so the rank state starts afresh."""
    step = msg.step or 0
    return Event(node=msg.node, ts=float(np.nextafter(msg.ts, -np.inf)), kind=EventKind.JOB_START, job=msg.job,
                 step=step, message="restart seen from the step counter", data={"world": 1, "first_step": step})


def _r(x: float) -> float:
    return round(float(x), 3)


def _number(value: object, default: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return float(default)
    return float(value)
