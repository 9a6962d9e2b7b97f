"""A bounded on-disk FIFO of bus records: the probe's write-ahead queue towards Kafka.

Every message the probe accepts is appended here first and removed only after the broker has
acknowledged it, so a broker outage (or a probe restart during one) loses nothing that fits in
the bound; on reconnect the records replay in the order they were accepted. Beyond
``max_bytes`` (default 512 MiB) the *oldest* records are dropped, a segment at a time, and
counted in ``dropped_total`` — the newest telemetry is the most useful after a long outage.

Layout: ``DIR/seg-<12 digits>.log`` segment files of records ``<u32 value_len><u16 topic_len>
<u16 key_len or 0xFFFF for none> topic key value``, and ``DIR/cursor`` holding the read position
(``<segment> <offset>``), replaced atomically on every acknowledgement. A record cut short by a
crash is truncated away on open. Segments are ``min(16 MiB, max_bytes / 8)`` so dropping the oldest
one never discards more than an eighth of the bound.
"""

from __future__ import annotations

import os
import struct
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from fleethealth.errors import ConfigError

__all__ = ["Spool", "SpoolRecord", "SpoolStats", "DEFAULT_MAX_BYTES"]

DEFAULT_MAX_BYTES = 512 << 20
_HEADER = struct.Struct("<IHH")
_NO_KEY = 0xFFFF


@dataclass(frozen=True, slots=True)
class SpoolRecord:
    """One queued bus record."""

    topic: str
    value: bytes
    key: bytes | None = None


@dataclass(frozen=True, slots=True)
class SpoolStats:
    """Records and bytes waiting, and counters since the spool was opened."""

    records: int
    bytes: int
    appended_total: int
    acked_total: int
    dropped_total: int
    dropped_bytes_total: int


@dataclass
class _Segment:
    seq: int
    path: Path
    size: int       # bytes in the file
    records: int    # unread records in the file
    offset: int = 0  # read position (only the head segment is ever partly read)


class Spool:
    """A bounded FIFO of :class:`SpoolRecord` in ``directory``; reopening resumes where it stopped."""

    def __init__(self, directory: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 segment_bytes: int | None = None) -> None:
        if max_bytes < 1024:
            raise ConfigError(f"spool bound must be at least 1024 bytes, got {max_bytes}")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the spool directory {self.directory}: {exc.strerror}") from exc
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or min(16 << 20, max(max_bytes // 8, 512))
        self._segments: deque[_Segment] = deque()
        self._appended = self._acked = self._dropped = self._dropped_bytes = 0
        self._head_seq = 0  # number of records removed (acked or dropped) since open: the head's index
        self._load()
        self._writer = open(self._segments[-1].path, "ab")  # noqa: SIM115 - held open for appends

    # ------------------------------------------------------------ writing
    def append(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        """Queue one record; drop the oldest records first if the bound would be exceeded."""
        t = topic.encode()
        k = b"" if key is None else key
        if len(t) >= _NO_KEY or len(k) >= _NO_KEY:
            raise ConfigError("spool: topic and key must be shorter than 65535 bytes")
        size = _HEADER.size + len(t) + len(k) + len(value)
        if size > self.max_bytes:
            self._dropped += 1
            self._dropped_bytes += size
            return
        tail = self._segments[-1]
        if tail.size >= self.segment_bytes:
            tail = self._roll()
        while self.pending_bytes + size > self.max_bytes:
            if len(self._segments) == 1:
                tail = self._roll()
            self._drop_head()
        self._writer.write(_HEADER.pack(len(value), len(t), _NO_KEY if key is None else len(k)))
        self._writer.write(t)
        self._writer.write(k)
        self._writer.write(value)
        self._writer.flush()
        tail.size += size
        tail.records += 1
        self._appended += 1

    # ------------------------------------------------------------ reading
    def peek(self, max_records: int = 1000) -> list[SpoolRecord]:
        """The oldest ``max_records`` records, oldest first, without removing them."""
        out: list[SpoolRecord] = []
        for seg in self._segments:
            if len(out) >= max_records:
                break
            if seg.records == 0:
                continue
            with open(seg.path, "rb") as fh:
                fh.seek(seg.offset)
                for _ in range(min(seg.records, max_records - len(out))):
                    out.append(_read_record(fh))
        return out

    @property
    def head_seq(self) -> int:
        """Index (since open) of the oldest queued record; :meth:`peek` returns records from here."""
        return self._head_seq

    def ack_until(self, end_seq: int) -> int:
        """Remove records with index below ``end_seq`` that are still queued (some of a delivered
        batch may have been dropped by the bound meanwhile); return how many were removed."""
        count = min(max(end_seq - self._head_seq, 0), len(self))
        if count:
            self.ack(count)
        return count

    def ack(self, count: int) -> None:
        """Remove the oldest ``count`` records (the broker has acknowledged them)."""
        left = count
        while left > 0 and self._segments:
            seg = self._segments[0]
            take = min(left, seg.records)
            if take:
                with open(seg.path, "rb") as fh:
                    fh.seek(seg.offset)
                    for _ in range(take):
                        _read_record(fh)
                    seg.offset = fh.tell()
                seg.records -= take
                left -= take
                self._acked += take
                self._head_seq += take
            if seg.records == 0 and len(self._segments) > 1:
                self._segments.popleft()
                seg.path.unlink(missing_ok=True)
            elif seg.records == 0:
                break
        if left > 0:
            raise ConfigError(f"spool: acknowledged {count} records but only {count - left} were queued")
        self._write_cursor()

    # ------------------------------------------------------------ state
    def __len__(self) -> int:
        return sum(seg.records for seg in self._segments)

    @property
    def pending_bytes(self) -> int:
        return sum(seg.size - seg.offset for seg in self._segments)

    @property
    def stats(self) -> SpoolStats:
        return SpoolStats(len(self), self.pending_bytes, self._appended, self._acked, self._dropped,
                          self._dropped_bytes)

    def close(self) -> None:
        self._writer.close()
        self._write_cursor()

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _roll(self) -> _Segment:
        seq = self._segments[-1].seq + 1 if self._segments else 1
        seg = _Segment(seq, self.directory / f"seg-{seq:012d}.log", 0, 0)
        seg.path.touch()
        if hasattr(self, "_writer"):
            self._writer.close()
            self._writer = open(seg.path, "ab")  # noqa: SIM115
        self._segments.append(seg)
        return seg

    def _drop_head(self) -> None:
        seg = self._segments.popleft()
        self._head_seq += seg.records
        self._dropped += seg.records
        self._dropped_bytes += seg.size - seg.offset
        seg.path.unlink(missing_ok=True)
        self._write_cursor()

    def _write_cursor(self) -> None:
        if not self._segments:
            return
        head = self._segments[0]
        tmp = self.directory / "cursor.tmp"
        tmp.write_text(f"{head.seq} {head.offset}\n")
        os.replace(tmp, self.directory / "cursor")

    def _load(self) -> None:
        paths = sorted(self.directory.glob("seg-*.log"))
        cursor_seq, cursor_offset = _read_cursor(self.directory / "cursor")
        for path in paths:
            try:
                seq = int(path.stem.removeprefix("seg-"))
            except ValueError:
                continue
            if seq < cursor_seq:  # fully acknowledged before a restart
                path.unlink(missing_ok=True)
                continue
            start = cursor_offset if seq == cursor_seq else 0
            size, records = _scan(path, start)
            self._segments.append(_Segment(seq, path, size, records, start if start <= size else size))
        if not self._segments:
            self._roll()


def _read_cursor(path: Path) -> tuple[int, int]:
    try:
        seq, offset = path.read_text().split()
        return int(seq), int(offset)
    except (FileNotFoundError, ValueError):
        return 0, 0


def _scan(path: Path, start: int) -> tuple[int, int]:
    """Count whole records from ``start``; truncate a torn record at the end. Returns (size, records)."""
    records = 0
    with open(path, "r+b") as fh:
        end = fh.seek(0, os.SEEK_END)
        pos = min(start, end)
        while pos + _HEADER.size <= end:
            fh.seek(pos)
            vlen, tlen, klen = _HEADER.unpack(fh.read(_HEADER.size))
            nxt = pos + _HEADER.size + tlen + (0 if klen == _NO_KEY else klen) + vlen
            if nxt > end:
                break
            pos = nxt
            records += 1
        if pos < end and pos >= start:
            fh.truncate(pos)
            end = pos
    return end, records


def _read_record(fh) -> SpoolRecord:  # noqa: ANN001 - a binary file object
    vlen, tlen, klen = _HEADER.unpack(fh.read(_HEADER.size))
    topic = fh.read(tlen).decode()
    key = None if klen == _NO_KEY else fh.read(klen)
    return SpoolRecord(topic, fh.read(vlen), key)
