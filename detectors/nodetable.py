"""Which node states a job-stage replica decodes: those of its jobs' nodes and their rack peers.

Every job-stage replica reads ``fh.nodestate`` (compacted, key node) outside its group, as a table.
Decoding the whole table on every replica made the job stage's CPU per rank-step grow with the
replica count. Instead, a record's head is read without decoding the state (:func:`peek_state`: the
node, its rack and the event time, the first fields of the wire form) and:

* a state of a node this replica needs — a node of one of its jobs (:meth:`NodeTable.want`, from the
  step records it reads) or a node whose rack holds one of them (the diagnosis compares a GPU with
  its rack peers) — is decoded as it is read;
* any other state is held undecoded (:class:`HeldState`) in the runner's event-time buffer, and when
  the buffer releases it, decoded if its node is needed by then (the node, or a node of its rack,
  joined a job here meanwhile: a table read ahead of the steps, as in a catch-up, loses nothing)
  and dropped otherwise — each node's newest dropped state is kept, still undecoded, and handed back
  the moment the node, or a node of its rack, joins a job here (a partition this replica gets in a
  rebalance, whose steps it reads again from the commit, finds its nodes' states as the replica
  that had it did).

Every record's head names its node's rack, so the racks are known from the first record on. A node
whose rack is unknown (``unknown``, or none reported) is no one's peer. Pure: no I/O, no clock; memory
is bounded by the fleet's nodes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from fleethealth.nodename import known_rack

__all__ = ["NodeTable", "HeldState", "peek_state"]

_HEAD_KEYS = ("v", "node", "rack", "ts")
_TS = b',"ts":'


def peek_state(value: bytes) -> tuple[str, str, float] | None:
    """``(node, rack, ts)`` from the head of an encoded :class:`~fleethealth.schema.NodeState` (its first
    fields, ``{"v":…,"node":…,"rack":…,"ts":…,`` as ``schema.encode`` writes them), without reading the
    per-GPU arrays behind; None when the head is not that (the record is then decoded whole)."""
    at = value.find(_TS, 0, 4096)
    if at < 0:
        return None
    end = value.find(b",", at + len(_TS), at + len(_TS) + 64)
    if end < 0:
        return None
    try:
        head = orjson.loads(value[:end] + b"}")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(head, dict) or tuple(head) != _HEAD_KEYS:
        return None
    node, rack, ts = head["node"], head["rack"], head["ts"]
    if not isinstance(node, str) or not isinstance(rack, str) or isinstance(ts, bool) \
            or not isinstance(ts, int | float):
        return None
    return node, rack, float(ts)


@dataclass(frozen=True)
class HeldState:
    """A node state held undecoded in the event-time buffer (``ts`` its event time, from its head)."""

    node: str
    rack: str
    ts: float
    value: bytes


class NodeTable:
    """Which nodes' states a job-stage replica needs (see the module docstring).

    ``learn(node, rack)`` records the rack a state reports; ``want(nodes)`` adds nodes of this
    replica's jobs; ``needed(node)`` says whether a node's states go to the detectors; ``drop(node, ts,
    item)`` keeps the newest state dropped of a node not needed. ``want`` and ``learn`` return the
    kept items of the nodes they made needed, oldest first, to be fed.
    """

    def __init__(self) -> None:
        self.rack_of_: dict[str, str | None] = {}
        self.members_: dict[str, set[str]] = {}  # rack -> nodes known in it
        self.mine_: set[str] = set()  # nodes of this replica's jobs
        self.racks_: set[str] = set()  # their known racks
        self.kept_: dict[str, tuple[float, Any]] = {}  # node -> (ts, item) of its newest state dropped
        self.decoded_total_ = 0
        self.passed_over_total_ = 0

    def needed(self, node: str) -> bool:
        """Whether ``node``'s states are needed here: one of this replica's jobs' nodes, or a rack peer."""
        if node in self.mine_:
            return True
        rack = self.rack_of_.get(node)
        return rack is not None and rack in self.racks_

    def drop(self, node: str, ts: float, item: Any) -> None:
        """A state of ``node`` (not needed) is not fed; keep it if it is the node's newest."""
        old = self.kept_.get(node)
        if old is None or ts >= old[0]:
            self.kept_[node] = (ts, item)
        self.passed_over_total_ += 1

    def _take(self, nodes: Iterable[str]) -> list[Any]:
        out = sorted((self.kept_.pop(n) for n in nodes if n in self.kept_), key=lambda k: k[0])
        return [item for _, item in out]

    def learn(self, node: str, rack: str | None) -> list[Any]:
        """A state of ``node`` reports ``rack``; returns the kept items this made needed."""
        rack = known_rack(rack) if rack is not None else None
        old = self.rack_of_.get(node, "\0")
        if old == rack:
            return []
        if old not in ("\0", None):
            peers = self.members_.get(old)  # type: ignore[arg-type]
            if peers is not None:
                peers.discard(node)
                if not peers:
                    del self.members_[old]  # type: ignore[arg-type]
        self.rack_of_[node] = rack
        if rack is None:
            return []
        self.members_.setdefault(rack, set()).add(node)
        if node in self.mine_ and rack not in self.racks_:
            self.racks_.add(rack)
            return self._take(self.members_[rack])
        return self._take([node]) if self.needed(node) else []

    def want(self, nodes: Iterable[str]) -> list[Any]:
        """``nodes`` run a job of this replica's: their states, and their rack peers', are needed.
        Returns the kept items this made needed."""
        new = set(nodes) - self.mine_
        if not new:
            return []
        self.mine_ |= new
        racks = {r for r in (self.rack_of_.get(n) for n in new) if r is not None} - self.racks_
        self.racks_ |= racks
        return self._take(new.union(*(self.members_.get(r, set()) for r in racks)))

    def forget(self, nodes: Iterable[str]) -> None:
        """``nodes`` no longer run a job of this replica's."""
        gone = set(nodes) & self.mine_
        if not gone:
            return
        self.mine_ -= gone
        self.racks_ = {r for r in (self.rack_of_.get(n) for n in self.mine_) if r is not None}
