"""Detector snapshots: a stage's detector state with the input offsets it reflects, as bytes.

A stream stage keeps one :class:`~fleethealth.detectors.pipeline.Pipeline` per input partition.
:func:`dump` turns one (or any object built of the classes below) into a self-checking blob,
:func:`load` turns the blob back, so a restarted replica, or the replica that gets the partition
after a rebalance, restores the state and replays the input only from the offsets it reflects.
The store keeps the newest blob per (consumer group, partition) in ``detector_snapshots``
(``store.save_snapshot`` / ``store.load_snapshot``).

The blob, all integers big-endian::

    magic    8 bytes   b"FHSNAP\\r\\n" (:data:`MAGIC`)
    version  uint16    :data:`SNAPSHOT_VERSION`
    meta     uint32    its length, then that many bytes of JSON: the fleethealth and schema
                       versions, the codec, the body's length and its uncompressed length, and
                       the offsets (``[[topic, partition, offset], ...]``)
    digest   32 bytes  sha256 over meta and body
    body     the state pickled (protocol 5; each telemetry sample's columns packed into one
             array, :class:`_PackedTelemetry`) and compressed with zlib (:func:`pickled` gives
             the pickle alone)

Reading is strict: a wrong magic, a version other than :data:`SNAPSHOT_VERSION`, a short blob, a
digest that does not match, a body that inflates to other than its stated size, a class outside
the allowed set or anything else that fails while unpickling raises :class:`SnapshotError`, whose
message says which. The stage reports it and
rebuilds its state from the input instead. Bump :data:`SNAPSHOT_VERSION` whenever a detector's
state attributes change in a way an older snapshot would not fit.

**What may be loaded.** :func:`load` unpickles with an ``Unpickler`` whose ``find_class`` admits
only (:func:`allowed`): classes defined in fleethealth's own modules, except those that reach the
outside or load heavy libraries (the store, the bus, the broker, the commands, the API, the probe,
the adapters, the configuration, the sweeps, the in-job library, the kernels, the report); NumPy's
array and scalar reconstruction and its dtypes; ``collections`` (deque, OrderedDict, defaultdict,
Counter); ``functools.partial``; plain ``builtins`` data types; ``datetime`` types. Anything else
(``os.system``, ``builtins.eval``, ``subprocess.Popen``, a foreign class re-exported by a
fleethealth module) is refused before it is imported or called. A blob is still the stage's own
output, read back from its own store: the check is a second line behind that, not a licence to
load blobs from elsewhere.

**Shared objects.** ``shared`` maps names to objects that several states hold and that are rebuilt
elsewhere (the node-state table every job-stage pipeline reads, rebuilt from its compacted topic):
they are written as a reference by name (pickle's ``persistent_id``), never serialised, and
:func:`load` puts the object passed under the same name in their place; a name the blob refers
to that ``load`` is not given is a :class:`SnapshotError`. Objects are matched by identity.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import pickle
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from fleethealth import __version__
from fleethealth.errors import FleetHealthError
from fleethealth.schema import SCHEMA_VERSION, Telemetry

__all__ = ["SNAPSHOT_VERSION", "MAGIC", "MAX_RAW_BYTES", "SnapshotError", "dump", "load", "info", "allowed", "pickled"]

SNAPSHOT_VERSION = 2  # 2: the lifecycle shares the hang rule, late steps after an exit, unscored jobs
"""The layout of a snapshot and of the detector state inside it; a blob of another version is refused."""
MAGIC = b"FHSNAP\r\n"
"""The first 8 bytes of every snapshot (the CR LF catches a blob mangled by a text transfer)."""

MAX_RAW_BYTES = 4 * 1024**3
"""The largest state :func:`load` inflates (a 16,384-rank pipeline pickles to about 30 MB)."""

_HEAD = struct.Struct(">8sHI")
_DIGEST = 32
_CODEC = "zlib"
_LEVEL = 1
"""zlib's fastest level. On a 16,384-rank pipeline after 500 steps (bench/snapshot_size.py) level 6
made the blob 12 % smaller (2.65 MB for 3.02) for 2.3 times the compression time (0.22 s for 0.10 s,
of a 0.85 s dump): the dump holds the stream up, the bytes are few either way."""

_REFUSED_UNDER = ("fleethealth.store", "fleethealth.bus", "fleethealth.broker", "fleethealth.commands",
                  "fleethealth.demo", "fleethealth.__main__", "fleethealth.api", "fleethealth.probe",
                  "fleethealth.adapters", "fleethealth.config", "fleethealth.sweeps", "fleethealth.injob",
                  "fleethealth.kernels", "fleethealth.report")
"""fleethealth modules whose classes are never loaded: they open connections, processes or files, read
settings, or import torch, CuPy or matplotlib (no detector state is made of them)."""
_PLAIN_DATA = {("fleethealth.bus", "Record"), ("fleethealth.bus", "DeadLetter")}
"""Plain records of those modules that a stage's state may hold (a reorder buffer holds bus records)."""
_NUMPY = {
    "numpy": {"dtype", "ndarray"},
    "numpy.dtypes": None,  # every dtype class (numpy.dtypes.Float64DType, ...)
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.numeric": {"_frombuffer"},
    "numpy.core.numeric": {"_frombuffer"},
}
_STDLIB = {
    "collections": {"deque", "OrderedDict", "defaultdict", "Counter"},
    "functools": {"partial"},
    "builtins": {"set", "frozenset", "slice", "range", "complex", "bytearray", "bytes", "list", "dict", "tuple",
                 "int", "float", "str", "bool", "object", "NotImplemented", "Ellipsis"},
    "datetime": {"datetime", "date", "time", "timedelta", "timezone"},
}


class SnapshotError(FleetHealthError):
    """A snapshot cannot be read: bad magic, another version, truncated, a digest mismatch, a class
    that may not be loaded, a shared object not given, or state that does not unpickle."""


def allowed(module: str, name: str) -> bool:
    """True when :func:`load` may resolve ``module.name`` (see the module docstring)."""
    if module.startswith("fleethealth.") or module == "fleethealth":
        if (module, name) in _PLAIN_DATA:
            return True
        return not any(module == r or module.startswith(r + ".") or module.startswith(r + "_")
                       for r in _REFUSED_UNDER)
    names = _NUMPY.get(module, _STDLIB.get(module, set()))
    if names is None:
        return not name.startswith("_")
    return name in names


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, shared: Mapping[str, object]) -> None:
        super().__init__(io.BytesIO(data))
        self._shared = shared

    def find_class(self, module: str, name: str) -> Any:
        if not allowed(module, name):
            raise SnapshotError(f"snapshot refers to {module}.{name}, which may not be loaded from a snapshot")
        if module.startswith("fleethealth"):
            # a class defined in fleethealth itself, never a name a fleethealth module imported from elsewhere
            try:
                found = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as exc:
                raise SnapshotError(f"snapshot refers to {module}.{name}, which does not exist here ({exc})") \
                    from None
            owner = getattr(found, "__module__", "") or ""
            if not isinstance(found, type) or not (owner == "fleethealth" or owner.startswith("fleethealth.")):
                raise SnapshotError(f"snapshot refers to {module}.{name}, which is not a class defined in "
                                    "fleethealth and may not be loaded from a snapshot")
            return found
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "shared" and isinstance(pid[1], str)):
            raise SnapshotError(f"snapshot holds an unknown persistent reference {pid!r}")
        try:
            return self._shared[pid[1]]
        except KeyError:
            given = ", ".join(sorted(self._shared)) or "none"
            raise SnapshotError(f"snapshot refers to the shared object {pid[1]!r}, which was not given "
                                f"(given: {given})") from None


class _PackedTelemetry:
    """Unpickles a :class:`~fleethealth.schema.Telemetry` written with its GPU columns as one matrix.

    Pickling a NumPy array costs a few microseconds however small it is, and a sample holds one per
    field: a pipeline's latest and previous samples of 2,048 nodes took most of a 16,384-rank
    snapshot's time. :class:`_Pickler` writes each sample's columns as the rows of one array
    instead; they come back as views of it, with the values and dtype they had."""

    def __new__(cls, fields: tuple[str, ...], matrix: np.ndarray, rest: dict[str, Any]) -> Telemetry:  # type: ignore[misc]
        sample = object.__new__(Telemetry)
        sample.__dict__.update(rest)
        sample.__dict__["columns"] = dict(zip(fields, matrix, strict=True))
        return sample


class _Pickler(pickle.Pickler):
    """Protocol 5, telemetry samples packed (:class:`_PackedTelemetry`)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is Telemetry:
            columns = obj.columns
            first = next(iter(columns.values()), None)
            if (type(first) is np.ndarray and first.ndim == 1
                    and all(type(c) is np.ndarray and c.dtype == first.dtype and c.shape == first.shape
                            for c in columns.values())):
                rest = {k: v for k, v in vars(obj).items() if k != "columns"}
                return _PackedTelemetry, (tuple(columns), np.stack(list(columns.values())), rest)
        return NotImplemented


class _SharingPickler(_Pickler):
    """A :class:`_Pickler` that writes the ``shared`` objects as references by name (used only when
    some are given: ``persistent_id`` is a Python call per object pickled)."""

    def __init__(self, file: io.BytesIO, shared: Mapping[str, object]) -> None:
        super().__init__(file)
        self._names = {id(obj): name for name, obj in shared.items()}
        self._keep = list(shared.values())  # ids stay valid while pickling

    def persistent_id(self, obj: Any) -> Any:
        name = self._names.get(id(obj))
        return None if name is None else ("shared", name)


def _offsets_list(offsets: Mapping[tuple[str, int], int]) -> list[list[Any]]:
    out = []
    for key, offset in offsets.items():
        if (not isinstance(key, tuple) or len(key) != 2 or not isinstance(key[0], str)
                or type(key[1]) is not int or key[1] < 0):
            raise SnapshotError(f"offsets: key {key!r} is not (topic, partition)")
        if type(offset) is not int or offset < 0:
            raise SnapshotError(f"offsets: {key[0]}[{key[1]}] -> {offset!r} is not an offset (an int >= 0)")
        out.append([key[0], key[1], offset])
    return sorted(out)


def pickled(state: object, *, shared: Mapping[str, object] | None = None) -> memoryview:
    """The body of a snapshot before compression: ``state`` pickled as :func:`dump` pickles it."""
    buf = io.BytesIO()
    try:
        (_SharingPickler(buf, shared) if shared else _Pickler(buf)).dump(state)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise SnapshotError(f"state of {type(state).__name__} cannot be snapshotted: {exc}") from exc
    return buf.getbuffer()


def dump(state: object, offsets: Mapping[tuple[str, int], int], *,
         shared: Mapping[str, object] | None = None) -> bytes:
    """``state`` and the input ``offsets`` it reflects (``{(topic, partition): next offset}``) as one
    snapshot blob; the objects of ``shared`` are referenced by name, not written."""
    raw = pickled(state, shared=shared)
    body = zlib.compress(raw, _LEVEL)
    meta = orjson.dumps({"fleethealth": __version__, "schema": SCHEMA_VERSION, "codec": _CODEC,
                         "body_bytes": len(body), "raw_bytes": len(raw), "offsets": _offsets_list(offsets)})
    digest = hashlib.sha256(meta)
    digest.update(body)
    return b"".join((_HEAD.pack(MAGIC, SNAPSHOT_VERSION, len(meta)), meta, digest.digest(), body))


def _split(blob: bytes) -> tuple[dict[str, Any], memoryview]:
    """Check the header and digest of ``blob``; return its header and its (compressed) body."""
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise SnapshotError(f"snapshot must be bytes, got {type(blob).__name__}")
    view = memoryview(blob)
    if len(view) < _HEAD.size:
        raise SnapshotError(f"snapshot truncated: {len(view)} bytes, shorter than its {_HEAD.size}-byte header")
    magic, version, meta_len = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise SnapshotError(f"not a detector snapshot: bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != SNAPSHOT_VERSION:
        raise SnapshotError(f"snapshot version {version} is not the version this fleethealth reads "
                            f"({SNAPSHOT_VERSION}): rebuild the state from the input")
    start = _HEAD.size + meta_len + _DIGEST
    if len(view) < start:
        raise SnapshotError(f"snapshot truncated: {len(view)} bytes, its header alone needs {start}")
    meta_bytes = view[_HEAD.size:_HEAD.size + meta_len]
    body = view[start:]
    try:
        meta = orjson.loads(meta_bytes)
        body_bytes = int(meta["body_bytes"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise SnapshotError(f"snapshot header unreadable: {exc}") from None
    if len(body) < body_bytes:
        raise SnapshotError(f"snapshot truncated: body of {len(body)} bytes, {body_bytes} written")
    if len(body) > body_bytes:
        raise SnapshotError(f"snapshot has {len(body) - body_bytes} bytes after its body")
    digest = hashlib.sha256(meta_bytes)
    digest.update(body)
    if digest.digest() != view[_HEAD.size + meta_len:start]:
        raise SnapshotError("snapshot digest mismatch: the blob was changed after it was written")
    if meta.get("codec") != _CODEC:
        raise SnapshotError(f"snapshot codec {meta.get('codec')!r} is not {_CODEC!r}")
    try:
        offsets = {(str(t), int(p)): int(o) for t, p, o in meta["offsets"]}
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotError(f"snapshot offsets unreadable: {exc}") from None
    return {**meta, "version": version, "offsets": offsets}, body


def info(blob: bytes) -> dict[str, Any]:
    """The header of ``blob``, its digest checked and nothing unpickled: ``version``, ``fleethealth``,
    ``schema``, ``codec``, ``body_bytes``, ``raw_bytes`` and ``offsets`` (``{(topic, partition): offset}``)."""
    return _split(blob)[0]


def load(blob: bytes, *, shared: Mapping[str, object] | None = None,
         expect: type | tuple[type, ...] | None = None) -> tuple[object, dict[tuple[str, int], int]]:
    """The state and offsets of a :func:`dump` blob; the objects of ``shared`` stand in for the names
    the blob refers to. With ``expect``, a state of another type is a :class:`SnapshotError` too."""
    meta, body = _split(blob)
    size = meta.get("raw_bytes")
    if type(size) is not int or not 0 <= size <= MAX_RAW_BYTES:
        raise SnapshotError(f"snapshot header: raw_bytes {size!r} is not a size up to {MAX_RAW_BYTES}")
    try:
        inflate = zlib.decompressobj()
        raw = inflate.decompress(body, size + 1)  # never more than the header says: no zip bomb
    except zlib.error as exc:
        raise SnapshotError(f"snapshot body does not decompress: {exc}") from None
    if len(raw) != size or not inflate.eof:
        raise SnapshotError(f"snapshot body does not decompress to the {size} bytes written")
    try:
        state = _Unpickler(raw, shared or {}).load()
    except SnapshotError:
        raise
    except Exception as exc:  # a state that no longer fits its classes: report it, the stage rebuilds
        raise SnapshotError(f"snapshot state does not load: {type(exc).__name__}: {exc}") from exc
    if expect is not None and not isinstance(state, expect):
        names = " or ".join(t.__name__ for t in (expect if isinstance(expect, tuple) else (expect,)))
        raise SnapshotError(f"snapshot holds a {type(state).__name__}, not the expected {names}")
    return state, meta["offsets"]
