"""Detector snapshots: a stage's detector state with the input offsets it reflects, as signed bytes.

A stream stage keeps one :class:`~fleethealth.detectors.pipeline.Pipeline` per input partition.
:meth:`Snapshots.dump` turns one (or any state :mod:`fleethealth.detectors.state` can write) into a
signed blob; :meth:`Snapshots.load` checks it and builds the state again, so a restarted replica, or
the replica that gets the partition after a rebalance, restores it and replays the input only from
the offsets it reflects. The store keeps the newest blob per (consumer group, partition) in
``detector_snapshots``; with ``snapshot_to = "bus"`` the compacted topic ``fh.snapshots`` does.

Nothing in a snapshot is unpickled: the state is explicit plain data (a JSON tree and numeric
arrays, :mod:`fleethealth.detectors.state`). The blob, integers big-endian::

    magic     8 bytes   b"FHSNAP\\r\\n" (:data:`MAGIC`)
    version   uint16    :data:`SNAPSHOT_VERSION`
    head      uint32    its length, then that many bytes of JSON: the fleethealth and schema
                        versions, the codec, the sizes of the body and of its two parts, the offsets
                        (``[[topic, partition, offset], ...]``)
    body      zlib of:  the manifest (JSON: ``{"tree": ..., "arrays": [[dtype, [shape], offset], ...]}``)
                        then the arrays' bytes (each little-endian, C order, at its offset)
    mac       32 bytes  HMAC-SHA256 over everything before it, with the key of ``key_file``

Reading is strict and bounded, in this order: the MAC is checked first (nothing of an unsigned or
wrongly signed blob is parsed); then the head, whose sizes must be within ``max_bytes`` (the whole
inflated body) and ``max_manifest_bytes``; then the body is inflated with ``max_length`` (never more
than the head states); then every array's dtype is checked against the allow-list
(:data:`fleethealth.detectors.state.ARRAY_DTYPES`, never ``object``) and its shape × item size
against ``max_array_bytes`` and the data's extent, and their sum against the data's size, before one
array is made; the arrays are copied out of the body and the state is rebuilt from registered
classes only. Any failure is a :class:`SnapshotError` whose message says which; the stage counts
it, logs it and rebuilds the partition from the group's committed offsets.

**The key.** Only detector replicas mount the key file (``detect.snapshot.key_file``). Without a
key no snapshot is written or restored: the stage rebuilds each partition from the group's commit
(a warning says so once). There is no unsigned mode. The demo makes a random key in its data folder.

**Offsets.** :func:`check_offsets` holds a blob's offsets against the partition being restored and
its real range (beginning and end offsets, asked of the broker) before the consumer seeks.

Bump :data:`SNAPSHOT_VERSION` when the layout changes; a detector's new field needs no bump (a
state missing it restores without it only if the detector copes, so a change of meaning needs one).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import struct
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from fleethealth import __version__
from fleethealth.detectors.state import State, StateError, array_dtype, from_state, state_dict
from fleethealth.errors import ConfigError, FleetHealthError
from fleethealth.params import check_int
from fleethealth.schema import SCHEMA_VERSION

__all__ = ["SNAPSHOT_VERSION", "MAGIC", "WHOLE", "SnapshotError", "Snapshots", "check_offsets", "read_key"]

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 3
"""The layout of a snapshot and of the detector state inside it (3: the node stage's windows as
:class:`~fleethealth.detectors.window.TimeRows`; 2: explicit state, signed, windows as deques of
rows; 1 was a pickle): a blob of another version is refused, and the partition rebuilt from the
group's commit (after an upgrade across versions, the node stage's windows start again)."""
WHOLE = 2**32 - 1
"""The partition number a whole-tier runner's snapshot is stored under (its one pipeline covers every
partition of its group; the store's ``partition`` column is a UInt32, and no topic has that many)."""
MAGIC = b"FHSNAP\r\n"
"""The first 8 bytes of every snapshot (the CR LF catches a blob mangled by a text transfer)."""

_HEAD = struct.Struct(">8sHI")
_MAC = 32
_MAX_HEAD = 65_536
_MAX_DIMS = 32
_ALIGN = 8
_CODEC = "zlib"
_LEVEL = 1
"""zlib's fastest level: the dump holds the stream up, the bytes are few either way."""
_MIB = 1024 * 1024
_PIECE = 4 * _MIB
"""Inflation's step: the most that comes out of zlib at once."""


class SnapshotError(FleetHealthError):
    """A snapshot cannot be written or used: no key, unsigned or wrongly signed, bad magic, another
    version, truncated, over a size cap, a body that does not inflate to its stated size, an array
    dtype or shape not allowed, offsets outside the partition, or state that does not rebuild."""


def read_key(path: str | os.PathLike[str]) -> bytes:
    """The snapshot key in the file ``path`` (its bytes, surrounding whitespace stripped): at least 32."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"detect.snapshot.key_file {str(path)!r}: cannot read ({exc.strerror})") from None
    if len(key) < 32:
        raise ConfigError(f"detect.snapshot.key_file {str(path)!r}: a key must have at least 32 bytes, "
                          f"it has {len(key)} (make one with: head -c 32 /dev/urandom | base64 > FILE)")
    return key


class Snapshots:
    """The snapshot format with its key and caps (the ``[detect.snapshot]`` configuration).

    ``key_file``: the file holding the HMAC key (only detector replicas mount it; empty: snapshots
    are off). ``max_bytes``: the largest inflated body (manifest and arrays); a 16,384-rank job's
    pipeline is about 28 MB (``bench/snapshot_size.py``). ``max_array_bytes``: the largest one array.
    ``max_manifest_bytes``: the largest JSON manifest (parsed into Python objects, which take several
    times its bytes). ``key`` passes the key itself (tests, the demo) instead of a file.
    """

    def __init__(self, *, key_file: str = "", max_bytes: int = 128 * _MIB, max_array_bytes: int = 32 * _MIB,
                 max_manifest_bytes: int = 32 * _MIB, key: bytes | None = None) -> None:
        self.max_bytes = check_int("max_bytes", max_bytes, at_least=1, owner=self)
        self.max_array_bytes = check_int("max_array_bytes", max_array_bytes, at_least=1, owner=self)
        self.max_manifest_bytes = check_int("max_manifest_bytes", max_manifest_bytes, at_least=2, owner=self)
        self.key_file = key_file
        if key is not None:
            if not isinstance(key, bytes) or len(key) < 32:
                raise ConfigError("Snapshots: key must be bytes, at least 32 of them")
            self.key: bytes | None = key
        else:
            self.key = read_key(key_file) if key_file else None

    @property
    def enabled(self) -> bool:
        """Whether a key is configured (without one nothing is written or restored)."""
        return self.key is not None

    def _key(self) -> bytes:
        if self.key is None:
            raise SnapshotError("no snapshot key configured (detect.snapshot.key_file): snapshots are neither "
                                "written nor restored")
        return self.key

    # ------------------------------------------------------------------ writing
    def dump(self, obj: object, offsets: Mapping[tuple[str, int], int], *,
             shared: Mapping[str, object] | None = None) -> bytes:
        """``obj``'s state and the input ``offsets`` it reflects (``{(topic, partition): next offset}``)
        as one signed blob; the objects of ``shared`` are referenced by name, not written."""
        key = self._key()
        try:
            state = state_dict(obj, shared=shared)
        except StateError as exc:
            raise SnapshotError(f"state of {type(obj).__name__} cannot be snapshotted: {exc}") from exc
        return self.seal(state, offsets, key=key)

    def seal(self, state: State, offsets: Mapping[tuple[str, int], int], *, key: bytes | None = None) -> bytes:
        """A blob of an explicit ``state`` (what :meth:`dump` writes after taking the state). A state over
        the caps the reader applies is a :class:`SnapshotError`, not a blob no replica could restore."""
        table, chunks, at = [], [], 0
        for a in state.arrays:
            if a.nbytes > self.max_array_bytes:
                raise SnapshotError(f"an array of {a.nbytes} bytes {a.shape} is over max_array_bytes="
                                    f"{self.max_array_bytes} (detect.snapshot.max_array_bytes): no replica could "
                                    "restore the snapshot")
            pad = -at % _ALIGN
            if pad:
                chunks.append(b"\0" * pad)
                at += pad
            table.append([a.dtype.str, list(a.shape), at])
            data = memoryview(a).cast("B") if a.size else b""
            chunks.append(data)
            at += a.nbytes
        manifest = orjson.dumps({"tree": state.tree, "arrays": table})
        if len(manifest) > self.max_manifest_bytes or len(manifest) + at > self.max_bytes:
            raise SnapshotError(f"the state inflates to {len(manifest) + at} bytes ({len(manifest)} of manifest), "
                                f"over max_bytes={self.max_bytes} or max_manifest_bytes={self.max_manifest_bytes} "
                                "(detect.snapshot.max_bytes, max_manifest_bytes): no replica could restore it; raise "
                                "them on every replica, or give the stage's topics more partitions")
        deflate = zlib.compressobj(_LEVEL)
        body = b"".join([deflate.compress(manifest), deflate.compress(b"".join(chunks)), deflate.flush()])
        head = orjson.dumps({"fleethealth": __version__, "schema": SCHEMA_VERSION, "codec": _CODEC,
                             "body_bytes": len(body), "manifest_bytes": len(manifest), "data_bytes": at,
                             "offsets": _offsets_list(offsets)})
        signed = b"".join((_HEAD.pack(MAGIC, SNAPSHOT_VERSION, len(head)), head, body))
        return signed + hmac.new(key if key is not None else self._key(), signed, hashlib.sha256).digest()

    # ------------------------------------------------------------------ reading
    def info(self, blob: bytes) -> dict[str, Any]:
        """The head of ``blob``, its MAC checked and nothing inflated: ``version``, ``fleethealth``,
        ``schema``, ``codec``, ``body_bytes``, ``manifest_bytes``, ``data_bytes`` and ``offsets``."""
        return self._open(blob)[0]

    def load(self, blob: bytes, *, like: object = None, shared: Mapping[str, object] | None = None,
             expect: type | None = None) -> tuple[Any, dict[tuple[str, int], int]]:
        """The state and offsets of a :meth:`dump` blob. ``like`` is the object built from the
        configuration that the state replaces (what a class does not write is taken from it); the
        objects of ``shared`` stand in for the names the blob refers to; with ``expect``, a state of
        another class is a :class:`SnapshotError`."""
        state, offsets = self.open(blob)
        try:
            obj = from_state(state, like=like, shared=shared, expect=expect)
        except StateError as exc:
            raise SnapshotError(f"snapshot state does not rebuild: {exc}") from None
        return obj, offsets

    def open(self, blob: bytes) -> tuple[State, dict[tuple[str, int], int]]:
        """The explicit state (tree and arrays) and the offsets of ``blob``, every check done."""
        head, body = self._open(blob)
        manifest_bytes, data_bytes = head["manifest_bytes"], head["data_bytes"]
        want = manifest_bytes + data_bytes
        inflate = zlib.decompressobj()
        text = _inflate(inflate, body, bytearray(manifest_bytes), want)
        data = _inflate(inflate, inflate.unconsumed_tail, bytearray(data_bytes), want, last=True)
        try:
            manifest = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise SnapshotError(f"snapshot manifest unreadable: {exc}") from None
        if type(manifest) is not dict or set(manifest) != {"tree", "arrays"} or type(manifest["arrays"]) is not list:
            raise SnapshotError("snapshot manifest is not {tree, arrays}")
        del text
        arrays = self._arrays(manifest["arrays"], data, data_bytes)
        return State(manifest["tree"], arrays), head["offsets"]

    def _arrays(self, table: list, data: bytearray, data_bytes: int) -> list[np.ndarray]:
        """The arrays of ``table``, each checked before any is made: views of ``data`` (inflated for them
        alone, so writable and not shared with anything else)."""
        specs = []
        total = 0
        for i, entry in enumerate(table):
            if type(entry) is not list or len(entry) != 3:
                raise SnapshotError(f"snapshot array {i}: not [dtype, shape, offset]")
            name, shape, offset = entry
            try:
                dtype = array_dtype(name)
            except StateError as exc:
                raise SnapshotError(f"snapshot array {i}: {exc}") from None
            if (type(shape) is not list or len(shape) > _MAX_DIMS
                    or not all(type(n) is int and 0 <= n for n in shape)):
                raise SnapshotError(f"snapshot array {i}: shape {shape!r} is not up to {_MAX_DIMS} sizes >= 0")
            count = math.prod(shape)
            nbytes = count * dtype.itemsize
            if nbytes > self.max_array_bytes:
                raise SnapshotError(f"snapshot array {i}: {shape} x {dtype.itemsize} bytes = {nbytes} bytes, over "
                                    f"max_array_bytes={self.max_array_bytes}")
            if type(offset) is not int or offset < 0 or offset % _ALIGN or offset + nbytes > data_bytes:
                raise SnapshotError(f"snapshot array {i}: offset {offset!r} (+{nbytes} bytes) is not within the "
                                    f"{data_bytes} bytes of data")
            total += nbytes
            specs.append((dtype, shape, offset, count))
        if total > data_bytes:
            raise SnapshotError(f"snapshot arrays add up to {total} bytes, more than the {data_bytes} bytes of data")
        return [np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
                for dtype, shape, offset, count in specs]

    def _open(self, blob: bytes) -> tuple[dict[str, Any], memoryview]:
        """Check the MAC, the header and the stated sizes of ``blob``; return its head and (compressed) body."""
        key = self._key()
        if not isinstance(blob, bytes | bytearray | memoryview):
            raise SnapshotError(f"snapshot must be bytes, got {type(blob).__name__}")
        view = memoryview(blob)
        if len(view) < _HEAD.size + _MAC:
            raise SnapshotError(f"snapshot truncated: {len(view)} bytes, shorter than its header and MAC")
        if len(view) > self.max_bytes + _MAX_HEAD + _HEAD.size + _MAC:
            raise SnapshotError(f"snapshot of {len(view)} bytes is larger than any this replica reads "
                                f"(max_bytes={self.max_bytes})")
        if bytes(view[:8]) != MAGIC:
            raise SnapshotError(f"not a detector snapshot: bad magic {bytes(view[:8])!r} (expected {MAGIC!r})")
        signed = view[:-_MAC]
        if not hmac.compare_digest(hmac.new(key, signed, hashlib.sha256).digest(), bytes(view[-_MAC:])):
            raise SnapshotError("snapshot MAC mismatch: not signed with this replica's key, or changed since")
        _, version, head_len = _HEAD.unpack_from(view)
        if version != SNAPSHOT_VERSION:
            raise SnapshotError(f"snapshot version {version} is not the version this fleethealth reads "
                                f"({SNAPSHOT_VERSION}): rebuild the state from the input")
        if head_len > _MAX_HEAD or _HEAD.size + head_len > len(signed):
            raise SnapshotError(f"snapshot head of {head_len} bytes does not fit (at most {_MAX_HEAD})")
        try:
            head = orjson.loads(signed[_HEAD.size:_HEAD.size + head_len])
        except orjson.JSONDecodeError as exc:
            raise SnapshotError(f"snapshot head unreadable: {exc}") from None
        body = signed[_HEAD.size + head_len:]
        if type(head) is not dict or head.get("codec") != _CODEC:
            raise SnapshotError(f"snapshot head is not an object with codec {_CODEC!r}")
        sizes = {k: head.get(k) for k in ("body_bytes", "manifest_bytes", "data_bytes")}
        if not all(type(v) is int and v >= 0 for v in sizes.values()):
            raise SnapshotError(f"snapshot head: sizes {sizes} are not byte counts")
        if sizes["body_bytes"] != len(body):
            raise SnapshotError(f"snapshot truncated or extended: body of {len(body)} bytes, "
                                f"{sizes['body_bytes']} written")
        if sizes["manifest_bytes"] > self.max_manifest_bytes:
            raise SnapshotError(f"snapshot manifest of {sizes['manifest_bytes']} bytes is over "
                                f"max_manifest_bytes={self.max_manifest_bytes}")
        if sizes["manifest_bytes"] + sizes["data_bytes"] > self.max_bytes:
            raise SnapshotError(f"snapshot body inflates to {sizes['manifest_bytes'] + sizes['data_bytes']} "
                                f"bytes, over max_bytes={self.max_bytes}")
        try:
            offsets = {}
            for t, p, o in head["offsets"]:
                if type(t) is not str or type(p) is not int or type(o) is not int or p < 0 or o < 0:
                    raise ValueError(f"{[t, p, o]!r} is not [topic, partition, offset]")
                offsets[(t, p)] = o
        except (KeyError, TypeError, ValueError) as exc:
            raise SnapshotError(f"snapshot offsets unreadable: {exc}") from None
        return {**head, "version": version, "offsets": offsets}, body


def _inflate(inflate: Any, body: bytes | memoryview, out: bytearray, want: int, *, last: bool = False) -> bytearray:
    """Fill ``out`` from ``inflate`` fed ``body``, a piece at a time (pages are taken as they are
    written); more than fits is a :class:`SnapshotError` (a zlib bomb stops at the size its signed head
    states), and so is less, or, with ``last``, a stream that does not end there."""
    at, size = 0, len(out)
    tail: bytes | memoryview = body
    try:
        while at < size or last:
            piece = inflate.decompress(tail, min(_PIECE, size - at + last))  # one byte more: is there more?
            if at + len(piece) > size:
                raise SnapshotError(f"snapshot body inflates past the {want} bytes its head states")
            out[at:at + len(piece)] = piece
            at += len(piece)
            tail = inflate.unconsumed_tail
            if inflate.eof or not piece:
                break
    except zlib.error as exc:
        raise SnapshotError(f"snapshot body does not decompress: {exc}") from None
    if at != size or (last and (not inflate.eof or inflate.unused_data or inflate.unconsumed_tail)):
        raise SnapshotError(f"snapshot body does not decompress to the {want} bytes its head states")
    return out


def check_offsets(offsets: Mapping[tuple[str, int], int], *, partition: int | None, topics: Iterable[str],
                  ranges: Mapping[tuple[str, int], tuple[int, int]]) -> None:
    """Refuse (:class:`SnapshotError`) a restored snapshot's ``offsets`` unless each names one of the
    stage's ``topics`` at ``partition`` (any partition: None, the whole tier's) and lies in that
    partition's real range (``ranges``: ``{(topic, partition): (beginning offset, end offset)}``, from the broker)."""
    allowed = set(topics)
    for (topic, p), offset in offsets.items():
        if topic not in allowed or (partition is not None and p != partition):
            raise SnapshotError(f"snapshot offsets name {topic}[{p}], not an input partition {partition} of this stage")
        span = ranges.get((topic, p))
        if span is None:
            raise SnapshotError(f"snapshot offsets name {topic}[{p}], whose range the broker did not give")
        if not span[0] <= offset <= span[1]:
            raise SnapshotError(f"snapshot offset {offset} of {topic}[{p}] is outside the partition's "
                                f"range [{span[0]}, {span[1]}]")


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
