"""A bounded on-disk FIFO of bus records: the probe's write-ahead queue towards Kafka.

Every message the probe accepts is appended here first and removed only after the broker has
acknowledged it, so a broker outage (or a probe restart during one) loses nothing that fits in
the bound; on reconnect the records replay in the order they were accepted. Beyond
``max_bytes`` (default 512 MiB) the *oldest* records are dropped, a segment at a time, and
counted in ``dropped_total`` — the newest telemetry is the most useful after a long outage.

What was dropped is also kept for a report on the bus (:meth:`Spool.drops_to_report`): how many
records and bytes, per topic, and the range of their times (the ``ts`` given to :meth:`append`,
the event time of a schema message). It survives a restart in ``DIR/dropped.json`` until the
delivery says the report was acknowledged (:meth:`Spool.drops_reported`). For segments left by an
earlier run the times are not known: the range is then bounded by the segment file's modification
time (the last append to it).

Layout: ``DIR/seg-<12 digits>.log`` segment files of records ``<u32 value_len><u16 topic_len>
<u16 key_len or 0xFFFF for none> topic key value``, and ``DIR/cursor`` holding the read position
(``<segment> <offset>``), replaced atomically on every acknowledgement. A record cut short by a
crash is truncated away on open. Segments are ``min(16 MiB, max_bytes / 8)`` so dropping the oldest
one never discards more than an eighth of the bound.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleethealth.errors import ConfigError

__all__ = ["Spool", "SpoolDrops", "SpoolRecord", "SpoolStats", "DEFAULT_MAX_BYTES"]

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


@dataclass(frozen=True, slots=True)
class SpoolDrops:
    """Records the spool dropped (beyond its bound) and has not yet reported on the bus.

    ``first_ts`` / ``last_ts`` bound the times of the dropped records (seconds since the epoch,
    NaN when unknown); ``topics`` counts the dropped records per topic.
    """

    records: int
    bytes: int
    first_ts: float
    last_ts: float
    topics: dict[str, int] = field(default_factory=dict)

    def merged(self, other: SpoolDrops | None) -> SpoolDrops:
        if other is None:
            return self
        topics = Counter(self.topics)
        topics.update(other.topics)
        return SpoolDrops(self.records + other.records, self.bytes + other.bytes,
                          _nanmin(self.first_ts, other.first_ts), _nanmax(self.last_ts, other.last_ts),
                          dict(sorted(topics.items())))

    def to_obj(self) -> dict[str, Any]:
        return {"records": self.records, "bytes": self.bytes,
                "first_ts": None if math.isnan(self.first_ts) else self.first_ts,
                "last_ts": None if math.isnan(self.last_ts) else self.last_ts, "topics": dict(self.topics)}

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> SpoolDrops:
        def ts(value: Any) -> float:
            return math.nan if value is None else float(value)

        return cls(int(obj["records"]), int(obj["bytes"]), ts(obj.get("first_ts")), ts(obj.get("last_ts")),
                   {str(k): int(v) for k, v in dict(obj.get("topics") or {}).items()})


def _nanmin(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else min(a, b)


def _nanmax(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


@dataclass
class _Segment:
    seq: int
    path: Path
    size: int       # bytes in the file
    records: int    # unread records in the file
    offset: int = 0  # read position (only the head segment is ever partly read)
    first_ts: float = math.nan  # times of the records appended to it (NaN: not known, see _load)
    last_ts: float = math.nan
    topics: Counter[str] = field(default_factory=Counter)  # unread records per topic


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
        self._unreported: SpoolDrops | None = None  # dropped, not yet handed out for a report
        self._reporting: SpoolDrops | None = None   # handed out by drops_to_report, not yet acknowledged
        self._load_drops()
        self._load()
        self._writer = open(self._segments[-1].path, "ab")  # noqa: SIM115 - held open for appends

    # ------------------------------------------------------------ writing
    def append(self, topic: str, value: bytes, key: bytes | None = None, *, ts: float | None = None) -> None:
        """Queue one record; drop the oldest records first if the bound would be exceeded.

        ``ts`` is the record's time for a drop report (default: now)."""
        t = topic.encode()
        k = b"" if key is None else key
        if len(t) >= _NO_KEY or len(k) >= _NO_KEY:
            raise ConfigError("spool: topic and key must be shorter than 65535 bytes")
        ts = time.time() if ts is None or not math.isfinite(ts) else float(ts)
        size = _HEADER.size + len(t) + len(k) + len(value)
        if size > self.max_bytes:
            self._dropped += 1
            self._dropped_bytes += size
            self._note_drop(SpoolDrops(1, size, ts, ts, {topic: 1}))
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
        tail.first_ts = _nanmin(tail.first_ts, ts)
        tail.last_ts = _nanmax(tail.last_ts, ts)
        tail.topics[topic] += 1
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

    def ack_delivered(self, start_seq: int, records: Sequence[SpoolRecord]) -> int:
        """The broker acknowledged ``records``, those :meth:`peek` returned from index ``start_seq``: remove
        the ones still queued and return how many. The first of them the bound dropped while they were in
        flight arrived after all: they leave the drop counters and the report not yet handed out, so a drop
        report counts only records that never reached the bus (its time range stays a bound)."""
        removed = self.ack_until(start_seq + len(records))
        arrived = records[:len(records) - removed]
        if arrived:
            size = sum(_HEADER.size + len(r.topic.encode()) + len(r.key or b"") + len(r.value) for r in arrived)
            self._dropped -= len(arrived)
            self._dropped_bytes -= size
            self._acked += len(arrived)
            if self._unreported is not None:
                left = self._unreported.records - len(arrived)
                topics = Counter(self._unreported.topics)
                topics.subtract(r.topic for r in arrived)
                self._unreported = None if left <= 0 else SpoolDrops(
                    left, max(self._unreported.bytes - size, 0), self._unreported.first_ts,
                    self._unreported.last_ts, dict(sorted((+topics).items())))
                self._write_drops()
        return removed

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
                        seg.topics[_read_record(fh).topic] -= 1
                    seg.offset = fh.tell()
                seg.topics = +seg.topics
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

    # ------------------------------------------------------------ drop reports
    def drops_to_report(self) -> SpoolDrops | None:
        """What was dropped and not yet reported, or ``None``. The same report is returned until
        :meth:`drops_reported` (drops after it are kept for the next report)."""
        if self._reporting is None and self._unreported is not None:
            self._reporting, self._unreported = self._unreported, None
            self._write_drops()
        return self._reporting

    def drops_reported(self) -> None:
        """The report :meth:`drops_to_report` returned is on the bus: forget it."""
        if self._reporting is not None:
            self._reporting = None
            self._write_drops()

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
        if seg.records:
            self._note_drop(SpoolDrops(seg.records, seg.size - seg.offset, seg.first_ts, seg.last_ts,
                                       dict(sorted((+seg.topics).items()))))
        seg.path.unlink(missing_ok=True)
        self._write_cursor()

    def _note_drop(self, drop: SpoolDrops) -> None:
        self._unreported = drop.merged(self._unreported)
        self._write_drops()

    def _write_drops(self) -> None:
        path = self.directory / "dropped.json"
        if self._unreported is None and self._reporting is None:
            path.unlink(missing_ok=True)
            return
        obj = {"pending": None if self._unreported is None else self._unreported.to_obj(),
               "reporting": None if self._reporting is None else self._reporting.to_obj()}
        tmp = self.directory / "dropped.json.tmp"
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, path)

    def _load_drops(self) -> None:
        try:
            obj = json.loads((self.directory / "dropped.json").read_text())
            self._unreported = None if obj.get("pending") is None else SpoolDrops.from_obj(obj["pending"])
            self._reporting = None if obj.get("reporting") is None else SpoolDrops.from_obj(obj["reporting"])
        except FileNotFoundError:
            return
        except (ValueError, TypeError, KeyError, AttributeError):  # a torn or foreign file: counts only in metrics
            with contextlib.suppress(OSError):
                (self.directory / "dropped.json").unlink()

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
            size, records, topics = _scan(path, start)
            try:
                mtime = path.stat().st_mtime
            except OSError:
                mtime = math.nan
            self._segments.append(_Segment(seq, path, size, records, start if start <= size else size,
                                           last_ts=mtime, topics=topics))
        if not self._segments:
            self._roll()


def _read_cursor(path: Path) -> tuple[int, int]:
    try:
        seq, offset = path.read_text().split()
        return int(seq), int(offset)
    except (FileNotFoundError, ValueError):
        return 0, 0


def _scan(path: Path, start: int) -> tuple[int, int, Counter[str]]:
    """Count whole records from ``start``; truncate a torn record at the end.
    Returns (size, records, records per topic)."""
    records = 0
    topics: Counter[str] = Counter()
    with open(path, "r+b") as fh:
        end = fh.seek(0, os.SEEK_END)
        pos = min(start, end)
        while pos + _HEADER.size <= end:
            fh.seek(pos)
            vlen, tlen, klen = _HEADER.unpack(fh.read(_HEADER.size))
            nxt = pos + _HEADER.size + tlen + (0 if klen == _NO_KEY else klen) + vlen
            if nxt > end:
                break
            topic = fh.read(tlen).decode(errors="replace")
            pos = nxt
            records += 1
            topics[topic] += 1
        if pos < end and pos >= start:
            fh.truncate(pos)
            end = pos
    return end, records, topics


def _read_record(fh) -> SpoolRecord:  # noqa: ANN001 - a binary file object
    vlen, tlen, klen = _HEADER.unpack(fh.read(_HEADER.size))
    topic = fh.read(tlen).decode()
    key = None if klen == _NO_KEY else fh.read(klen)
    return SpoolRecord(topic, fh.read(vlen), key)
