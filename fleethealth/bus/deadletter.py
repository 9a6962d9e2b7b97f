"""Dead letters (``fh.deadletter``): a value that could not be decoded or validated, with the reason."""

from __future__ import annotations

import base64
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Self

from fleethealth.errors import SchemaError
from fleethealth.schema import Topic

DEADLETTER_VERSION = 1
DEADLETTER_RAW_BYTES = 64 * 1024
"""A dead letter carries at most this much of the original value (then ``truncated`` is true, and
``raw_size`` and ``raw_sha256`` identify the whole), so a dead letter always fits in one Kafka request."""
DEADLETTER_REASON_CHARS = 2_000


@dataclass(frozen=True)
class DeadLetter:
    """A value that could not be decoded or validated (topic ``fh.deadletter``).

    ``raw`` is the original value as text, or base64 when it is not UTF-8 (then ``raw_base64``
    is true); ``key`` likewise (``key_base64``). ``ts`` is the broker timestamp of the original
    record in seconds (NaN when the broker gave none). A value larger than
    :data:`DEADLETTER_RAW_BYTES` is cut to that size: ``truncated`` is then true, and ``raw_size``
    (bytes) and ``raw_sha256`` describe the whole value.
    """

    topic: str
    partition: int
    offset: int
    key: str | None
    reason: str
    raw: str
    raw_base64: bool = False
    key_base64: bool = False
    ts: float = math.nan
    raw_size: int = -1
    raw_sha256: str = ""
    truncated: bool = False
    TOPIC = Topic.DEADLETTER

    def to_obj(self) -> dict[str, Any]:
        return {"v": DEADLETTER_VERSION, "topic": self.topic, "partition": self.partition,
                "offset": self.offset, "key": self.key, "key_base64": self.key_base64,
                "reason": self.reason, "raw": self.raw, "raw_base64": self.raw_base64,
                "ts": None if math.isnan(self.ts) else self.ts, "raw_size": self.raw_size,
                "raw_sha256": self.raw_sha256, "truncated": self.truncated}

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        if obj.get("v") != DEADLETTER_VERSION:
            raise SchemaError("v", f"unknown dead-letter version {obj.get('v')!r}")
        for name, kind in (("topic", str), ("partition", int), ("offset", int), ("reason", str), ("raw", str)):
            if not isinstance(obj.get(name), kind) or isinstance(obj.get(name), bool):
                raise SchemaError(name, f"expected {kind.__name__}, got {obj.get(name)!r}")
        key, ts = obj.get("key"), obj.get("ts")
        if key is not None and not isinstance(key, str):
            raise SchemaError("key", f"expected a string or null, got {key!r}")
        if ts is not None and (isinstance(ts, bool) or not isinstance(ts, int | float)):
            raise SchemaError("ts", f"expected a number or null, got {ts!r}")
        size, digest = obj.get("raw_size", -1), obj.get("raw_sha256", "")
        if isinstance(size, bool) or not isinstance(size, int) or not isinstance(digest, str):
            raise SchemaError("raw_size", f"expected an integer and a hex digest, got {size!r}, {digest!r}")
        return cls(topic=obj["topic"], partition=obj["partition"], offset=obj["offset"], key=key,
                   reason=obj["reason"], raw=obj["raw"], raw_base64=bool(obj.get("raw_base64", False)),
                   key_base64=bool(obj.get("key_base64", False)), ts=math.nan if ts is None else float(ts),
                   raw_size=size, raw_sha256=digest, truncated=bool(obj.get("truncated", False)))

    def raw_bytes(self) -> bytes:
        """The original value as it arrived (its first :data:`DEADLETTER_RAW_BYTES` when ``truncated``)."""
        return base64.b64decode(self.raw) if self.raw_base64 else self.raw.encode()

    @classmethod
    def of(cls, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
           reason: str, ts_ms: int | None) -> DeadLetter:
        value = value or b""
        kept = value[:DEADLETTER_RAW_BYTES]
        raw, raw_b64 = _text_or_base64(kept)
        key_text, key_b64 = (None, False) if key is None else _text_or_base64(key[:1024])
        ts = ts_ms / 1000.0 if ts_ms is not None and ts_ms >= 0 else math.nan
        if len(reason) > DEADLETTER_REASON_CHARS:
            reason = reason[:DEADLETTER_REASON_CHARS] + " …"
        return cls(topic=topic, partition=partition, offset=offset, key=key_text, reason=reason, raw=raw,
                   raw_base64=raw_b64, key_base64=key_b64, ts=ts, raw_size=len(value),
                   raw_sha256=hashlib.sha256(value).hexdigest(), truncated=len(kept) < len(value))


def _text_or_base64(data: bytes) -> tuple[str, bool]:
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), True
