"""The one parameter check the policy modules share: a finite number above a floor."""

from __future__ import annotations

import math
from typing import Any

from fleethealth.errors import ConfigError

__all__ = ["check_number"]


def check_number(name: str, value: Any, *, minimum: float = 0.0, strict: bool = True) -> float:
    """``value`` as a float when it is a finite number above ``minimum`` (or equal to it, with
    ``strict=False``); else a :class:`ConfigError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise ConfigError(f"{name} must be {'>' if strict else '>='} {minimum:g}, got {value}")
    return float(value)
