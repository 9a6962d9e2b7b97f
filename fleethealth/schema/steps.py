"""Step timings (``fh.steps``): one step of a node's ranks (:class:`StepBatch`) or several (:class:`StepBlock`).

How a poll's worth of step values is validated in one pass is :mod:`fleethealth.schema.columnar`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np

from fleethealth.errors import SchemaError
from fleethealth.schema.fields import (
    _I16_MAX,
    _I32,
    _INT_MAX,
    MAX_COMPUTE_S,
    MAX_TS,
    SCHEMA_VERSION,
    Topic,
    _array,
    _int,
    _req,
    _str,
    _ts,
)


def _rank_columns(obj: dict[str, Any], what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A step record's ``ranks`` (at least one, distinct), ``gpus`` and optional ``groups``."""
    ranks = _array(obj, "ranks", np.int32, minimum=0)
    if ranks.size == 0:
        raise SchemaError("ranks", f"a step {what} needs at least one rank")
    if np.unique(ranks).size != ranks.size:
        raise SchemaError("ranks", f"duplicate rank in one {what}")
    gpus = _array(obj, "gpus", np.int16, length=ranks.size, minimum=0)
    groups = _array(obj, "groups", np.int32, length=ranks.size) if obj.get("groups") is not None else None
    return ranks, gpus, groups


@dataclass(frozen=True, eq=False)
class StepBatch:
    """Pre-collective compute times of one node's ranks for one step (topic ``fh.steps``, key job).

    ``ranks`` (int32), ``gpus`` (int16) and ``compute_s`` (float64, seconds, finite, >= 0) all have
    shape ``(r,)``. ``groups`` optionally labels comparable ranks (e.g. pipeline stage); straggler
    scores are computed within a group. ``ts`` is the event time at which the step completed.
    """

    job: str
    step: int
    node: str
    ts: float
    ranks: np.ndarray
    gpus: np.ndarray
    compute_s: np.ndarray
    groups: np.ndarray | None = None
    TOPIC: ClassVar[Topic] = Topic.STEPS

    @property
    def key(self) -> str:
        return self.job

    def to_obj(self) -> dict[str, Any]:
        obj = {"v": SCHEMA_VERSION, "job": self.job, "step": self.step, "node": self.node, "ts": self.ts,
               "ranks": self.ranks.tolist(), "gpus": self.gpus.tolist(), "compute_s": self.compute_s.tolist()}
        if self.groups is not None:
            obj["groups"] = self.groups.tolist()
        return obj

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        ranks, gpus, groups = _rank_columns(obj, "batch")
        compute = _array(obj, "compute_s", np.float64, length=ranks.size, minimum=0.0, maximum=MAX_COMPUTE_S)
        return cls(job=_str(obj, "job"), step=_int(obj, "step"), node=_str(obj, "node"), ts=_ts(obj),
                   ranks=ranks, gpus=gpus, compute_s=compute, groups=groups)


MAX_BLOCK_STEPS = 4096
"""Most steps one :class:`StepBlock` may carry (a 10-steps/s job sent every minute is 600)."""


@dataclass(frozen=True)
class StepBlock:
    """Several steps of one node's ranks in one message (topic ``fh.steps``, key job): every step a
    probe saw complete in one interval, columnar, with the same ranks in each.

    ``steps`` (int64) and ``step_ts`` (float64, each step's completion time) have shape ``(s,)``;
    ``ranks``, ``gpus`` and ``groups`` shape ``(r,)`` as in :class:`StepBatch`; ``compute_s`` shape
    ``(s, r)``. On the wire it is a step batch whose ``steps`` is an array and whose ``ts`` and
    ``compute_s`` are one value and one row per step. The consumer splits it into step batches
    (:meth:`split`); a bad value anywhere dead-letters the whole block, naming the field.
    """

    job: str
    node: str
    steps: np.ndarray
    step_ts: np.ndarray
    ranks: np.ndarray
    gpus: np.ndarray
    compute_s: np.ndarray
    groups: np.ndarray | None = None
    TOPIC: ClassVar[Topic] = Topic.STEPS

    @property
    def key(self) -> str:
        return self.job

    @functools.cached_property
    def ts(self) -> float:
        """The latest step's completion time (what a drop report or a record timestamp names)."""
        return float(self.step_ts.max())

    @classmethod
    def of(cls, batches: Sequence[StepBatch]) -> StepBlock:
        """Pack step batches of one job and node with the same ranks, GPUs and groups."""
        first = batches[0]
        return cls(job=first.job, node=first.node, steps=np.array([b.step for b in batches], dtype=np.int64),
                   step_ts=np.array([b.ts for b in batches], dtype=np.float64), ranks=first.ranks, gpus=first.gpus,
                   compute_s=np.stack([b.compute_s for b in batches]), groups=first.groups)

    def split(self) -> list[StepBatch]:
        """One :class:`StepBatch` per step (views of this block's arrays)."""
        return [StepBatch(job=self.job, step=step, node=self.node, ts=ts, ranks=self.ranks, gpus=self.gpus,
                          compute_s=row, groups=self.groups)
                for step, ts, row in zip(self.steps.tolist(), self.step_ts.tolist(), self.compute_s, strict=True)]

    def row(self, k: int) -> StepBatch:
        """Step ``k`` of this block (0-based row) as a :class:`StepBatch` (views of its arrays)."""
        return StepBatch(job=self.job, step=int(self.steps[k]), node=self.node, ts=float(self.step_ts[k]),
                         ranks=self.ranks, gpus=self.gpus, compute_s=self.compute_s[k], groups=self.groups)

    def take(self, rows: Sequence[int] | np.ndarray) -> StepBlock:
        """The block of the given rows only (e.g. the steps a detector accepted), in that order."""
        rows = np.asarray(rows, dtype=np.intp)
        return StepBlock(job=self.job, node=self.node, steps=self.steps[rows], step_ts=self.step_ts[rows],
                         ranks=self.ranks, gpus=self.gpus, compute_s=self.compute_s[rows], groups=self.groups)

    def to_obj(self) -> dict[str, Any]:
        obj = {"v": SCHEMA_VERSION, "job": self.job, "steps": self.steps.tolist(), "node": self.node,
               "ts": self.step_ts.tolist(), "ranks": self.ranks.tolist(), "gpus": self.gpus.tolist(),
               "compute_s": self.compute_s.tolist()}
        if self.groups is not None:
            obj["groups"] = self.groups.tolist()
        return obj

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        fast = cls._fast(obj)
        return fast if fast is not None else cls._checked(obj)

    @classmethod
    def _fast(cls, obj: dict[str, Any]) -> Self | None:
        """The block when every check passes in a few NumPy passes; None when any may fail (then
        :meth:`_checked` names the field)."""
        job, node, steps, ts = obj.get("job"), obj.get("node"), obj.get("steps"), obj.get("ts")
        ranks, gpus, rows, groups = obj.get("ranks"), obj.get("gpus"), obj.get("compute_s"), obj.get("groups")
        if type(job) is not str or not job or type(node) is not str or not node or groups is not None:
            return None
        if type(steps) is not list or type(ts) is not list or type(ranks) is not list or type(gpus) is not list \
                or type(rows) is not list:
            return None
        s, r = len(steps), len(ranks)
        if not 0 < s <= MAX_BLOCK_STEPS or r == 0 or len(ts) != s or len(gpus) != r or len(rows) != s:
            return None
        if any(type(row) is not list or len(row) != r for row in rows):
            return None
        if not set(map(type, itertools.chain(steps, ranks, gpus))) <= {int}:
            return None
        if not set(map(type, itertools.chain(ts, *rows))) <= {int, float}:
            return None
        try:
            steps_a = np.array(steps, dtype=np.int64)
            ranks_a = np.array(ranks, dtype=np.int64)
            gpus_a = np.array(gpus, dtype=np.int64)
        except OverflowError:
            return None
        ts_a = np.array(ts, dtype=np.float64)
        compute = np.array(rows, dtype=np.float64)
        if steps_a.min() < 0 or ranks_a.min() < 0 or ranks_a.max() > _I32.max or gpus_a.min() < 0 \
                or gpus_a.max() > _I16_MAX:
            return None
        if not (np.isfinite(ts_a).all() and ts_a.min() >= 0.0 and ts_a.max() < MAX_TS):
            return None
        if not (np.isfinite(compute).all() and compute.min() >= 0.0 and compute.max() <= MAX_COMPUTE_S):
            return None
        if np.unique(steps_a).size != s or np.unique(ranks_a).size != r:
            return None
        return cls(job=job, node=node, steps=steps_a, step_ts=ts_a, ranks=ranks_a.astype(np.int32),
                   gpus=gpus_a.astype(np.int16), compute_s=compute)

    @classmethod
    def _checked(cls, obj: dict[str, Any]) -> Self:
        steps = _array(obj, "steps", np.int64, minimum=0, maximum=_INT_MAX)
        if steps.size == 0:
            raise SchemaError("steps", "a step block needs at least one step")
        if steps.size > MAX_BLOCK_STEPS:
            raise SchemaError("steps", f"{steps.size} steps exceed {MAX_BLOCK_STEPS} in one block")
        if np.unique(steps).size != steps.size:
            raise SchemaError("steps", "duplicate step in one block")
        step_ts = _array(obj, "ts", np.float64, length=steps.size, minimum=0.0)
        if step_ts.max() >= MAX_TS:
            raise SchemaError("ts", f"event time {step_ts.max()} is after 2100-01-01")
        ranks, gpus, groups = _rank_columns(obj, "block")
        rows = _req(obj, "compute_s")
        if type(rows) is not list or len(rows) != steps.size:
            raise SchemaError("compute_s", f"expected {steps.size} rows, one per step")
        compute = np.empty((steps.size, ranks.size), dtype=np.float64)
        for k, row in enumerate(rows):
            try:
                compute[k] = _array({"compute_s": row}, "compute_s", np.float64, length=ranks.size, minimum=0.0,
                                    maximum=MAX_COMPUTE_S)
            except SchemaError as exc:
                raise SchemaError("compute_s", f"step {int(steps[k])}: {exc.problem}") from None
        return cls(job=_str(obj, "job"), node=_str(obj, "node"), steps=steps, step_ts=step_ts, ranks=ranks,
                   gpus=gpus, compute_s=compute, groups=groups)
