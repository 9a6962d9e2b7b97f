"""Result records of the known-answer self-tests: verdicts, located mismatches, one record per test.

A :class:`SelfTestResult` is what every test returns and what travels on ``fh.events`` as
``Event(kind=SELFTEST)``; its :meth:`SelfTestResult.to_data` gives the record's keys (``suite``,
``test``, ``device``, ``verdict``, ``mismatches``, ``max_error``, ``duration_s``, ``throughput``,
``unit``, plus ``model`` and ``baseline``) and :meth:`SelfTestResult.from_data` reads them back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from fleethealth.errors import SchemaError
from fleethealth.schema import Event, EventKind

__all__ = ["Verdict", "Mismatch", "SelfTestResult", "MAX_REPORTED", "bits_of"]

MAX_REPORTED = 16
"""At most this many mismatches are carried in one record; ``mismatch_total`` counts them all."""


class Verdict(StrEnum):
    """``pass``: right answers at expected speed; ``fail``: a wrong answer (a mismatch, or a test
    that could not complete); ``slow``: right answers, throughput more than the allowed fraction
    below the device model's baseline (correct but degraded hardware)."""

    PASS = "pass"
    FAIL = "fail"
    SLOW = "slow"


def bits_of(xor: int) -> tuple[int, ...]:
    """Bit positions (0 = least significant) set in ``xor``: the bits that differ."""
    if xor < 0:
        raise ValueError("bits_of takes a non-negative integer")
    out = []
    pos = 0
    while xor:
        if xor & 1:
            out.append(pos)
        xor >>= 1
        pos += 1
    return tuple(out)


@dataclass(frozen=True)
class Mismatch:
    """One wrong value, located.

    ``where`` names the place: ``"C"`` (a GEMM output element at ``row``, ``col``), ``"A"`` or
    ``"B"`` (an operand element corrupted in device memory), ``"memory"`` (a word at byte ``offset``
    and virtual ``address``), ``"rank"`` (a collective contribution or result of ``rank`` at element
    ``index``). ``bits`` are the differing bit positions of the raw representation (empty where the
    method locates the element but not the bit, as ABFT does); ``expected`` / ``observed`` are the
    values (hex strings for raw words, numbers otherwise).
    """

    where: str
    row: int | None = None
    col: int | None = None
    index: int | None = None
    offset: int | None = None
    address: int | None = None
    rank: int | None = None
    bits: tuple[int, ...] = ()
    expected: float | str | None = None
    observed: float | str | None = None
    detail: str = ""

    def to_obj(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"where": self.where}
        for name in ("row", "col", "index", "offset", "address", "rank", "expected", "observed"):
            value = getattr(self, name)
            if value is not None:
                obj[name] = value
        if self.bits:
            obj["bits"] = list(self.bits)
        if self.detail:
            obj["detail"] = self.detail
        return obj

    @classmethod
    def from_obj(cls, obj: Mapping[str, Any]) -> Mismatch:
        if not isinstance(obj, Mapping) or not isinstance(obj.get("where"), str):
            raise SchemaError("mismatches", f"expected an object with 'where', got {obj!r}")
        known = {"where", "row", "col", "index", "offset", "address", "rank", "bits", "expected", "observed",
                 "detail"}
        unknown = set(obj) - known
        if unknown:
            raise SchemaError(f"mismatches.{sorted(unknown)[0]}", "unknown field")
        return cls(where=obj["where"], row=obj.get("row"), col=obj.get("col"), index=obj.get("index"),
                   offset=obj.get("offset"), address=obj.get("address"), rank=obj.get("rank"),
                   bits=tuple(obj.get("bits", ())), expected=obj.get("expected"),
                   observed=obj.get("observed"), detail=obj.get("detail", ""))

    def describe(self) -> str:
        """A short human-readable location, e.g. ``C[3,17] bits 22`` or ``memory +0x40 bits 5``."""
        if self.where == "memory":
            loc = f"memory +{self.offset:#x}"
        elif self.where == "rank":
            loc = f"rank {self.rank}" + (f"[{self.index}]" if self.index is not None else "")
        elif self.row is not None:
            loc = f"{self.where}[{self.row},{self.col}]"
        else:
            loc = self.where
        return loc + (f" bits {','.join(map(str, self.bits))}" if self.bits else "")


def _num(obj: Mapping[str, Any], name: str, *, optional: bool = False) -> float | None:
    value = obj.get(name)
    if value is None:
        if optional:
            return None
        raise SchemaError(name, "missing")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchemaError(name, f"expected a number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SelfTestResult:
    """The outcome of one known-answer test on one device.

    ``throughput`` is in ``unit`` (``TFLOP/s`` for GEMMs, ``GB/s`` for memory and bus bandwidth);
    ``baseline`` is the device model's expected throughput in the same unit (``None`` when no
    baseline is known, in which case speed cannot make the verdict ``slow``). ``max_error`` is the
    worst deviation seen, 0.0 on a clean pass: for exact GEMMs and collectives the largest absolute
    difference from the known answer; for ABFT the largest checksum residual divided by its
    tolerance (above 1 is a detection); for memory the most bits wrong in one word.
    ``mismatches`` holds at most :data:`MAX_REPORTED` located mismatches out of ``mismatch_total``;
    ``ts`` is the event time at which the test completed.
    """

    suite: str
    test: str
    device: str
    verdict: Verdict
    duration_s: float
    throughput: float
    unit: str
    max_error: float = 0.0
    mismatches: tuple[Mismatch, ...] = ()
    mismatch_total: int = 0
    model: str = ""
    baseline: float | None = None
    detail: str = ""
    ts: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.PASS

    def with_verdict(self, verdict: Verdict, *, baseline: float | None = None, detail: str = "") -> SelfTestResult:
        return replace(self, verdict=verdict, baseline=baseline if baseline is not None else self.baseline,
                       detail=detail or self.detail)

    def to_data(self) -> dict[str, Any]:
        """The ``Event.data`` record (contract keys first)."""
        return {
            "suite": self.suite, "test": self.test, "device": self.device, "verdict": self.verdict.value,
            "mismatches": [m.to_obj() for m in self.mismatches], "max_error": _finite(self.max_error),
            "duration_s": self.duration_s, "throughput": _finite(self.throughput), "unit": self.unit,
            "mismatch_total": self.mismatch_total, "model": self.model, "baseline": self.baseline,
            "detail": self.detail, "ts": self.ts, **({"extra": self.extra} if self.extra else {}),
        }

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> SelfTestResult:
        """Read a record written by :meth:`to_data`; raise :class:`SchemaError` naming a bad field."""
        if not isinstance(data, Mapping):
            raise SchemaError("<record>", f"expected an object, got {type(data).__name__}")
        for name in ("suite", "test", "device", "unit"):
            if not isinstance(data.get(name), str):
                raise SchemaError(name, f"expected a string, got {data.get(name)!r}")
        try:
            verdict = Verdict(data.get("verdict"))
        except ValueError:
            raise SchemaError("verdict", f"unknown verdict {data.get('verdict')!r} (known: pass, fail, slow)") \
                from None
        raw = data.get("mismatches", [])
        if not isinstance(raw, Sequence) or isinstance(raw, str):
            raise SchemaError("mismatches", "expected an array")
        mismatches = tuple(Mismatch.from_obj(m) for m in raw)
        max_error = _num(data, "max_error", optional=True)
        throughput = _num(data, "throughput", optional=True)
        extra = data.get("extra", {})
        return cls(suite=data["suite"], test=data["test"], device=data["device"], verdict=verdict,
                   duration_s=_num(data, "duration_s") or 0.0,
                   throughput=math.nan if throughput is None else throughput, unit=data["unit"],
                   max_error=math.inf if max_error is None else max_error, mismatches=mismatches,
                   mismatch_total=int(data.get("mismatch_total", len(mismatches))),
                   model=str(data.get("model", "")), baseline=_num(data, "baseline", optional=True),
                   detail=str(data.get("detail", "")), ts=_num(data, "ts", optional=True) or 0.0,
                   extra=dict(extra) if isinstance(extra, Mapping) else {})

    def to_event(self, node: str, ts: float | None = None, *, gpu: int | None = None) -> Event:
        """This result as an ``fh.events`` message of kind ``selftest`` at ``ts`` (default: the
        result's own completion time, so the results of one run have distinct event ids)."""
        ts = self.ts if ts is None else ts
        if gpu is None and self.device.startswith("cuda:") and self.device[5:].isdigit():
            gpu = int(self.device[5:])
        return Event(node=node, ts=float(ts), kind=EventKind.SELFTEST, gpu=gpu,
                     message=f"{self.test} on {self.device}: {self.verdict.value}", data=self.to_data())


def _finite(value: float) -> float | None:
    """JSON has no NaN or infinity: a value that is not finite is written as null."""
    return float(value) if math.isfinite(value) else None
