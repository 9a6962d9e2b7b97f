"""One node-naming rule: an explicit name, else $FLEETHEALTH_NODE, else the short host name (or the
FQDN when asked)."""

from __future__ import annotations

import socket

import pytest

from fleethealth.errors import ConfigError
from fleethealth.nodename import known_rack, node_name, rack_from_topology


@pytest.fixture(autouse=True)
def _host(monkeypatch):
    monkeypatch.delenv("FLEETHEALTH_NODE", raising=False)
    monkeypatch.delenv("FLEETHEALTH_NODE_NAMING", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-017.cluster.example")
    monkeypatch.setattr(socket, "getfqdn", lambda: "gpu-017.cluster.example")


def test_short_by_default_fqdn_on_request(monkeypatch) -> None:
    assert node_name() == "gpu-017"
    assert node_name(naming="fqdn") == "gpu-017.cluster.example"
    monkeypatch.setenv("FLEETHEALTH_NODE_NAMING", "fqdn")
    assert node_name() == "gpu-017.cluster.example"
    with pytest.raises(ConfigError, match="short, fqdn"):
        node_name(naming="long")


def test_an_explicit_name_wins_then_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("FLEETHEALTH_NODE", "n0042")
    assert node_name() == "n0042"
    assert node_name("n0007") == "n0007"
    assert node_name("") == "n0042"


def test_a_rack_is_known_only_when_reported() -> None:
    assert known_rack("row2-rack07") == "row2-rack07"
    assert known_rack("unknown") is None and known_rack("") is None and known_rack(None) is None


def test_a_fleet_topology_file_gives_a_node_its_rack(tmp_path) -> None:
    topo = tmp_path / "topology.txt"
    topo.write_text("# node rack\ngpu-017   row2-rack07\ngpu-018 row2-rack07  # same rack\n\ngpu-101 row3-rack01\n")
    assert rack_from_topology(str(topo), "gpu-017") == "row2-rack07"
    assert rack_from_topology(str(topo), "gpu-101") == "row3-rack01"
    assert rack_from_topology(str(topo), "gpu-999") == "unknown"
    topo.write_text("gpu-017 row2-rack07 extra\n")
    with pytest.raises(ConfigError, match="line 1"):
        rack_from_topology(str(topo), "gpu-017")
    topo.write_text("gpu-017 a\ngpu-017 b\n")
    with pytest.raises(ConfigError, match="racks a and b"):
        rack_from_topology(str(topo), "gpu-017")
    with pytest.raises(ConfigError, match="topology file"):
        rack_from_topology(str(tmp_path / "missing.txt"), "gpu-017")
