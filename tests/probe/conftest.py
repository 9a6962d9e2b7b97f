"""Fixtures of the probe tests: the recorded NVML / DCGM answers under ``recordings/``.

These machines have no GPU and no DCGM host engine, so the NVML and DCGM adapters are tested
against recorded field values replayed through objects with the libraries' call surface
(:mod:`fleethealth.probe.recorded`); ``bench/gpu_nvml.py`` runs the NVML source on a real GPU.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

RECORDINGS = Path(__file__).parent / "recordings"


@pytest.fixture
def recording() -> Callable[[str], Path]:
    """``recording("nvml_h100_faults.json")`` -> the path of a recording."""

    def path(name: str) -> Path:
        found = RECORDINGS / name
        if not found.is_file():
            raise FileNotFoundError(found)
        return found

    return path


_DATAGRAM = b'{"t":"e","event":{"kind":"xid","code":79,"job":"victim","ts":1.0}}'


def _send_as(uid: int, gid: int, path: Path, datagram: bytes = _DATAGRAM, groups: tuple[int, ...] = ()) -> str:
    """Fork a child that drops to ``uid``/``gid`` (and ``groups``, supplementary) and sends one datagram to ``path``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        code = 1
        try:
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                try:
                    sock.sendto(datagram, str(path))
                    os.write(write_end, b"SENT")
                except PermissionError:
                    os.write(write_end, b"EACCES")
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        _, status = os.waitpid(pid, 0)
        answer = os.read(read_end, 16).decode()
    finally:
        os.close(read_end)
    assert os.waitstatus_to_exitcode(status) == 0, status
    return answer


@pytest.fixture
def send_as():
    """``send_as(uid, gid, path)``: a forked child drops to ``uid``/``gid`` and sends one datagram;
    returns ``"SENT"`` or ``"EACCES"`` (the tests run as root)."""
    return _send_as
