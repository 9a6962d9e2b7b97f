"""``fleethealth_build_info``: which fleethealth a long-running process runs.

One gauge, always 1, whose labels say what is running, so a dashboard or an alert can tell the
versions in a fleet apart and a rollout can be watched replica by replica::

    fleethealth_build_info{version="0.1.0",python="3.11.7",commit="3f2a…"} 1

- ``version``: the installed distribution's version (``fleethealth.__version__`` when the package
  is imported from a source tree that was never installed);
- ``python``: the interpreter's version;
- ``commit``: the git commit the code was installed from when that is known, else empty: the
  ``vcs_info`` pip records for an install from a git URL (``direct_url.json``), or the commit of the
  source checkout the package is imported from (an editable install). An image built from a wheel
  knows no commit.

Every long-running command's metrics endpoint serves it: the probe's hand-rendered page
(:func:`render`), ``fleethealth act`` (:class:`~fleethealth.adapters.act.ActMetrics`), the API of
``serve`` (:class:`~fleethealth.api.app.ApiMetrics`) and ``fleethealth detect``'s registry
(:func:`register`). :func:`build_info` is computed once per process.
"""

from __future__ import annotations

import functools
import json
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["NAME", "HELP", "LABELS", "build_info", "register", "render"]

NAME = "fleethealth_build_info"
HELP = "fleethealth's version, Python version and git commit (empty when unknown); always 1"
LABELS = ("version", "python", "commit")

_SOURCE_ROOT = Path(__file__).resolve().parents[1]
_COMMIT = re.compile(r"[0-9a-f]{40}")


def _version() -> str:
    try:
        return metadata.version("fleethealth")
    except metadata.PackageNotFoundError:
        from fleethealth import __version__

        return __version__


def _installed_commit() -> str:
    """The commit pip recorded for an install from a VCS URL (PEP 610 ``direct_url.json``)."""
    try:
        text = metadata.distribution("fleethealth").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return ""
    try:
        commit = json.loads(text or "{}").get("vcs_info", {}).get("commit_id", "")
    except ValueError:
        return ""
    return commit if isinstance(commit, str) and _COMMIT.fullmatch(commit) else ""


def _checkout_commit(root: Path) -> str:
    """HEAD of the git checkout at ``root`` (a work tree or a linked worktree), else empty."""
    if not (root / ".git").exists():
        return ""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and _COMMIT.fullmatch(commit) else ""


@functools.cache
def build_info() -> dict[str, str]:
    """The labels of ``fleethealth_build_info``: ``version``, ``python``, ``commit``."""
    return {"version": _version(), "python": platform.python_version(),
            "commit": _installed_commit() or _checkout_commit(_SOURCE_ROOT)}


def register(registry: Any) -> None:
    """Add the gauge to a ``prometheus_client`` ``CollectorRegistry``."""
    from prometheus_client import Gauge

    info = build_info()
    Gauge(NAME, HELP, LABELS, registry=registry).labels(**info).set(1)


def render() -> str:
    """The gauge in the Prometheus text format (0.0.4), for pages rendered without prometheus_client."""
    info = build_info()
    labels = ",".join(f'{k}="{_escape(info[k])}"' for k in LABELS)
    return f"# HELP {NAME} {HELP}\n# TYPE {NAME} gauge\n{NAME}{{{labels}}} 1\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
