"""Which node states a job-stage replica decodes: those of its jobs' nodes and their rack peers.

Every job-stage replica reads ``fh.nodestate`` (compacted, key node) outside its group, as a table.
Decoding the whole table on every replica made the job stage's CPU per rank-step grow with the
replica count; :class:`NodeTable` decides from a record's key (the node's name) and its broker
timestamp, before anything is decoded, whether this replica needs it:

* a node whose rack is not known here yet is decoded once, to learn its rack (what the node reports);
* a node of one of this replica's jobs (:meth:`want`, from the step records it reads), and every
  node whose rack holds one of them (the diagnosis compares a GPU with its rack peers), is decoded;
* any other node's state is not for this replica's detectors: it is decoded at most once per
  ``peek_s`` of record time, only to learn the node's rack (a node moved to another rack is seen
  there within ``peek_s``); its newest value is kept undecoded, and handed back by :meth:`want` (or
  :meth:`learn`) the moment its node, or a node of its rack, joins a job here.

A node whose rack is unknown (``unknown``, or none reported) is no one's peer. Pure: no I/O, no clock
(record timestamps come in with the records); memory is bounded by the fleet's nodes, each with at
most one undecoded value.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fleethealth.nodename import known_rack
from fleethealth.params import check_number

__all__ = ["NodeTable", "Kept"]


@dataclass(frozen=True)
class Kept:
    """A node state passed over undecoded: where it was read, and its value."""

    partition: int
    offset: int
    key: bytes
    value: bytes
    timestamp_ms: int


class NodeTable:
    """The job stage's filter over ``fh.nodestate`` (see the module docstring).

    ``admit(key, value, partition, offset, timestamp_ms)`` says whether to decode a record (and keeps
    it when not); ``learn(node, rack)`` records a decoded state's rack; ``want(nodes)`` adds nodes of
    this replica's jobs and returns the kept records that became needed, oldest first, to decode now.
    """

    def __init__(self, *, peek_s: float = 300.0) -> None:
        self.peek_s = check_number("peek_s", peek_s, at_least=0)
        self.rack_of_: dict[str, str | None] = {}
        self.members_: dict[str, set[str]] = {}  # rack -> nodes known in it
        self.mine_: set[str] = set()  # nodes of this replica's jobs
        self.racks_: set[str] = set()  # their known racks
        self.peeked_ms_: dict[str, int] = {}
        self.kept_: dict[str, Kept] = {}
        self.decoded_total_ = 0
        self.passed_over_total_ = 0

    def needed(self, node: str) -> bool:
        """Whether ``node``'s states are needed here: one of this replica's jobs' nodes, or a rack peer."""
        if node in self.mine_:
            return True
        rack = self.rack_of_.get(node)
        return rack is not None and rack in self.racks_

    def admit(self, key: bytes | None, value: bytes | None, partition: int, offset: int, timestamp_ms: int) -> bool:
        """Whether to decode this node-state record. A record without a key or value is decoded (and
        dead-lettered by the decoder if it is bad)."""
        if key is None or value is None:
            return True
        try:
            node = key.decode()
        except UnicodeDecodeError:
            return True
        if self.needed(node):
            self.kept_.pop(node, None)
            self.decoded_total_ += 1
            return True
        old = self.kept_.get(node)  # not fed to the detectors: its newest value kept for when it is needed
        if old is None or (partition, offset) > (old.partition, old.offset):
            self.kept_[node] = Kept(partition, offset, key, value, timestamp_ms)
        last = self.peeked_ms_.get(node)
        if node not in self.rack_of_ or last is None or timestamp_ms - last >= self.peek_s * 1000.0 \
                or timestamp_ms < last:  # decoded only to learn its rack
            self.peeked_ms_[node] = timestamp_ms
            self.decoded_total_ += 1
            return True
        self.passed_over_total_ += 1
        return False

    def learn(self, node: str, rack: str | None) -> list[Kept]:
        """A decoded state of ``node`` reports ``rack``; returns the kept records this made needed (the
        rack's other nodes, when ``node`` is one of this replica's and its rack was not known), to decode."""
        rack = known_rack(rack) if rack is not None else None
        old = self.rack_of_.get(node, "\0")
        if old == rack:
            return []
        if old not in ("\0", None):
            peers = self.members_.get(old)
            if peers is not None:
                peers.discard(node)
                if not peers:
                    del self.members_[old]
        self.rack_of_[node] = rack
        if rack is None:
            return []
        self.members_.setdefault(rack, set()).add(node)
        if node not in self.mine_ or rack in self.racks_:
            return []
        self.racks_.add(rack)
        return self._take(self.members_[rack])

    def _take(self, nodes: Iterable[str]) -> list[Kept]:
        out = [self.kept_.pop(n) for n in nodes if n in self.kept_]
        for kept in out:
            self.peeked_ms_[kept.key.decode()] = kept.timestamp_ms
        self.decoded_total_ += len(out)
        return sorted(out, key=lambda k: (k.timestamp_ms, k.partition, k.offset))

    def want(self, nodes: Iterable[str]) -> list[Kept]:
        """Add ``nodes`` (of this replica's jobs); return the kept records now needed, to decode."""
        new = set(nodes) - self.mine_
        if not new:
            return []
        self.mine_ |= new
        racks = {self.rack_of_.get(n) for n in new} - {None} - self.racks_
        self.racks_ |= racks  # type: ignore[arg-type]
        needed = set(new)
        for rack in racks:
            needed |= self.members_.get(rack, set())  # type: ignore[arg-type]
        return self._take(needed)

    def forget(self, nodes: Iterable[str]) -> None:
        """``nodes`` are no longer in this replica's jobs (their jobs ended, or moved to another replica)."""
        gone = set(nodes) & self.mine_
        if not gone:
            return
        self.mine_ -= gone
        self.racks_ = {r for r in (self.rack_of_.get(n) for n in self.mine_) if r is not None}
