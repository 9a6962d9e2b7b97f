"""``fleethealth.schema`` is a package cut by concept, and still reads as the one module it was: every
class keeps the public name ``fleethealth.schema.<Class>`` (what detector snapshots record) and its
annotations resolve, and each submodule holds the concept its name says."""

from __future__ import annotations

import typing

import pytest

from fleethealth import schema
from fleethealth.schema import codec, events, fields, findings, nodestate, steps, telemetry

CLASSES = [name for name in schema.__all__ if isinstance(getattr(schema, name), type)]


@pytest.mark.parametrize("name", CLASSES)
def test_each_class_keeps_its_public_name_and_its_annotations_resolve(name: str) -> None:
    cls = getattr(schema, name)
    assert f"{cls.__module__}.{cls.__qualname__}" == f"fleethealth.schema.{name}"
    typing.get_type_hints(cls)  # raises NameError if an annotation names what the package lacks


def test_each_concept_has_one_home() -> None:
    homes = {fields: {"Topic", "SCHEMA_VERSION", "MAX_TS", "MAX_MESSAGE_BYTES"},
             telemetry: {"Telemetry", "NicPorts", "ClockReason", "GPU_FIELDS", "GPU_FIELD_RANGES"},
             steps: {"StepBatch", "StepBlock", "MAX_BLOCK_STEPS"},
             events: {"Event", "EventKind", "JOB_EVENT_KINDS", "is_job_event"},
             findings: {"Finding", "FindingKind", "Diagnosis", "Recommendation", "Action", "Guard"},
             nodestate: {"NodeState"},
             codec: {"encode", "decode", "decode_many", "load_object", "TOPIC_TYPES", "Message"}}
    for module, names in homes.items():
        for name in names:
            assert getattr(module, name) is getattr(schema, name), (module.__name__, name)
    assert sorted(n for names in homes.values() for n in names) == sorted(set().union(*homes.values()))
