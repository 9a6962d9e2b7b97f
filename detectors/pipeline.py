"""The detection pipeline: every detector wired together, pure and in event time.

:class:`Pipeline` takes messages already ordered by event time (the runner's reorder buffer
does that) and returns findings. It does no I/O and reads no clock: "now" is the median over
nodes of their newest message's event time. It feeds each detector through its one entry point,
``update(batch, now)`` (a :class:`~fleethealth.detectors.batch.Batch` of the records it reads), and
asks no more of it than questions (a node's rack, a diagnosis, a job's step timeout). What it
feeds, in order, for each ``feed``:

1. telemetry → the :class:`Diagnoser` (latest samples per node), the health rules (ECC, Xid,
   power brake, PCIe) and the failure predictor;
2. step batches → the :class:`StepAssembler` (one step across nodes; a step that can no longer
   complete is concluded once "now" is past the job's step timeout) → the job's straggler
   detector (one per job: its state is indexed by rank), given the assembled step as the
   placement, so each finding comes out with its node, GPU, job and time;
3. events → the hang detector (with step progress and each node's newest telemetry), SDC check
   results, Xid rules;
4. straggler findings wait (``diagnosis_wait_s`` of event time at most) until the node's and
   its rack peers' telemetry has caught up with the finding, then get their diagnosis; many
   ``ENVIRONMENTAL`` stragglers of one rack fold into one rack finding;
   every finding carries ``evidence["rack"]``, the rack its node reports (None when unknown);
5. interruption records restart the job's step assembly (a restarted run repeats step numbers);
6. the job lifecycle (:class:`~fleethealth.detectors.lifecycle.LifecycleTracker`) follows each
   job's runs from its step batches, ``job_start`` / ``job_exit`` records and the hang and Xid
   findings, and derives one ``interruption`` event per stop with its MTTR phases
   (``Output.events``). A restart it sees — a ``job_start`` after progress or an exit, the step
   counter going back, a batch after a failed exit — restarts the job's step assembly before the
   new run's first batch is assembled, and the hang detector's rank state with it.

State is bounded: a job without a batch for ``job_idle_s`` and a node without telemetry or a batch
for ``node_idle_s`` of event time are forgotten by every detector (checked once per ``prune_every_s``
of event time, so the work per batch does not grow with the number of jobs and nodes); beyond
``max_jobs`` jobs or ``max_nodes`` nodes a message naming a new one is refused (``Output.rejected``,
which the runner dead-letters, and counted in ``over_limit_``).

Policy is a stage of its own (:class:`fleethealth.policy.stage.PolicyStage`); the runner
(:mod:`fleethealth.detectors.runner`) composes the two. :class:`Output` carries, besides the
findings, what the policy's goodput needs from detection: the steps assembled and the jobs forgotten.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from fleethealth.detectors.assembly import AssembledStep, StepAssembler
from fleethealth.detectors.batch import Batch
from fleethealth.detectors.diagnosis import Diagnoser, RackEpisodes
from fleethealth.detectors.hang import HangDetector
from fleethealth.detectors.health import HealthRules
from fleethealth.detectors.lifecycle import LifecycleTracker
from fleethealth.detectors.predict import FailurePredictor
from fleethealth.detectors.sdc import SdcDetector
from fleethealth.detectors.state import Stateful, names
from fleethealth.detectors.straggler import SeedRule, StragglerDetector
from fleethealth.errors import ConfigError
from fleethealth.params import check_number
from fleethealth.schema import Event, EventKind, Finding, Message, NodeState, StepBatch, StepBlock, Telemetry

__all__ = ["Pipeline", "Output"]

StragglerLike = SeedRule | StragglerDetector


@dataclass
class Output:
    """What one ``feed`` (or ``drain``) concluded, at event time ``now``.

    ``steps`` lists (job, event time) of each step assembled, in order; ``ended`` the jobs forgotten
    after ``job_idle_s`` without a batch — the policy stage's goodput reads both. ``events`` are the
    ``interruption`` events the job lifecycle derived (stored and read by the policy like input events).
    """

    findings: list[Finding] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    steps: list[tuple[str, float]] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)
    now: float = 0.0
    refused: list[StepBatch | StepBlock] = field(default_factory=list)
    """Step batches the assembler refused (implausible step, foreign or contradicted ranks): not to be
    stored; a block with any step refused is listed whole, and its accepted steps are in ``kept``."""
    kept: list[tuple[StepBlock, StepBlock]] = field(default_factory=list)
    """``(block, accepted)``: the steps of a block in ``refused`` that the assembler accepted (to be stored)."""
    rejected: list[tuple[Message, str]] = field(default_factory=list)
    """Messages not processed at all, with why (a new job or node beyond the cardinality limits)."""
    states: list[NodeState] = field(default_factory=list)
    """Node states the telemetry changed (or whose heartbeat was due): what a node stage publishes."""
    unscored: list[tuple[str, int]] = field(default_factory=list)
    """``(job, ranks)``: jobs newly found too small for the straggler detector to score (fewer comparable
    ranks than its ``min_group``; ``ranks`` the largest group it saw), once each: the runner logs them."""


_LIFECYCLE = (EventKind.JOB_START, EventKind.JOB_EXIT)


class Pipeline(Stateful):
    """All detectors of the streaming tier behind one ``feed(messages) -> Output``.

    Every part may be replaced by a keyword argument (tests pass small or seeded ones); the
    defaults are the production detectors. ``straggler`` builds one straggler detector per job
    (``StragglerDetector``, ``SeedRule`` or a ``functools.partial`` of either).

    ``state_dict()`` / ``from_state(state, like=configured)``: every detector's state as plain data
    (:mod:`fleethealth.detectors.state`); the straggler factory is configuration, taken from ``like``.
    """

    _state_skip = ("straggler",)

    def __init__(self, *, straggler: Callable[[], StragglerLike] = StragglerDetector,
                 hang: HangDetector | None = None, diagnoser: Diagnoser | None = None,
                 rack_episodes: RackEpisodes | None = None, health: HealthRules | None = None,
                 sdc: SdcDetector | None = None, predictor: FailurePredictor | None = None,
                 assembler: StepAssembler | None = None, lifecycle: LifecycleTracker | None = None,
                 diagnosis_wait_s: float = 10.0,
                 job_idle_s: float = 6 * 3600.0, node_idle_s: float = 6 * 3600.0, prune_every_s: float = 60.0,
                 max_jobs: int = 20_000, max_nodes: int = 100_000) -> None:
        self.straggler = straggler
        self.hang = hang if hang is not None else HangDetector()
        self.diagnoser = diagnoser if diagnoser is not None else Diagnoser()
        self.rack_episodes = rack_episodes if rack_episodes is not None else RackEpisodes()
        self.health = health if health is not None else HealthRules()
        self.sdc = sdc if sdc is not None else SdcDetector()
        self.predictor = predictor if predictor is not None else FailurePredictor()
        self.assembler = assembler if assembler is not None else StepAssembler()
        rule = self.hang.step_timeout()  # one step-timeout rule: the hang detector's, shared with the lifecycle
        self.lifecycle = lifecycle if lifecycle is not None else LifecycleTracker(step_timeout=rule)
        if self.lifecycle.step_timeout is None:
            self.lifecycle.step_timeout = rule
        elif self.lifecycle.step_timeout != rule:
            raise ConfigError(f"the lifecycle's step timeout {self.lifecycle.step_timeout} differs from the hang "
                              f"detector's {rule}: a job has one step timeout (the detect.hang keys)")
        self.diagnosis_wait_s = diagnosis_wait_s
        self.job_idle_s = check_number("job_idle_s", job_idle_s, above=0)
        self.node_idle_s = check_number("node_idle_s", node_idle_s, above=0)
        self.prune_every_s = check_number("prune_every_s", prune_every_s, at_least=0)
        self.max_jobs = int(check_number("max_jobs", max_jobs, at_least=1))
        self.max_nodes = int(check_number("max_nodes", max_nodes, at_least=1))
        self.over_limit_: dict[str, int] = {"jobs": 0, "nodes": 0}
        self.forgotten_nodes_total_ = 0
        self._pruned_at = float("-inf")
        self.stragglers_: dict[str, StragglerLike] = {}
        self.restarted_: dict[str, float] = {}   # interruption event id -> its ts, once acted on
        self.clock_: dict[str, float] = {}
        self.telemetry_ts_: dict[str, float] = {}  # node -> newest telemetry: a hung job's nodes live on
        self.job_seen_: dict[str, float] = {}
        self.steps_: list[tuple[str, float]] = []
        self.ended_: list[str] = []
        self.now_ = float("-inf")
        self.pending_: list[Finding] = []
        self.waiting_racks_: set[str | None] = set()
        self.steps_total_ = 0
        self.unscored_jobs_: dict[str, int] = {}  # job -> its largest group, for jobs too small to score
        self.unscored_new_: list[tuple[str, int]] = []

    # ------------------------------------------------------------------ feeding
    def feed(self, messages: Sequence[Message]) -> Output:
        """Process messages in event-time order; return what they concluded."""
        telemetry: list[Telemetry] = []
        batches: list[StepBatch] = []
        events: list[Event] = []
        ready: list[Finding] = []
        refused: list[StepBatch | StepBlock] = []
        kept: list[tuple[StepBlock, StepBlock]] = []
        rejected: list[tuple[Message, str]] = []
        markers: list[Event] = []
        states: list[NodeState] = []
        foreign: list[Finding] = []
        run: list[Telemetry] = []  # samples not yet observed: a run of them is derived at once

        def observe() -> None:
            if run:
                states.extend(self.diagnoser.update(Batch(telemetry=tuple(run)), self.now_))
                run.clear()

        for m in messages:
            why = self._over_limit(m)
            if why is not None:
                rejected.append((m, why))
                continue
            if not isinstance(m, Telemetry):
                observe()
            if isinstance(m, Telemetry | NodeState):  # a sample, or (a job stage) the node stage's state of it
                self.clock_[m.node] = max(self.clock_.get(m.node, m.ts), m.ts)
                self.telemetry_ts_[m.node] = max(self.telemetry_ts_.get(m.node, m.ts), m.ts)
                if isinstance(m, Telemetry):
                    telemetry.append(m)
                    run.append(m)
                    if self.pending_:  # stragglers wait on this sample: its state before the next message
                        observe()
                else:  # a job stage's pipelines share one table: the first to see a state applies it, once
                    self.diagnoser.update(Batch(states=(m,)), self.now_)
                if self.pending_ and (m.rack in self.waiting_racks_ or None in self.waiting_racks_):
                    ready += self._diagnosable(final=False)
            elif isinstance(m, StepBatch):
                batches.append(m)
                self.clock_[m.node] = max(self.clock_.get(m.node, m.ts), m.ts)
                self.job_seen_[m.job] = max(self.job_seen_.get(m.job, m.ts), m.ts)
                self._restarts(m, markers)
                for step in self.assembler.add(m):
                    self._wait(self._stragglers(step))
                if self.assembler.refused_:
                    refused.append(m)
            elif isinstance(m, StepBlock):
                self._block(m, batches, refused, kept, markers)
            elif isinstance(m, Finding):  # a job stage: the node stage's finding (an Xid names a stop's cause)
                foreign.append(m)
            else:
                events.append(m)
                if m.kind in _LIFECYCLE and self.lifecycle.update(Batch(events=(m,), conclude=False), self.now_):
                    self.assembler.restart(m.job or "")
        observe()
        self._advance_clock(events)
        for step in self.assembler.overdue(self.now_, self.hang.timeout_s):  # steps that can no longer complete
            self._wait(self._stragglers(step))
        out = self._conclude(ready, telemetry, batches, events, final=False, markers=markers, foreign=foreign)
        out.refused = refused
        out.kept = kept
        out.rejected = rejected
        out.states = states
        return out

    def _block(self, m: StepBlock, batches: list, refused: list, kept: list, markers: list[Event]) -> None:
        """A step block, as its steps in order would be taken one by one: whole (one assembly call, its
        steps scored as they complete) when the job lifecycle can take it whole, else step by step."""
        ts = m.ts
        self.clock_[m.node] = max(self.clock_.get(m.node, ts), ts)
        self.job_seen_[m.job] = max(self.job_seen_.get(m.job, ts), ts)
        if self.lifecycle.takes_whole(m):
            self.lifecycle.update(Batch(steps=(m,), conclude=False), self.now_)
            batches.append(m)
            steps, rows = self.assembler.add_block(m)
            self._stragglers_many(steps)
            if rows:
                refused.append(m)
                taken = np.setdiff1d(np.arange(m.steps.size), rows)
                if taken.size:
                    kept.append((m, m.take(taken)))
            return
        parts: list[StepBatch] = []
        for b in m.split():
            self._restarts(b, markers)
            for step in self.assembler.add(b):
                self._wait(self._stragglers(step))
            if not self.assembler.refused_:
                parts.append(b)
            batches.append(b)
        if len(parts) < m.steps.size:
            refused.append(m)
            if parts:
                kept.append((m, StepBlock.of(parts)))

    def _restarts(self, b: StepBatch, markers: list[Event]) -> None:
        """The job lifecycle takes ``b``; when it began a new run (the step counter went back, or a run
        came after an exit) the job's step assembly restarts, and its marker goes to the hang detector."""
        seen = self.lifecycle.update(Batch(steps=(b,), conclude=False), self.now_)
        if seen:
            self.assembler.restart(b.job)
            markers += seen

    def _over_limit(self, m: Message) -> str | None:
        """Why ``m`` is refused for naming a new job or node beyond the limits, or None."""
        steps = isinstance(m, StepBatch | StepBlock)
        if steps and m.job not in self.job_seen_ and len(self.job_seen_) >= self.max_jobs:
            self.over_limit_["jobs"] += 1
            return f"job: {m.job!r} would be job {len(self.job_seen_) + 1}, beyond max_jobs={self.max_jobs}"
        if (steps or isinstance(m, Telemetry | NodeState)) and m.node not in self.clock_ \
                and len(self.clock_) >= self.max_nodes:
            self.over_limit_["nodes"] += 1
            return f"node: {m.node!r} would be node {len(self.clock_) + 1}, beyond max_nodes={self.max_nodes}"
        return None

    def drain(self) -> Output:
        """End of input: emit open steps and undiagnosed findings with what is known."""
        for step in self.assembler.drain():
            self._wait(self._stragglers(step))
        return self._conclude([], [], [], [], final=True)

    def open_steps(self) -> set[tuple[str, int]]:
        """(job, step) pairs whose conclusions are not out yet: steps still being assembled and
        steps whose straggler findings wait for telemetry. A runner must not commit past their input."""
        return self.assembler.open_steps() | {(f.job or "", f.step or 0) for f in self.pending_}

    def _advance_clock(self, events: list[Event]) -> None:
        """Event time "now": the median over nodes of their newest telemetry or step report, so one
        node (or one event) with a clock far ahead cannot make every other job look hung or late."""
        if self.clock_:
            now = float(np.median(np.fromiter(self.clock_.values(), dtype=np.float64, count=len(self.clock_))))
        else:
            now = max((e.ts for e in events), default=self.now_)
        self.now_ = max(self.now_, now)
        if self.now_ < self._pruned_at + self.prune_every_s:
            return
        self._pruned_at = self.now_
        gone = {node for node, seen in self.clock_.items() if seen < self.now_ - self.node_idle_s}
        idle = [job for job, seen in self.job_seen_.items() if seen < self.now_ - self.job_idle_s]
        self.ended_ += idle
        self.forget(idle, gone)
        self.lifecycle.forget_idle(self.now_ - self.job_idle_s)  # jobs known from their records alone
        if self.restarted_:
            self.restarted_ = {k: ts for k, ts in self.restarted_.items() if ts >= self.now_ - self.job_idle_s}

    def forget(self, jobs: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        """Drop everything every detector holds about ``jobs`` and ``nodes``, through each detector's own
        ``forget`` (the straggler detector of a job goes whole). Straggler findings of theirs still waiting
        for a diagnosis are dropped too. The idle ones are forgotten this way every ``prune_every_s``."""
        gone_jobs, gone_nodes = names("jobs", jobs), names("nodes", nodes)
        if not gone_jobs and not gone_nodes:
            return
        self.forgotten_nodes_total_ += sum(1 for node in gone_nodes if node in self.clock_)
        for job in gone_jobs:
            self.job_seen_.pop(job, None)
            self.stragglers_.pop(job, None)
            self.unscored_jobs_.pop(job, None)
        for node in gone_nodes:
            self.clock_.pop(node, None)
            self.telemetry_ts_.pop(node, None)
        if self.pending_:
            self.pending_ = [f for f in self.pending_ if f.job not in gone_jobs and f.node not in gone_nodes]
            self.waiting_racks_ = {self.diagnoser.rack_of(f.node) for f in self.pending_}
        for part in (self.assembler, self.hang, self.diagnoser, self.rack_episodes, self.health, self.sdc,
                     self.predictor, self.lifecycle):
            part.forget(gone_jobs, gone_nodes)

    # ------------------------------------------------------------------ internals
    def _conclude(self, ready: list[Finding], telemetry: list[Telemetry], batches: list[StepBatch],
                  events: list[Event], *, final: bool, markers: Sequence[Event] = (),
                  foreign: Sequence[Finding] = ()) -> Output:
        now = self.now_ if np.isfinite(self.now_) else 0.0
        out = Output(now=now)
        out.findings += self.hang.update(Batch(steps=batches, events=[*events, *markers], alive=self.telemetry_ts_),
                                         now)
        out.findings += self.sdc.update(Batch(events=events, owns=self.assembler.owns), now)
        out.findings += self.health.update(Batch(telemetry=telemetry, events=events), now)
        out.findings += self.predictor.update(Batch(telemetry=telemetry, events=events), now)
        ready += self._diagnosable(final)
        out.findings += self.rack_episodes.update(Batch(findings=ready, rack_of=self.diagnoser.rack_of), now)
        out.findings = [self._with_rack(f) for f in out.findings]
        for ev in events:
            if ev.kind is EventKind.INTERRUPTION and ev.job is not None and ev.id not in self.restarted_:
                self.restarted_[ev.id] = ev.ts
                self.assembler.restart(ev.job)
        out.events = self.lifecycle.update(Batch(findings=[*out.findings, *foreign], final=final), now)
        out.steps, self.steps_ = self.steps_, []
        out.ended, self.ended_ = self.ended_, []
        out.unscored, self.unscored_new_ = self.unscored_new_, []
        return out

    def _with_rack(self, f: Finding) -> Finding:
        """``f`` with ``evidence["rack"]``: the rack its node reports (None when unknown), so the policy's
        same-rack rule reads every finding that can remove a node the same way."""
        if "rack" in f.evidence:
            return f
        return dataclasses.replace(f, evidence={**f.evidence, "rack": self.diagnoser.rack_of(f.node)})

    def _stragglers(self, step: AssembledStep) -> list[Finding]:
        self.steps_total_ += 1
        self.steps_.append((step.job, step.ts))
        detector = self.stragglers_.get(step.job)
        if detector is None:
            detector = self.stragglers_[step.job] = self.straggler()
        found = detector.update(Batch(assembled=(step,)), self.now_)
        if (step.job not in self.unscored_jobs_ and getattr(detector, "unscored_small_total_", 0)
                and not getattr(detector, "scored_steps_", 0)):
            self._unscored(step.job, detector)
        return found

    def _unscored(self, job: str, detector: StragglerLike) -> None:
        """``job`` has steps the straggler detector left unscored for a group below its ``min_group``, and
        none scored (a step with a rank missing in a job of enough ranks does not make it small)."""
        self.unscored_jobs_[job] = int(getattr(detector, "unscored_group_", 0))
        self.unscored_new_.append((job, self.unscored_jobs_[job]))

    def _stragglers_many(self, steps: list[AssembledStep]) -> None:
        """:meth:`_stragglers` (and :meth:`_wait`) of each step in order; a run of steps of one job on the
        same ranks (a block's steps completed together) goes to the detector in one update (columnar
        over the run when the detector can score it so)."""
        i = 0
        while i < len(steps):
            first = steps[i]
            j = i + 1
            while (j < len(steps) and steps[j].job == first.job and steps[j].ranks is first.ranks
                   and steps[j].groups is None and first.groups is None):
                j += 1
            detector = self.stragglers_.get(first.job)
            if detector is None:
                detector = self.stragglers_[first.job] = self.straggler()
            if j - i > 1:
                run = steps[i:j]
                self.steps_total_ += len(run)
                self.steps_ += [(a.job, a.ts) for a in run]
                self._wait(detector.update(Batch(assembled=run), self.now_))
                if (first.job not in self.unscored_jobs_ and getattr(detector, "unscored_small_total_", 0)
                        and not getattr(detector, "scored_steps_", 0)):
                    self._unscored(first.job, detector)
            else:
                for step in steps[i:j]:
                    self._wait(self._stragglers(step))
            i = j

    def _wait(self, findings: list[Finding]) -> None:
        """Hold stragglers until their rack's telemetry catches up (see :meth:`_diagnosable`)."""
        if findings:
            self.pending_ += findings
            self.waiting_racks_ |= {self.diagnoser.rack_of(f.node) for f in findings}

    def _diagnosable(self, final: bool) -> list[Finding]:
        """Diagnose pending stragglers whose node and rack telemetry has caught up (or waited long enough)."""
        ready, waiting = [], []
        latest = self.diagnoser.latest_
        for f in self.pending_:
            rack = self.diagnoser.rack_of(f.node)
            peers = self.diagnoser.racks_.get(rack, ()) if rack is not None else ()
            caught_up = f.node in latest and all(latest[n].ts >= f.ts for n in peers)
            if final or caught_up or self.now_ - f.ts >= self.diagnosis_wait_s:
                result = self.diagnoser.diagnose(f.node, f.gpu, at=f.ts)
                ready.append(dataclasses.replace(f, diagnosis=result.diagnosis,
                                                 evidence={**f.evidence, **result.evidence}))
            else:
                waiting.append(f)
        self.pending_ = waiting
        self.waiting_racks_ = {self.diagnoser.rack_of(f.node) for f in waiting}
        return ready
