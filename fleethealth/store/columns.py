"""Between the schema dataclasses and ClickHouse columns, both ways.

Writers build one dict of columns (name -> NumPy array or list, all of one length) per batch of
messages, concatenated over messages, so a batch is one columnar insert; :func:`prepare` fits a
column to its ClickHouse type at insert time (times in epoch seconds become millisecond ticks).
Readers regroup sorted result columns into messages with :func:`segments` and decode the JSON
column of a row with :func:`row_object`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import orjson

from fleethealth import schema
from fleethealth.errors import StoreError
from fleethealth.schema import GPU_FIELDS, Event, Finding, Recommendation, StepBatch, StepBlock, Telemetry

__all__ = [
    "telemetry_columns",
    "sample_columns",
    "QUANTISED",
    "ROUNDED",
    "step_columns",
    "Codes",
    "event_columns",
    "finding_columns",
    "recommendation_columns",
    "prepare",
    "segments",
    "row_object",
    "loads_lenient",
    "dumps",
    "FLOAT32_FIELDS",
    "decimal_floats",
]

FLOAT32_FIELDS: frozenset[str] = frozenset({
    "power_limit_w", "sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "retired_sbe", "retired_dbe",
    "retired_pending", "remap_correctable", "remap_uncorrectable", "remap_pending", "remap_failure", "nvlink_links_up",
    "nvlink_links_max", "pcie_gen", "pcie_gen_max", "pcie_width", "pcie_width_max", "fb_used_mib", "fb_free_mib",
    "slowdown_temp_c",
})
"""``gpu_samples`` columns stored as Float32 (``deploy/clickhouse/007_samples_at_scale.sql``): each
field's range (``schema.GPU_FIELD_RANGES``) and its sources' resolution (whole MHz, W to 0.1 W below
16,384 W, link widths, MiB below 2^24) fit in 24 bits of mantissa. Counters that can pass 2^24 and the
clock-reason bitmask stay Float64; the gauges of :data:`QUANTISED` are scaled integers. Readers give a
Float32 value back as the shortest decimal that rounds to it (:func:`decimal_floats`), so 71.3 reads 71.3."""

QUANTISED: dict[str, tuple[str, float, str, int]] = {
    # field: (stored column, units of the field per stored step, stored dtype, "not reported")
    "temp_c": ("temp_dc", 0.1, "<i2", -32768),
    "mem_temp_c": ("mem_temp_dc", 0.1, "<i2", -32768),
    "power_w": ("power_dw", 0.1, "<u4", 2**32 - 1),
    "util_pct": ("util_pct_i", 1.0, "<u1", 2**8 - 1),
    "energy_mj": ("energy_j", 1000.0, "<u8", 2**64 - 1),
    "tensor_active": ("tensor_active_pm", 0.001, "<u2", 2**16 - 1),
    "nic_util": ("nic_util_pm", 0.001, "<u2", 2**16 - 1),
}
"""Gauges stored as scaled integers at their sensor's resolution (``deploy/clickhouse/013_samples_quantised.sql``;
the sources are cited in ``docs/scaling.md``): the field's value is ``stored * step``, the sentinel is a
NaN (not reported), and the table reads the field back through an ALIAS column of the field's name."""

ROUNDED: dict[str, float] = {
    "power_limit_w": 0.1, "sm_clock_mhz": 1.0, "sm_clock_max_mhz": 1.0, "mem_clock_mhz": 1.0,
    "fb_used_mib": 1.0, "fb_free_mib": 1.0, "slowdown_temp_c": 0.1,
}
"""Float32 gauges rounded to their sensor's resolution before they are stored (whole MHz and MiB,
0.1 W, 0.1 °C); counters, flags, link widths and the clock-reason bitmask are stored as sent."""


# ---------------------------------------------------------------- insert builders
def telemetry_columns(samples: Sequence[Telemetry]) -> dict[str, Any]:
    """``gpu_samples`` columns: one row per GPU of each sample (``node``, ``rack`` and ``model`` as
    :class:`Codes`)."""
    counts = np.fromiter((s.gpu.size for s in samples), dtype=np.int64, count=len(samples))
    text = {name: _codes([getattr(s, name) for s in samples]) for name in ("node", "rack", "model")}
    cols: dict[str, Any] = {  # node, rack and model as Codes: the insert goes as one Native block
        **{name: Codes(values, np.repeat(codes, counts)) for name, (values, codes) in text.items()},
        "gpu": np.concatenate([s.gpu for s in samples]).astype(np.uint16),
        "ts": np.repeat(np.fromiter((s.ts for s in samples), dtype=np.float64, count=len(samples)), counts),
        "uuid": np.concatenate([np.asarray(s.uuid if len(s.uuid) == s.gpu.size else ("",) * s.gpu.size,
                                           dtype=object) for s in samples]),
        "nic_util": np.repeat(np.fromiter((s.nic_util for s in samples), dtype=np.float64,
                                          count=len(samples)), counts),
    }
    for name in GPU_FIELDS:
        cols[name] = np.concatenate([s.columns[name] for s in samples]).astype(np.float64)
    return cols


def sample_columns(columns: dict[str, Any]) -> dict[str, Any]:
    """``gpu_samples`` columns as stored, from columns named as the fields (``telemetry_columns``'s form):
    each gauge of :data:`QUANTISED` becomes its scaled integer column (NaN and infinities: the
    sentinel), each of :data:`ROUNDED` is rounded to its step, the rest pass as they are. One NumPy pass
    a column. A finite value outside the stored type's range raises :class:`StoreError` naming the field
    (the schema's ranges keep decoded telemetry inside)."""
    out: dict[str, Any] = {}
    for name, column in columns.items():
        spec = QUANTISED.get(name)
        if spec is not None:
            out[spec[0]] = _quantise(name, column, spec)
        elif name in ROUNDED:
            step = ROUNDED[name]
            values = np.asarray(column, dtype=np.float64)
            out[name] = np.round(values / step) * step if step != 1.0 else np.round(values)
        else:
            out[name] = column
    return out


def _quantise(name: str, column: Any, spec: tuple[str, float, str, int]) -> np.ndarray:
    _, step, dtype, sentinel = spec
    values = np.asarray(column, dtype=np.float64)
    finite = np.isfinite(values)
    scaled = np.round(values / step) if step >= 1.0 else np.round(values * round(1.0 / step))
    info = np.iinfo(dtype)
    lo, hi = info.min + (sentinel == info.min), info.max - (sentinel == info.max)
    ok = finite & (scaled >= lo) & (scaled <= hi)
    if not np.array_equal(ok, finite):
        bad = float(values[finite & ~ok][0])
        raise StoreError(f"gpu_samples: {name} = {bad!r} does not fit its stored column ({dtype}, step {step})")
    out = np.full(values.shape, sentinel, dtype=dtype)
    out[finite] = scaled[finite].astype(dtype)
    return out


class Codes:
    """A text column as its distinct values and one code per row (``values[codes[i]]`` is row ``i``):
    how ``LowCardinality(String)`` is stored, so a writer that knows the column's few values (a job, the
    nodes of a batch) never builds one Python string per row. :func:`prepare` expands it for a client
    that wants the rows; :func:`fleethealth.store.native.encode_native` writes it as it is."""

    __slots__ = ("values", "codes")

    def __init__(self, values: Sequence[str], codes: np.ndarray) -> None:
        self.values = list(values)
        self.codes = codes

    def __len__(self) -> int:
        return len(self.codes)

    def rows(self) -> np.ndarray:
        """One value per row (an object array)."""
        return np.asarray(self.values, dtype=object)[self.codes] if self.values else np.empty(0, dtype=object)


def _codes(names: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """Distinct ``names`` in order of first appearance, and the code of each."""
    index: dict[str, int] = {}
    codes = np.fromiter((index.setdefault(n, len(index)) for n in names), dtype=np.int64, count=len(names))
    return list(index), codes


def step_columns(batches: Sequence[StepBatch | StepBlock]) -> dict[str, Any]:
    """``rank_steps`` columns: one row per rank of each batch, per step and rank of each block
    (``rank_group`` -1 where none). Items of one shape (steps, ranks, with or without groups) are
    stacked into arrays at once, so a poll of blocks costs a few NumPy calls per column, not per block;
    ``job`` and ``node`` are :class:`Codes`."""
    shapes: dict[tuple[int, int, bool], list[int]] = {}
    for i, b in enumerate(batches):
        s = b.steps.size if type(b) is StepBlock else 1
        shapes.setdefault((s, b.ranks.size, b.groups is not None), []).append(i)
    job_values, job_codes = _codes([b.job for b in batches])
    node_values, node_codes = _codes([b.node for b in batches])
    parts: dict[str, list[np.ndarray]] = {name: [] for name in
                                          ("job", "step", "rank", "node", "gpu", "ts", "compute_s", "rank_group")}
    for (s, r, grouped), members in shapes.items():
        items = [batches[i] for i in members]
        m = len(items)
        if s == 1 and all(type(b) is StepBatch for b in items):
            steps = np.fromiter((b.step for b in items), dtype=np.uint64, count=m).reshape(m, 1)
            stamps = np.fromiter((b.ts for b in items), dtype=np.float64, count=m).reshape(m, 1)
            compute = np.stack([b.compute_s for b in items]).reshape(m, 1, r)
        else:
            steps = np.stack([b.steps if type(b) is StepBlock else np.array([b.step]) for b in items]).astype(np.uint64)
            stamps = np.stack([b.step_ts if type(b) is StepBlock else np.array([b.ts]) for b in items])
            compute = np.stack([b.compute_s.reshape(-1, r) for b in items])
        ranks = np.stack([b.ranks for b in items])[:, None, :]
        gpus = np.stack([b.gpus for b in items])[:, None, :]
        shape = (m, s, r)
        parts["job"].append(np.repeat(job_codes[members], s * r))
        parts["node"].append(np.repeat(node_codes[members], s * r))
        parts["step"].append(np.repeat(steps, r, axis=1).reshape(-1))
        parts["ts"].append(np.repeat(stamps.astype(np.float64), r, axis=1).reshape(-1))
        parts["rank"].append(np.broadcast_to(ranks, shape).astype(np.uint32).reshape(-1))
        parts["gpu"].append(np.broadcast_to(gpus, shape).astype(np.uint16).reshape(-1))
        parts["compute_s"].append(compute.astype(np.float64, copy=False).reshape(-1))
        if grouped:
            groups = np.stack([b.groups for b in items])[:, None, :]
            parts["rank_group"].append(np.broadcast_to(groups, shape).astype(np.int32).reshape(-1))
        else:
            parts["rank_group"].append(np.full(m * s * r, -1, dtype=np.int32))
    cols = {name: (np.concatenate(arrs) if len(arrs) != 1 else arrs[0]) if arrs else np.empty(0)
            for name, arrs in parts.items()}
    cols["job"] = Codes(job_values, cols["job"])
    cols["node"] = Codes(node_values, cols["node"])
    return cols


def event_columns(events: Sequence[Event]) -> dict[str, Any]:
    """``events`` columns."""
    return {
        "id": [e.id for e in events], "node": [e.node for e in events], "ts": [e.ts for e in events],
        "ts_s": [e.ts for e in events], "kind": [e.kind.value for e in events],
        "job": [_opt(e.job, "") for e in events], "gpu": [e.gpu for e in events],
        "rank": [e.rank for e in events], "step": [e.step for e in events],
        "code": [e.code for e in events], "message": [e.message for e in events],
        "data": [dumps(e.data) for e in events],
    }


def finding_columns(findings: Sequence[Finding]) -> dict[str, Any]:
    """``findings`` columns."""
    return {
        "id": [f.id for f in findings], "kind": [f.kind.value for f in findings],
        "detector": [f.detector for f in findings], "job": [_opt(f.job, "") for f in findings],
        "node": [f.node for f in findings], "gpu": [f.gpu for f in findings],
        "rank": [f.rank for f in findings], "step": [f.step for f in findings],
        "ts": [f.ts for f in findings], "ts_s": [f.ts for f in findings],
        "diagnosis": [None if f.diagnosis is None else f.diagnosis.value for f in findings],
        "z": [f.z for f in findings], "slowdown": [f.slowdown for f in findings],
        "probability": [f.probability for f in findings], "evidence": [dumps(f.evidence) for f in findings],
        "episode_ts_s": [f.episode_ts for f in findings],
    }


def recommendation_columns(recs: Sequence[Recommendation]) -> dict[str, Any]:
    """``recommendations`` columns (not acknowledged)."""
    return {
        "id": [r.id for r in recs], "action": [r.action.value for r in recs], "node": [r.node for r in recs],
        "job": [_opt(r.job, "") for r in recs], "reason": [r.reason for r in recs],
        "guard": [r.guard.value for r in recs], "ts": [r.ts for r in recs], "ts_s": [r.ts for r in recs],
        "finding_id": [_opt(r.finding_id, "") for r in recs], "dry_run": [r.dry_run for r in recs],
        "evidence": [dumps(r.evidence) for r in recs], "acked_by": ["" for _ in recs],
    }


# ---------------------------------------------------------------- fitting a column to its type
def _epoch_ms(values: Any, nullable: bool) -> list[Any]:
    """Epoch seconds (floats; NaN/None = null when ``nullable``) -> integer milliseconds."""
    arr = np.asarray(values)
    if arr.dtype.kind == "M":
        return arr.astype("datetime64[ms]").astype(np.int64).tolist()
    if arr.dtype.kind == "O":
        if not nullable:
            return [int(round(float(v) * 1000.0)) for v in arr.tolist()]
        return [None if v is None or (isinstance(v, float) and math.isnan(v)) else int(round(float(v) * 1000.0))
                for v in arr.tolist()]
    secs = arr.astype(np.float64)
    ms = np.round(secs * 1000.0)
    if not nullable:
        if not np.isfinite(ms).all():
            raise StoreError("a non-nullable DateTime64 column holds NaN or infinity")
        return ms.astype(np.int64).tolist()
    out = ms.astype(object)
    out[~np.isfinite(ms)] = None
    return [None if v is None else int(v) for v in out.tolist()]


def prepare(ch_type: str, column: Any) -> Any:
    """Fit one column to its ClickHouse type: times in seconds to ticks, text arrays to lists."""
    base = ch_type.removeprefix("LowCardinality(").removeprefix("Nullable(")
    nullable = "Nullable(" in ch_type
    if isinstance(column, Codes):
        column = column.rows()
    if base.startswith("DateTime64"):
        return _epoch_ms(column, nullable)
    if isinstance(column, np.ndarray):
        if column.dtype.kind in "USO" or base.startswith(("String", "Bool")) or nullable:
            return column.tolist()
        if base == "Float32" and column.dtype != np.float32:
            return column.astype(np.float32)
        return column
    return column


def decimal_floats(values: Any) -> np.ndarray:
    """Float32 values (as read, widened to float64) as float64 of their shortest decimal: 71.3 stored
    in a Float32 column reads 71.30000305175781 through a plain widening, and 71.3 through this."""
    return np.asarray(values, dtype=np.float32).astype(str).astype(np.float64)


def dumps(obj: Any) -> str:
    """A JSON column's text (NumPy values allowed)."""
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY).decode()


def _opt(value: Any, default: Any = None) -> Any:
    return default if value is None else value


# ---------------------------------------------------------------- reading rows back
def segments(*keys: np.ndarray) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of equal key tuples in sorted key columns."""
    n = len(keys[0])
    change = np.zeros(max(n - 1, 0), dtype=bool)
    for key in keys:
        change |= key[1:] != key[:-1]
    bounds = np.concatenate([[0], np.flatnonzero(change) + 1, [n]])
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))


def row_object(columns: Iterable[str], row: Sequence[Any], json_column: str) -> dict[str, Any]:
    """One row as a message object for :func:`fleethealth.schema.decode`, its JSON column parsed."""
    obj = dict(zip(columns, row, strict=True))
    obj[json_column] = orjson.loads(obj[json_column] or "{}")
    obj["v"] = schema.SCHEMA_VERSION
    return obj


def loads_lenient(text: str) -> Any:
    """A JSON column's value: ``{}`` for empty text, ``{"unparsed": text}`` for text that is not JSON."""
    if not text:
        return {}
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return {"unparsed": text}
