"""Tiny models on a shared 2-core machine (one intra-op thread avoids oversubscription stalls), and a
Unix datagram socket standing in for the probe."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    import sys

    torch = sys.modules.get("torch")
    if torch is None:  # torch-free tests stay torch-free
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def probe_socket(tmp_path):
    """A bound Unix datagram socket standing in for the probe: (path, socket), 2 s receive timeout."""
    path = str(tmp_path / "probe.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(2.0)
    yield path, sock
    sock.close()
