"""Page on the pattern, not the count (seed 000 revision R5).

At an MTBF of 3.1 hours a 30-day run has 233 interruptions and perhaps two that need a person. A
pager that fires on routine failures is muted within a week, so the rules page only on patterns:

1. the same node interrupts twice → "quarantine ineffective" (it should have left the pool);
2. the failure rate over the last hour beyond 5 × the measured baseline → "failure rate anomaly";
3. the same job failing at the same step repeatedly → deterministic: data or code, not hardware;
4. goodput over the last hour below 0.3 → "goodput collapse" (restarts eat more than steps).

Everything else is an independent hardware failure: counted and reported (timeline, digest),
never paged. Rule 2 also needs ``rate_min_count`` failures in the window (default 3), so two
coincident independent failures at a small baseline cannot page on their own.

:class:`Pager` is pure like the detectors: parameters in ``__init__``, the pages already sent in
``paged_`` (a pattern pages once per ``repage_after_s``), ``evaluate(interruptions, now)`` decides.
A pattern's key names the rule and what it is about (the node, the job and step), never the time:
an anomaly or a goodput collapse that lasts all day pages once a day, not once an hour. Keys older
than ``repage_after_s`` are dropped, so ``paged_`` stays small.

A page's id is deterministic in event time: it names the pattern's key, the event time its
episode began (the interruption that made the pattern hold: the second on the node or at the
step, the newest in the window for the rate and goodput rules) and how many ``repage_after_s``
have passed since (0 for the first page, 1 for the first reminder …) — never the decision time,
so a restart that evaluates the same interruptions again makes the same page, which consumers
drop by id, while a reminder a day later is a page of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fleethealth.ids import derived
from fleethealth.params import check_number
from fleethealth.policy.goodput import Interruption
from fleethealth.schema import Action, Guard, Recommendation

__all__ = ["PageRule", "Page", "PageReport", "Pager", "GOODPUT_WINDOW_S", "GOODPUT_MIN_WINDOW_S"]


class PageRule(StrEnum):
    QUARANTINE_INEFFECTIVE = "quarantine_ineffective"
    FAILURE_RATE_ANOMALY = "failure_rate_anomaly"
    DETERMINISTIC_FAILURE = "deterministic_failure"
    GOODPUT_COLLAPSE = "goodput_collapse"


@dataclass(frozen=True)
class Page:
    """One page: the rule that fired, why in words, and the numbers behind it."""

    rule: PageRule
    reason: str
    key: str
    job: str | None = None
    node: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    episode: str = ""
    """The page's place in event time: ``"<episode start, s>+<repage number>"`` (see the module docstring)."""


@dataclass(frozen=True)
class PageReport:
    """``pages`` to send now; ``independent`` failures in the recent window that no pattern explains
    (counted, reported, never paged); ``suppressed`` pages already sent for the same pattern."""

    pages: tuple[Page, ...]
    interruptions: int
    independent: int
    suppressed: int
    observed_rate_per_h: float
    baseline_rate_per_h: float | None

    def to_recommendations(self, now: float) -> list[Recommendation]:
        """One ``page`` recommendation per page, decided at ``now``; the id comes from the page's
        ``episode``, so the same pattern paged again after ``repage_after_s`` is a new recommendation
        and the same page decided again (a restart, another batching of the input) is not."""
        return [Recommendation(action=Action.PAGE, node=p.node or "fleet", ts=now, reason=p.reason,
                               guard=Guard.NEEDS_HUMAN, job=p.job, finding_id=derived("page", f"{p.key}@{p.episode}"),
                               evidence={"rule": p.rule.value, **p.evidence})
                for p in self.pages]




GOODPUT_WINDOW_S = 3600.0
"""The default window of a job's goodput for the collapse rule: the last hour (seed 000 R5)."""
GOODPUT_MIN_WINDOW_S = 600.0
"""The default history a job needs for a goodput figure."""


class Pager:
    """Parameters: ``recent_s`` window of rules 1 and 3 (86,400); ``rate_window_s`` (3,600);
    ``rate_factor`` (5); ``rate_min_count`` (3); ``baseline_per_h`` the measured interruption rate
    (None: estimated from the interruptions before the rate window, needing at least
    ``baseline_min_count``); ``goodput_floor`` (0.3); ``repage_after_s`` (86,400); ``goodput_window_s``
    the window a job's goodput is measured over for rule 4 (3,600) and ``goodput_min_window_s`` the
    history a job needs before it has a figure (600; the figure of a younger window covers its life),
    both read by :class:`~fleethealth.policy.stage.PolicyStage`."""

    def __init__(self, *, recent_s: float = 86_400.0, rate_window_s: float = 3600.0, rate_factor: float = 5.0,
                 rate_min_count: int = 3, baseline_per_h: float | None = None, baseline_min_count: int = 5,
                 goodput_floor: float = 0.3, repage_after_s: float = 86_400.0,
                 goodput_window_s: float = GOODPUT_WINDOW_S,
                 goodput_min_window_s: float = GOODPUT_MIN_WINDOW_S) -> None:
        self.recent_s = check_number("recent_s", recent_s, above=0)
        self.rate_window_s = check_number("rate_window_s", rate_window_s, above=0)
        self.rate_factor = check_number("rate_factor", rate_factor, above=0)
        self.rate_min_count = int(check_number("rate_min_count", rate_min_count, above=0))
        self.baseline_per_h = (None if baseline_per_h is None
                               else check_number("baseline_per_h", baseline_per_h, above=0))
        self.baseline_min_count = int(check_number("baseline_min_count", baseline_min_count, above=0))
        self.goodput_floor = check_number("goodput_floor", goodput_floor, above=0)
        self.repage_after_s = check_number("repage_after_s", repage_after_s, above=0)
        self.goodput_window_s = check_number("goodput_window_s", goodput_window_s, above=0)
        self.goodput_min_window_s = check_number("goodput_min_window_s", goodput_min_window_s, at_least=0,
                                                 at_most=self.goodput_window_s)
        self.paged_: dict[str, float] = {}

    def _baseline(self, history: Sequence[Interruption], now: float) -> float | None:
        if self.baseline_per_h is not None:
            return self.baseline_per_h
        old = [i for i in history if i.ts <= now - self.rate_window_s]
        if len(old) < self.baseline_min_count:
            return None
        span_h = (now - self.rate_window_s - min(i.ts for i in old)) / 3600.0
        return len(old) / span_h if span_h > 0 else None

    def evaluate(self, interruptions: Iterable[Interruption], now: float,
                 goodput_1h: float | None = None) -> PageReport:
        """Pages for the interruptions known at event time ``now`` (any order; future ones ignored)."""
        history = sorted((i for i in interruptions if i.ts <= now), key=lambda i: (i.ts, i.node or ""))
        recent = [i for i in history if i.ts > now - self.recent_s]
        found: list[tuple[Page, set[int], float]] = []  # (page, the interruptions it explains, episode start)

        by_node: dict[str, list[int]] = {}
        for k, i in enumerate(recent):
            if i.node:
                by_node.setdefault(i.node, []).append(k)
        for node, idx in sorted(by_node.items()):
            if len(idx) >= 2:
                jobs = sorted({recent[k].job for k in idx})
                found.append((Page(PageRule.QUARANTINE_INEFFECTIVE, f"node {node} interrupted {len(idx)} times "
                                   f"in {self.recent_s / 3600:.0f} h (jobs {', '.join(jobs)}): quarantine "
                                   "ineffective", key=f"{PageRule.QUARANTINE_INEFFECTIVE}:{node}", node=node,
                                   evidence={"count": len(idx), "jobs": jobs,
                                             "ts": [recent[k].ts for k in idx]}), set(idx), recent[idx[1]].ts))

        by_step: dict[tuple[str, int], list[int]] = {}
        for k, i in enumerate(recent):
            if i.step is not None:
                by_step.setdefault((i.job, i.step), []).append(k)
        for (job, step), idx in sorted(by_step.items()):
            if len(idx) >= 2:
                nodes = sorted({recent[k].node or "?" for k in idx})
                found.append((Page(PageRule.DETERMINISTIC_FAILURE, f"job {job} failed {len(idx)} times at step "
                                   f"{step} (nodes {', '.join(nodes)}): deterministic failure, data or code, "
                                   "not hardware", key=f"{PageRule.DETERMINISTIC_FAILURE}:{job}:{step}", job=job,
                                   evidence={"step": step, "count": len(idx), "nodes": nodes}), set(idx),
                          recent[idx[1]].ts))

        window = [k for k, i in enumerate(recent) if i.ts > now - self.rate_window_s]
        observed = len(window) / (self.rate_window_s / 3600.0)
        baseline = self._baseline(history, now)
        if baseline is not None and len(window) >= self.rate_min_count and observed > self.rate_factor * baseline:
            found.append((Page(PageRule.FAILURE_RATE_ANOMALY, f"{len(window)} interruptions in the last "
                               f"{self.rate_window_s / 60:.0f} min: {observed:.2f}/h against a baseline of "
                               f"{baseline:.2f}/h (> {self.rate_factor:g}x): failure rate anomaly",
                               key=str(PageRule.FAILURE_RATE_ANOMALY),
                               evidence={"observed_per_h": observed, "baseline_per_h": baseline,
                                         "factor": self.rate_factor, "count": len(window)}), set(window),
                          recent[window[-1]].ts))

        if goodput_1h is not None and goodput_1h < self.goodput_floor:
            span = "hour" if self.goodput_window_s == 3600.0 else f"{self.goodput_window_s / 60:g} min"
            found.append((Page(PageRule.GOODPUT_COLLAPSE, f"goodput over the last {span} {goodput_1h:.2f} is below "
                               f"{self.goodput_floor:g}: restarts consume more time than steps",
                               key=str(PageRule.GOODPUT_COLLAPSE),
                               evidence={"goodput_1h": goodput_1h, "floor": self.goodput_floor,
                                         "window_s": self.goodput_window_s}), set(window),
                          recent[window[-1]].ts if window else now))

        self.paged_ = {k: t for k, t in self.paged_.items() if now - t < self.repage_after_s}
        explained: set[int] = set()
        pages: list[Page] = []
        suppressed = 0
        for page, idx, since in found:
            explained |= idx
            last = self.paged_.get(page.key)
            if last is not None and now - last < self.repage_after_s:
                suppressed += 1
                continue
            self.paged_[page.key] = now
            repage = max(0, int((now - since) // self.repage_after_s))
            pages.append(dataclasses.replace(page, episode=f"{since:.0f}+{repage}"))
        return PageReport(pages=tuple(pages), interruptions=len(recent), independent=len(recent) - len(explained),
                          suppressed=suppressed, observed_rate_per_h=observed, baseline_rate_per_h=baseline)

    def to_state(self) -> dict[str, Any]:
        return {"paged": dict(self.paged_)}

    def load_state(self, state: dict[str, Any]) -> None:
        self.paged_ = {str(k): float(v) for k, v in state.get("paged", {}).items()}
