"""``fleethealth_build_info`` on the metrics page of every long-running command: the probe, ``act``,
the API of ``serve`` (also the whole-tier detector replica) and ``fleethealth detect``, the last as a
real process whose endpoint is scraped over HTTP."""

from __future__ import annotations

import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleethealth import buildinfo
from fleethealth.adapters.act import ActMetrics
from fleethealth.probe.metrics import ProbeMetrics

ROOT = Path(__file__).resolve().parents[2]


def _build_info(page: str) -> dict[str, str]:
    """The labels of the one ``fleethealth_build_info`` sample on a Prometheus page (value 1, a gauge)."""
    (family,) = [f for f in text_string_to_metric_families(page) if f.name == buildinfo.NAME]
    assert family.type == "gauge"
    (sample,) = family.samples
    assert sample.value == 1.0
    return dict(sample.labels)


def _expected() -> dict[str, str]:
    commit = ""
    if shutil.which("git") and (ROOT / ".git").exists():
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
    return {"version": metadata.version("fleethealth"), "python": platform.python_version(), "commit": commit}


def test_the_labels_say_version_python_and_the_checkouts_commit():
    """Installed editable from this checkout: pip records no VCS commit, the checkout's HEAD is it."""
    info = buildinfo.build_info()
    assert info == _expected()
    assert info["version"] == __import__("fleethealth").__version__
    assert _build_info(buildinfo.render()) == info


def test_a_commit_unknown_is_an_empty_label(tmp_path):
    assert buildinfo._checkout_commit(tmp_path) == ""


def test_the_probe_act_and_api_pages_carry_it():
    from fastapi.testclient import TestClient

    from fleethealth.api import create_app

    expected = _expected()
    assert _build_info(ProbeMetrics("gpu-a17").render().decode()) == expected
    assert _build_info(ProbeMetrics("gpu-a17", compat=True).render().decode()) == expected
    assert _build_info(ActMetrics().render().decode()) == expected

    class _Empty:
        def __getattr__(self, name):
            return lambda *a, **k: []

    page = TestClient(create_app(_Empty(), token=None)).get("/metrics")  # /metrics needs no token
    assert page.status_code == 200 and _build_info(page.text) == expected


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fleethealth_detect_serves_it_from_its_first_second(tmp_path):
    """detect opens its metrics endpoint before it reaches the broker (here none listens: it waits it
    out with backoff), so a replica that cannot start yet still says what it runs."""
    metrics, nobody = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETHEALTH_")}
    proc = subprocess.Popen([sys.executable, "-m", "fleethealth", "detect", "--kafka", f"kafka://127.0.0.1:{nobody}",
                             "--store", f"chdb://{tmp_path / 'store'}", "--stage", "node",
                             "--metrics-port", str(metrics)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        page = None
        while page is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
                    page = r.read().decode()
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)  # not listening yet: the interpreter is still importing
        if page is None:
            proc.kill()
            pytest.fail(f"detect served no /metrics (exit {proc.poll()}): {proc.communicate()[1][-2000:]}")
        assert _build_info(page) == _expected()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
