"""The store client on real chDB: deduplicated inserts, read-only queries, errors translated to
StoreError, and ``fleethealth query``."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from fleethealth.commands import main
from fleethealth.errors import StoreError
from fleethealth.schema import Finding, StepBatch
from fleethealth.store import Store


# ---------------------------------------------------------------- deduplication
def test_dedup_token_stores_one_copy_of_three_identical_inserts(
        store: Store, make_batches: Callable[..., list[StepBatch]]) -> None:
    batches = make_batches(steps=4)
    for _ in range(3):
        store.insert_steps(batches, dedup_token="steps-0-3")
    assert store.query("SELECT count() FROM rank_steps").rows == [(4 * 3 * 8,)]
    store.insert_steps(batches, dedup_token="steps-0-3-again")  # a new token is a new insert ...
    assert store.query("SELECT count() FROM rank_steps").rows == [(2 * 4 * 3 * 8,)]
    # ... but the natural key (job, step, rank) still collapses it in FINAL / after a merge
    assert store.query("SELECT count() FROM rank_steps FINAL").rows == [(4 * 3 * 8,)]
    store.command("OPTIMIZE TABLE rank_steps FINAL")
    assert store.query("SELECT count() FROM rank_steps").rows == [(4 * 3 * 8,)]


# ---------------------------------------------------------------- errors
def test_readonly_query_refuses_writes(store: Store, make_finding: Callable[..., Finding]) -> None:
    store.insert_findings([make_finding()])
    with pytest.raises(StoreError, match="READONLY|readonly"):
        store.query("INSERT INTO findings (id, node) VALUES ('x', 'n9')", readonly=True)
    with pytest.raises(StoreError, match="READONLY|readonly"):
        store.query("DROP TABLE findings", readonly=True)
    assert store.query("SELECT count() FROM findings", readonly=True).rows == [(1,)]


def test_bad_inserts_and_queries_are_store_errors(store: Store) -> None:
    with pytest.raises(StoreError, match="unequal length"):
        store.insert("rank_steps", {"job": ["a", "b"], "step": [1]})
    with pytest.raises(StoreError, match="no column 'nonsense'"):
        store.insert("rank_steps", {"nonsense": [1]})
    with pytest.raises(StoreError, match="no table 'nowhere'"):
        store.insert("nowhere", {"a": [1]})
    with pytest.raises(StoreError, match="NaN"):
        store.insert("deadletter", {"ts": [math.nan], "topic": ["t"]})
    with pytest.raises(StoreError, match="query failed"):
        store.query("SELEC 1")
    assert store.insert("rank_steps", {"job": []}) == 0



# ---------------------------------------------------------------- fleethealth query
def test_cli_query_prints_a_table_or_json_and_is_read_only(
        store: Store, capsys: pytest.CaptureFixture, make_finding: Callable[..., Finding]) -> None:
    assert store.chdb_path is not None and store.chdb_path.endswith("/store")
    data = str(Path(store.chdb_path).parent)
    store.insert_findings([make_finding(), make_finding("n0021", 150)])
    assert main(["query", "SELECT node, step, z FROM findings ORDER BY node", "--data", data]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["node", "step", "z"] and out[2].split() == ["n0013", "199", "7.25"]
    assert main(["query", "SELECT node, diagnosis, ts FROM findings ORDER BY node", "--data", data, "--json"]) == 0
    rows = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["node"] for r in rows] == ["n0013", "n0021"] and rows[0]["diagnosis"] == "NODE_THERMAL"
    assert main(["query", "INSERT INTO findings (id, node) VALUES ('x', 'n9')", "--data", data]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "readonly" in err[0].lower()
    assert main(["query", "SELECT 1", "--data", str(Path(data) / "missing")]) == 2
    assert "no store at" in capsys.readouterr().err


def test_an_insert_leaves_nothing_for_the_cyclic_collector(store: Store, make_finding: Callable[..., Finding]) -> None:
    """The stream process collects cycles rarely (``tune_gc``), so an insert must free what it made by
    reference counting alone: clickhouse-connect's insert context held each insert's columns in a
    cycle, and 300 messages a second grew the detector by 15 MiB a minute until a full collection."""
    import gc

    from clickhouse_connect.driver.insert import InsertContext

    gc.collect()
    gc.disable()
    try:
        for i in range(50):
            store.insert_findings([make_finding(step=i)])
        left = sum(1 for o in gc.get_objects() if type(o) is InsertContext)
    finally:
        gc.enable()
    assert left == 0
    assert store.query("SELECT count() FROM findings FINAL").rows[0][0] == 50
