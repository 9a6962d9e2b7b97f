"""``fleethealth serve`` in embedded mode, end to end, and the CLI's API client.

One real process: the embedded broker, the chDB store it owns, the detector runner on a thread
and uvicorn on a free 127.0.0.1 port. A second "process" (this test) reaches the store only
through ``POST /v1/query`` (``query_via_api``), as ``fleethealth query`` does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from fleethealth.api.client import query_via_api, server_running
from fleethealth.errors import ConfigError, StoreError


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def served(tmp_path):
    port = _free_port()
    (tmp_path / "token").write_text("tok-" + "x" * 20 + "\n")
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "fleethealth", "serve", "--data", str(tmp_path / "data"),
                             "--port", str(port), "--token-file", str(tmp_path / "token"), "--migrate"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "FLEETHEALTH_API_TOKEN": ""})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not server_running(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"fleethealth serve did not come up: {(tmp_path / 'serve.log').read_text()}")
        time.sleep(0.2)
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _post(url: str, body: dict, token: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_serve_owns_the_store_and_answers_sql_through_the_api(served):
    url, proc = served
    token = "tok-" + "x" * 20
    with pytest.raises(ConfigError, match="HTTP 401"):
        query_via_api(url, "SELECT count() FROM findings")  # reads need a token too
    with pytest.raises(ConfigError, match="not readable"):
        query_via_api(url, "SELECT name FROM system.tables", token)
    with pytest.raises(ConfigError, match="only one statement"):
        query_via_api(url, "SELECT 1; DROP TABLE findings", token)
    assert query_via_api(url, "SELECT count() FROM findings", token).rows == [(0,)]
    assert _post(f"{url}/v1/breaker/reset", {"by": "ci"}) == 401
    assert _post(f"{url}/v1/breaker/reset", {"by": "ci"}, token="wrong") == 403
    assert _post(f"{url}/v1/breaker/reset", {"by": "ci"}, token="tok-" + "x" * 20) == 200
    assert query_via_api(url, "SELECT reset_by FROM breaker FINAL", token).rows == [("ci",)]
    # SIGHUP reloads the config file between two batches; started without one, the reload is refused
    # and counted, and serve keeps serving; the reload route needs the write token
    proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    refused = "fleethealth_config_reload_failures_total 1.0"
    while refused not in urllib.request.urlopen(f"{url}/metrics").read().decode():
        assert proc.poll() is None and time.monotonic() < deadline, "SIGHUP: no refused reload counted within 30 s"
        time.sleep(0.1)
    assert _post(f"{url}/v1/config/reload", {}) == 401
    assert _post(f"{url}/v1/config/reload", {}, token=token) == 422
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0


def test_client_reports_a_missing_server_clearly():
    url = f"http://127.0.0.1:{_free_port()}"
    assert server_running(url) is False
    with pytest.raises(StoreError, match="no answer"):
        query_via_api(url, "SELECT 1")
    with pytest.raises(ConfigError, match="http"):
        query_via_api("ftp://x", "SELECT 1")
