"""Discrete events (``fh.events``): their kinds, and which are about a job rather than a node."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Self

import orjson

from fleethealth.errors import SchemaError
from fleethealth.ids import digest as _digest
from fleethealth.schema.fields import (
    GPU_INDEX_MAX,
    MAX_DATA_DEPTH,
    MAX_TEXT_CHARS,
    RANK_MAX,
    SCHEMA_VERSION,
    Topic,
    _depth_ok,
    _enum,
    _int,
    _obj,
    _str,
    _ts,
)


class EventKind(StrEnum):
    XID = "xid"
    SDC_CHECK = "sdc_check"
    SELFTEST = "selftest"
    HANG_REPORT = "hang_report"
    HEALTH_WATCH = "health_watch"
    TELEMETRY_STALLED = "telemetry_stalled"
    GPU_LOST = "gpu_lost"
    PROBE_ERROR = "probe_error"
    SPOOL_DROPPED = "spool_dropped"  # a probe's spool overflowed in an outage: counts, bytes, topics, time range
    INTERRUPTION = "interruption"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_VALIDATED = "checkpoint_validated"  # a checkpoint's files checked after its save: valid or why not
    CHECKPOINT_COST = "checkpoint_cost"  # in-job: how long a save blocked training, how long its background write took
    SCHEDULER_ACTION = "scheduler_action"
    JOB_START = "job_start"
    JOB_EXIT = "job_exit"
    JOB_PROGRESS = "job_progress"  # derived by the job stage: the event times of the steps it assembled
    JOB_END = "job_end"  # derived by the job stage: it forgot the job (idle past detect.pipeline.job_idle_s)


JOB_EVENT_KINDS = frozenset({EventKind.SDC_CHECK, EventKind.HANG_REPORT, EventKind.CHECKPOINT,
                             EventKind.CHECKPOINT_VALIDATED, EventKind.JOB_START,
                             EventKind.JOB_EXIT, EventKind.INTERRUPTION, EventKind.JOB_PROGRESS,
                             EventKind.JOB_END, EventKind.CHECKPOINT_COST})
"""Kinds a training job (or the detectors, for ``interruption``, ``job_progress`` and ``job_end``) sends
about itself: keyed by job when
they name one, so they share a partition number with the job's step batches."""


def is_job_event(event: Event) -> bool:
    """Whether ``event`` is about a job (keyed by it) rather than about its node."""
    return event.job is not None and event.kind in JOB_EVENT_KINDS


@dataclass(frozen=True)
class Event:
    """A discrete event (topic ``fh.events``): keyed by job for what a job reports about itself
    (:data:`JOB_EVENT_KINDS` with a job), by node for the rest.

    ``data`` is a JSON object whose keys depend on ``kind``: ``sdc_check`` carries ``check``
    (``selfcheck`` | ``replay``), ``passed``, ``classification``, ``digests``; ``hang_report``
    carries ``stacks`` and ``last_collective``; ``selftest`` carries one result record;
    ``xid`` uses ``code``.
    """

    node: str
    ts: float
    kind: EventKind
    job: str | None = None
    gpu: int | None = None
    rank: int | None = None
    step: int | None = None
    code: int | None = None
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    TOPIC: ClassVar[Topic] = Topic.EVENTS

    @property
    def key(self) -> str:
        return self.job if is_job_event(self) and self.job else self.node

    @property
    def id(self) -> str:
        """Stable across replays; two different events of one node at one instant (several self-test
        results, a result and its suite record) differ by message and data."""
        data = orjson.dumps(self.data, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY)
        return _digest(self.kind, self.node, self.ts, self.job, self.gpu, self.rank, self.step, self.code,
                       self.message, data.decode())

    def to_obj(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "node": self.node, "ts": self.ts, "kind": self.kind.value, "job": self.job,
                "gpu": self.gpu, "rank": self.rank, "step": self.step, "code": self.code,
                "message": self.message, "data": self.data}

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Self:
        message = obj.get("message", "")
        if not isinstance(message, str):
            raise SchemaError("message", "expected a string")
        if len(message) > MAX_TEXT_CHARS:
            raise SchemaError("message", f"{len(message)} characters exceed {MAX_TEXT_CHARS}")
        data = _obj(obj, "data")
        if not _depth_ok(data, MAX_DATA_DEPTH):
            raise SchemaError("data", f"nested deeper than {MAX_DATA_DEPTH} levels")
        return cls(node=_str(obj, "node"), ts=_ts(obj), kind=_enum(obj, "kind", EventKind),
                   job=_str(obj, "job", optional=True), gpu=_int(obj, "gpu", optional=True, maximum=GPU_INDEX_MAX),
                   rank=_int(obj, "rank", optional=True, maximum=RANK_MAX), step=_int(obj, "step", optional=True),
                   code=_int(obj, "code", optional=True), message=message, data=data)
