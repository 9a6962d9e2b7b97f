"""Decisions: eviction payback with guards, quarantine, paging on patterns, goodput and budget arithmetic.

The engine (:class:`PolicyEngine`) is pure: findings and an event time in, explained and guarded
recommendations out. Store-backed parts are thin: :mod:`fleethealth.policy.quarantine` (the
quarantine book) and :mod:`fleethealth.policy.persist` (engine state, eviction history, breaker).
"""

from fleethealth.policy.budget import AutoInterval, Comparison, YoungDaly, auto_interval, compare, young_daly
from fleethealth.policy.engine import PolicyEngine
from fleethealth.policy.eviction import EvictionOutcome, HealthyPosterior, payback_s
from fleethealth.policy.goodput import GoodputReport, Interruption, Timeline, goodput, timeline
from fleethealth.policy.guards import CircuitBreaker
from fleethealth.policy.paging import Page, Pager, PageReport, PageRule
from fleethealth.policy.quarantine import QuarantineRecord

__all__ = [
    "PolicyEngine",
    "EvictionOutcome",
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
