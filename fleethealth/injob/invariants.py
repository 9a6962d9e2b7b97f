"""Cheap invariants checked every step (seed 000 §7, defence (a)); torch-free.

::

    if not isfinite(loss):              skip the update; the non-finite hook acts by classification
                                        (:class:`NonFiniteAction`: skip a transient, raise otherwise)
    if grad_norm > 10 x running p99:    skip the update, count the anomaly

The running p99 is taken over the last ``window`` accepted gradient norms (rejected ones never
enter it, so a burst of spikes cannot raise its own ceiling). No ceiling applies until ``warmup``
norms have been seen.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fleethealth.errors import ConfigError, FleetHealthError

__all__ = ["NonFiniteLoss", "InvariantVerdict", "Invariants", "NonFiniteHook", "NonFiniteAction",
           "DEFAULT_NONFINITE_ACTIONS", "default_on_nonfinite"]

_log = logging.getLogger("fleethealth.injob")


class NonFiniteLoss(FleetHealthError):
    """The loss (or, on another rank, the all-reduced gradient) was NaN or infinite: the default
    abort-and-report action raises this once the check results have been reported."""

    def __init__(self, step: int, loss: float, classification: str | None = None, what: str = "loss") -> None:
        self.step = step
        self.loss = loss
        self.classification = classification
        cause = "" if classification is None else f" (classified {classification})"
        super().__init__(f"non-finite {what} at step {step} (loss {loss}){cause}")


@dataclass(frozen=True)
class InvariantVerdict:
    """The invariants' decision for one step.

    ``skip_update``: do not apply this step's update (non-finite loss or norm, or a spike).
    ``ceiling``: the gradient-norm ceiling in force (``None`` during warm-up); ``reason`` is empty
    when the step is fine, else ``"nonfinite_loss"``, ``"nonfinite_grad"`` or ``"grad_spike"``.
    """

    step: int
    loss: float
    grad_norm: float
    ceiling: float | None
    skip_update: bool
    reason: str = ""


class Invariants:
    """Per-step loss and gradient-norm checks with anomaly counters.

    Parameters: ``ceiling_factor`` (10) x the running ``quantile`` (0.99) of the last ``window``
    accepted norms, refreshed every ``refresh`` norms; ``warmup`` norms before any ceiling applies.
    Counters: ``nonfinite_total``, ``spikes_total``, ``anomalies_total`` (their sum), ``steps_total``.
    """

    def __init__(self, *, ceiling_factor: float = 10.0, quantile: float = 0.99, window: int = 1000,
                 warmup: int = 50, refresh: int = 10) -> None:
        if not ceiling_factor > 1.0:
            raise ConfigError(f"ceiling_factor must be > 1, got {ceiling_factor}")
        if not 0.0 < quantile <= 1.0:
            raise ConfigError(f"quantile must be in (0, 1], got {quantile}")
        if window < 1 or warmup < 1 or warmup > window:
            raise ConfigError(f"need 1 <= warmup <= window, got warmup={warmup} window={window}")
        if refresh < 1:
            raise ConfigError(f"refresh must be >= 1, got {refresh}")
        self.refresh = int(refresh)
        self._ceiling: float | None = None
        self._ceiling_at = -1
        self.ceiling_factor = float(ceiling_factor)
        self.quantile = float(quantile)
        self.window = int(window)
        self.warmup = int(warmup)
        self.norms_ = np.zeros(self.window)
        self.seen_ = 0
        self.steps_total = 0
        self.nonfinite_total = 0
        self.spikes_total = 0

    @property
    def anomalies_total(self) -> int:
        return self.nonfinite_total + self.spikes_total

    def ceiling(self) -> float | None:
        """The current gradient-norm ceiling, or ``None`` during warm-up. The quantile is recomputed
        every ``refresh`` accepted norms (it moves slowly over a window of ``window``)."""
        n = min(self.seen_, self.window)
        if n < self.warmup:
            return None
        if self._ceiling is None or self.seen_ - self._ceiling_at >= self.refresh:
            self._ceiling = self.ceiling_factor * float(np.quantile(self.norms_[:n], self.quantile))
            self._ceiling_at = self.seen_
        return self._ceiling

    def check(self, step: int, loss: float, grad_norm: float) -> InvariantVerdict:
        """Judge one step from its loss and total gradient norm (plain floats)."""
        self.steps_total += 1
        loss, grad_norm = float(loss), float(grad_norm)
        ceiling = self.ceiling()
        if not math.isfinite(loss):
            self.nonfinite_total += 1
            return InvariantVerdict(step, loss, grad_norm, ceiling, True, "nonfinite_loss")
        if not math.isfinite(grad_norm):
            self.nonfinite_total += 1
            return InvariantVerdict(step, loss, grad_norm, ceiling, True, "nonfinite_grad")
        if ceiling is not None and grad_norm > ceiling:
            self.spikes_total += 1
            return InvariantVerdict(step, loss, grad_norm, ceiling, True, "grad_spike")
        self.norms_[self.seen_ % self.window] = grad_norm
        self.seen_ += 1
        return InvariantVerdict(step, loss, grad_norm, ceiling, False)


NONFINITE_ACTIONS = ("skip", "raise")
DEFAULT_NONFINITE_ACTIONS: dict[str, str] = {"transient": "skip", "persistent": "raise", "data_or_code": "raise",
                                             "unclassified": "raise"}
"""What the default hook does per classification of a non-finite step: a transient fault (a
self-check on the suspect rank failed) has already been kept out of the weights by the skipped
update, so training goes on; a persistent fault, data or code, or an unexplained one stops the job."""


class NonFiniteAction:
    """The non-finite hook, configurable per classification: ``skip`` (the update was skipped on
    every rank; log and go on) or ``raise`` (:class:`NonFiniteLoss`, after the report went out).

    ``actions`` overrides :data:`DEFAULT_NONFINITE_ACTIONS` by classification (``transient``,
    ``persistent``, ``data_or_code``, ``unclassified``)."""

    def __init__(self, **actions: str) -> None:
        merged = {**DEFAULT_NONFINITE_ACTIONS, **actions}
        for cls, action in merged.items():
            if cls not in DEFAULT_NONFINITE_ACTIONS:
                raise ConfigError(f"unknown classification {cls!r} (known: {', '.join(DEFAULT_NONFINITE_ACTIONS)})")
            if action not in NONFINITE_ACTIONS:
                raise ConfigError(f"non-finite action for {cls} must be one of {NONFINITE_ACTIONS}, got {action!r}")
        self.actions = merged
        self.skipped_total = 0

    def __call__(self, verdict: InvariantVerdict, classification: str | None) -> None:
        action = self.actions[classification or "unclassified"]
        what = "loss" if verdict.reason == "nonfinite_loss" else "gradient"
        if action == "raise":
            raise NonFiniteLoss(verdict.step, verdict.loss, classification, what)
        self.skipped_total += 1
        _log.warning("fleethealth: non-finite %s at step %d classified %s: update skipped, training goes on",
                     what, verdict.step, classification)


def default_on_nonfinite(verdict: InvariantVerdict, classification: str | None) -> None:
    """The default hook: :class:`NonFiniteAction` at its defaults (skip a transient, raise otherwise)."""
    NonFiniteAction()(verdict, classification)


NonFiniteHook = Callable[[InvariantVerdict, str | None], None]
