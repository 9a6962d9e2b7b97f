"""Parameter checks shared by the detectors (scikit-learn style: run on the first ``update``).

Each check raises :class:`~fleethealth.errors.ConfigError` naming the estimator and the parameter,
so ``StragglerDetector(clip=-1).update(...)`` says ``StragglerDetector: clip must be ...``.
"""

from __future__ import annotations

import math

from fleethealth.errors import ConfigError

__all__ = ["check_int", "check_float"]


def check_int(owner: object, name: str, value: object, *, minimum: int = 0) -> int:
    """Return ``value`` if it is an integer (not bool) >= ``minimum``, else raise ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{type(owner).__name__}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_float(owner: object, name: str, value: object, *, minimum: float = 0.0, strict: bool = False,
                maximum: float = math.inf) -> float:
    """Return ``float(value)`` if finite and within bounds (``> minimum`` when ``strict``), else raise."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > minimum if strict else value >= minimum) and value <= maximum
    if not ok:
        bound = f"> {minimum}" if strict else f">= {minimum}"
        if maximum < math.inf:
            bound += f" and <= {maximum}"
        raise ConfigError(f"{type(owner).__name__}: {name} must be a finite number {bound}, got {value!r}")
    return float(value)
