"""The consumer: decoded records from a consumer group (or a whole topic read as a table), dead-lettering
what it cannot decode, bound in event time or verify, and committing only what it returned."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Self

import orjson

from fleethealth import schema
from fleethealth.bus.deadletter import DeadLetter
from fleethealth.bus.dsn import _backend, parse_dsn
from fleethealth.bus.kafka_client import reaches_a_broker, translated
from fleethealth.bus.producer import Producer
from fleethealth.bus.records import Record, decode_value, event_time_skew, split_block
from fleethealth.bus.topics import TOPIC_CONFIGS
from fleethealth.errors import BusUnavailable, ConfigError, SchemaError
from fleethealth.schema import Topic

_log = logging.getLogger("fleethealth.bus")
_COMPACTED = frozenset(t for t, c in TOPIC_CONFIGS.items() if c.get("cleanup.policy") == "compact")


def group_read_to_end(members: Sequence[tuple[Collection[tuple[str, int]], bool]],
                      partitions: Collection[tuple[str, int]]) -> bool:
    """Whether a consumer group is read to its end, from what each member said after its last poll,
    ``(assignment, read to its end)``: every partition is assigned to exactly one member and each member
    that holds partitions has read them to their end.

    Pure. A member between two generations holds nothing, and one that lost partitions has dropped what
    it held of them, so a group is not done while a partition has no owner (its new owner has not
    joined yet) or two (a report older than the move): its records past the commit are unread."""
    held = [tp for assigned, _ in members for tp in assigned]
    if len(held) != len(set(held)) or set(held) != set(partitions) or not partitions:
        return False
    return all(done for assigned, done in members if assigned)


class Consumer:
    """Consumes schema messages from ``topics`` as member of consumer group ``group``.

    Offsets are committed only by :meth:`commit`. A value that fails to decode or validate is
    published to ``fh.deadletter`` (through ``producer`` if given, else one the consumer opens
    and closes itself) and skipped. ``from_beginning`` starts a group without committed offsets
    at the earliest record, else at the latest. ``max_ahead_s`` / ``max_behind_s`` bound a
    message's event time against its record timestamp (None: no bound; see :mod:`fleethealth.bus`).
    ``verifier`` (a :class:`fleethealth.signing.Verifier`) checks each decoded record's signature
    headers; the reason it gives dead-letters the record.
    """

    def __init__(self, dsn: str, topics: Sequence[str], group: str | None, *, producer: Producer | None = None,
                 from_beginning: bool = True, client_id: str = "fleethealth",
                 max_poll_interval_s: float = 3.0, session_timeout_s: float = 6.0,
                 connect_timeout_s: float = 10.0, max_ahead_s: float | None = None,
                 max_behind_s: float | None = None, verifier: Any = None) -> None:
        self.verifier = verifier  # a fleethealth.signing.Verifier: its reason dead-letters a record
        if isinstance(topics, str):
            topics = [topics]
        if not topics:
            raise ConfigError("a consumer needs at least one topic")
        known = {t.value for t in schema.TOPIC_TYPES} | {Topic.DEADLETTER.value}
        unknown = [str(t) for t in topics if str(t) not in known]
        if unknown:
            raise ConfigError(f"topic {unknown[0]!r} carries no known message type (known: {sorted(known)})")
        for name, bound in (("max_ahead_s", max_ahead_s), ("max_behind_s", max_behind_s)):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int | float)
                                      or not bound >= 0):
                raise ConfigError(f"{name} must be a non-negative number of seconds or None, got {bound!r}")
        self.max_ahead_s = None if max_ahead_s is None else float(max_ahead_s)
        self.max_behind_s = None if max_behind_s is None else float(max_behind_s)
        self.dsn = dsn
        self.topics = tuple(str(t) for t in topics)
        self.group = group
        self.from_beginning = from_beginning
        self._types: dict[str, Any] = {t.value: cls for t, cls in schema.TOPIC_TYPES.items()}
        self._types[Topic.DEADLETTER.value] = DeadLetter
        self._client_id = client_id
        backend = _backend(dsn)
        self._revoked: list[tuple[str, set[Any], int | None]] = []  # the client's rebalance listener's, for _settle
        self._leaving: set[Any] = set()  # revoked, the new assignment not known yet
        self._left_in: int | None = None  # the generation the partitions in _leaving were held in
        self._moved: set[tuple[str, int]] = set()
        self._connect = lambda: backend.consumer(self.topics, group, client_id, from_beginning,
                                                 int(max_poll_interval_s * 1000), int(session_timeout_s * 1000),
                                                 int(connect_timeout_s * 1000), on_revoked=self._revoked.append)
        with translated(f"joining group {group!r}", dsn):
            self._kc = self._connect()
        self._unreachable_since: float | None = None
        self.failovers_total = 0
        self._producer = producer
        self._own_producer = producer is None
        self._pending: dict[Any, int] = {}
        self._buffer: list[tuple[Record | None, Any, int]] = []
        self._committed: dict[Any, int] = {}
        self._dead_unflushed = False
        self.consumed_total = 0
        self.dead_lettered_total = 0
        self.commit_failed_total = 0
        self.holes_total = 0
        self.hole_offsets_total = 0
        """Holes in the log (offsets the partition's high watermark counts and no record holds) passed over
        or skipped, and the offsets in them (see :meth:`_watch_holes`); each is logged and dead-lettered."""
        self._next_offset: dict[Any, int] = {}  # per partition, the offset after the last record fetched
        self._stuck: dict[Any, tuple[int, float, float]] = {}  # position, when last seen, seconds stood still
        self._holes_checked_at = 0.0
        self.reached: dict[tuple[str, int], int] = {}
        """Per ``(topic, partition)``, the offset after the last record returned or dead-lettered here:
        records read again after a seek or a rebalance count once (``consumed_total`` counts each time)."""

    split_blocks: bool = True
    """Whether a :class:`~fleethealth.schema.StepBlock` comes out as one record per step (a
    :class:`~fleethealth.schema.StepBatch` each); a reader that takes blocks whole (the runner)
    sets it False and gets one record per block."""

    admit: Callable[[str, int, int, bytes | None, bytes | None, int], bool] | None = None
    """A reader's filter before decoding: ``admit(topic, partition, offset, key, value, timestamp_ms)``;
    a record it refuses is passed over undecoded (its offset counts as read) and counted in
    ``passed_over_total``. The job stage reads only the node states it needs this way."""
    passed_over_total: int = 0

    commit_timeout_s: float = 30.0
    """How long one commit waits for the group coordinator's answer before it raises
    :class:`~fleethealth.errors.BusUnavailable` (the caller retries it)."""

    fail_over_after_s: float = 10.0
    """With several brokers in the DSN: a client that has reached no broker for this long, across polls,
    is replaced by one bootstrapped from all of them (see :meth:`_fail_over`); 0 or less: never."""

    hole_skip_after_s: float = 600.0
    """A partition whose position has stood still this long (in time spent polling) while its high watermark
    is beyond it is read past a hole: the consumer moves to the high watermark (see :meth:`_watch_holes`).
    Longer than a broker can stand between its two writes of one batch; 0 or less: never."""

    def wait_assigned(self, timeout_s: float = 30.0) -> None:
        """Block until the group has assigned partitions and their start offsets are known.

        Records that arrive meanwhile are kept for the next :meth:`poll`. Useful with
        ``from_beginning=False``: what is published after this returns will be seen.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._buffer += self._fetch(0.1, 5000)
            with translated(f"joining group {self.group!r}", self.dsn):
                assigned = self._kc.assignment()
                if assigned:
                    for tp in assigned:
                        self._kc.position(tp, timeout_ms=max(1, int((deadline - time.monotonic()) * 1000)))
                    return
        raise BusUnavailable(f"group {self.group!r} got no partitions of {', '.join(self.topics)} on "
                             f"{self.dsn} within {timeout_s} s")

    def poll(self, timeout_s: float = 1.0, max_records: int = 5000) -> list[Record]:
        """Return up to ``max_records`` decoded records, waiting at most ``timeout_s`` for the first."""
        entries = self._buffer if self._buffer else self._fetch(timeout_s, max_records)
        out: list[Record] = []
        taken = 0
        for record, tp, next_offset in entries:
            if record is not None:
                if len(out) == max_records:
                    break
                out.append(record)
            self._pending[tp] = next_offset  # commit() covers what was returned or dead-lettered
            key = (tp.topic, tp.partition)
            if next_offset > self.reached.get(key, 0):
                self.reached[key] = next_offset
            taken += 1
        self._buffer = entries[taken:]
        self.consumed_total += len(out)
        return out

    def _fetch(self, timeout_s: float, max_records: int) -> list[tuple[Record | None, Any, int]]:
        """Poll Kafka once: ``(record, partition, next offset)`` per value, ``None`` for a dead letter."""
        try:
            with translated(f"polling {', '.join(self.topics)}", self.dsn):
                batches = self._kc.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except BusUnavailable as exc:  # with several brokers: one is gone, fail over rather than stop
            if not self._several():
                raise
            if self._unreachable_since is None:
                _log.warning("group %r: %s", self.group, exc)
            self._watch_reach()
            return []
        self._settle()  # a rebalance happens inside a poll: what it revoked, before what this poll returned
        if not batches:
            self._watch_reach()
        else:
            self._unreachable_since = None
        out: list[tuple[Record | None, Any, int]] = self._watch_holes(batches)
        for tp, records in batches.items():
            cls = self._types.get(tp.topic)
            admit = self.admit
            skip = set() if admit is None else {
                i for i, r in enumerate(records)
                if not admit(r.topic, r.partition, r.offset, r.key, r.value, getattr(r, "timestamp", -1))}
            self.passed_over_total += len(skip)
            # one bulk decode per partition's records (columnar for step batches); each value still
            # gets its own result, so a bad one is dead-lettered with its own reason
            bulk = iter(schema.decode_many(cls, [r.value for i, r in enumerate(records)
                                                 if r.value is not None and i not in skip])
                        if cls is not DeadLetter else ())
            for i, rec in enumerate(records):
                if i in skip:
                    out.append((None, tp, rec.offset + 1))
                    continue
                try:
                    if cls is DeadLetter or rec.value is None:
                        msg = decode_value(cls, rec.value)
                    else:
                        msg = next(bulk)
                        if isinstance(msg, Exception):
                            raise msg
                except SchemaError as exc:
                    self._dead_letter(rec, f"{exc.field}: {exc.problem}")
                    out.append((None, tp, rec.offset + 1))
                except Exception as exc:  # a poison value must never stop the stream
                    self._dead_letter(rec, f"<message>: {type(exc).__name__}: {exc}")
                    out.append((None, tp, rec.offset + 1))
                else:
                    skew = None if self.verifier is None else self.verifier.check(
                        rec.topic, rec.key, rec.value, getattr(rec, "headers", None), msg)
                    skew = skew or event_time_skew(msg, getattr(rec, "timestamp", None), max_ahead_s=self.max_ahead_s,
                                                   max_behind_s=self.max_behind_s)
                    if skew is not None:
                        self._dead_letter(rec, skew)
                        out.append((None, tp, rec.offset + 1))
                        continue
                    if isinstance(msg, schema.StepBlock) and self.split_blocks:
                        out.extend((part, tp, next_offset)
                                   for part, next_offset in split_block(rec.topic, rec.partition, rec.offset, rec.key,
                                                                        msg))
                        continue
                    out.append((Record(rec.topic, rec.partition, rec.offset, rec.key, msg), tp, rec.offset + 1))
        return out

    def _watch_holes(self, batches: Mapping[Any, Sequence[Any]]) -> list[tuple[None, Any, int]]:
        """Report holes in the log, and read past one at a partition's end.

        A Tansu broker on S3 SIGKILLed between its two writes of a batch (the watermark, then the batch)
        leaves offsets no batch holds (``tests/fleethealth/test_bus_holes.py``). A fetch answers the
        batches at or after its offset, so a hole followed by a record is passed over: reported here when
        a partition's records start past where the last fetch ended or skip offsets inside (not on the
        compacted topics, where gaps are normal). At the log's end a fetch answers nothing while the high
        watermark counts the hole, so the lag never reaches 0 until something new is written, and a reader
        draining to the end waits for ever. A partition whose position has stood still with the high
        watermark beyond it for ``hole_skip_after_s`` of polling is moved to the high watermark: one
        ``(None, partition, high watermark)`` entry, which :meth:`poll` takes as read past, as a dead
        letter. Each hole is counted, logged and dead-lettered with its topic, partition and offsets."""
        now = time.monotonic()
        for tp, records in batches.items():
            if not records:
                continue
            first, last = records[0].offset, records[-1].offset
            if tp.topic not in _COMPACTED:
                expected = self._next_offset.get(tp)
                if expected is not None and first > expected:
                    self._hole(tp, expected, first, "passed over (a later record was fetched)")
                if last - first + 1 != len(records):
                    for a, b in zip(records, records[1:], strict=False):
                        if b.offset > a.offset + 1:
                            self._hole(tp, a.offset + 1, b.offset, "passed over (a later record was fetched)")
            self._next_offset[tp] = last + 1
            self._stuck.pop(tp, None)
        if self.hole_skip_after_s <= 0 or self._buffer or now - self._holes_checked_at < 0.5:
            return []  # (entries not yet returned come first; twice a second is often enough)
        self._holes_checked_at = now
        skipped: list[tuple[None, Any, int]] = []
        with translated("reading consumer positions", self.dsn):
            for tp in self._kc.assignment():
                end = None if tp in batches else self._kc.highwater(tp)
                if end is None:
                    continue
                position = self._kc.position(tp, timeout_ms=1000)
                if position is None or position >= end:
                    self._stuck.pop(tp, None)
                    continue
                at, seen, still_s = self._stuck.get(tp, (position, now, 0.0))
                # time between two checks counts up to 2 s: a consumer that did not poll (a store outage)
                # has not seen the partition stand still
                still_s = still_s + min(now - seen, 2.0) if at == position else 0.0
                self._stuck[tp] = (position, now, still_s)
                if still_s < self.hole_skip_after_s:
                    continue
                self._kc.seek(tp, end)
                self._stuck.pop(tp, None)
                self._next_offset[tp] = end
                self._hole(tp, position, end, f"skipped: the high watermark stood beyond it and fetches "
                                              f"answered nothing for {still_s:.1f} s")
                skipped.append((None, tp, end))
        return skipped

    def _hole(self, tp: Any, start: int, end: int, how: str) -> None:
        """Count, log and dead-letter the hole ``[start, end)`` of partition ``tp``."""
        self.holes_total += 1
        self.hole_offsets_total += end - start
        reason = (f"hole: offsets {start}-{end - 1} ({end - start}) hold no record in the broker's log; "
                  f"group {self.group!r} {how}")
        _log.warning("%s[%d]: %s", tp.topic, tp.partition, reason)
        if tp.topic == Topic.DEADLETTER.value:
            return
        if self._producer is None:
            self._producer = Producer(self.dsn, client_id=f"{self._client_id}-deadletter")
        letter = DeadLetter.of(tp.topic, tp.partition, start, None, None, reason, None)
        self._producer.publish_raw(Topic.DEADLETTER.value, orjson.dumps(letter.to_obj()), None)
        self._dead_unflushed = True

    def _several(self) -> bool:
        return self.fail_over_after_s > 0 and len(parse_dsn(self.dsn)[1]) >= 2

    def _watch_reach(self, since: float | None = None) -> None:
        """After an empty or failed poll, or a failed commit: note since when the client has reached no
        broker, and fail over once that is ``fail_over_after_s`` ago (kafka-python mostly neither raises
        nor returns anything meanwhile; a commit to a dead coordinator times out, again and again)."""
        if not self._several() or reaches_a_broker(self._kc) is not False:
            self._unreachable_since = None
            return
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now if since is None else since
        if now - self._unreachable_since >= self.fail_over_after_s:
            self._fail_over(now - self._unreachable_since)

    def _fail_over(self, unreachable_s: float) -> None:
        """Replace the client by a new one bootstrapped from every broker of the DSN. kafka-python forgets
        its bootstrap list once it has metadata, and brokers that share one node id (Tansu's, on one
        storage) leave it one address, so a client whose broker died for good would poll and commit
        there forever, silently. The new client joins the group anew: what this one had read and not
        committed is read again by the partitions' owners (a rebalance: the runner sees its assignment
        empty, then restores what it is given from the snapshots); nothing read here is committed."""
        _log.warning("group %r reached no broker of %s for %.0f s: reconnecting from every broker of the DSN",
                     self.group, self.dsn, unreachable_s)
        try:
            with translated(f"rejoining group {self.group!r}", self.dsn):
                fresh = self._connect()
        except BusUnavailable as exc:  # none answers now: keep the old client, try again later
            _log.warning("group %r: no broker of %s answered: %s", self.group, self.dsn, exc)
            self._unreachable_since = time.monotonic()
            return
        old, self._kc = self._kc, fresh
        self._settle()
        # every partition the old client held is given up: its reader's state is dropped and taken again
        self._moved |= {(tp.topic, tp.partition) for tp in (*self._pending, *self._committed, *self._leaving)}
        self._leaving = set()
        self._pending.clear()
        self._buffer = []
        self._committed.clear()
        self._next_offset.clear()
        self._stuck.clear()
        self._unreachable_since = None
        self.failovers_total += 1
        try:
            old.close(autocommit=False)
        except Exception:  # noqa: BLE001 — the old client's broker is gone; it is dropped either way
            pass

    def _settle(self) -> None:
        """Apply the group's rebalances since the last call (the client's listener records each revoked
        and each assigned set, in order). A partition revoked and not given back loses what this member
        knew of it — the offsets it had read to and committed (a commit or a snapshot must never name
        them again: the partition's next owner may go further, or restore an older snapshot) and the
        records it had fetched and not returned — and :meth:`take_moved` names it. A partition assigned
        anew starts with nothing known here (read from the group's commit). One given back in the same
        rebalance is kept as it was (kafka-python tells of an eager revocation before the new
        assignment is known, so the two are matched here) — only when the member went straight from the
        generation it held it in to the next: a member dropped from the group (a poll slower than
        ``max_poll_interval_s``, its session expired) loses its partitions, and the group may give one to
        another member, which reads it further and commits, before this member joins again and gets it
        back; what it knew of it is behind then, as it is after any generation it missed."""
        while self._revoked:
            kind, tps, generation = self._revoked.pop(0)
            _log.debug("group %r: %s %d partition(s) in generation %s", self.group, kind, len(tps), generation)
            if kind != "assigned":
                self._leaving |= tps
                # a lost membership keeps nothing, nor does a revocation the client cannot date
                self._left_in = generation if kind == "revoked" and generation is not None and generation >= 0 \
                    else None
                continue
            straight = self._left_in is not None and generation == self._left_in + 1
            kept = self._leaving & tps if straight else set()
            for tp in (self._leaving | tps) - kept:
                self._pending.pop(tp, None)
                self._committed.pop(tp, None)
                self._next_offset.pop(tp, None)
                self._stuck.pop(tp, None)
                self._buffer = [entry for entry in self._buffer if entry[1] != tp]
                if tp in self._leaving:
                    self._moved.add((tp.topic, tp.partition))
            self._leaving = set()
            self._left_in = None

    def take_moved(self) -> set[tuple[str, int]]:
        """The ``(topic, partition)`` pairs the group took from this member since the last call (even one it
        gave back in a later rebalance before this call): a reader's state of them may be behind what
        another member did with them, so it is dropped and taken again from the partition's snapshot."""
        self._settle()
        moved, self._moved = self._moved, set()
        return moved

    def _dead_letter(self, rec: Any, reason: str) -> None:
        if rec.topic == Topic.DEADLETTER.value:
            self.dead_lettered_total += 1  # never loop a dead letter back into its own topic
            return
        if self._producer is None:
            self._producer = Producer(self.dsn, client_id=f"{self._client_id}-deadletter")
        letter = DeadLetter.of(rec.topic, rec.partition, rec.offset, rec.key, rec.value, reason,
                               getattr(rec, "timestamp", None))
        self._producer.publish_raw(Topic.DEADLETTER.value, orjson.dumps(letter.to_obj()), rec.key)
        self._dead_unflushed = True
        self.dead_lettered_total += 1

    def commit(self, hold: Mapping[tuple[str, int], int] | None = None) -> None:
        """Commit every record returned (or dead-lettered) by :meth:`poll` so far (see
        :meth:`_commit_pending`). A commit the broker did not answer counts toward the fail-over: a
        coordinator that died for good times it out again and again, and after a fail-over nothing read
        here is pending."""
        started = time.monotonic()
        try:
            self._commit_pending(hold)
        except BusUnavailable:
            self._watch_reach(since=started)  # the time the commit waited reached no broker either
            raise

    def _commit_pending(self, hold: Mapping[tuple[str, int], int] | None = None) -> None:
        """Commit every record returned (or dead-lettered) by :meth:`poll` so far.

        ``hold`` maps ``(topic, partition)`` to the first offset the caller has not finished
        with (records it still buffers); nothing from there on is committed for that partition,
        and the rest is committed by a later call.
        """
        if self._dead_unflushed and self._producer is not None:
            self._producer.flush()
            self._dead_unflushed = False
        if self.group is None:  # a table reader: it re-reads from its start, nothing to commit
            self._pending.clear()
            return
        self._settle()
        hold = hold or {}
        # never for a partition the group has moved to another member: its records read here were not
        # all processed, and a coordinator takes a commit for any partition from a current member
        owned = set(self._kc.assignment())
        self._pending = {tp: off for tp, off in self._pending.items() if tp in owned}
        targets = {tp: min(off, hold.get((tp.topic, tp.partition), off)) for tp, off in self._pending.items()}
        targets = {tp: off for tp, off in targets.items() if off > self._committed.get(tp, -1)}
        if not targets:
            return
        from kafka.structs import OffsetAndMetadata

        offsets = {tp: OffsetAndMetadata(off, "", -1) for tp, off in targets.items()}
        with translated(f"committing offsets of group {self.group!r}", self.dsn):
            try:
                self._kc.commit(offsets=offsets, timeout_ms=int(self.commit_timeout_s * 1000))
            except Exception as exc:
                if type(exc).__name__ not in ("CommitFailedError", "RebalanceInProgressError"):
                    raise
                # the group rebalanced under us (a slow poll on a loaded machine, a new member): nothing is
                # committed now. A partition that moved is dropped from what is pending at the next commit
                # (its records are redelivered to its owner, whose idempotent writes absorb them); one that
                # stayed keeps its pending offset — the group may keep its read position, and then nothing
                # would be returned again to commit past records this consumer has already finished
                self.commit_failed_total += 1
                _log.warning("commit for group %r refused after a rebalance; %d partition(s) will be re-read "
                             "from their last commit", self.group, len(offsets))
                return
        self._committed.update(targets)
        for tp, off in targets.items():
            if self._pending.get(tp) == off:
                del self._pending[tp]

    def seek(self, offsets: Mapping[tuple[str, int], int]) -> None:
        """Read the given ``(topic, partition)`` pairs from these offsets next (a restored snapshot's):
        what was fetched of them and not yet returned is dropped, and nothing is committed for them
        until records from there on are returned."""
        from kafka.structs import TopicPartition

        moved = {TopicPartition(t, p) for t, p in offsets}
        self._buffer = [entry for entry in self._buffer if entry[1] not in moved]
        with translated("seeking", self.dsn):
            for (topic, partition), offset in offsets.items():
                tp = TopicPartition(topic, partition)
                self._pending.pop(tp, None)
                self._next_offset[tp] = offset
                self._stuck.pop(tp, None)
                self._kc.seek(tp, offset)

    def offset_range(self, pairs: Collection[tuple[str, int]]) -> dict[tuple[str, int], tuple[int, int]]:
        """The broker's ``(beginning, end)`` offsets of each ``(topic, partition)`` of ``pairs`` that exists
        (what a restored snapshot's offsets are checked against before a seek)."""
        from kafka.structs import TopicPartition

        with translated("reading partition ranges", self.dsn):
            known = {(t, p) for t in {t for t, _ in pairs} for p in (self._kc.partitions_for_topic(t) or ())}
            tps = [TopicPartition(t, p) for t, p in pairs if (t, p) in known]
            if not tps:
                return {}
            first, last = self._kc.beginning_offsets(tps), self._kc.end_offsets(tps)
            # Tansu 0.6 answers ListOffsets 'latest' with the last record batch's base offset + 1, short
            # of the log's end; the group's own commit, and a fetch's high watermark, are never past it
            mine = set(self._kc.assignment()) if self.group is not None else set()
            for tp in tps:
                if tp in mine:
                    seen = (self._kc.highwater(tp), self._kc.committed(tp))
                    last[tp] = max([int(last[tp]), *(int(v) for v in seen if v is not None)])
        return {(tp.topic, tp.partition): (int(first[tp]), int(last[tp])) for tp in tps}

    def committed(self) -> dict[tuple[str, int], int]:
        """The offsets this consumer has committed, per ``(topic, partition)``, of the partitions it has held
        since it committed them (one taken away and assigned again has none until it commits it again)."""
        self._settle()
        return {(tp.topic, tp.partition): off for tp, off in self._committed.items()}

    def began_at(self, pairs: Collection[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """Where this member began reading each of ``pairs`` that it holds and has not committed itself: the
        group's commit from before it held the partition (only the holder commits), else, for a group read
        from the beginning, the log's first offset. What a snapshot names for a partition of its unit that
        this replica has read nothing of, or not committed yet: its state has seen nothing before there."""
        from kafka.structs import TopicPartition

        self._settle()
        with translated("reading the group's commits", self.dsn):
            mine = set(self._kc.assignment())
            tps = [tp for tp in (TopicPartition(t, p) for t, p in pairs) if tp in mine and tp not in self._committed]
            out: dict[tuple[str, int], int] = {}
            unset = []
            for tp in tps:
                off = self._kc.committed(tp)  # the group's, cached when this member was given the partition
                if off is None:
                    unset.append(tp)
                else:
                    out[(tp.topic, tp.partition)] = int(off)
            if unset and self.from_beginning:
                first = self._kc.beginning_offsets(unset)
                out.update({(tp.topic, tp.partition): int(first[tp]) for tp in unset})
        return out

    def partitions(self) -> set[tuple[str, int]]:
        """Every ``(topic, partition)`` of this consumer's topics the broker knows (those a group splits)."""
        with translated("reading partitions", self.dsn):
            return {(t, p) for t in self.topics for p in (self._kc.partitions_for_topic(t) or ())}

    def assignment(self) -> set[tuple[str, int]]:
        """The ``(topic, partition)`` pairs this consumer reads now (empty between group generations)."""
        with translated("reading the assignment", self.dsn):
            return {(tp.topic, tp.partition) for tp in self._kc.assignment()}

    def positions(self) -> dict[tuple[str, int], int]:
        """The next offset to read per assigned ``(topic, partition)`` (after a join: where reading
        starts, the group's committed offset or the reset position)."""
        out: dict[tuple[str, int], int] = {}
        with translated("reading consumer positions", self.dsn):
            for tp in self._kc.assignment():
                out[(tp.topic, tp.partition)] = self._kc.position(tp, timeout_ms=5000)
        return out

    def lag(self) -> dict[tuple[str, int], int | None]:
        """Records not yet returned by :meth:`poll`, per assigned ``(topic, partition)``.

        0 means the partition is read to its end as far as the last fetch knows; None means its
        end is not known yet (no fetch has answered for it).
        """
        out: dict[tuple[str, int], int | None] = {}
        held = Counter(tp for _, tp, _ in self._buffer)  # fetched, not yet returned: still unread
        with translated("reading consumer positions", self.dsn):
            for tp in self._kc.assignment():
                end = self._kc.highwater(tp)
                position = None if end is None else self._kc.position(tp, timeout_ms=1000)
                out[(tp.topic, tp.partition)] = None if position is None else max(0, end - position) + held[tp]
        return out

    def close(self) -> None:
        try:
            with translated("closing a consumer", self.dsn):
                self._kc.close(autocommit=False)
        finally:
            if self._own_producer and self._producer is not None:
                self._producer.close()
                self._producer = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
