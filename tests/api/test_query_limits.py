"""Analyst SQL cannot hurt the detector: limits that hold, on the real chDB store.

Each query here ran past its limit or grew the process before (``fleethealth/api/analyst.py``):
a cross join and a scan of generated rows are cut by the engine at the time and read limits; a
sort inside one function call (which the engine cannot interrupt: it ran 7 s against a 1 s limit
and took the process to 2.7 GB) is answered by the wall-clock guard, holds its slot until the
engine lets go of it (others get 429 with Retry-After), and does not hold up the owner's handle.
The assertions are on the answer's kind, never on how long it took.
"""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from fleethealth.api import create_app
from fleethealth.api.analyst import AnalystQueries, LimitReason, QueryFailed, QueryLimits, classify
from fleethealth.errors import StoreError
from fleethealth.store import open_store

UNSTOPPABLE = "SELECT length(arrayReverseSort(x -> cityHash64(x), range(10000000)))"
"""A constant expression that sorts 10M numbers by their hash: ClickHouse folds constants while it
analyses the statement, before the pipeline that checks the time limit starts, so it runs to the
end whatever the limit (about 1.1 s here against 0.1 s; with 30M elements and no lambda, 7 s
against 1 s)."""


@pytest.fixture
def handles(shared_store):
    """A second handle on the shared store for analyst queries (as ``fleethealth serve`` opens)."""
    with open_store(shared_store.dsn) as reader:
        yield shared_store, reader


def _app(owner, reader=None, **limits):
    return create_app(owner, token=None, open_reads=True, max_execution_s=limits.pop("max_execution_s", 1.0),
                      query_store=reader, limits=QueryLimits(**limits))


def _limited(client, reason: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'fleethealth_api_query_limited_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_idle(app, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while app.state.analyst.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.state.analyst.running == 0, "the engine never let go of the analyst query"


def test_a_cross_join_is_cut_at_the_time_limit(shared_store):
    with TestClient(_app(shared_store)) as client:
        out = client.post("/v1/query", json={"sql": "SELECT count() FROM numbers(100000) AS a "
                                                    "CROSS JOIN numbers(100000) AS b"})
        assert out.status_code == 400, out.text
        assert out.json()["reason"] == "timeout" and "Timeout exceeded" in out.json()["detail"]
        assert _limited(client, "timeout") == 1


def test_rows_read_are_bounded(shared_store):
    with TestClient(_app(shared_store, max_read_rows=1_000_000)) as client:
        big = client.post("/v1/query", json={"sql": "SELECT sum(number) FROM numbers(10000000)"})
        assert big.status_code == 400 and big.json()["reason"] == "read_limit", big.text
        assert "rows" in big.json()["detail"].lower()
        small = client.post("/v1/query", json={"sql": "SELECT sum(number) FROM numbers(1000)"})
        assert small.status_code == 200 and small.json()["rows"] == [[499500]]


def test_memory_is_bounded_and_a_big_group_by_spills_instead_of_failing(shared_store):
    with TestClient(_app(shared_store, max_memory_bytes=32 * 1024**2)) as client:
        hungry = client.post("/v1/query", json={"sql": "SELECT length(groupArray(number)) FROM numbers(20000000)"})
        assert hungry.status_code == 400 and hungry.json()["reason"] == "memory", hungry.text
        wide = client.post("/v1/query", json={"sql": "SELECT k, count() AS n FROM (SELECT number % 4000000 AS k "
                                                     "FROM numbers(4000000)) GROUP BY k ORDER BY k DESC LIMIT 1"})
        assert wide.status_code == 200, wide.text
        assert wide.json()["rows"] == [[3999999, 1]]


def test_the_guard_answers_on_time_holds_the_slot_and_spares_the_owner(handles):
    owner, reader = handles
    app = _app(owner, reader, max_execution_s=0.1, grace_s=0.2, queue_wait_s=0.0)
    with TestClient(app) as client:
        answers: list[object] = []
        first = threading.Thread(target=lambda: answers.append(client.post("/v1/query", json={"sql": UNSTOPPABLE})))
        first.start()
        deadline = time.monotonic() + 30
        while not app.state.analyst.running and time.monotonic() < deadline:
            time.sleep(0.005)
        assert app.state.analyst.running == 1
        # the engine is busy with the analyst query on its own handle: the owner's handle still answers
        assert owner.query("SELECT 1").rows == [(1,)]
        busy = client.post("/v1/query", json={"sql": "SELECT 1"})
        assert busy.status_code == 429 and busy.json()["reason"] == "busy", busy.text
        assert int(busy.headers["Retry-After"]) >= 1
        first.join(timeout=60)
        (late,) = answers
        assert late.status_code == 504 and late.json()["reason"] == "timeout", late.text
        assert "did not finish within 0.3 s" in late.json()["detail"]
        assert _limited(client, "timeout") == 1 and _limited(client, "busy") == 1
        _wait_idle(app)  # the slot comes back once the engine has finished (or cancelled) the sort
        again = client.post("/v1/query", json={"sql": "SELECT 1 AS one"})
        assert again.status_code == 200 and again.json()["rows"] == [[1]]
        assert "fleethealth_api_query_running 0.0" in client.get("/metrics").text


def test_the_guard_cancels_a_query_the_engine_could_only_stop_at_its_own_limit(handles):
    """A scan the engine would run for 20 s (its limit) is cancelled by the guard's KILL QUERY."""
    owner, reader = handles
    analyst = AnalystQueries(reader.query, owner.command, limits=QueryLimits(), max_execution_s=20.0,
                             answer_after_s=0.3)
    with pytest.raises(QueryFailed) as err:
        analyst.run("SELECT count() FROM numbers(2000000000) WHERE sipHash64(number) % 7 = 1", max_rows=10)
    assert err.value.status == 504 and err.value.reason is LimitReason.TIMEOUT
    deadline = time.monotonic() + 15.0  # far less than the scan needs: the kill stopped it
    while analyst.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert analyst.running == 0
    assert analyst.run("SELECT 2 AS two", max_rows=10).rows == [(2,)]


@pytest.mark.parametrize(("message", "reason"), [
    ("Code: 159. DB::Exception: Timeout exceeded: elapsed 1.0 s", LimitReason.TIMEOUT),
    ("Code: 394. DB::Exception: Query was cancelled. (QUERY_WAS_CANCELLED)", LimitReason.TIMEOUT),
    ("Code: 241. DB::Exception: Query memory limit exceeded", LimitReason.MEMORY),
    ("Code: 158. DB::Exception: Limit for rows (controlled by 'max_rows_to_read' setting) exceeded",
     LimitReason.READ_LIMIT),
    ("Code: 307. DB::Exception: Limit for (uncompressed) bytes to read exceeded", LimitReason.READ_LIMIT),
    ("Code: 47. DB::Exception: Unknown identifier", LimitReason.FAILED),
    ("no code at all", LimitReason.FAILED),
])
def test_store_errors_are_classified_by_their_code(message, reason):
    assert classify(StoreError(message)) is reason


def test_limits_refuse_nonsense():
    with pytest.raises(ValueError, match="positive"):
        QueryLimits(max_concurrent=0)
    with pytest.raises(ValueError, match="positive"):
        QueryLimits(grace_s=0)
    clause = QueryLimits(max_threads=1).settings(max_rows=5, max_execution_s=2.5)
    for setting in ("max_execution_time=2.5", "timeout_overflow_mode='throw'", "max_threads=1", "readonly=1",
                    "max_rows_to_read=", "max_bytes_before_external_group_by=", "max_result_rows=5"):
        assert setting in clause
