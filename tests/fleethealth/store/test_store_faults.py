"""Store crashes on real chDB: the process that owns the store SIGKILLed during its inserts (and
between an insert and its commit) and restarted on the same data path, three times (bench/store_crash.py:
ten) — no row missing, none twice; and a store volume that fills up — a StoreFull error that says
so, counted on fleethealth_store_full_errors_total, waited out by the runner's retry policy (never
dead-lettered, no exit), the writes resuming once space returns.

The full volume is real: a 48 MiB tmpfs mounted in a mount namespace of the worker's own
(``unshare -m`` as root, ``unshare -rm`` otherwise), filled to its last block by a file that the
worker removes at the retry policy's third wait. Where no mount namespace can be made the test is
skipped, saying why."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fleethealth.errors import StoreFull, StoreUnavailable
from fleethealth.store import open_store
from fleethealth.store.translate import store_error

HERE = Path(__file__).parent
CRASH = HERE / "_crash_worker.py"
FULL = HERE / "_full_worker.py"
BATCHES = 24
KILLS = ("during:5", "after:11", "during:17")


def _run(dsn: str, commits: Path, kill: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CRASH), dsn, str(commits), str(BATCHES), kill], capture_output=True,
                          text=True, timeout=180)


def test_the_store_owner_sigkilled_during_inserts_and_restarted_loses_and_doubles_no_row(tmp_path: Path) -> None:
    dsn, commits = f"chdb://{tmp_path}/store", tmp_path / "committed"
    with open_store(dsn) as store:
        store.migrate()
    for kill in KILLS:
        run = _run(dsn, commits, kill)
        assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    done = _run(dsn, commits)
    assert done.returncode == 0, done.stderr[-2000:]
    rows, total = _expected()
    with open_store(dsn) as store:  # raw rows, no FINAL: a row written twice would show
        count, unique, sums = store.query("SELECT count(), uniqExact(step, rank), sum(compute_s) "
                                          "FROM rank_steps").rows[0]
    assert (count, unique, round(sums, 6)) == (rows, rows, total)


def _expected() -> tuple[int, float]:
    sys.path.insert(0, str(HERE))
    try:
        from _crash_worker import ROWS, batch
    finally:
        sys.path.pop(0)
    return BATCHES * ROWS, round(sum(float(batch(b)["compute_s"].sum()) for b in range(BATCHES)), 6)


def test_a_full_volume_error_is_a_store_full_a_writer_retries() -> None:
    full = store_error(RuntimeError("Code: 243. DB::Exception: Cannot reserve 1.00 MiB, not enough space. "
                                    "(NOT_ENOUGH_SPACE)"), "insert into rank_steps failed", "chdb:///x")
    assert isinstance(full, StoreFull) and isinstance(full, StoreUnavailable)
    assert "the store's volume is full" in str(full)
    assert not isinstance(store_error(RuntimeError("Code: 62. Syntax error"), "query failed", "chdb:///x"), StoreFull)


def _namespace() -> list[str] | None:
    """A command prefix that runs its argument in a mount namespace of its own, or None."""
    if shutil.which("unshare") is None:
        return None
    import os

    prefix = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    probe = subprocess.run([*prefix, "sh", "-c", "mkdir -p /tmp/fh-ns-probe && mount -t tmpfs -o size=1m tmpfs "
                            "/tmp/fh-ns-probe"], capture_output=True, text=True, timeout=30)
    return prefix if probe.returncode == 0 else None


def test_a_full_store_volume_is_waited_out_and_the_writes_resume_when_space_returns(tmp_path: Path) -> None:
    prefix = _namespace()
    if prefix is None:
        pytest.skip("no mount namespace here (unshare -m / -rm refused): a real full volume cannot be made")
    mnt = tmp_path / "volume"
    mnt.mkdir()
    script = f'mount -t tmpfs -o size=48m tmpfs "{mnt}" && exec "{sys.executable}" "{FULL}" "{mnt}"'
    run = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, timeout=240,
                         cwd=HERE.parents[2])
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["rows"] == got["unique"] == got["expected"]  # every batch stored once, none dead-lettered
    assert got["freed"] and got["waits"] >= 3 and got["metric"] == len(got["errors"]) >= 1
    assert all(e.startswith("StoreFull: insert into rank_steps failed on chdb://") and
               "the store's volume is full" in e and "NOT_ENOUGH_SPACE" in e for e in got["errors"]), got["errors"]
