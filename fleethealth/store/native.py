"""ClickHouse's Native format, written from NumPy columns: an insert without a Python object per row.

clickhouse-connect serialises an insert column by column, but builds a ``LowCardinality`` column's
dictionary with a Python loop over its rows and takes ``DateTime64`` as Python integers: for the
``rank_steps`` stream (a million rows a second at fleet scale) that was most of the insert's cost.
:func:`encode_native` writes one Native block directly — numbers and times as the bytes of a NumPy
array, a ``LowCardinality(String)`` column given as :class:`~fleethealth.store.columns.Codes` as its
dictionary and its keys — for the column types it knows, and returns None for anything else (the
caller then inserts through clickhouse-connect as before). The block is what clickhouse-connect
sends over HTTP and into chDB (``FORMAT Native``): column count and row count as LEB128, then per
column its name, its type and its data; a ``LowCardinality`` column's data is the key-serialisation
version (1), the index type with the "new dictionary" and "additional keys" flags, the dictionary,
and the keys.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from fleethealth.store.columns import Codes

__all__ = ["encode_native"]

_INTS = {"UInt8": "<u1", "UInt16": "<u2", "UInt32": "<u4", "UInt64": "<u8",
         "Int8": "<i1", "Int16": "<i2", "Int32": "<i4", "Int64": "<i8"}
_FLOATS = {"Float32": "<f4", "Float64": "<f8"}
_DATETIME64 = re.compile(r"DateTime64\(3(, *'[^']*')?\)")
_LC_FLAGS = (1 << 9) | (1 << 10)  # a new dictionary, and keys that index it (clickhouse-connect writes the same)


def _leb128(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _text(value: str) -> bytes:
    raw = value.encode()
    return _leb128(len(raw)) + raw


def _strings(column: np.ndarray) -> bytes | None:
    """A ``String`` column of ASCII text values all of one length under 128 bytes (a GPU's UUID, the
    empty string) as one length byte and the bytes per row, built in NumPy; None for any other."""
    if column.dtype.kind != "O":
        return None
    values = column.tolist()
    if not set(map(type, values)) <= {str}:
        return None
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    size = int(lengths[0]) if values else 0
    if size >= 128 or (lengths != size).any():
        return None
    try:
        raw = np.array(values, dtype=f"S{max(size, 1)}")
    except UnicodeEncodeError:
        return None
    if (np.char.str_len(raw) != size).any():  # a NUL at a value's end, which a bytes array drops
        return None
    rows = np.empty((len(values), size + 1), dtype=np.uint8)
    rows[:, 0] = size
    rows[:, 1:] = raw.view(np.uint8).reshape(len(values), max(size, 1))[:, :size]
    return rows.tobytes()


def _column(ch_type: str, column: Any) -> bytes | None:
    """The Native data of one column, or None when this writer does not take it."""
    if isinstance(column, Codes):
        if ch_type != "LowCardinality(String)" or not all(type(v) is str for v in column.values):
            return None
        n = len(column.values)
        key = 0 if n <= 0xFF else 1 if n <= 0xFFFF else 2 if n <= 0xFFFFFFFF else 3
        head = np.array([1, _LC_FLAGS | key, n], dtype="<u8").tobytes()
        codes = np.asarray(column.codes)
        if codes.size and (int(codes.min()) < 0 or int(codes.max()) >= n):
            return None
        keys = codes.astype(("<u1", "<u2", "<u4", "<u8")[key]).tobytes()
        return b"".join([head, *map(_text, column.values), np.array([codes.size], dtype="<u8").tobytes(), keys])
    if not isinstance(column, np.ndarray) or column.ndim != 1:
        return None
    if ch_type == "String":
        return _strings(column)
    kind = column.dtype.kind
    if ch_type in _INTS:
        if kind not in "iu":
            return None
        info = np.iinfo(_INTS[ch_type])
        if column.size and (int(column.min()) < info.min or int(column.max()) > info.max):
            return None
        return column.astype(_INTS[ch_type], copy=False).tobytes()
    if ch_type in _FLOATS:
        if kind not in "iuf":
            return None
        return column.astype(_FLOATS[ch_type], copy=False).tobytes()
    if _DATETIME64.fullmatch(ch_type):
        if kind not in "iuf":
            return None
        ms = np.round(column.astype(np.float64) * 1000.0)  # epoch seconds -> ticks, as prepare() does
        if not np.isfinite(ms).all():
            return None  # prepare() names the problem
        return ms.astype("<i8").tobytes()
    return None


def encode_native(columns: Mapping[str, Any], types: Mapping[str, str]) -> bytes | None:
    """One Native block of ``columns`` (name -> NumPy array or :class:`Codes`, all of one length) with
    the table's ``types``; None when any column is of a type or form this writer does not take."""
    names = list(columns)
    rows = len(columns[names[0]]) if names else 0
    out = [_leb128(len(names)), _leb128(rows)]
    for name in names:
        data = _column(types[name], columns[name])
        if data is None:
            return None
        out += [_text(name), _text(types[name]), data]
    return b"".join(out)
