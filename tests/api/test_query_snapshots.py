"""Analyst SQL never reads the detector snapshots: ``detector_snapshots`` is out of the gate's table
scope (it holds the detector replicas' own state), through the real ``POST /v1/query`` on chDB."""

from __future__ import annotations

import pytest

from fleethealth.api.sqlgate import NOT_ANALYST_TABLES, fleethealth_tables


@pytest.mark.parametrize("sql", [
    "SELECT * FROM detector_snapshots",
    "SELECT base64Encode(blob) FROM detector_snapshots FINAL",
    "SELECT count() FROM findings WHERE id IN (SELECT consumer_group FROM detector_snapshots)",
    "WITH s AS (SELECT blob FROM detector_snapshots) SELECT * FROM s",
])
def test_the_snapshot_table_is_refused_to_analyst_sql(shared_client, shared_store, sql) -> None:
    shared_store.save_snapshot("fh-detect-job", 0, 1, 1.0, {("fh.steps", 0): 1}, b"detector state")
    response = shared_client.post("/v1/query", json={"sql": sql})
    assert response.status_code == 400, response.text
    assert "detector_snapshots" in response.json()["detail"]
    assert "detector state" not in response.text
    control = shared_client.post("/v1/query", json={"sql": "SELECT count() FROM findings"})
    assert control.status_code == 200, control.text


def test_the_scope_is_every_migration_table_but_the_snapshots() -> None:
    tables = fleethealth_tables()
    assert "detector_snapshots" not in tables and NOT_ANALYST_TABLES == {"detector_snapshots"}
    assert {"findings", "recommendations", "events"} <= tables
