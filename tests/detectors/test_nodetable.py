"""The job stage's filter over fh.nodestate: a replica needs its jobs' nodes and their rack peers, knows
every node's rack from a record's head without decoding it, and an unknown rack is no one's peer."""

from __future__ import annotations

import numpy as np

from fleethealth.detectors.nodestate import node_state
from fleethealth.detectors.nodetable import NodeTable, peek_state
from fleethealth.schema import Telemetry, encode

# data-centre names and the racks the nodes report, not the simulator's n0000 / r00
RACK = {"gpu-a1-07.dc2": "dc2-a1", "gpu-a1-08.dc2": "dc2-a1", "gpu-b4-01.dc2": "dc2-b4",
        "gpu-b4-02.dc2": "dc2-b4", "gpu-x-99.dc2": "unknown", "gpu-y-01.dc2": "unknown"}


def _table() -> NodeTable:
    table = NodeTable()
    for node, rack in RACK.items():
        table.learn(node, rack)
    return table


def test_a_replica_needs_its_jobs_nodes_and_their_rack_peers() -> None:
    table = _table()
    assert not any(table.needed(n) for n in RACK)
    table.want(["gpu-a1-07.dc2"])
    assert {n for n in RACK if table.needed(n)} == {"gpu-a1-07.dc2", "gpu-a1-08.dc2"}
    table.forget(["gpu-a1-07.dc2"])
    assert not any(table.needed(n) for n in RACK)


def test_an_unknown_rack_is_no_ones_peer() -> None:
    table = _table()
    table.want(["gpu-x-99.dc2"])
    assert {n for n in RACK if table.needed(n)} == {"gpu-x-99.dc2"}


def test_a_rack_learned_after_the_node_joined_brings_its_peers_and_a_move_is_followed() -> None:
    table = NodeTable()
    table.learn("gpu-a1-08.dc2", "dc2-a1")
    table.want(["gpu-a1-07.dc2"])  # its rack not known yet
    assert not table.needed("gpu-a1-08.dc2")
    table.learn("gpu-a1-07.dc2", "dc2-a1")
    assert table.needed("gpu-a1-08.dc2")
    table.learn("gpu-a1-08.dc2", "dc2-b4")  # re-racked: no longer a peer
    assert not table.needed("gpu-a1-08.dc2") and table.members_ == {"dc2-a1": {"gpu-a1-07.dc2"},
                                                                    "dc2-b4": {"gpu-a1-08.dc2"}}


def test_the_head_of_an_encoded_state_is_read_as_the_wire_writes_it() -> None:
    sample = Telemetry.from_columns("gpu-a1-07.dc2", "dc2-a1", 1_767_225_600.25, np.arange(8),
                                    temp_c=np.full(8, 61.5), power_w=np.full(8, 640.0))
    value = encode(node_state(sample, None))
    assert peek_state(value) == ("gpu-a1-07.dc2", "dc2-a1", 1_767_225_600.25)
    for other in (b'{"v":1,"rack":"r","node":"n","ts":1.0,"gpu":[]}', b"[1,2]", b"not json", b'{"ts":1}',
                  b'{"v":1,"node":7,"rack":"r","ts":1.0,"gpu":[]}', b'{"v":1,"node":"n","rack":"r","ts":true,"g":1}'):
        assert peek_state(other) is None  # decoded whole instead (and dead-lettered if it is bad)


def test_the_newest_state_dropped_comes_back_when_its_node_or_a_rack_peer_joins_a_job_here() -> None:
    """A partition this replica gets in a rebalance is read again from the commit: its nodes' newest states
    were dropped here while another replica had it, and must be fed now, as that replica had them."""
    table = _table()
    for ts in (10.0, 15.0, 5.0):  # out of order: the newest by event time is kept
        for node in RACK:
            table.drop(node, ts, (node, ts))
    assert table.passed_over_total_ == 3 * len(RACK)
    assert sorted(table.want(["gpu-b4-02.dc2"])) == [("gpu-b4-01.dc2", 15.0), ("gpu-b4-02.dc2", 15.0)]
    assert table.want(["gpu-b4-01.dc2"]) == []  # once
    late = NodeTable()
    late.drop("gpu-a1-08.dc2", 3.0, "peer")
    late.learn("gpu-a1-08.dc2", "dc2-a1")
    late.want(["gpu-a1-07.dc2"])  # its rack not known yet: the peer's state stays kept
    assert late.learn("gpu-a1-07.dc2", "dc2-a1") == ["peer"]
