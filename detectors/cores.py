"""What one batch of input concludes, composed of the pure stages: detection, then policy.

:func:`conclude` is the one place where detection (:class:`~fleethealth.detectors.pipeline.Pipeline`:
findings, the derived ``interruption`` events, node states, the jobs' progress and ends) and the policy
(:class:`~fleethealth.policy.stage.PolicyStage`: recommendations, pages, eviction outcomes) are
composed, for every form of the tier: the whole tier in one process hands detection's conclusions to
the policy in process; a node or job stage detects only and publishes what the policy stage reads
(findings, ``job_progress``, ``job_end``, ``interruption``), which that stage decides on. Pure: no I/O,
no clock. :class:`Conclusions` is what the runner (:mod:`fleethealth.detectors.runner`) carries out:
rows to store, messages to publish, the policy state to save.
"""

from __future__ import annotations

import itertools
import logging
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from fleethealth.bus import Record
from fleethealth.detectors.effects import Effects
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.snapshot import WHOLE
from fleethealth.detectors.stages import NODE_FINDING_KINDS, Stage, group_topics, takes_event, takes_finding
from fleethealth.detectors.state import State, from_state, state_dict
from fleethealth.errors import ConfigError
from fleethealth.ids import token as digest_token
from fleethealth.payloads.progress import job_end_events, job_progress_events
from fleethealth.policy.eviction import EvictionOutcome
from fleethealth.policy.stage import PolicyStage
from fleethealth.schema import (
    Action,
    Event,
    Finding,
    Message,
    NodeState,
    Recommendation,
    StepBatch,
    StepBlock,
    Telemetry,
    Topic,
)

__all__ = ["Conclusions", "conclude", "publishable", "Core", "DetectCore", "WholeCore", "PolicyCore", "Tier",
           "make_core"]

log = logging.getLogger(__name__)


@dataclass
class Conclusions:
    """What one batch of input concluded: detection's findings, then the policy's decisions."""

    findings: list[Finding] = field(default_factory=list)
    recommendations: list[Recommendation] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    """Events detection derived (``interruption``), stored with the input events."""
    outcomes: list[EvictionOutcome] = field(default_factory=list)
    policy_changed: bool = False
    refused: list[StepBatch | StepBlock] = field(default_factory=list)
    kept: list[tuple[StepBlock, StepBlock]] = field(default_factory=list)
    rejected: list[tuple[Message, str]] = field(default_factory=list)
    states: list[NodeState] = field(default_factory=list)
    """Node states to publish on ``fh.nodestate`` (the node stage)."""
    unscored: list[tuple[str, int]] = field(default_factory=list)
    """Jobs newly found too small to score for stragglers, with their largest group (logged once)."""
    progress: list[Event] = field(default_factory=list)
    """``job_progress`` and ``job_end`` events for the policy (:mod:`fleethealth.payloads.progress`): a job
    stage publishes them on ``fh.events``; :func:`conclude` hands them to a policy in process."""

    def extend(self, other: Conclusions) -> None:
        """Add what ``other`` (a later part of the same batch, or another partition's) concluded."""
        self.findings += other.findings
        self.recommendations += other.recommendations
        self.events += other.events
        self.states += other.states
        self.unscored += other.unscored
        self.progress += other.progress
        self.outcomes += other.outcomes
        self.policy_changed = self.policy_changed or other.policy_changed
        self.refused += other.refused
        self.kept += other.kept
        self.rejected += other.rejected


def publishable(msg: Finding | Recommendation) -> bool:
    """Whether ``msg`` goes to the bus: every finding, and the recommendations that ask a scheduler for
    an action (a ``none`` — already recommended, not worth it, stale — stays in the store only)."""
    return not isinstance(msg, Recommendation) or msg.action is not Action.NONE


def conclude(pipeline: Pipeline | None, policy: PolicyStage | None, messages: Sequence[Message], *,
             final: bool = False, now: float = 0.0) -> Conclusions:
    """Detection, then policy, on ``messages`` (in event-time order); pure. With ``final`` (end of
    input), the pipeline's drain is decided too. The one place the two stages are composed.

    Either may be None: a node or job stage detects only (its findings go to the policy stage over
    ``fh.findings``); the policy stage decides on the findings among ``messages``, at event time ``now``."""
    events = [m for m in messages if isinstance(m, Event)]
    if pipeline is None:
        out = Conclusions()
        if policy is None:
            return out
        # each finding decided at its own event time, as the detectors concluded it (those of one instant together)
        for ts, group in itertools.groupby((m for m in messages if isinstance(m, Finding | Event)), key=lambda m: m.ts):
            now = max(now, ts)
            batch = list(group)
            decided = policy.update([m for m in batch if isinstance(m, Finding)],
                                    [m for m in batch if isinstance(m, Event)], now)
            out.recommendations += decided.recommendations
            out.outcomes += decided.outcomes
            out.policy_changed = out.policy_changed or decided.changed
        if final:
            flushed = policy.flush()
            out.recommendations += flushed.recommendations
        return out
    out = pipeline.feed(messages)
    findings, derived_events, states = list(out.findings), list(out.events), list(out.states)
    unscored = list(out.unscored)
    # what the policy learns of the jobs' steps and ends: the same messages a job stage publishes
    progress = [*job_progress_events(out.steps), *job_end_events(out.ended, out.now)]
    tail = pipeline.drain() if final else None
    tail_progress: list[Event] = []
    if tail is not None:
        findings += tail.findings
        derived_events += tail.events
        tail_progress = [*job_progress_events(tail.steps), *job_end_events(tail.ended, tail.now)]
    if policy is None:
        return Conclusions(findings=findings, events=derived_events, refused=list(out.refused),
                           kept=list(out.kept), rejected=list(out.rejected), states=states, unscored=unscored,
                           progress=[*progress, *tail_progress])
    decided = policy.update(out.findings, [*events, *out.events, *progress], out.now)
    if tail is not None:
        decided.extend(policy.update(tail.findings, [*tail.events, *tail_progress], tail.now))
        decided.extend(policy.flush())
    return Conclusions(findings=findings, recommendations=decided.recommendations, events=derived_events,
                       outcomes=decided.outcomes, policy_changed=decided.changed, refused=list(out.refused),
                       kept=list(out.kept), rejected=list(out.rejected), states=states, unscored=unscored)


# ---------------------------------------------------------------------------------------------- stage cores
class Core(ABC):
    """A stage of the detector tier as a pure core: ``step(records, now) -> Effects``, ``forget(jobs, nodes)``
    and ``state_dict(unit)`` / ``from_state(unit, state)`` for the units it snapshots (a partition's pipeline,
    or :data:`~fleethealth.detectors.snapshot.WHOLE` for one pipeline over every partition). No I/O, no
    clock: the runner (:mod:`fleethealth.detectors.runner`) polls, orders by event time, carries out the
    :class:`~fleethealth.detectors.effects.Effects`, commits and snapshots, the same for every core.

    ``pipelines`` are the core's detection pipelines (keyed by partition, or ``None`` for the one of the
    whole tier; none in the policy stage) and ``policy`` its :class:`PolicyStage` (None in a detection
    stage); ``shared`` the objects its pipelines share, referenced by name in a snapshot."""

    stage: Stage
    stores_inputs = True
    """Whether it stores the input events it takes (the policy stage's are stored by the stage that owns them)."""
    publishes_events = False
    """Whether the events it derives and the jobs' progress and ends go out on ``fh.events`` (the job stage)."""
    publishes_states = False
    """Whether its node states go out on ``fh.nodestate`` (the node stage)."""
    state_class: type = Pipeline
    """The class of one unit of its state (a snapshot of another class is refused)."""
    keeps_state = False
    """Whether it has units of state to snapshot (the detection stages, the whole tier)."""
    without_key = logging.WARNING
    """How loudly a runner says it has no snapshot key (a scaled-out stage should have one)."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.pipelines: dict[int | None, Pipeline] = {}
        self.policy: PolicyStage | None = None
        self.shared: dict[str, object] = {}

    # ---------------------------------------------------------------------- the step
    def takes(self, msg: Message) -> bool:
        """Whether the stage processes ``msg`` (another stage's events and findings are left to it)."""
        if isinstance(msg, Event):
            return takes_event(self.stage, msg)
        if isinstance(msg, Finding):
            return takes_finding(self.stage, msg)
        return True

    def step(self, records: Sequence[Record], now: float, *, final: bool = False) -> Effects:
        """Conclude ``records`` (in event-time order; ``now``: the newest event time of the records stepped
        before) and say what is to be stored, published and saved. With ``final`` (end of input) the
        pipelines' drain is concluded too. A detector that raises on the batch has it fed again one record
        at a time; the records it raises on come back in ``poisoned``."""
        ready = [r for r in records if self.takes(r.msg)]
        out, kept, poisoned = self._conclude(ready, now, final)
        token = _token(kept, out)
        rejected = {id(m) for m, _ in out.rejected}
        refused = {id(b) for b in out.refused}
        origin: dict[int, Record] = {}
        telemetry: list[Telemetry] = []
        taken: list[Record] = []
        steps: list[StepBatch | StepBlock] = []
        inputs: list[Event] = []
        for r in kept:  # one pass over the records (a poll of one-step batches is thousands)
            m = r.msg
            origin[id(m)] = r
            if isinstance(m, Telemetry):
                telemetry.append(m)
            if id(m) in rejected:
                continue
            taken.append(r)
            if isinstance(m, StepBatch | StepBlock):
                if id(m) not in refused:
                    steps.append(m)
            elif isinstance(m, Event):
                inputs.append(m)
        for block, accepted in out.kept:  # the steps of a partly refused block the assembler took
            steps.append(accepted)
            if id(block) in origin:
                origin[id(accepted)] = origin[id(block)]
        if not self.stores_inputs:
            inputs = []
        outbox: list[Finding | Recommendation | Event] = [
            m for m in (*out.findings, *out.recommendations) if publishable(m)]
        if self.publishes_events:  # the policy stage reads the stops the lifecycle derived, the progress and ends
            outbox += [*out.events, *out.progress]
        return Effects(taken=tuple(taken), token=token, rejected=tuple(out.rejected), poisoned=tuple(poisoned),
                       telemetry=tuple(telemetry), steps=tuple(steps), events=(*inputs, *out.events),  # type: ignore[arg-type]
                       findings=tuple(out.findings), recommendations=tuple(out.recommendations),
                       outcomes=tuple(out.outcomes), outbox=tuple(outbox),
                       states=tuple(out.states) if self.publishes_states else (),
                       policy=self.policy.engine if out.policy_changed and self.policy is not None else None,
                       now=self._reached(ready, now), unscored=tuple(out.unscored), origin_=origin)

    def _reached(self, ready: Sequence[Record], now: float) -> float:
        """The event time the core reached after stepping ``ready`` (``now`` before it)."""
        return now

    @abstractmethod
    def _conclude(self, ready: list[Record], now: float,
                  final: bool) -> tuple[Conclusions, list[Record], list[tuple[Record, str]]]:
        """Conclude the records the core takes: the conclusions, the records kept, the poisoned ones."""

    def _part(self, pipeline: Pipeline | None, ready: list[Record], now: float, final: bool, *,
              decide: bool = True) -> tuple[Conclusions, list[Record], list[tuple[Record, str]]]:
        """:func:`conclude` on one pipeline's records (and the policy's decisions, with ``decide``); if a
        detector raises, the records again one at a time (the detectors take what they had folded in before
        as duplicates), each record it raises on returned with the error."""
        policy = self.policy if decide else None
        try:
            return conclude(pipeline, policy, [r.msg for r in ready], final=final, now=now), ready, []
        except Exception as exc:
            log.warning("a detector raised on a batch of %d record(s), isolating: %s: %s", len(ready),
                        type(exc).__name__, exc)
        out, kept, poisoned = Conclusions(), [], []
        for rec in ready:
            try:
                out.extend(conclude(pipeline, policy, [rec.msg], now=now))
            except Exception as exc:
                poisoned.append((rec, f"detector: {type(exc).__name__}: {exc}"))
                continue
            kept.append(rec)
        if final:
            out.extend(conclude(pipeline, policy, [], final=True, now=now))
        return out, kept, poisoned

    def written(self) -> None:
        """The step's effects are carried out: what the policy took out is in the quarantine book now."""
        if self.policy is not None:
            self.policy.unbooked_.clear()

    def open_steps(self) -> set[tuple[str, int]]:
        """The (job, step) pairs not concluded yet: their step records are not to be committed past."""
        still: set[tuple[str, int]] = set()
        for pipeline in self.pipelines.values():
            still |= pipeline.open_steps()
        return still

    def forget(self, jobs: Iterable[str] = (), nodes: Iterable[str] = ()) -> None:
        """Drop what the core holds about ``jobs`` and ``nodes`` (its pipelines', and the policy's of the jobs)."""
        jobs, nodes = list(jobs), list(nodes)
        for pipeline in self.pipelines.values():
            pipeline.forget(jobs, nodes)
        if self.policy is not None:  # as a job_end does; the nodes' quarantine is the book's to release
            for job in jobs:
                self.policy.step_ends_.pop(job, None)
                self.policy.job_first_.pop(job, None)
                self.policy.engine.forget_job(job)

    # ---------------------------------------------------------------------- units of state
    def wanted(self, assigned: set[int]) -> set[int]:
        """The units of state the core holds with ``assigned`` partitions (none: nothing to snapshot)."""
        return set()

    def held(self) -> set[int]:
        """The units of state the core holds now."""
        return set()

    def fresh(self, unit: int) -> Pipeline:
        """A unit's state built from the configuration (the one a snapshot replaces)."""
        raise ConfigError(f"the {self.stage} stage keeps no snapshot state")

    def unit(self, unit: int) -> Pipeline:
        """The state of one unit the core holds."""
        raise ConfigError(f"the {self.stage} stage keeps no snapshot state")

    def adopt(self, unit: int, state: Pipeline) -> None:
        """Hold ``state`` as the unit's (a fresh one, or one restored from a snapshot)."""
        raise ConfigError(f"the {self.stage} stage keeps no snapshot state")

    def drop(self, units: Iterable[int]) -> None:  # noqa: B027 — a core that holds no units drops none
        """Forget the units of partitions the group moved to another replica (its new owner restores them)."""

    def state_dict(self, unit: int) -> State:
        """The explicit state of one unit (what a snapshot holds; the shared objects by name)."""
        return state_dict(self.unit(unit), shared=self.shared)

    def from_state(self, unit: int, state: State) -> Pipeline:
        """One unit's state rebuilt from ``state`` (configuration from :meth:`fresh`); not held yet."""
        return from_state(state, like=self.fresh(unit), shared=self.shared,  # type: ignore[no-any-return]
                          expect=self.state_class)


class DetectCore(Core):
    """A node or job stage: one pipeline per partition of its group (made by ``make``); the records of its
    tables (node states, the node stage's findings) go to every pipeline. A job stage's pipelines share the
    replica's node-state table (``shared["node_states"]``)."""

    def __init__(self, stage: Stage, make: Callable[[], Pipeline], *, shared: dict[str, object] | None = None,
                 publishes_events: bool = False, publishes_states: bool = False) -> None:
        super().__init__(stage)
        self.keeps_state = True
        self.make = make
        self.shared = dict(shared or {})
        self.publishes_events = publishes_events
        self.publishes_states = publishes_states
        self.group = frozenset(group_topics(stage))

    def _conclude(self, ready: list[Record], now: float,
                  final: bool) -> tuple[Conclusions, list[Record], list[tuple[Record, str]]]:
        for rec in ready:
            if rec.topic in self.group and rec.partition not in self.pipelines:
                self.pipelines[rec.partition] = self.make()
        routed: dict[int | None, list[Record]] = {p: [] for p in self.pipelines}
        for rec in ready:  # one pass, event-time order kept: a table record goes to every pipeline
            if rec.topic in self.group:
                routed[rec.partition].append(rec)
            else:
                for part in routed.values():
                    part.append(rec)
        out, kept, poisoned = Conclusions(), [], []
        for partition, mine in routed.items():
            if not mine and not final:
                continue
            part, done, bad = self._part(self.pipelines[partition], mine, now, final)
            out.extend(part)
            kept += [r for r in done if r.topic in self.group]
            poisoned += bad
        return out, kept, poisoned

    def wanted(self, assigned: set[int]) -> set[int]:
        return set(assigned)

    def held(self) -> set[int]:
        return {p for p in self.pipelines if p is not None}

    def fresh(self, unit: int) -> Pipeline:
        return self.make()

    def unit(self, unit: int) -> Pipeline:
        return self.pipelines[unit]

    def adopt(self, unit: int, state: Pipeline) -> None:
        self.pipelines[unit] = state

    def drop(self, units: Iterable[int]) -> None:
        for p in units:
            self.pipelines.pop(p, None)


@dataclass
class Tier:
    """The whole tier's state in one snapshot: the node side's pipeline and the job side's (the policy's
    is the engine's, saved in the store)."""

    node: Pipeline
    job: Pipeline

    @property
    def now_(self) -> float:
        return max(self.node.now_, self.job.now_)


class WholeCore(Core):
    """The whole tier in one process (``--stage all``): the node, job and policy stages wired in process.
    What passes between them passes as the messages the staged form publishes, in event-time order: the node
    side's node states and findings (those of :data:`~fleethealth.detectors.stages.NODE_FINDING_KINDS`) to
    the job side; every finding, the input events, the derived ``interruption`` events and the jobs'
    ``job_progress`` and ``job_end`` to the policy, which decides each finding at its own event time. One
    unit of state, :data:`~fleethealth.detectors.snapshot.WHOLE` (a :class:`Tier`), restored once when the
    group first gives the runner partitions."""

    state_class = Tier

    def __init__(self, node: Pipeline, job: Pipeline, policy: PolicyStage) -> None:
        super().__init__(Stage.ALL)
        self.keeps_state = True
        self.without_key = logging.INFO  # the one-machine default
        self.node, self.job = node, job
        self.pipelines = {None: job, NODE_SIDE: node}
        self.policy = policy
        self.restored_ = False
        self.clock_ = float("-inf")
        """The policy side's event time: the newest of what it was handed."""

    def _conclude(self, ready: list[Record], now: float,
                  final: bool) -> tuple[Conclusions, list[Record], list[tuple[Record, str]]]:
        node_in: list[Record] = []
        job_in: list[Record] = []
        events: list[Record] = []
        for r in ready:  # one pass, each side's records in the order given
            m = r.msg
            if isinstance(m, StepBatch | StepBlock):
                job_in.append(r)
            elif isinstance(m, Telemetry):
                node_in.append(r)
            elif isinstance(m, Event):
                events.append(r)
                if takes_event(Stage.NODE, m):
                    node_in.append(r)
                if takes_event(Stage.JOB, m):
                    job_in.append(r)
        node, node_kept, bad = self._part(self.node, node_in, now, final, decide=False)
        handed = [*(_handed(Topic.NODESTATE, s) for s in node.states),
                  *(_handed(Topic.FINDINGS, f) for f in node.findings if f.kind in NODE_FINDING_KINDS)]
        job, job_kept, job_bad = self._part(self.job, _by_time([*job_in, *handed]), now, final, decide=False)
        told = [*(_handed(Topic.FINDINGS, f) for f in (*node.findings, *job.findings)),
                *(_handed(Topic.EVENTS, e) for e in (*node.events, *job.events, *job.progress))]
        policy_in = _by_time([*events, *told])
        decided, _, policy_bad = self._part(None, policy_in, self.clock_, final)
        self.clock_ = max([self.clock_, *(r.msg.ts for r in policy_in)])
        out = Conclusions(findings=[*node.findings, *job.findings], recommendations=decided.recommendations,
                          events=[*node.events, *job.events], outcomes=decided.outcomes,
                          policy_changed=decided.policy_changed, refused=[*node.refused, *job.refused],
                          kept=[*node.kept, *job.kept], rejected=[*node.rejected, *job.rejected],
                          states=node.states, unscored=[*node.unscored, *job.unscored], progress=job.progress)
        kept = [*node_kept, *(r for r in job_kept if r.offset >= 0)]
        return out, kept, [*bad, *job_bad, *((r, why) for r, why in policy_bad if r.offset >= 0)]

    def _reached(self, ready: Sequence[Record], now: float) -> float:
        return max(self.node.now_, self.job.now_)

    def wanted(self, assigned: set[int]) -> set[int]:
        return {WHOLE} if assigned or self.restored_ else set()

    def held(self) -> set[int]:
        return {WHOLE} if self.restored_ else set()

    def fresh(self, unit: int) -> Tier:  # type: ignore[override]
        return Tier(self.node, self.job)  # not fed yet when it is restored: their configuration is the one to keep

    def unit(self, unit: int) -> Tier:  # type: ignore[override]
        return Tier(self.node, self.job)

    def adopt(self, unit: int, state: Tier) -> None:  # type: ignore[override]
        self.node, self.job = state.node, state.job
        self.pipelines = {None: state.job, NODE_SIDE: state.node}
        self.restored_ = True


NODE_SIDE = -1
"""The key of the whole tier's node-side pipeline among its ``pipelines`` (the job side's is None)."""


def _handed(topic: Topic, msg: Message) -> Record:
    """A message one stage hands another in process, as the record it would be on ``topic`` (no offset)."""
    return Record(topic.value, -1, -1, None, msg)


def _by_time(records: list[Record]) -> list[Record]:
    """``records`` in event-time order (stable: those of one instant keep their order)."""
    return sorted(records, key=_EVENT_TIME)


_EVENT_TIME = operator.attrgetter("msg.ts")


class PolicyCore(Core):
    """The policy stage: findings and events in, recommendations, pages and eviction outcomes out, each
    finding decided at its own event time. Its state is the engine's, saved in the store after each step."""

    stores_inputs = False

    def __init__(self, policy: PolicyStage) -> None:
        super().__init__(Stage.POLICY)
        self.policy = policy

    def _conclude(self, ready: list[Record], now: float,
                  final: bool) -> tuple[Conclusions, list[Record], list[tuple[Record, str]]]:
        return self._part(None, ready, now, final)

    def _reached(self, ready: Sequence[Record], now: float) -> float:
        return max([now, *(r.msg.ts for r in ready)])


def make_core(stage: Stage | str, *, pipeline: Pipeline | Callable[[], Pipeline] | None = None,
              policy: Callable[[], PolicyStage] | None = None) -> Core:
    """The core of ``stage``: the one place a stage chooses what it is. ``pipeline`` is the whole tier's
    pipeline (or a factory of it), or a node or job stage's factory of one per partition (default: the
    defaults; a job stage's share one node-state table); ``policy`` makes the policy stage's (the whole
    tier's and the policy stage's)."""
    stage = Stage(stage)
    make_policy = policy if policy is not None else PolicyStage
    if stage is Stage.POLICY:
        return PolicyCore(make_policy())
    if isinstance(pipeline, Pipeline):
        raise ConfigError(f"the {stage} stage keeps " + ("a node-side and a job-side pipeline" if stage is Stage.ALL
                          else "one pipeline per partition") + ": pass a factory (a callable returning a "
                          "Pipeline), not one pipeline")
    if stage is Stage.ALL:
        make_all = pipeline if pipeline is not None else Pipeline
        return WholeCore(make_all(), make_all(), make_policy())
    if stage is Stage.NODE:
        return DetectCore(stage, pipeline if pipeline is not None else Pipeline, publishes_states=True)
    make = pipeline if pipeline is not None else _job_pipelines()
    # the job stage's pipelines share the replica's node-state table: referenced by name in a snapshot,
    # never written into it (it is rebuilt from fh.nodestate)
    return DetectCore(stage, make, shared={"node_states": make().diagnoser}, publishes_events=True)


def _job_pipelines() -> Callable[[], Pipeline]:
    """Default pipelines of a job stage: they share one node-state table (the replica's copy of ``fh.nodestate``)."""
    from fleethealth.detectors.diagnosis import Diagnoser

    shared = Diagnoser()
    return lambda: Pipeline(diagnoser=shared)


def _token(records: Sequence[Record], out: Conclusions) -> str:
    """A deduplication token naming exactly what a write covers: the input offsets and the output ids."""
    # a split block's steps share its offset and are released apart: a record is its offset and step
    offsets = (f"{r.topic}/{r.partition}/{r.offset}/{r.msg.step if isinstance(r.msg, StepBatch) else ''};"
               for r in sorted(records, key=operator.attrgetter("topic", "partition", "offset")))
    return digest_token([*offsets, *(msg.id for msg in (*out.findings, *out.recommendations, *out.events))])
