"""Fixtures for the scheduler adapters: a real single-node Slurm cluster, a Kubernetes API replay.

``slurm_cluster`` writes a minimal ``slurm.conf`` (one node, ``n0000`` on 127.0.0.1, free ports,
every path inside a temporary directory, ``HealthCheckProgram`` = deploy/slurm/healthcheck.sh every
2 s, idle until a test writes its settings file), starts ``munged`` with a fresh key, ``slurmctld`` and
``slurmd`` in the foreground in their own process groups, waits until ``sinfo`` shows the node
idle, and stops all three afterwards. Each pytest-xdist worker that needs one starts its own (paths,
ports and munge key its own); a daemon that exits while starting because another process took its
port in between is started again on new ports. It needs Debian's ``slurm-wlm`` and ``munge`` packages
(``apt-get install -y slurm-wlm munge``) and root (``slurmd`` runs jobs as their users); without
them the tests that use it are skipped with the reason printed.

``k8s_replay`` serves Kubernetes API exchanges from ``fixtures/*.json`` on 127.0.0.1: each request
the ``kubernetes`` client makes is compared with the next expected request (method, path, query,
content type, JSON body; the string ``"<any>"`` in an expected body matches any value, for generated
names) and answered with the fixture's response; a request that differs, or one too many, is
answered 500 and listed in ``mismatches``. The fixtures are written by hand from the Kubernetes API
reference (core/v1 Node, Pod, Event; policy/v1 Eviction; Status for 404/409/429/5xx), not recorded
from a server: no Kubernetes API server runs on these machines, so this is as close to one as the
tests get.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest

_SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "sinfo")
SLURM_NODE = "n0000"


@dataclass(frozen=True)
class SlurmCluster:
    """A running single-node cluster: ``env`` selects it (``SLURM_CONF``); ``node`` is its node."""

    root: Path
    conf: Path
    env: dict[str, str]
    node: str

    @property
    def healthcheck_conf(self) -> Path:
        """Writing this file arms slurmd's HealthCheckProgram (deploy/slurm/healthcheck.sh); removing it
        disarms it."""
        return self.root / "healthcheck.conf"

    def sinfo(self, *args: str) -> str:
        out = subprocess.run(["sinfo", *args], env=self.env, capture_output=True, text=True, timeout=10,
                             check=True)
        return out.stdout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


HEALTHCHECK = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "healthcheck.sh"
HEALTHCHECK_INTERVAL_S = 2


def _write_conf(root: Path, munge_socket: Path) -> Path:
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(exist_ok=True)
    # slurmd runs HealthCheckProgram without arguments, so a two-line wrapper names the settings file;
    # it does nothing until a test writes ROOT/healthcheck.conf (see SlurmCluster.healthcheck_conf)
    wrapper = root / "healthcheck"
    wrapper.write_text(f"#!/bin/sh\n[ -f {root}/healthcheck.conf ] || exit 0\n"
                       f"exec /bin/bash {HEALTHCHECK} {root}/healthcheck.conf\n")
    wrapper.chmod(0o755)
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=fleethealth-test
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/linear
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
HealthCheckProgram={wrapper}
HealthCheckInterval={HEALTHCHECK_INTERVAL_S}
HealthCheckNodeState=ANY
NodeName={SLURM_NODE} NodeAddr=127.0.0.1 NodeHostname=localhost CPUs=1 RealMemory=100 State=UNKNOWN
PartitionName=debug Nodes={SLURM_NODE} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in reversed(procs):
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    missing = [b for b in _SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm not installed (missing {', '.join(missing)}); "
                    "install with: apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the single-node Slurm fixture runs slurmd, which needs root")
    root = tmp_path_factory.mktemp("slurm")
    munge_dir = root / "munge"
    munge_dir.mkdir(mode=0o700)
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    munge_socket = munge_dir / "munge.sock"
    (root / "log").mkdir()
    logs = (root / "log" / "daemons.out").open("ab")
    munged = ["munged", "--foreground", "--force", f"--socket={munge_socket}", f"--key-file={key}",
              f"--log-file={root}/log/munged.log", f"--pid-file={munge_dir}/munged.pid",
              f"--seed-file={munge_dir}/munged.seed"]
    procs = [subprocess.Popen(munged, stdout=logs, stderr=subprocess.STDOUT, start_new_session=True)]
    try:
        _wait(lambda: munge_socket.exists(), 10, "munged socket", root, procs)
        for attempt in range(3):  # its ports are chosen free, and another test process can take one before
            conf = _write_conf(root, munge_socket)  # slurmctld or slurmd binds it: then again on new ports
            env = {**os.environ, "SLURM_CONF": str(conf)}
            daemons = [subprocess.Popen(argv, env=env, stdout=logs, stderr=subprocess.STDOUT, start_new_session=True)
                       for argv in (["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", SLURM_NODE])]
            procs += daemons

            def node_idle(env: dict[str, str] = env) -> bool:
                try:  # a port taken by another process may accept sinfo's connection and never answer
                    out = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], env=env,
                                         capture_output=True, text=True, timeout=5)
                except subprocess.TimeoutExpired:
                    return False
                return out.returncode == 0 and f"{SLURM_NODE} idle" in out.stdout.split("\n")

            try:
                _wait(node_idle, 30, "node n0000 idle in sinfo", root, procs)
                break
            except _DaemonExited as exc:
                if attempt == 2 or "in use" not in str(exc).lower():
                    raise
                _stop(daemons)
                del procs[1:]
        yield SlurmCluster(root=root, conf=conf, env=env, node=SLURM_NODE)
    finally:
        _stop(procs)
        logs.close()


class _DaemonExited(RuntimeError):
    """A daemon of the single-node cluster exited while it was starting (its logs' tails in the message)."""


def _wait(ready, timeout_s: float, what: str, root: Path, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        gone = [p for p in procs if p.poll() is not None]
        if gone:
            raise _DaemonExited(f"single-node Slurm did not come up: {gone[0].args[0]} exited with code "
                                f"{gone[0].returncode}{_log_tails(root)}")
        time.sleep(0.2)
    raise RuntimeError(f"single-node Slurm did not come up: no {what} after {timeout_s:g} s{_log_tails(root)}")


def _log_tails(root: Path) -> str:
    tail = ""
    for name in ("daemons.out", "slurmctld.log", "slurmd.log"):
        path = root / "log" / name
        if path.exists():
            tail += f"\n--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
    return tail


# ---------------------------------------------------------------- Kubernetes API replay
FIXTURES = Path(__file__).parent / "fixtures"


def _matches(want: Any, got: Any) -> bool:
    if want == "<any>":
        return True
    if isinstance(want, dict):
        return isinstance(got, dict) and want.keys() == got.keys() and all(_matches(want[k], got[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(want) == len(got) and all(map(_matches, want, got))
    return want == got


@dataclass
class K8sReplay:
    """A replay of one fixture: ``api`` is a ``CoreV1Api`` pointed at it."""

    name: str
    exchanges: list[dict[str, Any]]
    api: Any = None
    position: int = 0
    mismatches: list[str] = field(default_factory=list)
    seen: list[dict[str, Any]] = field(default_factory=list)

    def answer(self, method: str, target: str, content_type: str | None, raw: bytes) -> tuple[int, bytes]:
        parts = urlsplit(target)
        got = {"method": method, "path": parts.path, "query": dict(parse_qsl(parts.query))}
        if raw:
            got["content_type"] = content_type
            got["body"] = json.loads(raw)
        self.seen.append(got)
        if self.position >= len(self.exchanges):
            self.mismatches.append(f"unexpected request #{self.position + 1}: {method} {target}")
            return 500, b'{"kind":"Status","status":"Failure","message":"not in the fixture","code":500}'
        want = self.exchanges[self.position]["request"]
        expected = {k: want[k] for k in ("method", "path", "query")}
        if "body" in want:
            expected["content_type"] = want.get("content_type")
            expected["body"] = want["body"]
        if not _matches(expected, got):
            self.mismatches.append(f"request #{self.position + 1} differs:\n  want {expected}\n  got  {got}")
            return 500, b'{"kind":"Status","status":"Failure","message":"differs from the fixture","code":500}'
        response = self.exchanges[self.position]["response"]
        self.position += 1
        return response["status"], json.dumps(response["body"]).encode()

    def assert_all_replayed(self) -> None:
        assert not self.mismatches, "\n".join(self.mismatches)
        assert self.position == len(self.exchanges), (
            f"{self.name}: {len(self.exchanges) - self.position} expected requests were never made")


def _handler(replay_of: Callable[[], K8sReplay]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            status, body = replay_of().answer(self.command, self.path, self.headers.get("Content-Type"), raw)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PATCH = do_PUT = do_POST = do_DELETE = _serve

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def k8s_replay() -> Iterator[Callable[[str], K8sReplay]]:
    """``k8s_replay("cordon_taint_condition.json")`` -> a :class:`K8sReplay` with a ready ``api``."""
    kubernetes = pytest.importorskip("kubernetes")
    current: list[K8sReplay] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(lambda: current[-1]))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    clients = []

    def load(name: str) -> K8sReplay:
        fixture = json.loads((FIXTURES / name).read_text())
        replay = K8sReplay(name=name, exchanges=fixture["exchanges"])
        config = kubernetes.client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
        client = kubernetes.client.ApiClient(config)
        clients.append(client)
        replay.api = kubernetes.client.CoreV1Api(client)
        current.append(replay)
        return replay

    try:
        yield load
    finally:
        for client in clients:
            client.close()
        server.shutdown()
        server.server_close()
