"""Decisions: eviction payback with guards, quarantine, paging on patterns, goodput and budget arithmetic.

The engine (:class:`PolicyEngine`) is pure: findings and an event time in, explained and guarded
recommendations out; its rules live in :mod:`fleethealth.policy.rules`, one module a family of
findings, and its memory is one dataclass (``rules.context.EngineState``). :class:`PolicyStage` is
the stage the detector runner composes after detection: the engine, the pager and the goodput it
reads, and the eviction-outcome loop.

Store-backed parts are thin: :mod:`fleethealth.policy.quarantine` (the
quarantine book) and :mod:`fleethealth.policy.persist` (engine state, eviction history, breaker).
"""

from fleethealth.policy.budget import AutoInterval, Comparison, YoungDaly, auto_interval, compare, young_daly
from fleethealth.policy.engine import PolicyEngine
from fleethealth.policy.eviction import EvictionOutcome, EvictionWatch, HealthyPosterior, payback_s
from fleethealth.policy.goodput import GoodputReport, Interruption, Timeline, goodput, timeline
from fleethealth.policy.guards import CircuitBreaker
from fleethealth.policy.paging import Page, Pager, PageReport, PageRule
from fleethealth.policy.quarantine import QuarantineRecord
from fleethealth.policy.stage import Decisions, PolicyStage

__all__ = [
    "PolicyEngine",
    "PolicyStage",
    "Decisions",
    "EvictionOutcome",
    "EvictionWatch",
    "HealthyPosterior",
    "payback_s",
    "CircuitBreaker",
    "QuarantineRecord",
    "Pager",
    "PageRule",
    "Page",
    "PageReport",
    "Interruption",
    "Timeline",
    "GoodputReport",
    "goodput",
    "timeline",
    "YoungDaly",
    "AutoInterval",
    "Comparison",
    "young_daly",
    "auto_interval",
    "compare",
]
