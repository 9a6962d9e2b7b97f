"""The one parameter check every configurable part shares: the detectors, the policy and the config.

Each check raises :class:`~fleethealth.errors.ConfigError` naming the parameter and, for an
estimator, its class: ``StragglerDetector(z=-1).update(...)`` says ``StragglerDetector: z must be
> 0, got -1``. Detectors check on their first ``update`` (scikit-learn's habit), the policy in
``__init__``; both call the same two functions.

Every call states its bound: ``above=`` (strict) or ``at_least=`` (inclusive), with ``at_most=``
as the optional ceiling. There is no default floor on purpose: the two checkers this module
replaces had opposite defaults (the detectors' was ``>= 0``, the policy's ``> 0``), so the same
call without a bound meant different things in the two halves of the code. A check with neither
``above`` nor ``at_least`` accepts any finite number.
"""

from __future__ import annotations

import math

from fleethealth.errors import ConfigError

__all__ = ["check_number", "check_int"]


def _prefix(owner: object | None) -> str:
    return "" if owner is None else f"{type(owner).__name__}: "


def check_number(name: str, value: object, *, above: float | None = None, at_least: float | None = None,
                 at_most: float = math.inf, owner: object | None = None) -> float:
    """``value`` as a float when it is a finite number (not a bool) within the bounds, else a
    :class:`ConfigError` naming ``name`` (and ``owner``'s class when given)."""
    if above is not None and at_least is not None:
        raise TypeError("check_number: give above= or at_least=, not both")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{_prefix(owner)}{name} must be a finite number, got {value!r}")
    low_ok = ((above is None or value > above) and (at_least is None or value >= at_least))
    if not low_ok or value > at_most:
        bounds = [f"> {above:g}"] if above is not None else [f">= {at_least:g}"] if at_least is not None else []
        if at_most < math.inf:
            bounds.append(f"<= {at_most:g}")
        raise ConfigError(f"{_prefix(owner)}{name} must be {' and '.join(bounds)}, got {value!r}")
    return float(value)


def check_int(name: str, value: object, *, at_least: int = 0, owner: object | None = None) -> int:
    """``value`` when it is an integer (not a bool) ``>= at_least``, else a :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        raise ConfigError(f"{_prefix(owner)}{name} must be an integer >= {at_least}, got {value!r}")
    return value
