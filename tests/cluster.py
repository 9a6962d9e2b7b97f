"""A durable Kafka-protocol test cluster: moto's S3 server and two or three Tansu brokers on one bucket.

The embedded broker keeps everything in memory; these brokers keep the log, the topics and the
committed offsets in S3 (moto's server on 127.0.0.1), so a broker SIGKILLed and started again on its
port serves what it had, and any broker serves what another wrote. ``DurableCluster.dsn`` names every
broker (``kafka://127.0.0.1:P1,127.0.0.1:P2``), so a client reaches the cluster through whichever
answers. Used by the ``cluster`` fixture (``tests/conftest.py``) and by ``bench/broker_faults.py``::

    with DurableCluster(brokers=2, root=tmp_path) as cluster:
        cluster.brokers[0].kill(); cluster.brokers[0].start()

``ClusterUnavailable`` says why a cluster cannot run here (moto or the Tansu binary missing, a
server that does not answer); the fixture turns it into a skip that prints the reason.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Self

from fleethealth.broker import EmbeddedBroker, _die_with_parent, find_broker_binary, free_port
from fleethealth.errors import BusUnavailable

__all__ = ["ClusterUnavailable", "DurableCluster", "S3Gate", "S3Server", "running_cluster", "until"]

_HOST = "127.0.0.1"
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "fleethealth", "AWS_SECRET_ACCESS_KEY": "fleethealth",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}


class ClusterUnavailable(RuntimeError):
    """The durable cluster cannot run here; the message says what is missing."""


class S3Server:
    """moto's S3 server (``python -m moto.server``) on a free 127.0.0.1 port, with one bucket made."""

    def __init__(self, *, bucket: str = "fleethealth", log_path: Path | None = None,
                 start_timeout_s: float = 30.0) -> None:
        self.bucket = bucket
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise ClusterUnavailable("the S3 server has not been started")
        return f"http://{_HOST}:{self.port}"

    def start(self) -> Self:
        if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
            raise ClusterUnavailable("the durable cluster needs moto's S3 server: pip install 'moto[server]'")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="fleethealth-s3-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        attempts_left = 3  # a free port can be taken (by another test process) before moto binds it
        while True:
            attempts_left -= 1
            self.port = free_port()
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", _HOST, "-p", str(self.port)],
                                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True, preexec_fn=_die_with_parent())
            if self._answer():
                return self
            if attempts_left <= 0 or "in use" not in self._tail().lower():
                raise ClusterUnavailable(f"moto's S3 server exited with code {self._proc.returncode}: "
                                         f"{self._tail()}")

    def _answer(self) -> bool:
        """Wait until the server just started answers (True; the bucket made) or exits (False)."""
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._proc.poll() is not None:
                return False
            try:  # PUT /bucket creates it (moto answers 200, also when it exists)
                request = urllib.request.Request(f"{self.endpoint}/{self.bucket}", method="PUT")
                with urllib.request.urlopen(request, timeout=2.0):
                    return True
            except urllib.error.HTTPError as exc:  # it answered, and refused: a bad bucket name
                self.stop()
                raise ClusterUnavailable(f"moto's S3 server refused to make bucket {self.bucket!r}: "
                                         f"HTTP {exc.code}") from exc
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise ClusterUnavailable(f"moto's S3 server did not answer within {self.start_timeout_s} s: "
                                             f"{self._tail()}") from None
                time.sleep(0.1)

    def _tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no output)"
        return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-5:]) or "(no output)"

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class S3Gate:
    """A pass-through HTTP proxy in front of :class:`S3Server` that can hold the brokers' record-batch
    writes: the crash window between a broker's two S3 writes of one produce.

    A Tansu broker on S3 appends a batch in two writes: the partition's ``watermark.json`` (the next
    offset, and the producer's sequence numbers), then the ``records/<offset>.batch`` object. After
    :meth:`hold_batches` every batch PUT is held (never forwarded, never answered) and counted in
    ``held``; a broker SIGKILLed then has taken the sequence numbers and not written the batch.
    :meth:`release` forwards nothing that was held: it only lets later writes through.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.held = 0
        self._holding = threading.Event()
        self._freed = threading.Event()
        gate = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.command == "PUT" and self.path.endswith(".batch") and gate._holding.is_set():
                    gate.held += 1
                    gate._freed.wait(120.0)  # held; its broker is SIGKILLed meanwhile
                    self.close_connection = True
                    return
                upstream = http.client.HTTPConnection(_HOST, gate.upstream_port, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                finally:
                    upstream.close()
                self.send_response(answer.status, answer.reason)
                for k, v in answer.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = http.server.ThreadingHTTPServer((_HOST, 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="s3-gate")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://{_HOST}:{self.port}"

    def hold_batches(self) -> None:
        self._freed.clear()
        self._holding.set()

    def release(self) -> None:
        self._holding.clear()
        self._freed.set()

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()


class DurableCluster:
    """``brokers`` Tansu brokers on one S3 bucket (moto), each on a port of its own that it keeps across
    restarts; a context manager. ``root`` holds the logs (else a temporary folder). ``gated``: the
    brokers reach S3 through an :class:`S3Gate` (``cluster.gate``), which can hold their batch writes."""

    def __init__(self, *, brokers: int = 2, root: str | os.PathLike[str] | None = None,
                 bucket: str = "fleethealth", start_timeout_s: float = 30.0, gated: bool = False) -> None:
        if not 1 <= brokers <= 5:
            raise ValueError(f"brokers must be 1 to 5, got {brokers}")
        self._temp = None if root is not None else tempfile.TemporaryDirectory(prefix="fleethealth-cluster-")
        self.root = Path(root if root is not None else self._temp.name)  # type: ignore[union-attr]
        self.root.mkdir(parents=True, exist_ok=True)
        self.s3 = S3Server(bucket=bucket, log_path=self.root / "s3.log", start_timeout_s=start_timeout_s)
        self.count = brokers
        self.start_timeout_s = start_timeout_s
        self.brokers: list[EmbeddedBroker] = []
        self.gated = gated
        self.gate: S3Gate | None = None

    @property
    def dsn(self) -> str:
        """``kafka://`` naming every broker."""
        return "kafka://" + ",".join(b.bootstrap for b in self.brokers)

    def start(self) -> Self:
        try:
            binary = find_broker_binary()
        except BusUnavailable as exc:
            raise ClusterUnavailable(str(exc)) from exc
        self.s3.start()
        if self.gated:
            self.gate = S3Gate(self.s3.port)  # type: ignore[arg-type]
        env = {**_CREDENTIALS, "AWS_ENDPOINT": self.s3.endpoint if self.gate is None else self.gate.endpoint}
        try:
            for k in range(self.count):
                broker = EmbeddedBroker(port=free_port(), binary=binary, log_path=self.root / f"broker{k}.log",
                                        storage=f"s3://{self.s3.bucket}/", env=env,
                                        start_timeout_s=self.start_timeout_s)
                self.brokers.append(broker)
                broker.start()
        except BusUnavailable:
            self.stop()
            raise
        return self

    def restart(self, k: int) -> None:
        """SIGKILL broker ``k`` and start it again on its port (waits until it answers)."""
        self.brokers[k].kill()
        self.brokers[k].start()

    def freeze(self, k: int) -> None:
        """SIGSTOP broker ``k``: its sockets stay open and nothing answers."""
        os.kill(self._pid(k), signal.SIGSTOP)

    def thaw(self, k: int) -> None:
        os.kill(self._pid(k), signal.SIGCONT)

    def _pid(self, k: int) -> int:
        pid = self.brokers[k].pid
        if pid is None or not self.brokers[k].running:
            raise ClusterUnavailable(f"broker {k} is not running")
        return pid

    def stop(self) -> None:
        for broker in self.brokers:
            if broker.running:
                with contextlib.suppress(OSError, ClusterUnavailable):
                    os.kill(broker.pid, signal.SIGCONT)  # a frozen broker would not see SIGINT
            broker.stop()
        if self.gate is not None:
            self.gate.stop()
            self.gate = None
        self.s3.stop()
        if self._temp is not None:
            self._temp.cleanup()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_cluster(root: Path, **options: object) -> Iterator[DurableCluster]:
    """A started :class:`DurableCluster` (``options`` as its own: ``brokers``, ``gated``...), stopped on exit;
    the test is skipped, with the reason printed, where none can run here (a test helper: imports pytest)."""
    import pytest

    try:
        cluster = DurableCluster(root=root, **options).start()  # type: ignore[arg-type]
    except ClusterUnavailable as exc:
        print(f"durable cluster unavailable: {exc}")
        pytest.skip(f"durable cluster unavailable: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


def until(cond: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll ``cond`` every 50 ms until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout_s} s")
        time.sleep(0.05)
