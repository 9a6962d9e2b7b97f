"""Poison pills on the real broker and chDB: each is dead-lettered naming its field, the dead letter
fits in one Kafka request, and the valid traffic around them is stored and scored.

Before the schema and the store shared one set of ranges, an event naming GPU 65,536 or rank 2³²
passed validation and then failed the ``UInt16``/``UInt32`` insert: the runner re-raised, and every
restart replayed the same record. Each value below is one such input a broken or hostile node can send.
"""

from __future__ import annotations

import re
import time
import uuid
from importlib import resources

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry

from fleethealth import schema
from fleethealth.bus import DEADLETTER_RAW_BYTES, Consumer, DeadLetter, Producer
from fleethealth.detectors.runner import Runner
from fleethealth.errors import SchemaError
from fleethealth.schema import Event, EventKind, StepBatch, Telemetry, Topic

T0 = 1_795_900_000.0



def _event(**over) -> dict:
    obj = {"v": 1, "node": "n0001", "ts": T0, "kind": "xid", "gpu": 0, "code": 79, "message": "", "data": {}}
    obj.update(over)
    return obj


def _nested(depth: int) -> bytes:
    """An event whose ``data`` nests ``depth`` objects (orjson parses up to 1,024 but writes only 254)."""
    data = '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)
    return orjson.dumps(_event()).replace(b'"data":{}', b'"data":' + data.encode())


def _sample(**over) -> dict:
    obj = Telemetry.from_columns("n0001", "r00", T0, [0, 1], temp_c=[60.0, 61.0]).to_obj()
    obj.update(over)
    return obj


POISON: list[tuple[Topic, dict | bytes, str]] = [
    (Topic.EVENTS, _event(gpu=65_536), "gpu"),
    (Topic.EVENTS, _event(rank=2**32), "rank"),
    (Topic.EVENTS, _nested(300), "data"),
    (Topic.EVENTS, _event(message="x" * 100_000), "message"),
    (Topic.EVENTS, _event(message="Xid 79 " * 300_000), "<message>"),  # ~2 MB: over the message limit
    (Topic.EVENTS, _event(v=True), "v"),
    (Topic.TELEMETRY, _sample(ts=1e300), "ts"),
    (Topic.TELEMETRY, _sample(columns={"temp_c": [1e308, 60.0]}), "columns.temp_c"),
    (Topic.TELEMETRY, _sample(gpu=[0, 0]), "gpu"),
    (Topic.STEPS, {"v": 1, "job": "j", "step": 1, "node": "n0001", "ts": 1e300, "ranks": [0], "gpus": [0],
                   "compute_s": [1.0]}, "ts"),
]


@pytest.mark.parametrize(("topic", "obj", "field"), POISON, ids=[f"{t.name}-{f}" for t, _, f in POISON])
def test_each_poison_pill_names_its_field(topic, obj, field):
    cls = schema.TOPIC_TYPES[topic]
    with pytest.raises(SchemaError) as err:
        schema.decode(cls, obj if isinstance(obj, bytes) else orjson.dumps(obj))
    assert err.value.field == field


def test_the_schema_ranges_are_the_store_ranges():
    """One source of truth: every integer column the store declares holds the schema's whole range."""
    sql = "\n".join(f.read_text() for f in resources.files("fleethealth.migrations").iterdir()
                    if f.name.endswith(".sql"))
    types = {name: kind for name, kind in re.findall(r"^\s+(gpu|rank)\s+(?:Nullable\()?(\w+)", sql, re.M)}
    widths = {"UInt16": 2**16 - 1, "UInt32": 2**32 - 1, "UInt64": 2**64 - 1}
    assert widths[types["gpu"]] >= schema.GPU_INDEX_MAX and widths[types["rank"]] >= schema.RANK_MAX
    assert schema.decode(Event, orjson.dumps(_event(gpu=schema.GPU_INDEX_MAX))).gpu == schema.GPU_INDEX_MAX
    with pytest.raises(SchemaError):
        schema.decode(Event, orjson.dumps(_event(gpu=schema.GPU_INDEX_MAX + 1)))


def _raw_producer(dsn: str):
    from kafka import KafkaProducer

    return KafkaProducer(bootstrap_servers=dsn.split("://", 1)[1], max_request_size=16 * 1024**2)


def test_poison_pills_are_dead_lettered_and_the_traffic_around_them_is_stored(own_broker, store):
    tag = uuid.uuid4().hex[:8]
    valid_steps = [StepBatch(job=f"{tag}-ok", step=s, node="n0001", ts=T0 + s, ranks=np.arange(8, dtype=np.int32),
                             gpus=np.arange(8, dtype=np.int16), compute_s=np.full(8, 1.0)) for s in range(20)]
    valid_events = [Event(node="n0002", ts=T0 + k, kind=EventKind.XID, gpu=1, code=31, message=f"{tag}-{k}")
                    for k in range(5)]
    raw = _raw_producer(own_broker.dsn)
    at = int(T0 * 1000)  # a timeline of its own: stamped with its event time, as a replay would be
    keys = []
    for k, (topic, obj, _) in enumerate(POISON):
        key = f"{tag}:{k}"
        keys.append(key)
        raw.send(topic.value, value=obj if isinstance(obj, bytes) else orjson.dumps(obj), key=key.encode(),
                 timestamp_ms=at)
        if k < len(valid_steps):
            raw.send(Topic.STEPS.value, value=schema.encode(valid_steps[2 * k]), key=valid_steps[2 * k].key.encode(),
                     timestamp_ms=at)
            raw.send(Topic.STEPS.value, value=schema.encode(valid_steps[2 * k + 1]),
                     key=valid_steps[2 * k + 1].key.encode(), timestamp_ms=at)
    for event in valid_events:
        raw.send(Topic.EVENTS.value, value=schema.encode(event), key=event.key.encode(), timestamp_ms=at)
    raw.flush()
    raw.close()

    with Runner(own_broker.dsn, store, group=f"poison-{tag}", registry=CollectorRegistry()) as runner:
        deadline = time.monotonic() + 60
        total = len(POISON) + len(valid_steps) + len(valid_events)
        while runner.consumer.consumed_total + runner.consumer.dead_lettered_total < total or len(runner.buffer):
            assert time.monotonic() < deadline, "the runner stopped taking input"
            runner.process_once(0.2)

    got: dict[str, DeadLetter] = {}
    with Consumer(own_broker.dsn, [Topic.DEADLETTER], f"poison-dl-{tag}", session_timeout_s=2.0,
                  max_poll_interval_s=2.0) as letters:
        deadline = time.monotonic() + 30
        while len(got) < len(POISON) and time.monotonic() < deadline:
            for rec in letters.poll(0.2):
                if isinstance(rec.msg, DeadLetter) and (rec.msg.key or "").startswith(f"{tag}:"):
                    got[rec.msg.key] = rec.msg
    assert set(got) == set(keys)
    for key, (_, _, field) in zip(keys, POISON, strict=True):
        assert got[key].reason.split(": ", 1)[0] == field, got[key].reason
    big = got[keys[4]]
    assert big.truncated and big.raw_size > 1_000_000 and len(big.raw_bytes()) == DEADLETTER_RAW_BYTES
    assert len(big.raw_sha256) == 64

    rows = store.query("SELECT count() FROM rank_steps FINAL WHERE job = {j:String}", {"j": f"{tag}-ok"}).rows
    assert rows[0][0] == 8 * len(valid_steps)
    rows = store.query("SELECT count() FROM events FINAL WHERE startsWith(message, {t:String})", {"t": tag}).rows
    assert rows[0][0] == len(valid_events)
    # and nothing of the poison reached the store
    rows = store.query("SELECT count() FROM events FINAL WHERE gpu > 32767 OR length(message) > 16384").rows
    assert rows[0][0] == 0


def test_a_large_dead_letter_still_publishes(own_broker):
    """A 10 MB value's dead letter is cut to fit; the producer's 1 MiB request limit holds."""
    letter = DeadLetter.of("fh.events", 0, 7, b"k", b"x" * 10_000_000, "<message>: too large", None)
    encoded = orjson.dumps(letter.to_obj())
    assert len(encoded) < 1024**2 and letter.truncated and letter.raw_size == 10_000_000
    with Producer(own_broker.dsn) as producer:
        producer.publish_raw(Topic.DEADLETTER.value, encoded, b"k")
        producer.flush()
