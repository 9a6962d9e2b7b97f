"""Live settings reaching running detectors: the range check of a reloaded file and its application
at a batch boundary, keeping every detector's state.

The keys that may change without a restart are :data:`fleethealth.config.LIVE_KEYS`; the command
holds them in a :class:`fleethealth.config.LiveSettings` and, between two batches of its runner,
calls :func:`apply` with what :meth:`~fleethealth.config.LiveSettings.take` returned.

* :func:`validate` builds a twin of each part a live key reaches from the new settings and runs the
  part's own parameter checks (the straggler detector's thresholds derived from its false-alarm
  budget, the health rules' ranges, the policy engine's and pager's constructors), so a value out of
  range refuses the whole file before anything running changes.
* :func:`apply` sets the new values on the parts in force: each pipeline's straggler factory (for
  jobs seen later) and every job's straggler detector (its derived thresholds recomputed, its
  per-rank baselines, CUSUM statistics and episodes kept), the health rules, the policy engine's
  scalar thresholds and the pager. New pipelines (a partition assigned later) are built from the
  settings in force by the command's factory, and a pipeline restored from a snapshot (which holds
  the parameters of the process that wrote it) takes the live keys in force at the next boundary.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fleethealth.config import LIVE_KEYS, LiveSettings, Reload, Settings
from fleethealth.detectors.health import HealthRules
from fleethealth.detectors.straggler import StragglerDetector
from fleethealth.errors import ConfigError
from fleethealth.policy.engine import PolicyEngine
from fleethealth.policy.paging import Pager

if TYPE_CHECKING:
    from fleethealth.detectors.pipeline import Pipeline
    from fleethealth.detectors.runner import Runner

__all__ = ["validate", "apply", "reconfigure", "at_boundary"]

log = logging.getLogger("fleethealth.config")


def _of(settings: Settings, table: str) -> dict[str, Any]:
    return settings.section(table, changed_only=True)


def _live(table: str) -> set[str]:
    return {name.rpartition(".")[2] for name in LIVE_KEYS if name.rpartition(".")[0] == table}


def validate(settings: Settings) -> None:
    """A :class:`ConfigError` naming the parameter when a value the live keys reach is out of range."""
    StragglerDetector(**_of(settings, "detect.straggler"))._validate_params()
    HealthRules(**_of(settings, "detect.health"))._start()
    try:
        PolicyEngine(**_of(settings, "policy"))
        Pager(**_of(settings, "policy.paging"))
    except ValueError as exc:  # the constructors' checks (ConfigError is one)
        raise ConfigError(str(exc)) from exc


def reconfigure(detector: Any, params: Mapping[str, Any]) -> None:
    """Set ``params`` (live parameters of ``detector``'s class) on a built detector, keeping its state.

    A straggler detector that has started recomputes what it derives from its parameters (each arm's
    threshold from the false-alarm budget, the winsorising limits, the effect gates); the health rules
    their minimum Xid severity. The values are checked on a twin first (:func:`validate`), so a
    detector is never left half reconfigured."""
    for name, value in params.items():
        if not hasattr(detector, name):
            raise ConfigError(f"{type(detector).__name__} has no parameter {name!r}")
        setattr(detector, name, value)
    if isinstance(detector, StragglerDetector) and hasattr(detector, "k_"):
        arms = detector.k_.shape[0]
        detector._validate_params()
        if detector.k_.shape[0] != arms:  # drifts is restart-only; a live change never reaches here
            raise ConfigError(f"StragglerDetector: the number of arms changed from {arms} to {detector.k_.shape[0]}")
    elif isinstance(detector, HealthRules) and hasattr(detector, "min_severity_"):
        from fleethealth.xid import XidSeverity

        detector.min_severity_ = XidSeverity(detector.min_xid_severity)


def _straggler_factory(pipeline: Pipeline, params: dict[str, Any]) -> None:
    base = pipeline.straggler
    cls = base.func if isinstance(base, functools.partial) else base
    pipeline.straggler = functools.partial(cls, **params)


def _apply_pipelines(pipelines: list[Pipeline], settings: Settings, sections: set[str]) -> list[str]:
    done: list[str] = []
    if "detect.straggler" in sections:
        live = {k: v for k, v in settings.section("detect.straggler").items() if k in _live("detect.straggler")}
        n = 0
        for pipeline in pipelines:
            _straggler_factory(pipeline, _of(settings, "detect.straggler"))
            for detector in pipeline.stragglers_.values():
                if isinstance(detector, StragglerDetector):
                    reconfigure(detector, live)
                    n += 1
        done.append(f"straggler: {len(pipelines)} pipeline(s), {n} job detector(s)")
    if "detect.health" in sections:
        live = {k: v for k, v in settings.section("detect.health").items() if k in _live("detect.health")}
        for pipeline in pipelines:
            reconfigure(pipeline.health, live)
        done.append(f"health: {len(pipelines)} pipeline(s)")
    return done


def apply(runner: Runner, plan: Reload) -> list[str]:
    """Carry ``plan``'s live changes into ``runner``'s parts; returns what was reconfigured, for the log."""
    sections = plan.sections()
    settings = plan.settings
    done = _apply_pipelines([p for p in runner.pipelines.values() if p is not None], settings, sections)
    policy = getattr(runner, "policy", None)
    if policy is not None and "policy" in sections:
        twin = PolicyEngine(**_of(settings, "policy"))
        for name in _live("policy"):
            setattr(policy.engine, name, getattr(twin, name))
        done.append("policy engine")
    if policy is not None and "policy.paging" in sections:
        twin_pager = Pager(**_of(settings, "policy.paging"))
        for name in _live("policy.paging"):
            setattr(policy.pager, name, getattr(twin_pager, name))
        done.append("pager")
    return done


def at_boundary(live: LiveSettings, runner: Runner) -> Callable[[], None]:
    """What the runner calls between two batches: apply a requested or pending reload, and log what it
    reached. A reload that fails to apply (it was validated, so this is a defect) is logged, counted
    and leaves the loop running."""
    seen: weakref.WeakSet[Pipeline] = weakref.WeakSet()

    def between() -> None:
        plan = live.take()
        try:
            if plan is not None and plan.applied:
                done = apply(runner, plan)
                log.warning("config reload applied (%d key(s)) to %s", len(plan.applied),
                            "; ".join(done) or "nothing running")
            # a pipeline restored from a snapshot carries the detectors' parameters of the process that
            # wrote it: the live keys in force win
            fresh = [p for p in runner.pipelines.values() if p is not None and p not in seen]
            if fresh:
                _apply_pipelines(fresh, live.current, {"detect.straggler", "detect.health"})
                seen.update(fresh)
        except (ConfigError, ValueError) as exc:
            live.failed(f"applying the reload: {exc}")

    return between
