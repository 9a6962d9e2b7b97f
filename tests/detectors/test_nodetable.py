"""The job stage's filter over fh.nodestate: a replica decodes its jobs' nodes and their rack peers, learns
every other node's rack once per peek, and gets a passed-over state back the moment it is needed."""

from __future__ import annotations

import numpy as np
import pytest

from fleethealth.detectors.nodetable import NodeTable
from fleethealth.errors import ConfigError

# data-centre names and the racks the nodes report, not the simulator's n0000 / r00
RACK = {"gpu-a1-07.dc2": "dc2-a1", "gpu-a1-08.dc2": "dc2-a1", "gpu-b4-01.dc2": "dc2-b4",
        "gpu-b4-02.dc2": "dc2-b4", "gpu-x-99.dc2": "unknown"}


def _offer(table: NodeTable, node: str, ts_ms: int, offset: int) -> bool:
    return table.admit(node.encode(), b"{...}", 0, offset, ts_ms)


def test_a_replica_decodes_its_nodes_and_their_rack_peers_and_passes_over_the_rest() -> None:
    table = NodeTable(peek_s=300.0)
    for i, node in enumerate(RACK):  # the first state of every node is decoded: its rack is learned
        assert _offer(table, node, 0, i)
        assert table.learn(node, RACK[node]) == []
    back = table.want(["gpu-a1-07.dc2"])  # decoded only to learn a rack so far: now for the detectors
    assert sorted(k.key for k in back) == [b"gpu-a1-07.dc2", b"gpu-a1-08.dc2"]
    decoded = {n: [_offer(table, n, 25_000 * s, 100 + 10 * s + i) for s in range(1, 13)]
               for i, n in enumerate(RACK)}
    assert all(decoded["gpu-a1-07.dc2"]) and all(decoded["gpu-a1-08.dc2"])  # its node and its rack peer
    for other in ("gpu-b4-01.dc2", "gpu-b4-02.dc2", "gpu-x-99.dc2"):  # another rack; no rack at all
        assert decoded[other] == [False] * 11 + [True]  # once per peek_s: states every 25 s, the 12th at 300 s
    assert table.passed_over_total_ == 3 * 11


def test_a_node_that_joins_a_job_here_brings_back_its_newest_state_and_its_peers() -> None:
    table = NodeTable(peek_s=300.0)
    for i, node in enumerate(RACK):
        _offer(table, node, 0, i)
        table.learn(node, RACK[node])
    for s in range(1, 4):
        for i, node in enumerate(RACK):
            assert not _offer(table, node, 5_000 * s, 10 * s + i)
    back = table.want(["gpu-b4-02.dc2"])
    assert sorted(k.key.decode() for k in back) == ["gpu-b4-01.dc2", "gpu-b4-02.dc2"]
    assert [k.offset for k in back] == [32, 33] and all(k.timestamp_ms == 15_000 for k in back)  # the newest
    assert table.want(["gpu-b4-02.dc2"]) == []  # once


def test_an_unknown_rack_is_no_ones_peer() -> None:
    table = NodeTable()
    for i, node in enumerate(("gpu-x-99.dc2", "gpu-y-01.dc2")):
        _offer(table, node, 0, i)
        table.learn(node, "unknown")
    assert [k.key for k in table.want(["gpu-x-99.dc2"])] == [b"gpu-x-99.dc2"]  # its own state, no peer's
    assert table.needed("gpu-x-99.dc2") and not table.needed("gpu-y-01.dc2")


def test_a_rack_learned_after_the_node_joined_brings_its_peers() -> None:
    table = NodeTable()
    _offer(table, "gpu-a1-08.dc2", 0, 0)
    table.learn("gpu-a1-08.dc2", "dc2-a1")
    assert not _offer(table, "gpu-a1-08.dc2", 5_000, 1)
    assert table.want(["gpu-a1-07.dc2"]) == []  # its rack not known yet
    assert _offer(table, "gpu-a1-07.dc2", 5_000, 2)
    back = table.learn("gpu-a1-07.dc2", "dc2-a1")
    assert [(k.key, k.offset) for k in back] == [(b"gpu-a1-08.dc2", 1)]


def test_peek_s_is_checked() -> None:
    with pytest.raises(ConfigError, match="peek_s"):
        NodeTable(peek_s=np.nan)
