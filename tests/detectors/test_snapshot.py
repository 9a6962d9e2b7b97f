"""Detector snapshots: a fed pipeline round-trips, a damaged or foreign blob is refused with its reason."""

from __future__ import annotations

import functools
import os
import pickle
import struct
import subprocess

import numpy as np
import pytest

from fleethealth.detectors import snapshot
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.predict import FailurePredictor, load_model
from fleethealth.detectors.snapshot import SNAPSHOT_VERSION, SnapshotError, allowed, dump, info, load
from fleethealth.detectors.straggler import StragglerDetector
from fleethealth.schema import Finding, Message, Telemetry
from fleethealth.sim import FleetSim, Scenario

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
    blob = dump(original, OFFSETS)
    restored, offsets = load(blob, expect=Pipeline)
    assert offsets == OFFSETS and restored is not original
    assert isinstance(restored.stragglers_["big"], StragglerDetector)
    found = _feed(original, after) + original.drain().findings
    again = _feed(restored, after) + restored.drain().findings
    assert [(f.id, f.kind, f.node, f.step, f.diagnosis) for f in again] == \
        [(f.id, f.kind, f.node, f.step, f.diagnosis) for f in found]
    assert again == found
    seen = {(f.kind.value, f.node, f.diagnosis and f.diagnosis.value) for f in found}
    assert {("straggler", "n0013", "NODE_THERMAL"), ("straggler", "n0021", "NODE_LINK"), ("xid", "n0030", None)} <= seen
    assert min(f.step for f in found if f.node == "n0013") > _CUT_STEP  # begun before the snapshot, found after


def test_telemetry_samples_come_back_with_every_field_and_shared_as_they_were() -> None:
    from fleethealth.schema import GPU_FIELDS, NicPorts

    nic = NicPorts.from_columns(["mlx5_0/1"], ["ib"], tx_bytes=[12.0])
    packed = Telemetry.from_columns("n0001", "r00", T0, [0, 1, 2], temp_c=[61.5, np.nan, 70.25], model="H100",
                                    uuid=("a", "b", "c"), nic=nic, nic_util=0.5, power_w=[1.0, 2.0, 3.0])
    ragged = Telemetry.from_columns("n0002", "r00", T0, [0, 1], temp_c=[60.0, 61.0])
    ragged.columns["power_w"] = np.array([1, 2, 3])  # not one shape and dtype: written field by field
    state = {"a": packed, "b": packed, "c": ragged}
    back, _ = load(dump(state, {}))
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


def test_a_reorder_buffer_of_bus_records_releases_the_same_after_a_round_trip() -> None:
    from fleethealth.bus import Record
    from fleethealth.detectors.assembly import EventTimeBuffer

    buffer: EventTimeBuffer[Record] = EventTimeBuffer()
    for offset, (ts, partition) in enumerate([(5.0, 0), (3.0, 1), (5.0, 1), (3.0, 0), (9.0, 0)]):
        sample = Telemetry.from_columns(f"n{offset:04d}", "r00", T0 + ts, [0])
        buffer.push(T0 + ts, ("fh.telemetry", partition), Record("fh.telemetry", partition, offset, b"k", sample))
    back, _ = load(dump(buffer, {}))
    back.push(T0 + 5.0, ("fh.telemetry", 0), "late")
    buffer.push(T0 + 5.0, ("fh.telemetry", 0), "late")
    assert back.watermark([("fh.telemetry", 0), ("fh.telemetry", 1)]) == T0 + 5.0

    def order(released: list) -> list:
        return [(tp, r if isinstance(r, str) else r.offset) for tp, r in released]

    assert order(back.release(T0 + 5.0)) == order(buffer.release(T0 + 5.0)) == \
        [(("fh.telemetry", 1), 1), (("fh.telemetry", 0), 3), (("fh.telemetry", 0), 0), (("fh.telemetry", 1), 2),
         (("fh.telemetry", 0), "late")]
    assert len(back) == len(buffer) == 1


def test_the_header_is_read_without_unpickling() -> None:
    blob = dump(_small_pipeline(), OFFSETS)
    head = info(blob)
    assert blob.startswith(snapshot.MAGIC)
    assert head["version"] == SNAPSHOT_VERSION and head["offsets"] == OFFSETS and head["codec"] == "zlib"
    assert head["body_bytes"] < head["raw_bytes"] and len(blob) > head["body_bytes"]


def _header_end(blob: bytes) -> int:
    meta_len = struct.unpack_from(">I", blob, 10)[0]
    return 14 + meta_len + 32


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda b, h: b[:h] + bytes([b[h + 100] ^ 0x01]).join([b[h:h + 100], b[h + 101:]]), "digest mismatch"),
    (lambda b, h: b[:h + 7] + bytes([b[h + 7] ^ 0x80]) + b[h + 8:], "digest mismatch"),
    (lambda b, h: b[:20] + bytes([b[20] ^ 0x04]) + b[21:], "digest mismatch|header unreadable"),
    (lambda b, h: b[: len(b) - 10], "truncated"),
    (lambda b, h: b[: h - 5], "truncated"),
    (lambda b, h: b[:5], "truncated"),
    (lambda b, h: b + b"\0", "after its body"),
    (lambda b, h: b"GARBAGE!" + b[8:], "bad magic"),
    (lambda b, h: b[:8] + struct.pack(">H", SNAPSHOT_VERSION - 1) + b[10:], f"version {SNAPSHOT_VERSION - 1} is not"),
    (lambda b, h: b[:8] + struct.pack(">H", SNAPSHOT_VERSION + 1) + b[10:], "rebuild the state"),
], ids=["body-bit", "body-byte", "meta-bit", "truncated-body", "truncated-header", "stub", "trailing", "magic",
        "older", "newer"])
def test_a_damaged_snapshot_is_refused_with_its_reason(damage, reason) -> None:
    blob = dump(_small_pipeline(), OFFSETS)
    with pytest.raises(SnapshotError, match=reason):
        load(damage(blob, _header_end(blob)))


def test_a_state_of_another_type_or_not_bytes_is_refused() -> None:
    with pytest.raises(SnapshotError, match="not the expected Pipeline"):
        load(dump({"a": 1}, {}), expect=Pipeline)
    with pytest.raises(SnapshotError, match="must be bytes"):
        load("FHSNAP")  # type: ignore[arg-type]
    with pytest.raises(SnapshotError, match="is not an offset"):
        dump({}, {("fh.steps", 0): -1})
    with pytest.raises(SnapshotError, match="not \\(topic, partition\\)"):
        dump({}, {"fh.steps": 1})  # type: ignore[dict-item]
    with pytest.raises(SnapshotError, match="cannot be snapshotted"):
        dump(lambda: None, {})


def _forge(payload: bytes, raw_bytes: int | None = None) -> bytes:
    """A well-formed snapshot around a pickle of anyone's making (right magic, version and digest)."""
    real = dump(None, {})
    end = _header_end(real)
    meta = snapshot.orjson.loads(real[14:end - 32])
    body = snapshot.zlib.compress(payload)
    meta.update(body_bytes=len(body), raw_bytes=len(payload) if raw_bytes is None else raw_bytes)
    meta_bytes = snapshot.orjson.dumps(meta)
    digest = snapshot.hashlib.sha256(meta_bytes + body).digest()
    return struct.pack(">8sHI", snapshot.MAGIC, SNAPSHOT_VERSION, len(meta_bytes)) + meta_bytes + digest + body


class _Call:
    """Pickles as a call of ``func(*args)`` on loading: what a malicious snapshot would hold."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def test_a_body_that_inflates_beyond_its_stated_size_is_refused() -> None:
    bomb = b"\0" * 50_000_000
    with pytest.raises(SnapshotError, match="does not decompress to the 1000 bytes"):
        load(_forge(bomb, raw_bytes=1000))
    with pytest.raises(SnapshotError, match="is not a size"):
        load(_forge(b"N.", raw_bytes=-1))
    assert load(_forge(pickle.dumps({"ok": 1}, protocol=5))) == ({"ok": 1}, {})


@pytest.mark.parametrize("evil", [
    _Call(os.system, "touch /tmp/fleethealth-pwned"),
    _Call(eval, "__import__('os').getcwd()"),
    _Call(subprocess.Popen, ["true"]),
    _Call(getattr, Pipeline, "feed"),
    functools.partial(os.system, "true"),
    _Call(pickle.loads, b"N."),
    _Call(np.load, "/etc/passwd"),
], ids=["os.system", "eval", "subprocess", "getattr", "partial-of-os.system", "nested-pickle", "numpy-load"])
def test_a_malicious_pickle_is_refused_before_anything_runs(evil) -> None:
    payload = pickle.dumps(evil, protocol=5)
    with pytest.raises(SnapshotError, match="may not be loaded from a snapshot"):
        load(_forge(payload))
    assert not os.path.exists("/tmp/fleethealth-pwned")


def _global(module: str, name: str) -> bytes:
    """A protocol-5 pickle of just ``module.name`` (what ``find_class`` is asked for)."""
    def text(value: str) -> bytes:
        return b"\x8c" + bytes([len(value)]) + value.encode() + b"\x94"
    return b"\x80\x05" + text(module) + text(name) + b"\x93\x94."


@pytest.mark.parametrize("module, name", [
    ("fleethealth.detectors.snapshot", "Mapping"),   # a class it imported: collections.abc's, not fleethealth's
    ("fleethealth.detectors.snapshot", "hashlib"),   # a module it imported
    ("fleethealth.detectors.snapshot", "dump"),      # a function, not a class
])
def test_a_name_a_fleethealth_module_did_not_define_as_a_class_is_refused(module: str, name: str) -> None:
    with pytest.raises(SnapshotError, match="not a class defined in fleethealth"):
        load(_forge(_global(module, name)))


def test_which_names_may_be_loaded() -> None:
    assert load(_forge(_global("fleethealth.detectors.straggler", "StragglerDetector")))[0] is StragglerDetector
    assert allowed("fleethealth.detectors.straggler", "StragglerDetector") and allowed("collections", "deque")
    assert allowed("numpy", "dtype") and allowed("numpy._core.numeric", "_frombuffer")
    for module, name in [("fleethealth.store.client", "Store"), ("fleethealth.bus", "Consumer"),
                         ("fleethealth.broker", "EmbeddedBroker"), ("fleethealth.demo_injob", "x"),
                         ("fleethealth.injob", "Guard"), ("fleethealth.config", "Settings"),
                         ("fleethealth.kernels.gemm", "x"), ("fleethealth.api.app", "x"),
                         ("builtins", "eval"), ("builtins", "getattr"), ("os", "system"), ("numpy", "load"),
                         ("numpy.lib.npyio", "load"), ("subprocess", "Popen"), ("functools", "reduce")]:
        assert not allowed(module, name), (module, name)
    with pytest.raises(SnapshotError, match="which does not exist here"):
        load(_forge(_global("fleethealth.detectors.straggler", "Gone")))


def test_shared_objects_are_referenced_by_name_and_must_be_given() -> None:
    table = {f"n{i:04d}": np.arange(1000.0) for i in range(50)}  # e.g. the node-state table
    pipes = [_small_pipeline(), _small_pipeline()]
    for pipe in pipes:
        pipe.nodestate = table
    blobs = [dump(pipe, OFFSETS, shared={"nodestate": table}) for pipe in pipes]
    assert all(len(b) < len(dump(pipes[0], OFFSETS)) / 4 for b in blobs)  # the table is not in them
    fresh = {"n0000": np.zeros(1)}
    restored = [load(b, shared={"nodestate": fresh})[0] for b in blobs]
    assert all(r.nodestate is fresh for r in restored)
    with pytest.raises(SnapshotError, match="shared object 'nodestate', which was not given"):
        load(blobs[0])


def test_a_predictor_with_its_model_loads_the_model_again_instead_of_unpickling_it() -> None:
    pipe = Pipeline(predictor=FailurePredictor(use_model=True))
    pipe.feed([Telemetry.from_columns(f"n{i:04d}", "r00", T0 + 10.0, [0]) for i in range(4)])
    restored, _ = load(dump(pipe, {}))
    assert type(restored.predictor.artifact_.model) is type(pipe.predictor.artifact_.model)
    artifact = load_model()  # given as an object: a snapshot names it as shared
    given = Pipeline(predictor=FailurePredictor(use_model=True, model=artifact))
    given.feed([Telemetry.from_columns("n0000", "r00", T0 + 10.0, [0])])
    with pytest.raises(SnapshotError, match="sklearn"):
        load(dump(given, {}))
    back, _ = load(dump(given, {}, shared={"failure_model": artifact}), shared={"failure_model": artifact})
    assert back.predictor.artifact_ is artifact and back.predictor.model is artifact
