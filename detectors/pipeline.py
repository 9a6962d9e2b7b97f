"""The detection pipeline: every detector wired together, pure and in event time.

:class:`Pipeline` takes messages already ordered by event time (the runner's reorder buffer
does that) and returns findings and recommendations. It does no I/O and reads no clock: the
event time of the newest message is "now". What it calls, in order, for each ``feed``:

1. telemetry → the :class:`Diagnoser` (latest samples per node), the health rules (ECC, Xid,
   power brake, PCIe) and the failure predictor;
2. step batches → the :class:`StepAssembler` (one step across nodes) → the job's straggler
   detector (one per job: its state is indexed by rank) → partial findings completed with
   node, GPU, job and time from the placement;
3. events → the hang detector (with step progress), SDC check results, Xid rules;
4. straggler findings wait (``diagnosis_wait_s`` of event time at most) until the node's and
   its rack peers' telemetry has caught up with the finding, then get their diagnosis; many
   ``ENVIRONMENTAL`` stragglers of one rack fold into one rack finding;
5. the policy engine turns findings into recommendations (it also reads checkpoint and SDC
   check events, for rollback targets), and the pager looks for patterns in interruptions
   (seed 000 R5): a page when one is found, a counted report otherwise.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from fleethealth.detectors.assembly import AssembledStep, StepAssembler
from fleethealth.detectors.diagnosis import Diagnoser, RackEpisodes
from fleethealth.detectors.hang import HangDetector
from fleethealth.detectors.health import HealthRules
from fleethealth.detectors.predict import FailurePredictor
from fleethealth.detectors.sdc import SdcDetector
from fleethealth.detectors.straggler import SeedRule, StragglerDetector
from fleethealth.errors import SchemaError
from fleethealth.policy.engine import PolicyEngine
from fleethealth.policy.goodput import Interruption, ideal_step_time, window_goodput
from fleethealth.policy.paging import Pager
from fleethealth.schema import Event, EventKind, Finding, Message, Recommendation, StepBatch, Telemetry

__all__ = ["Pipeline", "Output"]

StragglerLike = SeedRule | StragglerDetector
GOODPUT_WINDOW_S = 3600.0
"""Goodput for the pager's collapse rule is measured over the last hour (seed 000 R5)."""
GOODPUT_MIN_WINDOW_S = 600.0
"""A job younger than this has too little history for a goodput figure."""


@dataclass
class Output:
    """What one ``feed`` produced."""

    findings: list[Finding] = field(default_factory=list)
    recommendations: list[Recommendation] = field(default_factory=list)

    def extend(self, other: Output) -> None:
        self.findings += other.findings
        self.recommendations += other.recommendations


class Pipeline:
    """All detectors of the streaming tier behind one ``feed(messages) -> Output``.

    Every part may be replaced by a keyword argument (tests pass small or seeded ones); the
    defaults are the production detectors. ``straggler`` builds one straggler detector per job
    (``StragglerDetector``, ``SeedRule`` or a ``functools.partial`` of either); ``policy`` is a
    :class:`PolicyEngine`, or None for findings only (then no pager either).
    """

    def __init__(self, *, straggler: Callable[[], StragglerLike] = StragglerDetector,
                 hang: HangDetector | None = None, diagnoser: Diagnoser | None = None,
                 rack_episodes: RackEpisodes | None = None, health: HealthRules | None = None,
                 sdc: SdcDetector | None = None, predictor: FailurePredictor | None = None,
                 assembler: StepAssembler | None = None, policy: PolicyEngine | None = None,
                 pager: Pager | None = None, diagnosis_wait_s: float = 10.0, job_idle_s: float = 6 * 3600.0) -> None:
        self.straggler = straggler
        self.hang = hang if hang is not None else HangDetector()
        self.diagnoser = diagnoser if diagnoser is not None else Diagnoser()
        self.rack_episodes = rack_episodes if rack_episodes is not None else RackEpisodes()
        self.health = health if health is not None else HealthRules()
        self.sdc = sdc if sdc is not None else SdcDetector()
        self.predictor = predictor if predictor is not None else FailurePredictor()
        self.assembler = assembler if assembler is not None else StepAssembler()
        self.policy = policy
        self.pager = pager if pager is not None else Pager()
        self.diagnosis_wait_s = diagnosis_wait_s
        self.job_idle_s = job_idle_s
        self.stragglers_: dict[str, StragglerLike] = {}
        self.interruptions_: dict[str, Interruption] = {}
        self.clock_: dict[str, float] = {}
        self.job_seen_: dict[str, float] = {}
        self.job_first_: dict[str, float] = {}
        self.step_ends_: dict[str, deque[float]] = {}
        self.now_ = float("-inf")
        self.pending_: list[Finding] = []
        self.waiting_racks_: set[str | None] = set()
        self.steps_total_ = 0

    # ------------------------------------------------------------------ feeding
    def feed(self, messages: Sequence[Message]) -> Output:
        """Process messages in event-time order; return what they concluded."""
        telemetry: list[Telemetry] = []
        batches: list[StepBatch] = []
        events: list[Event] = []
        ready: list[Finding] = []
        for m in messages:
            if isinstance(m, Telemetry):
                telemetry.append(m)
                self.clock_[m.node] = max(self.clock_.get(m.node, m.ts), m.ts)
                self.diagnoser.observe((m,))
                if self.pending_ and (m.rack in self.waiting_racks_ or None in self.waiting_racks_):
                    ready += self._diagnosable(final=False)
            elif isinstance(m, StepBatch):
                batches.append(m)
                self.clock_[m.node] = max(self.clock_.get(m.node, m.ts), m.ts)
                self.job_seen_[m.job] = max(self.job_seen_.get(m.job, m.ts), m.ts)
                for step in self.assembler.add(m):
                    self._wait(self._stragglers(step))
            else:
                events.append(m)
        self._advance_clock(events)
        return self._conclude(ready, telemetry, batches, events, final=False)

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
        idle = [job for job, seen in self.job_seen_.items() if seen < self.now_ - self.job_idle_s]
        for job in idle:
            del self.job_seen_[job]
            self.stragglers_.pop(job, None)
            self.step_ends_.pop(job, None)
            self.job_first_.pop(job, None)
            self.assembler.forget(job)
            self.hang.forget(job)

    # ------------------------------------------------------------------ internals
    def _conclude(self, ready: list[Finding], telemetry: list[Telemetry], batches: list[StepBatch],
                  events: list[Event], *, final: bool) -> Output:
        out = Output()
        now = self.now_ if np.isfinite(self.now_) else 0.0
        out.findings += self.hang.update(batches, events, now)
        out.findings += self.sdc.update(events)
        out.findings += self.health.update(telemetry, events)
        out.findings += self.predictor.update(telemetry, events)
        ready += self._diagnosable(final)
        out.findings += self.rack_episodes.update(ready, self.diagnoser.rack_of)
        if self.policy is None:
            return out
        self.policy.observe(events)
        if out.findings:
            out.recommendations += self.policy.decide(out.findings, now)
        fresh: set[str] = set()
        at = now  # an interruption record is itself evidence that its job's time has reached it
        for ev in events:
            if ev.kind is EventKind.INTERRUPTION and ev.id not in self.interruptions_:
                try:
                    self.interruptions_[ev.id] = Interruption.from_event(ev)
                except SchemaError:
                    continue  # an interruption record without a job cannot be attributed; it is stored anyway
                self.assembler.restart(ev.job or "")
                fresh.add(ev.job or "")
                at = max(at, ev.ts)
        if fresh:
            horizon = at - self.pager.recent_s - self.pager.rate_window_s
            self.interruptions_ = {k: i for k, i in self.interruptions_.items() if i.ts >= horizon}
            report = self.pager.evaluate(self.interruptions_.values(), at, goodput_1h=self._worst_goodput(fresh, at))
            out.recommendations += report.to_recommendations(at)
        return out

    def _worst_goodput(self, jobs: set[str], now: float) -> float | None:
        """The lowest goodput over the last hour (or the job's life, from 10 minutes on) among ``jobs``."""
        values = []
        for job in jobs:
            ends = self.step_ends_.get(job)
            if not ends or len(ends) < 3:
                continue
            window = min(GOODPUT_WINDOW_S, now - self.job_first_[job])
            if window < GOODPUT_MIN_WINDOW_S:
                continue
            ts = np.fromiter(ends, dtype=np.float64, count=len(ends))
            gaps = np.diff(ts)
            gaps = gaps[gaps > 0]  # steps reported at one instant (a replay) carry no duration
            if gaps.size:
                mine = [i for i in self.interruptions_.values() if i.job == job]
                values.append(window_goodput(ts, ideal_step_time(gaps), mine, now, window))
        return min(values, default=None)

    def _stragglers(self, step: AssembledStep) -> list[Finding]:
        self.steps_total_ += 1
        ends = self.step_ends_.setdefault(step.job, deque())
        ends.append(step.ts)
        while ends and ends[0] < step.ts - GOODPUT_WINDOW_S:
            ends.popleft()
        self.job_first_.setdefault(step.job, step.ts)
        detector = self.stragglers_.get(step.job)
        if detector is None:
            detector = self.stragglers_[step.job] = self.straggler()
        found = detector.update(step.step, step.ranks, step.compute_s, step.groups)
        if not found:
            return []
        out = []
        for f in found:
            i = int(np.flatnonzero(step.ranks == f.rank)[0])
            out.append(dataclasses.replace(f, job=step.job, node=str(step.nodes[i]), gpu=int(step.gpus[i]),
                                           ts=step.ts))
        return out

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
                result = self.diagnoser.diagnose(f.node, f.gpu)
                ready.append(dataclasses.replace(f, diagnosis=result.diagnosis,
                                                 evidence={**f.evidence, **result.evidence}))
            else:
                waiting.append(f)
        self.pending_ = waiting
        self.waiting_racks_ = {self.diagnoser.rack_of(f.node) for f in waiting}
        return ready
