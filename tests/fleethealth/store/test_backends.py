"""Backends from a DSN on real chDB: the scheme registry, an unreachable server, the
one-path-per-process rule and a path held by another process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fleethealth.commands import main
from fleethealth.errors import ConfigError, StoreError, StoreLocked
from fleethealth.schema import Finding
from fleethealth.store import Store, backends, known_schemes, open_store, register_backend


# ---------------------------------------------------------------- DSNs
def test_unknown_scheme_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown store DSN 'mysql://db'.*chdb://, http://, https://"):
        open_store("mysql://db")
    with pytest.raises(ConfigError):
        open_store("/var/lib/fleethealth")


def test_chdb_dsn_needs_a_path() -> None:
    with pytest.raises(ConfigError, match="names no data path"):
        open_store("chdb://")


def test_a_registered_scheme_opens_through_its_factory(store: Store) -> None:
    opened: list[str] = []

    def factory(dsn: str) -> Store:
        opened.append(dsn)
        return open_store(store.dsn)  # the same chDB path shares the engine

    register_backend("FHTest", factory)
    try:
        assert "fhtest://" in known_schemes()
        with open_store("fhtest://anything") as other:
            assert other.query("SELECT 1 AS one").column("one") == [1]
        assert opened == ["fhtest://anything"]
    finally:
        backends._BACKENDS.pop("fhtest")
    with pytest.raises(ConfigError, match="unknown store DSN"):
        open_store("fhtest://anything")


def test_unreachable_server_is_a_store_error() -> None:
    from fleethealth.broker import free_port

    with pytest.raises(StoreError, match=r"cannot reach ClickHouse at http://127\.0\.0\.1"):
        open_store(f"http://127.0.0.1:{free_port()}/fleet")


# ---------------------------------------------------------------- one path per process, locks, CLI
def test_one_chdb_path_per_process(store: Store, tmp_path: Path, make_finding: Callable[..., Finding]) -> None:
    with pytest.raises(StoreError, match="one open data path per process"):
        open_store(f"chdb://{tmp_path}/other")
    with open_store(store.dsn) as same:  # the same path shares the engine
        same.insert_findings([make_finding()])
    assert len(store.findings()) == 1  # and closing the second store leaves the first usable


_HOLDER = """
import sys
from fleethealth.store import open_store
with open_store(sys.argv[1]) as store:
    store.migrate()
    store.insert_findings([])
    print("ready", flush=True)
    sys.stdin.read()
"""


def test_a_path_held_by_another_process_is_store_locked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "data" / "store"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, f"chdb://{path}"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(StoreLocked, match=f"chDB data path {path} is in use by another process"):
            open_store(f"chdb://{path}")
        assert main(["query", "SELECT 1", "--data", str(tmp_path / "data")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "in use by another process" in err[0]
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    with open_store(f"chdb://{path}") as store:  # released when the holder exits
        assert "findings" in store.query("SELECT name FROM system.tables WHERE database = currentDatabase()"
                                         ).column("name")




def test_the_embedded_engine_runs_with_bounded_caches_and_reports_its_memory(store: Store) -> None:
    """ClickHouse sizes its caches for a server of its own (5 GiB each for marks and primary
    indexes); in the detector's process they are bounded, and the engine says what it holds."""
    from fleethealth.store.backends import CHDB_SERVER_SETTINGS

    names = ", ".join(f"'{n}'" for n in CHDB_SERVER_SETTINGS)
    got = dict(store.query(f"SELECT name, value FROM system.server_settings WHERE name IN ({names})").rows)
    assert {n: int(v) for n, v in got.items()} == CHDB_SERVER_SETTINGS
    memory = store.engine_memory()
    assert {"tracked", "mark_cache", "pk_cache", "jemalloc_allocated", "jemalloc_resident",
            "active_parts"} <= set(memory)
    assert 0 < memory["jemalloc_allocated"] <= memory["jemalloc_resident"] + memory["jemalloc_metadata"]
    assert memory["active_parts"] >= 1  # the migrated tables' parts (schema_migrations at least)
