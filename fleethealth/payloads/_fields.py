"""Validators shared by the payload parsers: each raises :class:`SchemaError` naming the key."""

from __future__ import annotations

import math
from typing import Any

from fleethealth.errors import SchemaError

__all__ = ["hex_list", "rank_list", "opt_float"]


def hex_list(digests: Any) -> list[str]:
    """A list (or tuple) of non-empty hex strings (key ``digests``)."""
    if isinstance(digests, str) or not isinstance(digests, list | tuple):
        raise SchemaError("digests", "expected a list of hex strings")
    for d in digests:
        if not isinstance(d, str) or not d:
            raise SchemaError("digests", f"expected hex strings, got {d!r}")
        try:
            int(d, 16)
        except ValueError:
            raise SchemaError("digests", f"not a hex string: {d!r}") from None
    return list(digests)


def rank_list(ranks: Any) -> list[int]:
    """A list (or tuple) of non-negative integer ranks (key ``peer_ranks``)."""
    if not isinstance(ranks, list | tuple) or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
        raise SchemaError("peer_ranks", f"expected a list of non-negative integers, got {ranks!r}")
    return [int(r) for r in ranks]


def opt_float(name: str, value: Any) -> float | None:
    """A finite non-negative number, or ``None`` for null."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise SchemaError(name, f"expected a finite non-negative number or null, got {value!r}")
    return float(value)
