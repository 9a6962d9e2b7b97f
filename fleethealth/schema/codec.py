"""The codec: ``encode``, ``decode`` and ``decode_many`` over every message type, and which type each topic carries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import orjson

from fleethealth.errors import SchemaError
from fleethealth.schema.columnar import _block_shape_ok, _blocks_columnar, _step_shape_ok, _steps_columnar
from fleethealth.schema.events import Event
from fleethealth.schema.fields import MAX_MESSAGE_BYTES, SCHEMA_VERSION, Topic
from fleethealth.schema.findings import Finding, Recommendation
from fleethealth.schema.nodestate import NodeState
from fleethealth.schema.steps import StepBatch, StepBlock
from fleethealth.schema.telemetry import Telemetry, telemetry_columnar

_T = TypeVar("_T")

Message = Telemetry | StepBatch | StepBlock | Event | Finding | Recommendation | NodeState

TOPIC_TYPES: dict[Topic, type] = {
    Topic.TELEMETRY: Telemetry,
    Topic.STEPS: StepBatch,
    Topic.EVENTS: Event,
    Topic.FINDINGS: Finding,
    Topic.RECOMMENDATIONS: Recommendation,
    Topic.NODESTATE: NodeState,
}


def encode(msg: Message) -> bytes:
    """Serialise a message to JSON bytes (with ``"v"``). A telemetry sample's columns and a node
    state's float arrays go to orjson as arrays (the same bytes as lists with null for NaN: a probe
    publishes a sample a second per node, the node stage a state per changed node)."""
    obj = msg.to_obj(arrays=True) if isinstance(msg, NodeState | Telemetry) else msg.to_obj()
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def load_object(raw: bytes | str | dict[str, Any]) -> dict[str, Any]:
    """Parse one JSON object (a dict passes through); :class:`SchemaError` on anything else."""
    if isinstance(raw, dict):
        return raw
    if len(raw) > MAX_MESSAGE_BYTES:
        raise SchemaError("<message>", f"{len(raw)} bytes exceed the {MAX_MESSAGE_BYTES}-byte message limit")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SchemaError("<message>", f"not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise SchemaError("<message>", f"expected a JSON object, got {type(obj).__name__}")
    return obj


def decode(cls: type[_T], raw: bytes | str | dict[str, Any]) -> _T:
    """Parse and validate one message of type ``cls``; raise :class:`SchemaError` naming the field.

    ``fh.steps`` carries two forms: asked for a :class:`StepBatch`, a value whose ``steps`` is an
    array is a :class:`StepBlock` and is returned as one (:meth:`StepBlock.split` gives its batches).
    """
    obj = load_object(raw)
    version = obj.get("v")
    if type(version) is not int or version != SCHEMA_VERSION:  # true == 1 in Python, not on the wire
        raise SchemaError("v", f"unknown schema version {version!r} (this build reads {SCHEMA_VERSION})")
    if cls is StepBatch and "steps" in obj:
        return StepBlock.from_obj(obj)  # type: ignore[return-value]
    return cls.from_obj(obj)  # type: ignore[attr-defined]


def decode_many(cls: type[_T], raws: Sequence[bytes | str]) -> list[_T | Exception]:
    """Decode many values of one message type (a poll's worth); one result per value, in order.

    Each result is the message, or the exception :func:`decode` raises for that value (a
    :class:`SchemaError` naming the field) — returned, not raised, so one bad value does not
    hide the rest. Results and errors are exactly :func:`decode`'s: step batches and step blocks are
    validated columnar over the whole poll (one NumPy pass for ranks, GPUs and compute times, one for
    the blocks' steps, times and rows), telemetry samples likewise, stacked by shape
    (:func:`~fleethealth.schema.telemetry.telemetry_columnar`), and any value that pass does not accept outright is
    decoded
    alone by :func:`decode`.
    """
    out: list[Any] = [None] * len(raws)
    fast: list[tuple[int, dict[str, Any]]] = []
    blocks: list[tuple[int, dict[str, Any]]] = []
    samples: list[tuple[int, dict[str, Any]]] = []
    for i, raw in enumerate(raws):
        try:
            obj = orjson.loads(raw) if len(raw) <= MAX_MESSAGE_BYTES else None
        except (orjson.JSONDecodeError, TypeError):
            obj = None
        if cls is StepBatch and type(obj) is dict and "steps" in obj:
            if _block_shape_ok(obj):
                blocks.append((i, obj))
            else:
                out[i] = _decode_one(cls, obj)
        elif cls is StepBatch and type(obj) is dict and _step_shape_ok(obj):
            fast.append((i, obj))
        elif cls is Telemetry and type(obj) is dict:
            samples.append((i, obj))
        else:
            out[i] = _decode_one(cls, obj if type(obj) is dict else raw)
    if fast:
        for (i, obj), msg in zip(fast, _steps_columnar([obj for _, obj in fast]), strict=True):
            out[i] = msg if msg is not None else _decode_one(cls, obj)
    if blocks:
        for (i, obj), msg in zip(blocks, _blocks_columnar([obj for _, obj in blocks]), strict=True):
            out[i] = msg if msg is not None else _decode_one(cls, obj)
    if samples:
        for (i, obj), msg in zip(samples, telemetry_columnar([obj for _, obj in samples]), strict=True):
            out[i] = msg if msg is not None else _decode_one(cls, obj)
    return out


def _decode_one(cls: type[_T], raw: bytes | str | dict[str, Any]) -> _T | Exception:
    try:
        return decode(cls, raw)
    except Exception as exc:  # returned to the caller, which reports it per value
        return exc
