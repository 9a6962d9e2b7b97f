"""The probe socket's guards: who may send (file mode, the sender's credentials), how large a
datagram may be, and what one job may make the probe hold or publish.

The tests run as root, so a co-tenant is a real child process that drops to ``nobody``
(``os.fork``, then ``setgid``/``setuid``) and sends to a socket in a directory it can reach.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from fleethealth.probe.aggregator import SocketLimits, StepAggregator
from fleethealth.probe.listener import DatagramListener, PeerPolicy
from fleethealth.schema import EventKind

NOBODY = 65534

_DATAGRAM = b'{"t":"e","event":{"kind":"xid","code":79,"job":"victim","ts":1.0}}'

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another uid")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user can reach (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="fh-sock-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        for child in path.iterdir():
            child.unlink()
        path.rmdir()


def test_a_co_tenant_of_another_uid_cannot_send(shared_dir, send_as) -> None:
    path = shared_dir / "probe.sock"
    with DatagramListener(str(path)) as listener:
        assert (path.stat().st_mode & 0o777) == 0o660
        assert send_as(NOBODY, NOBODY, path) == "EACCES"  # the file mode stops it before the queue
        # a socket made writable anyway (a wrong umask, a mode changed by hand): the credentials still refuse
        path.chmod(0o666)
        assert send_as(NOBODY, NOBODY, path) == "SENT"
        assert listener.receive() == []
        stats = listener.stats
        assert stats.refused_total == 1 and stats.accepted_total == 0
        assert stats.last_refused is not None and stats.last_refused[1:] == (NOBODY, NOBODY)
        # the probe's own uid (root here) is admitted
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as own:
            own.sendto(b'{"t":"p","job":"j","rank":0,"gpu":0,"step":1,"ts":1.0}', str(path))
        assert len(listener.receive()) == 1


def test_the_socket_group_admits_its_members_and_the_uid_list_is_exact(shared_dir, send_as) -> None:
    path = shared_dir / "probe.sock"
    with DatagramListener(str(path), group=NOBODY) as listener:
        assert path.stat().st_gid == NOBODY and (path.stat().st_mode & 0o777) == 0o660
        assert send_as(NOBODY, NOBODY, path) == "SENT"  # nogroup is the socket's group
        assert len(listener.receive()) == 1
    path2 = shared_dir / "strict.sock"
    with DatagramListener(str(path2), group=NOBODY, policy=PeerPolicy(uids=frozenset({4242}))) as strict:
        assert send_as(NOBODY, NOBODY, path2) == "SENT"  # the file mode lets the group in ...
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as own:
            own.sendto(b"{}", str(path2))
        assert strict.receive() == []  # ... the configured uid list admits neither nobody nor root
        assert strict.stats.refused_total == 2


def test_a_supplementary_member_of_the_group_is_admitted(shared_dir, send_as) -> None:
    """A trainer whose primary group is not the socket's but a supplementary one is (its groups are
    read from /proc while it runs: the child waits until the datagram was received)."""
    path = shared_dir / "probe.sock"
    with DatagramListener(str(path), group=4343) as listener:
        assert send_as(NOBODY, NOBODY, path) == "EACCES"
        release_r, release_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setgroups([4343])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                    sock.sendto(b'{"t":"p","job":"j","rank":0,"gpu":0,"step":1,"ts":1.0}', str(path))
                os.read(release_r, 1)  # stay alive until the probe has looked
                code = 0
            finally:
                os._exit(code)
        try:
            got: list[bytes] = []
            for _ in range(200):  # the datagram is queued before the child blocks; poll with a bound
                got += listener.receive()
                if got or listener.stats.refused_total:
                    break
                time.sleep(0.01)
        finally:
            os.write(release_w, b"x")
            os.waitpid(pid, 0)
            os.close(release_r)
            os.close(release_w)
        assert len(got) == 1 and listener.stats.refused_total == 0, listener.stats


def test_an_oversize_datagram_is_dropped_before_it_is_buffered(tmp_path) -> None:
    path = tmp_path / "probe.sock"
    with DatagramListener(str(path), max_bytes=4096) as listener, \
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        sender.sendto(b"x" * 150_000, str(path))
        sender.sendto(b"y" * 4096, str(path))
        got = listener.receive()
    assert got == [b"y" * 4096]
    assert listener.stats.oversize_total == 1


def _event(job: str, kind: str = "sdc_check") -> bytes:
    return orjson.dumps({"t": "e", "event": {"kind": kind, "job": job, "ts": 1.0, "data": {"check": "x"}}})


def test_events_are_limited_per_job_and_per_node_and_reported_once() -> None:
    agg = StepAggregator("n0", limits=SocketLimits(events_per_s=2.0, event_burst=5, node_events_per_s=10.0,
                                                   node_event_burst=20))
    for _ in range(100):  # one job floods at one instant
        agg.feed(_event("flood"), now=100.0, wall=1.0)
    out = agg.drain(100.0)
    relayed = [e for e in out.events if e.kind is not EventKind.PROBE_ERROR]
    notes = [e for e in out.events if e.kind is EventKind.PROBE_ERROR]
    assert len(relayed) == 5 and agg.stats.events_limited_total == 95
    assert len(notes) == 1 and notes[0].job == "flood" and notes[0].data["limit"] == "events_per_s"
    # a second job is not starved by the first, and the job recovers at its rate
    agg.feed(_event("other"), now=100.0, wall=1.0)
    for k in range(4):
        agg.feed(_event("flood"), now=101.0 + k * 0.1, wall=2.0)
    out = agg.drain(102.0)
    assert [e.job for e in out.events] == ["other", "flood", "flood"]  # 2/s: two tokens in 1.3 s, no new note
    # inventing job names gets no further than the node's bucket
    for k in range(200):
        agg.feed(_event(f"made-up-{k}"), now=200.0, wall=3.0)
    out = agg.drain(200.0)
    relayed = [e for e in out.events if e.kind is not EventKind.PROBE_ERROR]
    notes = [e for e in out.events if e.kind is EventKind.PROBE_ERROR]
    assert len(relayed) <= 20 and len(notes) == 1 and notes[0].job is None


def test_node_event_kinds_never_come_from_the_socket() -> None:
    """A co-tenant of an admitted uid cannot report an Xid, a lost GPU or a self-test for its node."""
    agg = StepAggregator("n0")
    for kind in ("xid", "gpu_lost", "selftest", "health_watch", "probe_error", "interruption", "spool_dropped"):
        agg.feed(orjson.dumps({"t": "e", "event": {"kind": kind, "code": 79, "job": "j", "ts": 1.0, "data": {}}}), 1.0)
    agg.feed(_event("j"), 1.0)
    out = agg.drain(1.0)
    assert [e.kind for e in out.events] == [EventKind.SDC_CHECK]
    assert agg.stats.garbage_total == 7 and "not one a training process may send" in (agg.last_garbage or "")


def test_a_step_takes_at_most_max_ranks_and_the_overflow_is_counted_once() -> None:
    agg = StepAggregator("n0", timeout_s=1.0, limits=SocketLimits(max_ranks=8))
    for rank in range(10_000):
        agg.feed(orjson.dumps({"t": "c", "job": "j", "rank": rank, "gpu": 0, "step": 1, "s": 0.1, "ts": 1.0}), 0.0)
    out = agg.drain(5.0)
    assert len(out.batches) == 1 and out.batches[0].ranks.tolist() == list(range(8))
    assert agg.stats.ranks_limited_total == 10_000 - 8
    notes = [e for e in out.events if e.kind is EventKind.PROBE_ERROR]
    assert len(notes) == 1 and notes[0].data["limit"] == "max_ranks"


def test_the_reporter_reads_the_socket_at_use_and_warns_on_drops_once(tmp_path, monkeypatch, caplog) -> None:
    from fleethealth.injob.reporter import Reporter
    from fleethealth.schema import Event

    monkeypatch.setenv("FLEETHEALTH_SOCKET", str(tmp_path / "late.sock"))
    clock = [0.0]
    reporter = Reporter(job="j", rank=0, gpu=0, monotonic=lambda: clock[0], warn_every_s=60.0)
    assert reporter.sender is not None and reporter.sender.path == str(tmp_path / "late.sock")
    caplog.set_level("WARNING", logger="fleethealth.injob")
    for _ in range(50):  # no probe listens: every event drops
        assert reporter.emit(Event(node="", ts=1.0, kind=EventKind.SDC_CHECK, data={"check": "x"})) is False
    assert reporter.dropped_total == 50
    assert len([r for r in caplog.records if "dropped" in r.message]) == 1
    clock[0] = 61.0
    reporter.emit(Event(node="", ts=1.0, kind=EventKind.SDC_CHECK, data={"check": "x"}))
    warned = [r.message for r in caplog.records if "dropped" in r.message]
    assert len(warned) == 2 and "50 event(s) dropped (51 in all)" in warned[1]
    reporter.close()
