"""The wire contract: every message on the bus, as frozen dataclasses with a JSON codec.

One message type per topic (see :class:`Topic`). Messages are JSON objects (orjson) carrying
``"v"`` (:data:`SCHEMA_VERSION`), so ``kcat`` and ClickHouse's Kafka engine can read them.
Per-GPU and per-rank values travel as columnar arrays, never one message per rank.

``decode(cls, raw)`` validates everything it reads and raises :class:`SchemaError` naming the
field: wrong types, NaN or negative times, arrays of unequal length, unknown versions.

Where each part lives::

    fields.py     the schema version, input limits, Topic, and the field readers every decoder uses
    telemetry.py  Telemetry, NicPorts, ClockReason, GPU_FIELDS / NIC_FIELDS and their physical ranges
    fabric.py     Fabric: each GPU's NVLink fabric registration, optional in a telemetry sample
    steps.py      StepBatch, StepBlock (fh.steps)
    columnar.py   a poll's step values validated in one NumPy pass per column (for decode_many)
    events.py     Event, EventKind, JOB_EVENT_KINDS, is_job_event (fh.events)
    findings.py   Finding, FindingKind, Diagnosis; Recommendation, Action, Guard
    nodestate.py  NodeState (fh.nodestate)
    codec.py      Message, TOPIC_TYPES, encode, decode, decode_many, load_object

Every class keeps the public name ``fleethealth.schema.<Class>`` (its ``__module__``): that is the
name a detector snapshot records for it (``detectors/state.py``), so where a class is defined inside
this package is not part of any stored format.
"""

from typing import Any, ClassVar  # noqa: F401  (see the end: the classes' annotations resolve here)

import numpy as np  # noqa: F401

from fleethealth.errors import SchemaError as SchemaError
from fleethealth.schema.codec import TOPIC_TYPES, Message, decode, decode_many, encode, load_object
from fleethealth.schema.events import JOB_EVENT_KINDS, Event, EventKind, is_job_event
from fleethealth.schema.fabric import Fabric
from fleethealth.schema.fields import (
    GPU_INDEX_MAX,
    MAX_COMPUTE_S,
    MAX_DATA_DEPTH,
    MAX_MESSAGE_BYTES,
    MAX_TEXT_CHARS,
    MAX_TS,
    RANK_MAX,
    SCHEMA_VERSION,
    Topic,
)
from fleethealth.schema.findings import Action, Diagnosis, Finding, FindingKind, Guard, Recommendation
from fleethealth.schema.nodestate import NodeState
from fleethealth.schema.steps import MAX_BLOCK_STEPS, StepBatch, StepBlock
from fleethealth.schema.telemetry import GPU_FIELD_RANGES, GPU_FIELDS, NIC_FIELDS, ClockReason, NicPorts, Telemetry

__all__ = [
    "SCHEMA_VERSION",
    "MAX_COMPUTE_S",
    "MAX_TS",
    "MAX_MESSAGE_BYTES",
    "MAX_DATA_DEPTH",
    "MAX_BLOCK_STEPS",
    "MAX_TEXT_CHARS",
    "GPU_INDEX_MAX",
    "RANK_MAX",
    "GPU_FIELD_RANGES",
    "Topic",
    "FindingKind",
    "Diagnosis",
    "Action",
    "Guard",
    "EventKind",
    "ClockReason",
    "GPU_FIELDS",
    "NIC_FIELDS",
    "NicPorts",
    "Fabric",
    "Telemetry",
    "StepBatch",
    "StepBlock",
    "Event",
    "Finding",
    "Recommendation",
    "NodeState",
    "JOB_EVENT_KINDS",
    "is_job_event",
    "Message",
    "encode",
    "decode",
    "decode_many",
    "load_object",
    "TOPIC_TYPES",
]

# Each class's public name is fleethealth.schema.<Class>, whichever module above defines it: detector
# snapshots record classes by that name (detectors/state.py). Its string annotations (``np.ndarray``,
# ``Any``, ``ClassVar[Topic]``) then resolve in this namespace, which is why np, Any and ClassVar are here.
for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type):
        _value.__module__ = __name__
del _name, _value
