"""The wire contract: every message type round-trips, and every kind of bad input is rejected
with a :class:`SchemaError` that names the offending field."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pytest

from fleethealth import schema
from fleethealth.errors import SchemaError
from fleethealth.schema import (
    GPU_FIELDS,
    MAX_COMPUTE_S,
    SCHEMA_VERSION,
    Action,
    ClockReason,
    Diagnosis,
    Event,
    EventKind,
    Finding,
    FindingKind,
    Guard,
    Recommendation,
    StepBatch,
    Telemetry,
    Topic,
)


def _telemetry() -> Telemetry:
    return Telemetry.from_columns(
        "n0013", "r01", 1_700_000_000.25, [0, 1, 2], nic_util=0.4, model="H100", uuid=("a", "b", "c"),
        temp_c=[61.0, 88.5, 60.0], clock_reasons=[0, float(ClockReason.HW_THERMAL), 0],
        sm_clock_mhz=[1980.0, 1410.0, 1980.0], ecc_sbe_volatile=[0.0, math.nan, 2.0])


def _steps(groups: bool = True) -> StepBatch:
    return StepBatch(job="train-1", step=412, node="n0013", ts=1_700_000_824.0,
                     ranks=np.array([104, 105, 106], dtype=np.int32), gpus=np.array([0, 1, 2], dtype=np.int16),
                     compute_s=np.array([1.91, 2.31, 1.89]),
                     groups=np.array([0, 0, 1], dtype=np.int32) if groups else None)


def _event() -> Event:
    return Event(node="n0019", ts=640.5, kind=EventKind.SDC_CHECK, job="train-1", gpu=6, rank=158, step=320,
                 message="replay mismatch", data={"check": "replay", "passed": False, "digests": ["ab", "cd"],
                                                  "classification": "persistent", "culprit_rank": 158})


def _finding() -> Finding:
    return Finding(kind=FindingKind.STRAGGLER, node="n0013", ts=1_700_000_824.0, job="train-1", gpu=3, rank=107,
                   step=199, diagnosis=Diagnosis.NODE_THERMAL, z=7.5, slowdown=0.2, detector="straggler",
                   evidence={"temp_c": 91.0, "reasons": ["HW_THERMAL"]})


def _recommendation() -> Recommendation:
    return Recommendation(action=Action.EVICT, node="n0013", ts=1_700_000_830.0, reason="thermal straggler",
                          guard=Guard.RATE_LIMITED, job="train-1", finding_id=_finding().id, dry_run=True,
                          evidence={"payback_s": 120.0})


# ---------------------------------------------------------------- round trips
def test_telemetry_round_trip_keeps_every_column_and_nan() -> None:
    msg = _telemetry()
    raw = schema.encode(msg)
    back = schema.decode(Telemetry, raw)
    assert (back.node, back.rack, back.ts, back.nic_util, back.model, back.uuid) == \
        (msg.node, msg.rack, msg.ts, msg.nic_util, msg.model, msg.uuid)
    np.testing.assert_array_equal(back.gpu, msg.gpu)
    assert set(back.columns) == set(GPU_FIELDS)
    for name in GPU_FIELDS:
        np.testing.assert_array_equal(back.columns[name], msg.columns[name])  # NaN == NaN here
    assert math.isnan(back.columns["power_w"][0]) and back.columns["ecc_sbe_volatile"][2] == 2.0
    assert back.key == "n0013" and Telemetry.TOPIC is Topic.TELEMETRY


def test_telemetry_unknown_nic_util_stays_nan() -> None:
    msg = Telemetry.from_columns("n0", "r00", 1.0, [0])
    back = schema.decode(Telemetry, schema.encode(msg))
    assert math.isnan(back.nic_util) and orjson.loads(schema.encode(msg))["nic_util"] is None


def test_telemetry_is_encoded_from_its_arrays_to_the_bytes_of_its_lists() -> None:
    """``encode`` hands a sample's columns to orjson as arrays: the bytes must be those of the lists
    (NaN as null), for the values that print differently in most formatters (decoding would refuse
    some of them as out of range; the round trip is the test above)."""
    from fleethealth.schema import NicPorts

    odd = [0.0, -0.0, math.nan, 1e16, 1.0 / 3.0, 5e-324, 1.7976931348623157e308, 2.5e-7, 123456789.0, 0.1]
    nic = NicPorts.from_columns(["mlx5_0/1"], ["ib"], tx_bytes=[2.0**53], rx_bytes=[0.0], xmit_wait=[math.nan],
                                link_gbps=[400.0], up=[1.0], link_downed=[0.0])
    msg = Telemetry.from_columns("n0013", "r01", 1_700_000_000.25, list(range(len(odd))), nic_util=math.nan,
                                 temp_c=odd, power_w=odd[::-1], sm_clock_mhz=[1980.0] * len(odd), nic=nic)
    raw = schema.encode(msg)
    assert raw == orjson.dumps(msg.to_obj())
    assert orjson.loads(raw)["columns"]["temp_c"][:3] == [0.0, -0.0, None]
    assert b'"temp_c":[0.0,-0.0,null,1e+16,0.3333333333333333,5e-324,' in raw


@pytest.mark.parametrize("groups", [True, False])
def test_step_batch_round_trip(groups: bool) -> None:
    msg = _steps(groups)
    back = schema.decode(StepBatch, schema.encode(msg))
    assert (back.job, back.step, back.node, back.ts) == (msg.job, msg.step, msg.node, msg.ts)
    for name in ("ranks", "gpus", "compute_s"):
        np.testing.assert_array_equal(getattr(back, name), getattr(msg, name))
    assert back.ranks.dtype == np.int32 and back.gpus.dtype == np.int16 and back.compute_s.dtype == np.float64
    if groups:
        np.testing.assert_array_equal(back.groups, msg.groups)
    else:
        assert back.groups is None
    assert back.key == "train-1"


@pytest.mark.parametrize("make", [_event, _finding, _recommendation])
def test_frozen_messages_round_trip_equal(make: Callable[[], Any]) -> None:
    msg = make()
    raw = schema.encode(msg)
    obj = orjson.loads(raw)
    assert obj["v"] == SCHEMA_VERSION
    back = schema.decode(type(msg), raw)
    assert back == msg and back.id == msg.id
    assert schema.TOPIC_TYPES[type(msg).TOPIC] is type(msg)


def test_ids_are_stable_and_sensitive() -> None:
    a, b = _finding(), _finding()
    assert a.id == b.id
    assert Finding(**{**a.__dict__, "step": 200}).id != a.id
    assert _recommendation().id == _recommendation().id
    assert Event(**{**_event().__dict__, "rank": 1}).id != _event().id


def test_decode_accepts_a_parsed_object_and_text() -> None:
    obj = _finding().to_obj()
    assert schema.decode(Finding, obj) == _finding()
    assert schema.decode(Finding, orjson.dumps(obj).decode()) == _finding()


def test_every_topic_but_deadletter_has_a_type() -> None:
    # fh.snapshots carries detector snapshots as opaque blobs (fleethealth.detectors.snapshot), not messages
    assert set(schema.TOPIC_TYPES) == set(Topic) - {Topic.DEADLETTER, Topic.SNAPSHOTS}


def test_a_node_state_round_trips_and_a_bad_one_names_its_field() -> None:
    from fleethealth.detectors.nodestate import node_state
    from fleethealth.schema import NicPorts, NodeState, Telemetry

    def sample(ts: float, tx: float) -> Telemetry:
        nic = NicPorts.from_columns(["mlx5_0/1"], ["ib"], tx_bytes=[tx], rx_bytes=[0.0], xmit_wait=[0.0],
                                    link_gbps=[400.0], up=[1.0], link_downed=[0.0])
        return Telemetry.from_columns("n1", "r1", ts, [0, 1], temp_c=[61.0, float("nan")],
                                      slowdown_temp_c=[87.0, 87.0], clock_reasons=[0.0, 32.0], nic=nic,
                                      nvlink_crc_flit=[0.0, 0.0])
    state = node_state(sample(11.0, 25e9), sample(10.0, 0.0), load_power_w=np.array([610.0, np.nan]),
                       residual_c=np.array([2.5, np.nan]))
    assert state.nic_port_util[0] == pytest.approx(0.5) and not state.nic_port_down[0]
    back = schema.decode(NodeState, schema.encode(state))
    for name in (*NodeState.GPU_ARRAYS, *NodeState.THERMAL_ARRAYS, "reports", "gpu", "nic_port_util",
                 "nic_port_wait", "nic_port_down"):
        assert np.array_equal(getattr(back, name), getattr(state, name), equal_nan=True), name
    assert (back.node, back.rack, back.ts, back.nic_port) == ("n1", "r1", 11.0, ("mlx5_0/1",))
    assert back.residual_c[0] == 2.5 and back.load_power_w[0] == 610.0
    older = orjson.loads(schema.encode(state))  # from a node stage before the thermal model: unknown
    for name in NodeState.THERMAL_ARRAYS:
        del older[name]
    assert np.isnan(schema.decode(NodeState, orjson.dumps(older)).residual_c).all()
    bad = orjson.loads(schema.encode(state))
    bad["reports"] = [True]
    with pytest.raises(SchemaError) as err:
        schema.decode(NodeState, orjson.dumps(bad))
    assert err.value.field == "reports"
    bad = orjson.loads(schema.encode(state))
    bad["nic"]["util"] = [-1.0]
    with pytest.raises(SchemaError) as err:
        schema.decode(NodeState, orjson.dumps(bad))
    assert err.value.field == "nic.util"


# ---------------------------------------------------------------- validation errors
def _with(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``obj`` with ``path`` (``a`` or ``a.b``) set to ``value``, or removed for _DROP."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in obj.items()}
    *parents, last = path.split(".")
    target = out
    for p in parents:
        target = target[p]
    if value is _DROP:
        del target[last]
    else:
        target[last] = value
    return out


_DROP = object()

CASES: list[tuple[str, Callable[[], Any], str, Any, str]] = [
    # (case, message builder, path to change, new value, field named by the error)
    ("missing node", _steps, "node", _DROP, "node"),
    ("empty node", _steps, "node", "", "node"),
    ("node not a string", _steps, "node", 5, "node"),
    ("step as a string", _steps, "step", "412", "step"),
    ("step as a bool", _steps, "step", True, "step"),
    ("negative step", _steps, "step", -1, "step"),
    ("step beyond int64", _steps, "step", 2**70, "step"),
    ("rank beyond int32", _steps, "ranks", [2**40, 105, 106], "ranks"),
    ("GPU index beyond int16", _steps, "gpus", [70_000, 1, 2], "gpus"),
    ("compute time beyond a double", _steps, "compute_s", [1.0, 10**400, 1.0], "compute_s"),
    ("ts as a string", _steps, "ts", "noon", "ts"),
    ("NaN ts", _steps, "ts", math.nan, "ts"),
    ("infinite ts", _steps, "ts", math.inf, "ts"),
    ("negative ts", _steps, "ts", -5.0, "ts"),
    ("ranks not an array", _steps, "ranks", "104", "ranks"),
    ("ranks as floats", _steps, "ranks", [104.0, 105.0, 106.0], "ranks"),
    ("negative rank", _steps, "ranks", [-1, 105, 106], "ranks"),
    ("duplicate rank", _steps, "ranks", [104, 104, 106], "ranks"),
    ("no ranks", _steps, "ranks", [], "ranks"),
    ("gpus shorter than ranks", _steps, "gpus", [0, 1], "gpus"),
    ("compute_s longer than ranks", _steps, "compute_s", [1.0, 1.0, 1.0, 1.0], "compute_s"),
    ("groups shorter than ranks", _steps, "groups", [0], "groups"),
    ("compute_s with text", _steps, "compute_s", [1.0, "slow", 1.0], "compute_s"),
    ("compute_s with null", _steps, "compute_s", [1.0, None, 1.0], "compute_s"),
    ("NaN compute time", _steps, "compute_s", [1.0, math.nan, 1.0], "compute_s"),
    ("infinite compute time", _steps, "compute_s", [1.0, math.inf, 1.0], "compute_s"),
    ("negative compute time", _steps, "compute_s", [1.0, -0.1, 1.0], "compute_s"),
    ("absurd compute time", _steps, "compute_s", [1.0, MAX_COMPUTE_S * 2, 1.0], "compute_s"),
    ("unknown GPU field", _telemetry, "columns.gpu_mood", [1.0, 2.0, 3.0], "columns.gpu_mood"),
    ("GPU column of wrong length", _telemetry, "columns.temp_c", [60.0], "temp_c"),
    ("infinite GPU value", _telemetry, "columns.temp_c", [60.0, math.inf, 60.0], "temp_c"),
    ("GPU column with text", _telemetry, "columns.temp_c", [60.0, "hot", 60.0], "temp_c"),
    ("columns not an object", _telemetry, "columns", [1, 2], "columns"),
    ("uuid not strings", _telemetry, "uuid", [1, 2, 3], "uuid"),
    ("model not a string", _telemetry, "model", 7, "model"),
    ("negative nic_util", _telemetry, "nic_util", -0.5, "nic_util"),
    ("negative GPU index", _telemetry, "gpu", [-1, 1, 2], "gpu"),
    ("unknown event kind", _event, "kind", "meteor", "kind"),
    ("event gpu as a string", _event, "gpu", "6", "gpu"),
    ("event message not a string", _event, "message", 3, "message"),
    ("event data not an object", _event, "data", ["x"], "data"),
    ("unknown finding kind", _finding, "kind", "vibes", "kind"),
    ("unknown diagnosis", _finding, "diagnosis", "HOT", "diagnosis"),
    ("z as a string", _finding, "z", "high", "z"),
    ("NaN z", _finding, "z", math.nan, "z"),
    ("negative probability", _finding, "probability", -0.1, "probability"),
    ("detector not a string", _finding, "detector", 1, "detector"),
    ("evidence not an object", _finding, "evidence", "hot", "evidence"),
    ("unknown action", _recommendation, "action", "reboot_everything", "action"),
    ("unknown guard", _recommendation, "guard", "yolo", "guard"),
    ("missing reason", _recommendation, "reason", _DROP, "reason"),
    ("dry_run as text", _recommendation, "dry_run", "yes", "dry_run"),
    ("unknown version", _finding, "v", 2, "v"),
    ("missing version", _finding, "v", _DROP, "v"),
]


@pytest.mark.parametrize(("case", "make", "path", "value", "field"), CASES, ids=[c[0] for c in CASES])
def test_invalid_message_names_the_field(case: str, make: Callable[[], Any], path: str, value: Any,
                                         field: str) -> None:
    msg = make()
    good = msg.to_obj()
    schema.decode(type(msg), good)  # the unmodified message is valid
    with pytest.raises(SchemaError) as err:
        schema.decode(type(msg), _with(good, path, value))
    assert err.value.field == field, f"{case}: {err.value}"
    assert str(err.value).startswith(f"{field}: ")


@pytest.mark.parametrize(("raw", "problem"), [
    (b'{"v": 1, "job": ', "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"[1, 2, 3]", "expected a JSON object"),
    (b'"a string"', "expected a JSON object"),
    (b"null", "expected a JSON object"),
])
def test_not_json_or_not_an_object(raw: bytes, problem: str) -> None:
    with pytest.raises(SchemaError) as err:
        schema.decode(StepBatch, raw)
    assert err.value.field == "<message>" and problem in err.value.problem


def test_version_error_says_what_this_build_reads() -> None:
    with pytest.raises(SchemaError, match=r"unknown schema version 99 \(this build reads 1\)"):
        schema.decode(Event, {**_event().to_obj(), "v": 99})


def test_unknown_enum_lists_the_known_values() -> None:
    with pytest.raises(SchemaError) as err:
        schema.decode(Finding, {**_finding().to_obj(), "diagnosis": "HOT"})
    assert "NODE_THERMAL" in err.value.problem and "ENVIRONMENTAL" in err.value.problem


def test_from_columns_rejects_unknown_fields() -> None:
    with pytest.raises(SchemaError) as err:
        Telemetry.from_columns("n0", "r00", 0.0, [0], not_a_field=[1.0])
    assert err.value.field == "not_a_field"


def test_schema_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        schema.decode(StepBatch, b"{}")


# ---------------------------------------------------------------------------------------- step blocks
def _block(steps: int = 3, ranks: int = 4, groups: bool = False) -> schema.StepBlock:
    r = np.arange(8, 8 + ranks, dtype=np.int32)
    return schema.StepBlock.of([StepBatch(job="j", step=10 + k, node="n0001", ts=1000.0 + 0.1 * k, ranks=r,
                                          gpus=(r % 8).astype(np.int16), compute_s=0.5 + 0.01 * k + 0.001 * r,
                                          groups=(r % 2).astype(np.int32) if groups else None)
                                for k in range(steps)])


@pytest.mark.parametrize("groups", [False, True])
def test_a_step_block_round_trips_and_splits_into_its_batches(groups: bool) -> None:
    block = _block(groups=groups)
    back = schema.decode(StepBatch, schema.encode(block))  # fh.steps: both forms, one decoder
    assert isinstance(back, schema.StepBlock) and back.key == "j" and back.ts == pytest.approx(1000.2)
    assert back.steps.tolist() == [10, 11, 12] and back.compute_s.shape == (3, 4)
    assert back.ranks.dtype == np.int32 and back.gpus.dtype == np.int16
    for a, b in zip(back.split(), block.split(), strict=True):
        assert (a.job, a.step, a.node, a.ts) == (b.job, b.step, b.node, b.ts)
        assert a.ranks.tolist() == b.ranks.tolist() and a.compute_s.tolist() == b.compute_s.tolist()
        assert (a.groups is None) == (not groups)
    # the bulk decoder gives the same block, beside one-step batches it still decodes columnar
    one = block.split()[0]
    got = schema.decode_many(StepBatch, [schema.encode(block), schema.encode(one)])
    assert isinstance(got[0], schema.StepBlock) and got[0].steps.tolist() == [10, 11, 12]
    assert isinstance(got[1], StepBatch) and got[1].step == 10


@pytest.mark.parametrize(("change", "field"), [
    (lambda o: o["compute_s"][1].__setitem__(2, -1.0), "compute_s"),
    (lambda o: o["compute_s"][2].__setitem__(0, "0.5"), "compute_s"),
    (lambda o: o["compute_s"].pop(), "compute_s"),
    (lambda o: o["compute_s"][0].pop(), "compute_s"),
    (lambda o: o["compute_s"][0].__setitem__(1, MAX_COMPUTE_S * 2), "compute_s"),
    (lambda o: o["steps"].__setitem__(1, 10), "steps"),
    (lambda o: o["steps"].__setitem__(1, -3), "steps"),
    (lambda o: o.__setitem__("steps", []), "steps"),
    (lambda o: o["ts"].pop(), "ts"),
    (lambda o: o["ts"].__setitem__(0, 5e9), "ts"),
    (lambda o: o["ranks"].__setitem__(1, 8), "ranks"),
    (lambda o: o["gpus"].__setitem__(0, 40_000), "gpus"),
    (lambda o: o.__setitem__("node", ""), "node"),
])
def test_a_step_block_with_one_bad_value_is_rejected_whole_naming_the_field(change, field: str) -> None:
    obj = orjson.loads(schema.encode(_block()))
    change(obj)
    with pytest.raises(SchemaError) as err:
        schema.decode(StepBatch, orjson.dumps(obj))
    assert err.value.field == field
    [got] = schema.decode_many(StepBatch, [orjson.dumps(obj)])
    assert isinstance(got, SchemaError) and got.field == field


def test_a_poll_of_step_blocks_decodes_columnar_as_each_alone() -> None:
    """Blocks of several shapes (with and without groups), some broken, among step batches: the bulk
    decoder's results are exactly each value's own decode, arrays, dtypes and errors alike."""
    good = [_block(steps=s, ranks=r, groups=g) for s, r, g in ((3, 4, False), (1, 8, False), (5, 2, True),
                                                                (3, 4, False))]
    broken = orjson.loads(schema.encode(_block()))
    broken["compute_s"][2][1] = True
    late = orjson.loads(schema.encode(_block()))
    late["ts"][2] = 5e9
    twice = orjson.loads(schema.encode(_block()))
    twice["ranks"][3] = twice["ranks"][0]
    values = [schema.encode(good[0]), orjson.dumps(broken), schema.encode(good[1].split()[0]),
              schema.encode(good[1]), orjson.dumps(late), schema.encode(good[2]), orjson.dumps(twice),
              schema.encode(good[3])]
    bulk = schema.decode_many(StepBatch, values)
    for value, got in zip(values, bulk, strict=True):
        try:
            alone = schema.decode(StepBatch, value)
        except SchemaError as exc:
            assert isinstance(got, SchemaError) and (got.field, got.problem) == (exc.field, exc.problem)
            continue
        assert type(got) is type(alone)
        names = ("steps", "step_ts", "ranks", "gpus", "compute_s", "groups")
        for name in names if isinstance(alone, schema.StepBlock) else ("ranks", "gpus", "compute_s"):
            a, b = getattr(alone, name), getattr(got, name)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
    assert [type(x).__name__ for x in bulk] == ["StepBlock", "SchemaError", "StepBatch", "StepBlock", "SchemaError",
                                                "StepBlock", "SchemaError", "StepBlock"]
