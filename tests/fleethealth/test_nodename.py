"""One node-naming rule: an explicit name, else $FLEETHEALTH_NODE, else the short host name (or the
FQDN when asked)."""

from __future__ import annotations

import socket

import pytest

from fleethealth.errors import ConfigError
from fleethealth.nodename import node_name


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
