"""A poll's worth of step values validated columnar: one NumPy pass per column over all of them.

:func:`fleethealth.schema.codec.decode_many` hands the values whose shape passes (:func:`_step_shape_ok`,
:func:`_block_shape_ok`) to :func:`_steps_columnar` / :func:`_blocks_columnar`; a value they do not
accept outright comes back as None and is decoded alone, which names the problem.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from fleethealth.schema.fields import _I16_MAX, _I32, _INT_MAX, MAX_COMPUTE_S, MAX_TS, SCHEMA_VERSION
from fleethealth.schema.steps import MAX_BLOCK_STEPS, StepBatch, StepBlock


def _step_shape_ok(obj: dict[str, Any]) -> bool:
    """The scalar fields of a step batch are valid and its arrays are lists of one length."""
    if type(obj.get("v")) is not int or obj.get("v") != SCHEMA_VERSION or "steps" in obj:
        return False  # a step block (``steps``) is decoded alone
    job, node, step, ts = obj.get("job"), obj.get("node"), obj.get("step"), obj.get("ts")
    if type(job) is not str or not job or type(node) is not str or not node:
        return False
    if type(step) is not int or not 0 <= step <= _INT_MAX:
        return False
    if type(ts) is float:
        if not 0.0 <= ts < MAX_TS:
            return False
    elif type(ts) is not int or not 0 <= ts < MAX_TS:
        return False
    ranks, gpus, compute, groups = obj.get("ranks"), obj.get("gpus"), obj.get("compute_s"), obj.get("groups")
    if type(ranks) is not list or type(gpus) is not list or type(compute) is not list:
        return False
    n = len(ranks)
    return n > 0 and len(gpus) == n and len(compute) == n and (
        groups is None or (type(groups) is list and len(groups) == n))


def _column(lists: list[list[Any]], counts: np.ndarray, dtype: type, low: float,
            high: float) -> tuple[np.ndarray, np.ndarray] | None:
    """Concatenate ``lists`` (lengths ``counts``) into one array; also a per-list flag of lists with an
    element of the wrong type or outside ``[low, high]`` (or not finite). None when NumPy cannot
    convert them at all (then every list is decoded alone)."""
    allowed = {int} if dtype is np.int64 else {int, float}
    flat = list(itertools.chain.from_iterable(lists))
    bad = np.zeros(len(lists), dtype=bool)
    if not set(map(type, flat)) <= allowed:  # rare: find the lists at fault, zero them
        bad = np.fromiter((not set(map(type, x)) <= allowed for x in lists), dtype=bool, count=len(lists))
        flat = list(itertools.chain.from_iterable([0] * len(x) if b else x for x, b in zip(lists, bad, strict=True)))
    try:
        arr = np.array(flat, dtype=dtype)
    except (OverflowError, ValueError):
        return None
    wrong = (arr < low) | (arr > high)
    if dtype is np.float64:
        wrong |= ~np.isfinite(arr)
    if wrong.any():
        bad[np.repeat(np.arange(len(lists)), counts)[wrong]] = True
    return arr, bad



def _group_columns(objs: Sequence[dict[str, Any]], counts: np.ndarray,
                   bad: np.ndarray) -> list[np.ndarray | None] | None:
    """Each value's optional ``groups`` (int32, ``counts[k]`` long), read in one pass over those that
    have one, marking ``bad`` the values with an out-of-range group; None when the pass cannot read them."""
    groups: list[np.ndarray | None] = [None] * len(objs)
    with_groups = [k for k, o in enumerate(objs) if o.get("groups") is not None]
    if with_groups:
        got = _column([objs[k]["groups"] for k in with_groups], counts[with_groups], np.int64, _I32.min, _I32.max)
        if got is None:
            return None
        bad[with_groups] |= got[1]
        for k, g in zip(with_groups, _split(got[0].astype(np.int32), counts[with_groups]), strict=True):
            groups[k] = g
    return groups

def _split(flat: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """Views of ``flat`` cut into consecutive pieces of ``counts`` elements."""
    if counts.size and (counts == counts[0]).all():
        return list(flat.reshape(counts.size, int(counts[0])))  # the common case: one node size
    ends = np.cumsum(counts).tolist()
    return [flat[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def _steps_columnar(objs: list[dict[str, Any]]) -> list[StepBatch | None]:
    """Step batches from objects :func:`_step_shape_ok` accepted; None where one needs :func:`decode`."""
    m = len(objs)
    counts = np.fromiter((len(o["ranks"]) for o in objs), dtype=np.int64, count=m)
    bad = np.zeros(m, dtype=bool)
    columns = []
    for name, dtype, low, high in (("ranks", np.int64, 0, _I32.max), ("gpus", np.int64, 0, _I16_MAX),
                                   ("compute_s", np.float64, 0.0, MAX_COMPUTE_S)):
        got = _column([o[name] for o in objs], counts, dtype, low, high)
        if got is None:
            return [None] * m
        columns.append(got[0])
        bad |= got[1]
    ranks, gpus, compute = columns
    seg = np.repeat(np.arange(m), counts)
    order = np.lexsort((ranks, seg))
    same = (ranks[order][1:] == ranks[order][:-1]) & (seg[order][1:] == seg[order][:-1])
    bad[seg[order][1:][same]] = True
    groups = _group_columns(objs, counts, bad)
    if groups is None:
        return [None] * m
    parts = zip(_split(ranks.astype(np.int32), counts), _split(gpus.astype(np.int16), counts),
                _split(compute, counts), groups, strict=True)
    return [None if is_bad else  # decode() names the problem
            StepBatch(job=obj["job"], step=obj["step"], node=obj["node"], ts=float(obj["ts"]), ranks=r, gpus=g,
                      compute_s=c, groups=grp)
            for obj, is_bad, (r, g, c, grp) in zip(objs, bad.tolist(), parts, strict=True)]


def _block_shape_ok(obj: dict[str, Any]) -> bool:
    """The scalar fields of a step block are valid and its arrays are lists of matching lengths (the
    rows of ``compute_s`` one per step, each one value per rank)."""
    if type(obj.get("v")) is not int or obj.get("v") != SCHEMA_VERSION:
        return False
    job, node, steps, ts = obj.get("job"), obj.get("node"), obj.get("steps"), obj.get("ts")
    if type(job) is not str or not job or type(node) is not str or not node:
        return False
    ranks, gpus, rows, groups = obj.get("ranks"), obj.get("gpus"), obj.get("compute_s"), obj.get("groups")
    if type(steps) is not list or type(ts) is not list or type(ranks) is not list or type(gpus) is not list \
            or type(rows) is not list:
        return False
    s, r = len(steps), len(ranks)
    if not 0 < s <= MAX_BLOCK_STEPS or r == 0 or len(ts) != s or len(gpus) != r or len(rows) != s:
        return False
    if groups is not None and (type(groups) is not list or len(groups) != r):
        return False
    return set(map(type, rows)) == {list} and set(map(len, rows)) == {r}


def _distinct(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per segment (consecutive pieces of ``counts`` elements of ``values``): whether a value repeats."""
    m = counts.size
    seg = np.repeat(np.arange(m), counts)
    order = np.lexsort((values, seg))
    same = (values[order][1:] == values[order][:-1]) & (seg[order][1:] == seg[order][:-1])
    bad = np.zeros(m, dtype=bool)
    bad[seg[order][1:][same]] = True
    return bad


def _blocks_columnar(objs: list[dict[str, Any]]) -> list[StepBlock | None]:
    """Step blocks from objects :func:`_block_shape_ok` accepted, every check of
    :meth:`StepBlock.from_obj` done in one NumPy pass per column over all of them; None where one
    needs :func:`decode` (which names the problem)."""
    m = len(objs)
    s_counts = np.fromiter((len(o["steps"]) for o in objs), dtype=np.int64, count=m)
    r_counts = np.fromiter((len(o["ranks"]) for o in objs), dtype=np.int64, count=m)
    bad = np.zeros(m, dtype=bool)
    got = [_column([o[name] for o in objs], counts, dtype, low, high)
           for name, counts, dtype, low, high in (
               ("steps", s_counts, np.int64, 0, _INT_MAX), ("ts", s_counts, np.float64, 0.0, MAX_TS),
               ("ranks", r_counts, np.int64, 0, _I32.max), ("gpus", r_counts, np.int64, 0, _I16_MAX))]
    cells = s_counts * r_counts
    rows = _column([row for o in objs for row in o["compute_s"]], np.repeat(r_counts, s_counts), np.float64,
                   0.0, MAX_COMPUTE_S)
    if rows is None or any(g is None for g in got):
        return [None] * m
    (steps, b1), (ts, b2), (ranks, b3), (gpus, b4) = got  # type: ignore[misc]
    bad |= b1 | b2 | b3 | b4
    row_bad = rows[1]
    if row_bad.any():
        bad[np.repeat(np.arange(m), s_counts)[row_bad]] = True
    late = ts >= MAX_TS
    if late.any():
        bad[np.repeat(np.arange(m), s_counts)[late]] = True
    bad |= _distinct(steps, s_counts) | _distinct(ranks, r_counts)
    groups = _group_columns(objs, r_counts, bad)
    if groups is None:
        return [None] * m
    compute = rows[0]
    out: list[StepBlock | None] = []
    step_parts = _split(steps, s_counts)
    ts_parts = _split(ts, s_counts)
    rank_parts = _split(ranks.astype(np.int32), r_counts)
    gpu_parts = _split(gpus.astype(np.int16), r_counts)
    ends = np.cumsum(cells).tolist()
    starts = [0, *ends[:-1]]
    s_list, r_list = s_counts.tolist(), r_counts.tolist()
    for k, (obj, is_bad) in enumerate(zip(objs, bad.tolist(), strict=True)):
        if is_bad:
            out.append(None)
            continue
        out.append(StepBlock(job=obj["job"], node=obj["node"], steps=step_parts[k], step_ts=ts_parts[k],
                             ranks=rank_parts[k], gpus=gpu_parts[k],
                             compute_s=compute[starts[k]:ends[k]].reshape(s_list[k], r_list[k]), groups=groups[k]))
    return out
