"""Detector snapshots: a fed pipeline round-trips through signed explicit state; a damaged, foreign,
unsigned or oversized blob is refused with its reason before anything is built from it."""

from __future__ import annotations

import functools
import hashlib
import hmac
import struct
import zlib

import numpy as np
import orjson
import pytest

from fleethealth.detectors import snapshot
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.predict import FailurePredictor, load_model
from fleethealth.detectors.snapshot import SNAPSHOT_VERSION, SnapshotError, Snapshots, check_offsets
from fleethealth.detectors.state import State, StateError, from_state, registered, state_dict
from fleethealth.detectors.straggler import StragglerDetector
from fleethealth.errors import ConfigError
from fleethealth.schema import Finding, Message, Telemetry
from fleethealth.sim import FleetSim, Scenario

KEY = b"snapshot-test-key-0123456789abcdef"
SNAPS = Snapshots(key=KEY)
T0 = 1_767_225_600.0
OFFSETS = {("fh.steps", 3): 40_123, ("fh.events", 3): 17}

# 1,024 ranks (8 racks x 16 nodes x 8 GPUs); the snapshot is taken before step 110, while the thermal
# straggler that began at step 108 is still accumulating evidence, and everything else comes after it.
_SCENARIO = {
    "seed": 5,
    "fleet": {"racks": 8, "nodes_per_rack": 16, "gpus_per_node": 8},
    "job": {"id": "big", "steps": 160, "step_time_s": 1.0, "jitter": 0.02},
    "checks": {"selfcheck_every": 50, "replay_every": 100, "checkpoint_every": 25},
    "faults": [
        {"kind": "thermal_straggler", "node": "n0013", "gpu": 3, "start_step": 108, "slowdown": 0.2},
        {"kind": "nvlink_degraded", "node": "n0021", "start_step": 125, "slowdown": 0.15},
        {"kind": "nic_contention", "node": "n0005", "start_step": 60, "slowdown": 0.10},
        {"kind": "hot_aisle", "rack": "r05", "start_step": 130, "temp_rise_c": 15, "slowdown": 0.10},
        {"kind": "xid", "node": "n0030", "gpu": 5, "step": 140, "code": 13},
    ],
}
_CUT_STEP = 110


@pytest.fixture(scope="module")
def workload() -> tuple[list[list[Message]], list[list[Message]]]:
    """The simulated job's messages, per moment, before and after the snapshot."""
    moments = list(FleetSim(Scenario.from_obj(_SCENARIO)).run())
    cut = next(i for i, m in enumerate(moments) if m.step == _CUT_STEP)
    messages = [[*m.telemetry, *m.batches, *m.events] for m in moments]
    return messages[:cut], messages[cut:]


def _feed(pipe: Pipeline, moments: list[list[Message]]) -> list[Finding]:
    found: list[Finding] = []
    for messages in moments:
        found += pipe.feed(messages).findings
    return found


def _small_pipeline() -> Pipeline:
    pipe = Pipeline()
    pipe.feed([Telemetry.from_columns(f"n{i:04d}", "r00", T0 + 10.0, [0]) for i in range(4)])
    return pipe


@pytest.mark.parametrize("factory", [StragglerDetector, functools.partial(StragglerDetector, min_effect=0.01)],
                         ids=["class", "partial"])
def test_a_fed_pipeline_restored_from_its_snapshot_finds_what_the_original_finds(workload, factory) -> None:
    before, after = workload
    original = Pipeline(straggler=factory)
    _feed(original, before)
    blob = SNAPS.dump(original, OFFSETS)
    restored, offsets = SNAPS.load(blob, like=Pipeline(straggler=factory), expect=Pipeline)
    assert offsets == OFFSETS and restored is not original
    assert isinstance(restored.stragglers_["big"], StragglerDetector) and restored.straggler is factory
    found = _feed(original, after) + original.drain().findings
    again = _feed(restored, after) + restored.drain().findings
    assert [(f.id, f.kind, f.node, f.step, f.diagnosis) for f in again] == \
        [(f.id, f.kind, f.node, f.step, f.diagnosis) for f in found]
    assert again == found
    seen = {(f.kind.value, f.node, f.diagnosis and f.diagnosis.value) for f in found}
    assert {("straggler", "n0013", "NODE_THERMAL"), ("straggler", "n0021", "NODE_LINK"), ("xid", "n0030", None)} <= seen
    assert min(f.step for f in found if f.node == "n0013") > _CUT_STEP  # begun before the snapshot, found after


def test_the_state_is_json_and_numeric_arrays_only(workload) -> None:
    pipe = Pipeline()
    _feed(pipe, workload[0])
    state = state_dict(pipe)
    orjson.loads(orjson.dumps(state.tree))  # plain JSON, nothing else
    assert {a.dtype.kind for a in state.arrays} <= set("biufU") and state.arrays
    assert b"pickle" not in orjson.dumps(state.tree)


def test_telemetry_samples_come_back_with_every_field_and_shared_as_they_were() -> None:
    from fleethealth.schema import GPU_FIELDS, NicPorts

    nic = NicPorts.from_columns(["mlx5_0/1"], ["ib"], tx_bytes=[12.0])
    packed = Telemetry.from_columns("n0001", "r00", T0, [0, 1, 2], temp_c=[61.5, np.nan, 70.25], model="H100",
                                    uuid=("a", "b", "c"), nic=nic, nic_util=0.5, power_w=[1.0, 2.0, 3.0])
    ragged = Telemetry.from_columns("n0002", "r00", T0, [0, 1], temp_c=[60.0, 61.0])
    ragged.columns["power_w"] = np.array([1, 2, 3])  # not one shape and dtype: written field by field
    state = {"a": packed, "b": packed, "c": ragged}
    back, _ = SNAPS.load(SNAPS.dump(state, {}))
    assert back["a"] is back["b"] and back["a"] is not packed
    for old, new in ((packed, back["a"]), (ragged, back["c"])):
        assert type(new) is Telemetry and list(new.columns) == list(old.columns)
        assert repr({k: v for k, v in vars(new).items() if k not in ("columns", "gpu", "nic")}) == \
            repr({k: v for k, v in vars(old).items() if k not in ("columns", "gpu", "nic")})  # NaN == NaN
        assert np.array_equal(new.gpu, old.gpu) and new.gpu.dtype == old.gpu.dtype
        for name, column in old.columns.items():
            assert new.columns[name].dtype == column.dtype
            assert np.array_equal(new.columns[name], column, equal_nan=True), name
    assert set(back["a"].columns) == set(GPU_FIELDS) and back["a"].nic.columns["tx_bytes"][0] == 12.0


def test_the_head_is_read_without_inflating() -> None:
    blob = SNAPS.dump(_small_pipeline(), OFFSETS)
    head = SNAPS.info(blob)
    assert blob.startswith(snapshot.MAGIC)
    assert head["version"] == SNAPSHOT_VERSION and head["offsets"] == OFFSETS and head["codec"] == "zlib"
    assert head["body_bytes"] < head["manifest_bytes"] + head["data_bytes"]


def _head_end(blob: bytes) -> int:
    return 14 + struct.unpack_from(">I", blob, 10)[0]


def _resign(blob: bytes, key: bytes = KEY) -> bytes:
    signed = blob[:-32]
    return signed + hmac.new(key, signed, hashlib.sha256).digest()


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda b, h: b[:h + 100] + bytes([b[h + 100] ^ 0x01]) + b[h + 101:], "MAC mismatch"),
    (lambda b, h: b[:20] + bytes([b[20] ^ 0x04]) + b[21:], "MAC mismatch"),
    (lambda b, h: b[:-1] + bytes([b[-1] ^ 1]), "MAC mismatch"),
    (lambda b, h: b[: len(b) - 10], "MAC mismatch"),
    (lambda b, h: b[:5], "truncated"),
    (lambda b, h: b + b"\0", "MAC mismatch"),
    (lambda b, h: b"GARBAGE!" + b[8:], "bad magic"),
    (lambda b, h: _resign(b[:h + 10] + b[h + 20:]), "truncated or extended"),
    (lambda b, h: _resign(b[:8] + struct.pack(">H", SNAPSHOT_VERSION - 1) + b[10:]),
     f"version {SNAPSHOT_VERSION - 1} is not"),
    (lambda b, h: _resign(b[:8] + struct.pack(">H", SNAPSHOT_VERSION + 1) + b[10:]), "rebuild the state"),
], ids=["body-bit", "head-bit", "mac-bit", "truncated", "stub", "trailing", "magic", "cut-body", "older", "newer"])
def test_a_damaged_snapshot_is_refused_with_its_reason(damage, reason) -> None:
    blob = SNAPS.dump(_small_pipeline(), OFFSETS)
    with pytest.raises(SnapshotError, match=reason):
        SNAPS.load(damage(blob, _head_end(blob)))


def test_a_blob_of_another_key_or_no_key_is_refused_and_none_is_written_without_one(tmp_path) -> None:
    blob = SNAPS.dump(_small_pipeline(), OFFSETS)
    with pytest.raises(SnapshotError, match="MAC mismatch"):
        Snapshots(key=b"another-key-of-at-least-32-bytes!!").load(blob)
    off = Snapshots()
    assert not off.enabled
    with pytest.raises(SnapshotError, match="no snapshot key"):
        off.load(blob)
    with pytest.raises(SnapshotError, match="no snapshot key"):
        off.dump(_small_pipeline(), OFFSETS)
    path = tmp_path / "key"
    path.write_bytes(KEY + b"\n")
    assert Snapshots(key_file=str(path)).load(blob)[1] == OFFSETS
    path.write_bytes(b"short")
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        Snapshots(key_file=str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        Snapshots(key_file=str(tmp_path / "absent"))


def test_a_state_of_another_type_or_not_bytes_is_refused() -> None:
    with pytest.raises(SnapshotError, match="not the expected Pipeline"):
        SNAPS.load(SNAPS.dump({"a": 1}, {}), expect=Pipeline)
    with pytest.raises(SnapshotError, match="must be bytes"):
        SNAPS.load("FHSNAP")  # type: ignore[arg-type]
    with pytest.raises(SnapshotError, match="is not an offset"):
        SNAPS.dump({}, {("fh.steps", 0): -1})
    with pytest.raises(SnapshotError, match="not \\(topic, partition\\)"):
        SNAPS.dump({}, {"fh.steps": 1})  # type: ignore[dict-item]
    with pytest.raises(SnapshotError, match="cannot be snapshotted.*builtins.function"):
        SNAPS.dump(lambda: None, {})
    with pytest.raises(SnapshotError, match="object array holding other than str"):
        SNAPS.dump({"a": np.array([1, "x", None], dtype=object)}, {})


def forge(tree: object, arrays: list | None = None, data: bytes = b"", *, key: bytes = KEY,
          manifest_bytes: int | None = None, data_bytes: int | None = None, body: bytes | None = None,
          offsets: list | None = None) -> bytes:
    """A blob of anyone's making, signed with ``key`` (the right key unless said otherwise): a holder
    of the key, or a bug, is what the checks after the MAC are for."""
    manifest = orjson.dumps({"tree": tree, "arrays": arrays or []})
    if body is None:
        body = zlib.compress(manifest + data)
    head = orjson.dumps({"fleethealth": "0", "schema": 1, "codec": "zlib", "body_bytes": len(body),
                         "manifest_bytes": len(manifest) if manifest_bytes is None else manifest_bytes,
                         "data_bytes": len(data) if data_bytes is None else data_bytes,
                         "offsets": offsets or []})
    signed = struct.pack(">8sHI", snapshot.MAGIC, SNAPSHOT_VERSION, len(head)) + head + body
    return signed + hmac.new(key, signed, hashlib.sha256).digest()


@pytest.mark.parametrize(("tree", "arrays", "data", "reason"), [
    (["o", "os.system", {}], [], b"", "not a registered state class"),
    (["o", "builtins.eval", {}], [], b"", "not a registered state class"),
    (["o", "fleethealth.detectors.snapshot.Snapshots", {}], [], b"", "not a registered state class"),
    (["o", "fleethealth.store.client.Store", {}], [], b"", "not a registered state class"),
    (["e", "numpy.dtypes.Float64DType", "__getattribute__"], [], b"", "not a registered state class"),
    (["o", "fleethealth.detectors.pipeline.Pipeline", {"__class__": 1}], [], b"", "not an attribute name"),
    (["o", "fleethealth.detectors.pipeline.Pipeline", {"__dict__": {}}], [], b"", "not an attribute name"),
    (["o", "fleethealth.detectors.pipeline.Pipeline", {"feed": ["l"]}], [], b"", "replace a method"),
    (["o", "fleethealth.detectors.pipeline.Pipeline", {"_stragglers": 1}], [], b"", "replace a method"),
    (["a", 0], [["|O", [1], 0]], b"\0" * 8, "dtype '|O' is not one"),
    (["a", 0], [["V8", [1], 0]], b"\0" * 8, "dtype 'V8' is not one"),
    (["a", 0], [["<f8", [1 << 40], 0]], b"\0" * 8, "over max_array_bytes"),
    (["a", 0], [["<f8", [1 << 20, 1 << 20, 1 << 20], 0]], b"\0" * 8, "over max_array_bytes"),
    (["a", 0], [["<f8", [4], 0]], b"\0" * 8, "not within the 8 bytes"),
    (["a", 0], [["<f8", [1], 8]], b"\0" * 8, "not within the 8 bytes"),
    (["l", ["a", 0], ["a", 1]], [["<f8", [1], 0], ["<f8", [1], 0]], b"\0" * 8, "add up to 16 bytes"),
    (["a", 3], [["<f8", [1], 0]], b"\0" * 8, "not one of the 1"),
    (["@", 5], [], b"", "not read before"),
    (["zz"], [], b"", "unknown tag"),
    (["d", [["l"], 1]], [], b"", "does not fit"),
    (["n", "|O", 1], [], b"", "is not one a state may hold"),
    (["r", "node_states"], [], b"", "shared object"),
], ids=["os.system", "eval", "unregistered-fleethealth", "store", "dtype-gadget", "set-class", "set-dict",
        "shadow-method", "shadow-private-method", "object-dtype", "void-dtype", "huge-array", "huge-3d",
        "array-past-data", "offset-past-data", "aliased-arrays",
        "array-index", "back-ref", "tag", "unhashable-key", "object-scalar", "shared-not-given"])
def test_a_forged_state_signed_with_the_key_is_refused(tree, arrays, data, reason) -> None:
    with pytest.raises(SnapshotError, match=reason):
        SNAPS.load(forge(tree, arrays, data))


def test_sizes_are_checked_before_inflating_or_allocating() -> None:
    small = Snapshots(key=KEY, max_bytes=1 << 20, max_manifest_bytes=1 << 16, max_array_bytes=1 << 16)
    with pytest.raises(SnapshotError, match="over max_bytes"):
        small.load(forge(None, data_bytes=1 << 30))
    with pytest.raises(SnapshotError, match="over max_manifest_bytes"):
        small.load(forge(None, manifest_bytes=1 << 20))
    bomb = zlib.compress(b"\0" * 50_000_000, 9)  # 49 KB that inflate to 50 MB
    with pytest.raises(SnapshotError, match="inflates past the 1000 bytes"):
        SNAPS.load(forge(None, body=bomb, manifest_bytes=4, data_bytes=996))
    with pytest.raises(SnapshotError, match="sizes"):
        SNAPS.load(forge(None, data_bytes=-1))
    assert SNAPS.load(forge({"ok": ["l", 1, ["f", "nan"]]}))[0]["ok"][0] == 1


def test_a_state_over_the_readers_caps_is_refused_when_written_not_when_restored() -> None:
    """What the reader would refuse is not written: a replica would otherwise save snapshots none can
    restore, and every restart would rebuild from the commit with the history lost."""
    small = Snapshots(key=KEY, max_bytes=1 << 20, max_manifest_bytes=1 << 16, max_array_bytes=1 << 16)
    fits = {"rows": np.zeros(1 << 12)}  # 32 KiB
    assert small.load(small.dump(fits, OFFSETS))[0]["rows"].size == 1 << 12
    with pytest.raises(SnapshotError, match="over max_array_bytes=65536 .*no replica could restore"):
        small.dump({"rows": np.zeros(1 << 14)}, OFFSETS)  # one array of 128 KiB
    with pytest.raises(SnapshotError, match=r"inflates to \d+ bytes .*over max_bytes=1048576"):
        small.dump([np.zeros((1 << 12) + i) for i in range(40)], OFFSETS)  # 40 arrays of 32 KiB
    with pytest.raises(SnapshotError, match="max_manifest_bytes=65536"):
        small.dump({f"k{i}": "x" * 100 for i in range(1000)}, OFFSETS)  # a 100 KB tree


def test_a_restored_object_runs_no_code_of_the_blobs_choosing() -> None:
    """The old gadgets: ``__setstate__`` (the predictor's loaded a model from a path in the blob),
    ``__reduce__``, ``__init__``: rebuilding calls none of them, and the predictor's model comes from
    the configured object, never from a path in the state."""
    calls = []
    tree = ["o", "fleethealth.detectors.predict.FailurePredictor",
            {"model": "/tmp/evil.joblib", "use_model": True, "threshold_": 0.5, "artifact_": "x",
             "__setstate__": 1}]
    with pytest.raises(SnapshotError, match="not an attribute name"):
        SNAPS.load(forge(tree))
    del tree[2]["__setstate__"]
    configured = FailurePredictor(use_model=True)
    configured.check([])
    back, _ = SNAPS.load(forge(tree), like=configured)
    assert back.model is None and back.artifact_ is configured.artifact_ and calls == []
    assert "/tmp/evil.joblib" not in repr(vars(back))


def test_offsets_are_checked_against_the_partition_range() -> None:
    ranges = {("fh.steps", 3): (100, 5000), ("fh.events", 3): (0, 17)}
    check_offsets(OFFSETS | {("fh.steps", 3): 4000}, partition=3, topics=["fh.steps", "fh.events"], ranges=ranges)
    for offsets, reason in [({("fh.steps", 3): 5001}, "outside the partition's range"),
                            ({("fh.steps", 3): 99}, "outside the partition's range"),
                            ({("fh.steps", 4): 200}, "not an input partition 3"),
                            ({("fh.telemetry", 3): 200}, "not an input partition 3"),
                            ({("fh.events", 3): 18}, r"range \[0, 17\]")]:
        with pytest.raises(SnapshotError, match=reason):
            check_offsets(offsets, partition=3, topics=["fh.steps", "fh.events"], ranges=ranges)
    with pytest.raises(SnapshotError, match="did not give"):
        check_offsets({("fh.steps", 3): 1}, partition=3, topics=["fh.steps"], ranges={})


def test_shared_objects_are_referenced_by_name_and_must_be_given() -> None:
    table = {f"n{i:04d}": np.arange(1000.0) for i in range(50)}  # e.g. the node-state table
    pipes = [_small_pipeline(), _small_pipeline()]
    for pipe in pipes:
        pipe.nodestate = table
    blobs = [SNAPS.dump(pipe, OFFSETS, shared={"nodestate": table}) for pipe in pipes]
    assert all(len(b) < len(SNAPS.dump(pipes[0], OFFSETS)) / 4 for b in blobs)  # the table is not in them
    fresh = {"n0000": np.zeros(1)}
    restored = [SNAPS.load(b, shared={"nodestate": fresh})[0] for b in blobs]
    assert all(r.nodestate is fresh for r in restored)
    with pytest.raises(SnapshotError, match="shared object \\['nodestate'\\], which was not given"):
        SNAPS.load(blobs[0])


def test_a_predictor_with_its_model_takes_it_from_the_configuration() -> None:
    pipe = Pipeline(predictor=FailurePredictor(use_model=True))
    pipe.feed([Telemetry.from_columns(f"n{i:04d}", "r00", T0 + 10.0, [0]) for i in range(4)])
    blob = SNAPS.dump(pipe, {})
    restored, _ = SNAPS.load(blob)  # no configured object: the shipped model, from its path
    assert type(restored.predictor.artifact_.model) is type(pipe.predictor.artifact_.model)
    artifact = load_model()
    configured = Pipeline(predictor=FailurePredictor(use_model=True, model=artifact))
    back, _ = SNAPS.load(blob, like=configured)
    assert back.predictor.model is artifact
    assert back.predictor.artifact_ is artifact  # loaded by the configured predictor, not from the state


def test_a_step_block_with_its_cached_time_round_trips() -> None:
    from fleethealth.schema import StepBlock

    block = StepBlock(job="j", node="gpu-a", steps=np.arange(3), step_ts=T0 + np.arange(3.0), ranks=np.arange(8),
                      gpus=np.arange(8, dtype=np.int16), compute_s=np.ones((3, 8)))
    assert block.ts == T0 + 2  # cached in the instance
    back = from_state(state_dict({"held": [block]}))["held"][0]
    assert type(back) is StepBlock and back.ts == T0 + 2 and np.array_equal(back.compute_s, block.compute_s)


def test_identity_and_every_registered_class_survive() -> None:
    shared_list = [1, 2]
    arr = np.arange(3.0)
    state = {"a": shared_list, "b": shared_list, "x": arr, "y": arr, "t": (1, 2.5, float("inf")), "s": {1, 2},
             "z": frozenset({"a"}), "k": {(1, "a"): 2}, "big": 1 << 70, "np": np.int16(3), "by": b"\x00\x01"}
    back = from_state(state_dict(state))
    assert back["a"] is back["b"] and back["x"] is back["y"] and back == {**state, "x": arr, "y": arr} | {
        "x": back["x"], "y": back["y"]}
    assert type(back["np"]) is np.int16 and back["t"][2] == float("inf")
    names = registered()
    assert "fleethealth.detectors.pipeline.Pipeline" in names and "fleethealth.schema.Telemetry" in names
    assert not any(n.startswith(("fleethealth.store", "fleethealth.bus", "fleethealth.detectors.snapshot"))
                   for n in names)
    with pytest.raises(StateError, match="deeper"):
        from_state(State(functools.reduce(lambda acc, _: ["l", acc], range(300), None), []))


def test_an_object_rebuilt_in_memory_shares_no_array_with_the_one_its_state_was_taken_from() -> None:
    """``from_state(state_dict(x))`` with no blob between (the whole tier's restore test, a tool comparing
    states): feeding the original afterwards must not move the rebuilt one. Before, the rebuilt object held
    the original's arrays, and a restored hang detector dated its episode by the original's newer steps."""
    steps = {"last": np.arange(4), "cols": {"a": np.zeros(3), "b": np.ones(3)}}
    back = from_state(state_dict(steps))
    steps["last"][:] = 99
    steps["cols"]["a"][:] = 7.0
    assert back["last"].tolist() == [0, 1, 2, 3] and back["cols"]["a"].tolist() == [0.0, 0.0, 0.0]
    assert not np.shares_memory(back["last"], steps["last"])
