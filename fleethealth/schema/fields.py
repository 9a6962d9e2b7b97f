"""What every message shares: the schema version, the input limits, the topics, and the field readers.

The readers (``_str``, ``_int``, ``_float``, ``_array`` …) validate one field of a parsed JSON object
and raise :class:`SchemaError` naming it; every message's ``from_obj`` is built from them.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

import numpy as np

from fleethealth.errors import SchemaError

SCHEMA_VERSION = 1
MAX_COMPUTE_S = 86_400.0
"""A compute time above a day is not a measurement; it is rejected as absurd."""
MAX_TS = 4_102_444_800.0
"""Event times are epoch seconds before 2100-01-01; anything later is a forged or broken clock."""
MAX_MESSAGE_BYTES = 512 * 1024
"""An input message larger than this is dead-lettered unread, so nothing derived from it (a finding
quoting it, a dead letter carrying it) can outgrow what a Kafka broker accepts (1 MiB by default)."""
MAX_DATA_DEPTH = 32
"""Nesting limit of an event's ``data`` object (what orjson can write back is 254 levels)."""
MAX_TEXT_CHARS = 16_384
"""Longest free-text ``message`` an event may carry."""
GPU_INDEX_MAX = int(np.iinfo(np.int16).max)
"""GPU indices are int16 on the wire and UInt16 in the store; one bound for both."""
RANK_MAX = int(np.iinfo(np.int32).max)
"""Ranks are int32 on the wire and UInt32 in the store; one bound for both."""


class Topic(StrEnum):
    TELEMETRY = "fh.telemetry"
    STEPS = "fh.steps"
    EVENTS = "fh.events"
    FINDINGS = "fh.findings"
    RECOMMENDATIONS = "fh.recommendations"
    DEADLETTER = "fh.deadletter"
    NODESTATE = "fh.nodestate"
    SNAPSHOTS = "fh.snapshots"


# ---------------------------------------------------------------- field readers
_INT_MAX = 2**63 - 1
"""Integers travel into Int64/UInt64 columns; anything larger is not a step, rank or code."""


def _req(obj: dict[str, Any], name: str) -> Any:
    if name not in obj:
        raise SchemaError(name, "missing")
    return obj[name]


def _str(obj: dict[str, Any], name: str, *, optional: bool = False) -> str | None:
    value = obj.get(name) if optional else _req(obj, name)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise SchemaError(name, f"expected a non-empty string, got {value!r}")
    return value


def _int(obj: dict[str, Any], name: str, *, optional: bool = False, minimum: int = 0,
         maximum: int = _INT_MAX) -> int | None:
    value = obj.get(name) if optional else _req(obj, name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(name, f"expected an integer, got {value!r}")
    if value < minimum:
        raise SchemaError(name, f"must be >= {minimum}, got {value}")
    if value > maximum:
        raise SchemaError(name, f"must be <= {maximum}, got {value}")
    return value


def _float(obj: dict[str, Any], name: str, *, optional: bool = False, minimum: float | None = 0.0,
           maximum: float | None = None) -> float | None:
    value = obj.get(name) if optional else _req(obj, name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchemaError(name, f"expected a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise SchemaError(name, f"must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise SchemaError(name, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SchemaError(name, f"must be <= {maximum}, got {value}")
    return value


def _ts(obj: dict[str, Any]) -> float:
    """An event time: finite epoch seconds in ``[0, MAX_TS)``."""
    return _float(obj, "ts", maximum=MAX_TS)  # type: ignore[return-value]


def _depth_ok(value: Any, limit: int) -> bool:
    """True when ``value`` nests no deeper than ``limit`` lists and objects (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return False
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return True


def _obj(obj: dict[str, Any], name: str) -> dict[str, Any]:
    value = obj.get(name, {})
    if not isinstance(value, dict):
        raise SchemaError(name, f"expected an object, got {type(value).__name__}")
    return value


def _enum(obj: dict[str, Any], name: str, enum: type[StrEnum], *, optional: bool = False) -> Any:
    value = obj.get(name) if optional else _req(obj, name)
    if value is None and optional:
        return None
    try:
        return enum(value)
    except ValueError:
        known = ", ".join(e.value for e in enum)
        raise SchemaError(name, f"unknown value {value!r} (known: {known})") from None


def _array(obj: dict[str, Any], name: str, dtype: type, *, length: int | None = None,
           nan_ok: bool = False, minimum: float | None = None, maximum: float | None = None) -> np.ndarray:
    value = _req(obj, name)
    if not isinstance(value, list):
        raise SchemaError(name, f"expected an array, got {type(value).__name__}")
    if length is not None and len(value) != length:
        raise SchemaError(name, f"expected {length} values, got {len(value)}")
    allowed = {int, float, type(None)} if nan_ok else {int, float}
    if np.dtype(dtype).kind == "i":
        allowed = {int}
    found = set(map(type, value)) - allowed
    if found:
        raise SchemaError(name, f"expected {'integers' if allowed == {int} else 'numbers'}, "
                                f"found {sorted(t.__name__ for t in found)}")
    try:
        arr = np.array(value, dtype=np.float64 if nan_ok else dtype)
    except (OverflowError, ValueError) as exc:
        raise SchemaError(name, f"value out of range for {np.dtype(dtype).name} ({exc})") from None
    if arr.dtype.kind == "f":
        bad = np.isinf(arr) if nan_ok else ~np.isfinite(arr)
        if bad.any():
            raise SchemaError(name, f"non-finite value at index {int(np.argmax(bad))}")
    finite = arr.size and not np.isnan(arr).all()
    if minimum is not None and finite and np.nanmin(arr) < minimum:
        raise SchemaError(name, f"values must be >= {minimum}, found {np.nanmin(arr)}")
    if maximum is not None and finite and np.nanmax(arr) > maximum:
        raise SchemaError(name, f"values must be <= {maximum}, found {np.nanmax(arr)}")
    return arr


_I32 = np.iinfo(np.int32)
_I16_MAX = int(np.iinfo(np.int16).max)


def _jsonable(arr: np.ndarray) -> list[Any]:
    if arr.dtype.kind == "f" and np.isnan(arr).any():
        return [None if math.isnan(x) else x for x in arr.tolist()]
    return arr.tolist()


def _contiguous(arr: np.ndarray) -> np.ndarray:
    """A float array as orjson (``OPT_SERIALIZE_NUMPY``) takes it: contiguous float64, which it writes
    as the same bytes as :func:`_jsonable`'s list (NaN as null) without a Python object per value."""
    return np.ascontiguousarray(arr, dtype=np.float64)


def _bools(obj: dict[str, Any], name: str, length: int) -> np.ndarray:
    value = _req(obj, name)
    if not isinstance(value, list) or len(value) != length or not all(type(x) is bool for x in value):
        raise SchemaError(name, f"expected an array of {length} booleans")
    return np.array(value, dtype=bool)
