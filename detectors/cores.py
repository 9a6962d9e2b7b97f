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
from collections.abc import Sequence
from dataclasses import dataclass, field

from fleethealth.detectors.pipeline import Pipeline
from fleethealth.payloads.progress import job_end_events, job_progress_events
from fleethealth.policy.eviction import EvictionOutcome
from fleethealth.policy.stage import PolicyStage
from fleethealth.schema import Action, Event, Finding, Message, NodeState, Recommendation, StepBatch, StepBlock

__all__ = ["Conclusions", "conclude", "publishable"]


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
