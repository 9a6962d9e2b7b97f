"""Hostile snapshots through the real job-stage restore: a job-stage :class:`Runner` on the embedded
broker with its snapshots in chDB is handed each blob as the newest snapshot of a partition it is
assigned, and restores that partition as it does after a restart or a rebalance.

Each blob is refused: logged with its reason, counted in ``fleethealth_detect_snapshot_errors_total``,
the partition rebuilt fresh from the group's commit (the consumer is not moved), nothing of the blob's
choosing run (a canary file stays absent), and the process's peak RSS during the restore at most
:data:`RSS_BOUND` above what it was before it (Linux ``VmHWM``, reset with ``clear_refs``). A genuine
snapshot, the control, is restored and moves the consumer to its offsets.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import pickle
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry

from fleethealth.bus import Producer, ensure_topics
from fleethealth.detectors import snapshot
from fleethealth.detectors.pipeline import Pipeline
from fleethealth.detectors.runner import Runner
from fleethealth.detectors.snapshot import SNAPSHOT_VERSION, Snapshots
from fleethealth.detectors.stages import Stage
from fleethealth.schema import StepBatch

KEY = b"hostile-suite-key-0123456789abcdef"
GROUP = "fh-hostile-job"
PART = 1
RSS_BOUND = 40 * 1024 * 1024
"""The most a refused restore may raise the process's peak resident memory (the old format let a
197-byte blob allocate 1 GiB and an 18 MB one inflate to 4 GiB). A body inflates into one buffer of
the size its signed head states (at most ``max_bytes``) 4 MiB at a time, so the bound is that size plus
16 MiB; the largest case here states 24 MiB (measured on 2 loaded cores: 35.6 MiB; every other case
under 20 MiB, most under 2 MiB)."""
CANARY = Path(f"/tmp/fleethealth-hostile-canary-{os.getpid()}")
T0 = 1_767_225_600.0


def _hwm() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _rss() -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


# ---------------------------------------------------------------- forging
def _sign(signed: bytes, key: bytes | None = KEY) -> bytes:
    return signed + (hmac.new(key, signed, hashlib.sha256).digest() if key is not None else b"\0" * 32)


def _v2(tree: object, arrays: list | None = None, data: bytes = b"", *, key: bytes | None = KEY,
        manifest_bytes: int | None = None, data_bytes: int | None = None, body: bytes | None = None,
        offsets: list | None = None, raw_manifest: bytes | None = None) -> bytes:
    manifest = raw_manifest if raw_manifest is not None else orjson.dumps({"tree": tree, "arrays": arrays or []})
    if body is None:
        body = zlib.compress(manifest + data)
    head = orjson.dumps({"fleethealth": "0", "schema": 1, "codec": "zlib", "body_bytes": len(body),
                         "manifest_bytes": len(manifest) if manifest_bytes is None else manifest_bytes,
                         "data_bytes": len(data) if data_bytes is None else data_bytes,
                         "offsets": offsets if offsets is not None else [["fh.steps", PART, 0]]})
    return _sign(struct.pack(">8sHI", snapshot.MAGIC, SNAPSHOT_VERSION, len(head)) + head + body, key)


def _v1(payload: bytes) -> bytes:
    """A blob of the old pickle format: sha256 digest, no key."""
    body = zlib.compress(payload)
    meta = orjson.dumps({"fleethealth": "0", "schema": 1, "codec": "zlib", "body_bytes": len(body),
                         "raw_bytes": len(payload), "offsets": [["fh.steps", PART, 0]]})
    digest = hashlib.sha256(meta + body).digest()
    return struct.pack(">8sHI", snapshot.MAGIC, 1, len(meta)) + meta + digest + body


class _Call:
    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _text(value: str) -> bytes:
    return b"\x8c" + bytes([len(value)]) + value.encode() + b"\x94"


# the dotted-name chain through numpy.dtypes that reached eval under the old restricted unpickler
_DOTTED = b"\x80\x05" + _text("numpy.dtypes") + _text("Float64DType.__getattribute__") + b"\x93\x94."
_SYSTEM = pickle.dumps(_Call(os.system, f"touch {CANARY}"), protocol=5)
_BYTEARRAY = b"\x80\x05" + _text("builtins") + _text("bytearray") + b"\x93\x94\x8a\x05\x00\x00\x00\x00\x01\x85R."


@functools.cache
def _zlib_bomb(size: int) -> bytes:
    deflate = zlib.compressobj(9)
    chunk = b"\0" * (1 << 20)
    return b"".join([*(deflate.compress(chunk) for _ in range(size >> 20)), deflate.flush()])


_BOMB = 256 << 20  # a zlib bomb: 256 MiB of zeros in ~250 KB
_PIPE = "fleethealth.detectors.pipeline.Pipeline"

HOSTILE = {
    # the old pickle chains, as the old format wrote them (no key) and re-signed as a version-2 body
    "v1-os.system": (lambda g: _v1(_SYSTEM), "MAC mismatch"),
    "v1-numpy-dotted-chain": (lambda g: _v1(_DOTTED), "MAC mismatch"),
    "v1-bytearray-1TiB": (lambda g: _v1(_BYTEARRAY), "MAC mismatch"),
    "signed-pickle-body": (lambda g: _v2(None, raw_manifest=_SYSTEM), "manifest unreadable"),
    "signed-dotted-chain-body": (lambda g: _v2(None, raw_manifest=_DOTTED), "manifest unreadable"),
    # __setstate__ / __reduce__ / __init__ gadgets, signed with the right key
    "setstate-attribute": (lambda g: _v2(["o", _PIPE, {"__setstate__": ["l"]}]), "not an attribute name"),
    "class-attribute": (lambda g: _v2(["o", _PIPE, {"__class__": "x"}]), "not an attribute name"),
    "predictor-setstate": (lambda g: _v2(["o", _PIPE, {"predictor": [
        "o", "fleethealth.detectors.predict.FailurePredictor", {"__setstate__": "/tmp/evil.joblib"}]}]),
        "not an attribute name"),
    "load-model-function": (lambda g: _v2(["o", "fleethealth.detectors.predict.load_model", {}]),
                            "not a registered state class"),
    "os.system-class": (lambda g: _v2(["o", "posix.system", {}]), "not a registered state class"),
    "dtype-gadget": (lambda g: _v2(["e", "numpy.dtypes.Float64DType", "__getattribute__"]),
                     "not a registered state class"),
    "object-dtype": (lambda g: _v2(["a", 0], [["|O", [1], 0]], b"\0" * 8), "dtype '\\|O' is not one"),
    # allocation bombs
    "array-1TiB": (lambda g: _v2(["a", 0], [["<f8", [1 << 37], 0]], b"\0" * 8), "over max_array_bytes"),
    "arrays-past-data": (lambda g: _v2(["l", *(["a", i] for i in range(64))],
                                       [["<f8", [1 << 20], 0]] * 64, b"\0" * (8 << 20)), "add up to"),
    "head-claims-4GiB": (lambda g: _v2(None, data_bytes=4 << 30), "over max_bytes"),
    "json-nesting": (lambda g: _v2(None, raw_manifest=b"[" * 200_000 + b"]" * 200_000), "manifest unreadable"),
    "state-nesting": (lambda g: _v2(None, raw_manifest=b'{"tree":' + b'["l",' * 500 + b"null" + b"]" * 500
                                    + b',"arrays":[]}'), "nested"),
    # zlib bombs
    "zlib-bomb-small-head": (lambda g: _v2(None, body=_zlib_bomb(_BOMB), manifest_bytes=100, data_bytes=900),
                             "inflates past the 1000 bytes"),
    "zlib-bomb-stating-24MiB": (lambda g: _v2(None, body=_zlib_bomb(_BOMB), manifest_bytes=1000, data_bytes=(24 << 20)),
                                "inflates past the"),
    # forged offsets
    "offset-past-end": (lambda g: _genuine(g, [["fh.steps", PART, 10**12]]), "outside the partition's range"),
    "offset-other-partition": (lambda g: _genuine(g, [["fh.steps", PART + 1, 0]]), "not an input partition"),
    "offset-other-topic": (lambda g: _genuine(g, [["fh.telemetry", PART, 0]]), "not an input partition"),
    # unsigned, and re-signed with the wrong key
    "unsigned": (lambda g: _genuine(g, None, key=None), "MAC mismatch"),
    "mac-cut": (lambda g: _genuine(g, None)[:-32], "MAC mismatch|truncated|does not"),
    "wrong-key": (lambda g: _genuine(g, None, key=b"a-key-no-detector-replica-holds!!!"), "MAC mismatch"),
    "empty-key": (lambda g: _genuine(g, None, key=b""), "MAC mismatch"),
}


def _genuine(g: dict, offsets: list | None, key: bytes | None = KEY) -> bytes:
    """The genuine state of a fed pipeline, with other ``offsets`` and signed with ``key``."""
    state, _ = Snapshots(key=KEY).open(g["blob"])
    arrays = []
    data = b""
    for a in state.arrays:
        data += b"\0" * (-len(data) % 8)
        arrays.append([a.dtype.str, list(a.shape), len(data)])
        data += a.tobytes()
    return _v2(state.tree, arrays, data, key=key,
               offsets=offsets if offsets is not None else [["fh.steps", PART, 0], ["fh.events", PART, 0]])


# ---------------------------------------------------------------- the stage
@pytest.fixture(scope="module")
def stage(broker, tmp_path_factory):
    from fleethealth.store import open_store

    dsn = broker.dsn
    ensure_topics(dsn, partitions=2)
    with Producer(dsn) as producer:
        for step in range(3):
            producer.publish(_batch(step))
        producer.flush()
    with open_store(f"chdb://{tmp_path_factory.mktemp('hostile')}/store") as store:
        store.migrate()
        with Runner(dsn, store, group=GROUP, stage=Stage.JOB, registry=CollectorRegistry(), snapshot_every_s=3600.0,
                    snapshots=Snapshots(key=KEY), max_ahead_s=None, max_behind_s=None, publish=False) as runner:
            runner.consumer.wait_assigned(timeout_s=60.0)
            # the session broker may already hold the topics with more partitions (earlier tests)
            assert {0, 1} <= {p for _, p in runner.consumer.assignment()}
            pipe = runner.core.fresh(PART)
            pipe.feed([_batch(s) for s in range(3)])
            blob = runner.snapshot_format.dump(pipe, {("fh.steps", PART): 0, ("fh.events", PART): 0},
                                               shared=runner.core.shared)
            yield {"runner": runner, "store": store, "blob": blob, "seq": [10]}


def _batch(step: int) -> StepBatch:
    ranks = np.arange(8, dtype=np.int32)
    return StepBatch(job="hostile", step=step, node="gpu-host-a", ts=T0 + step, ranks=ranks,
                     gpus=ranks.astype(np.int16), compute_s=np.full(8, 0.1))


def _errors(runner: Runner) -> float:
    return runner.metrics.snapshot_errors._value.get()


def _restore(stage: dict, blob: bytes) -> tuple[set, int]:
    """Store ``blob`` as the partition's newest snapshot and have the runner take the partition again."""
    runner, store = stage["runner"], stage["store"]
    stage["seq"][0] += 1
    store.save_snapshot(GROUP, PART, stage["seq"][0], T0, {("fh.steps", PART): 0}, blob)
    runner.pipelines.pop(PART, None)
    base = _rss()
    _reset_hwm()
    restored = runner._follow_assignment()
    return restored, _hwm() - base


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_snapshot_is_refused_by_the_job_stage_restore(stage, name, caplog) -> None:
    forge, reason = HOSTILE[name]
    runner = stage["runner"]
    blob = forge(stage)
    errors = _errors(runner)
    restored_before = runner.restored_total
    with caplog.at_level(logging.WARNING, logger="fleethealth.detectors.runner"):
        moved, peak = _restore(stage, blob)
    assert moved == set() and runner.restored_total == restored_before, "the consumer was moved to the blob"
    assert _errors(runner) == errors + 1
    logged = [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]
    assert logged and re.search(reason, logged[-1]), logged
    fresh = runner.pipelines[PART]
    assert isinstance(fresh, Pipeline) and not fresh.stragglers_ and fresh.now_ == float("-inf")
    assert not CANARY.exists()
    assert peak <= RSS_BOUND, f"restoring {name} ({len(blob)} bytes) raised peak RSS by {peak / 2**20:.1f} MiB"


def test_the_genuine_snapshot_is_restored_and_moves_the_consumer(stage) -> None:
    runner = stage["runner"]
    before = runner.restored_total
    moved, peak = _restore(stage, _genuine(stage, None))
    assert moved == {("fh.steps", PART), ("fh.events", PART)} and runner.restored_total == before + 1
    assert runner.pipelines[PART].job_seen_ == {"hostile": T0 + 2}  # the state the blob holds
    assert peak <= RSS_BOUND
