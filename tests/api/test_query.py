"""``POST /v1/query``: analyst SQL on the real chDB store, one read-only SELECT or a clear 400.

Each refusal is checked twice: the response says why, and the store shows nothing was executed
(the table still exists, the row count is unchanged, no file was written). Every test here only
reads, so the module shares one seeded store (``shared_store``).
"""

from __future__ import annotations

import pytest

from fleethealth.api.sqlgate import QueryRefused, RefusalReason, check_select


@pytest.fixture
def client(shared_client):
    return shared_client


@pytest.fixture
def store_(shared_store):
    return shared_store


def _count(store, table: str = "recommendations") -> int:
    return store.query(f"SELECT count() FROM {table}").rows[0][0]


def test_select_returns_columns_and_rows(client):
    out = client.post("/v1/query", json={"sql": "SELECT action, node FROM recommendations FINAL "
                                                "WHERE node = 'n0001' ORDER BY ts_s"}).json()
    assert out["columns"] == ["action", "node"]
    assert out["rows"] == [["evict", "n0001"], ["quarantine", "n0001"]]
    assert out["row_count"] == 2 and out["truncated"] is False


def test_with_comments_strings_and_a_trailing_semicolon(client):
    sql = ("-- how many per action; a comment may hold a semicolon\n"
           "WITH 'x;DROP TABLE findings' AS s /* ; DELETE */ SELECT action, count() AS n, any(s) AS s2 "
           "FROM recommendations GROUP BY action ORDER BY action;  -- done\n")
    out = client.post("/v1/query", json={"sql": sql}).json()
    assert out["columns"] == ["action", "n", "s2"]
    assert [r[0] for r in out["rows"]] == ["alert_facilities", "evict", "quarantine"]
    assert out["rows"][0][2] == "x;DROP TABLE findings"


def test_rows_are_cut_at_the_server_limit(client):
    out = client.post("/v1/query", json={"sql": "SELECT number FROM numbers(100000)"}).json()
    assert out["row_count"] == 50 and out["truncated"] is True  # the app's max_rows
    out = client.post("/v1/query", json={"sql": "SELECT number FROM numbers(100)", "max_rows": 7}).json()
    assert out["rows"] == [[i] for i in range(7)] and out["truncated"] is True
    out = client.post("/v1/query", json={"sql": "SELECT number FROM numbers(100)", "max_rows": 10_000}).json()
    assert out["row_count"] == 50


def test_datetimes_and_nan_are_json(client):
    out = client.post("/v1/query", json={"sql": "SELECT toDateTime64(0, 3, 'UTC') AS t, nan AS x"}).json()
    assert out["rows"][0][0].startswith("1970-01-01T00:00:00") and out["rows"][0][1] is None


@pytest.mark.parametrize(("sql", "reason"), [
    ("SELECT 1; DROP TABLE recommendations", "only one statement"),
    ("SELECT 1;\n/* hidden */ DROP TABLE recommendations;", "only one statement"),
    ("SELECT 1; SELECT 2", "only one statement"),
    ("DROP TABLE recommendations", "only SELECT or WITH"),
    ("TRUNCATE TABLE recommendations", "only SELECT or WITH"),
    ("INSERT INTO recommendations (id) VALUES ('x')", "only SELECT or WITH"),
    ("ALTER TABLE recommendations DELETE WHERE 1", "only SELECT or WITH"),
    ("CREATE TABLE t (a Int8) ENGINE = Memory", "only SELECT or WITH"),
    ("WITH 1 AS a INSERT INTO recommendations (id) VALUES ('x')", "INSERT is not allowed"),
    ("SELECT * FROM recommendations INTO OUTFILE '/tmp/fh-leak.csv'", "OUTFILE is not allowed"),
    ("SELECT 1 SETTINGS readonly = 0", "SETTINGS is not allowed"),
    ("SELECT 1 FORMAT TSV", "FORMAT clause"),
    ("SELECT * FROM file('/etc/passwd', 'LineAsString')", "table function file()"),
    ("SELECT * FROM url('http://127.0.0.1:1/x', 'LineAsString')", "table function url()"),
    ("SELECT 'unterminated", "unterminated string"),
    ("SELECT 1 /* never closed", "unterminated comment"),
    ("SELEC 1", "only SELECT or WITH"),
    ("   ;  ", "no statement"),
])
def test_refused_before_anything_runs(client, store_, sql, reason):
    before = _count(store_)
    response = client.post("/v1/query", json={"sql": sql})
    assert response.status_code == 400, response.text
    assert reason in response.json()["detail"]
    assert _count(store_) == before
    assert store_.query("EXISTS TABLE recommendations").rows[0][0] == 1


def _refused(client, reason: str) -> float:
    prefix = f'fleethealth_api_query_refused_total{{reason="{reason}"}} '
    lines = [line for line in client.get("/metrics").text.splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_refusals_are_counted_in_metrics(client):
    multi, ddl = _refused(client, "multi_statement"), _refused(client, "not_select")
    client.post("/v1/query", json={"sql": "SELECT 1; DROP TABLE x"})
    client.post("/v1/query", json={"sql": "DROP TABLE x"})
    client.post("/v1/query", json={"sql": "DROP TABLE y"})
    assert _refused(client, "multi_statement") == multi + 1
    assert _refused(client, "not_select") == ddl + 2


def test_outfile_is_not_written(client, tmp_path):
    target = tmp_path / "leak.csv"
    response = client.post("/v1/query", json={"sql": f"SELECT 1 INTO OUTFILE '{target}'"})
    assert response.status_code == 400 and not target.exists()


def test_malformed_sql_and_runaway_queries_are_400(client):
    bad = client.post("/v1/query", json={"sql": "SELECT FROM WHERE"})
    assert bad.status_code == 400 and "could not parse" in bad.json()["detail"]
    unknown = client.post("/v1/query", json={"sql": "SELECT * FROM no_such_table"})
    assert unknown.status_code == 400
    slow = client.post("/v1/query", json={"sql": "SELECT count() FROM numbers(2000000000) "
                                                 "WHERE sipHash64(number) % 7 = 1"})  # the app allows 1 s
    assert slow.status_code == 400 and "imeout" in slow.json()["detail"]


def test_readonly_setting_is_the_second_line(store_):
    """Even text the gate let through cannot write: the store runs it with readonly=1."""
    from fleethealth.errors import StoreError

    with pytest.raises(StoreError, match="readonly"):
        store_.query("SELECT * FROM file('/etc/hostname', 'LineAsString')\nSETTINGS readonly=1")


@pytest.mark.parametrize("body", [{}, {"sql": ""}, {"sql": 5}, {"sql": "SELECT 1", "max_rows": 0},
                                  {"sql": "SELECT 1", "extra": True}])
def test_malformed_bodies_are_422(client, body):
    assert client.post("/v1/query", json=body).status_code == 422


def test_gate_keeps_a_single_statement_and_names_the_reason():
    assert check_select("SELECT 1;") == "SELECT 1\n"
    assert check_select("select `plain_name` from t -- trailing") == "select `plain_name` from t -- trailing\n"
    with pytest.raises(QueryRefused) as err:
        check_select("select `weird;name` from t")  # a quoted name must read the same to the gate and ClickHouse
    assert err.value.reason is RefusalReason.AMBIGUOUS
    assert check_select("(SELECT 1) UNION ALL (SELECT 2)").startswith("(SELECT 1)")
    assert check_select("SELECT format('{}', 1), replaceAll('a', 'a', 'b')")
    with pytest.raises(QueryRefused) as err:
        check_select("SELECT 1; SELECT 2")
    assert err.value.reason is RefusalReason.MULTI_STATEMENT and err.value.field == "sql"
    with pytest.raises(QueryRefused) as err:
        check_select("x" * 100_001)
    assert err.value.reason is RefusalReason.TOO_LONG


def test_readonly_does_not_stick_to_the_store(client, store_):
    """chDB keeps session settings; the query's readonly=1 must not leave the owner unable to write."""
    assert client.post("/v1/query", json={"sql": "SELECT 1"}).status_code == 200
    assert client.post("/v1/query", json={"sql": "SELECT * FROM file('/etc/hostname')"}).status_code == 400
    store_.command("CREATE TABLE IF NOT EXISTS after_query (a UInt8) ENGINE = Memory")
    store_.command("DROP TABLE after_query")


_HIDDEN_OUTFILE = [
    "SELECT $$'$$ AS a INTO OUTFILE '{target}' --'",
    "SELECT $tag$'$tag$ AS a INTO OUTFILE '{target}' --'",
    "SELECT /* /* */ ' */ 7 AS a INTO OUTFILE '{target}' --'",
    "SELECT /* a /*/ ' */ */ 7 AS a INTO OUTFILE '{target}' --'",
    "SELECT 7 AS a # '\nINTO OUTFILE '{target}' --'",
    "SELECT 7 AS a #!'\nINTO OUTFILE '{target}' --'",
    "SELECT 7 AS a\x00 INTO OUTFILE '{target}'",
]


@pytest.mark.parametrize("template", _HIDDEN_OUTFILE)
def test_text_clickhouse_would_read_differently_is_refused_and_writes_nothing(client, tmp_path, template):
    """Heredocs, nested comments and ``#`` comments hid ``INTO OUTFILE`` from the gate while
    ClickHouse ran it (chDB writes the file even with readonly=1). Each must be a 400, no file."""
    target = tmp_path / "leak.txt"
    before = _refused(client, "ambiguous")
    response = client.post("/v1/query", json={"sql": template.format(target=target)})
    assert response.status_code == 400, response.text
    assert not target.exists()
    assert _refused(client, "ambiguous") == before + 1


def test_dollar_and_hash_inside_strings_and_comments_still_run(client):
    sql = "SELECT '$$ # /* x' AS s, concat('#', '$') AS t -- $$ # /*\n/* $ # */"
    out = client.post("/v1/query", json={"sql": sql})
    assert out.status_code == 200, out.text
    assert out.json()["rows"] == [["$$ # /* x", "#$"]]
    with pytest.raises(QueryRefused) as err:
        check_select("SELECT /* outer /* inner */ still comment */ 1")
    assert err.value.reason is RefusalReason.AMBIGUOUS


def test_memory_read_and_result_bytes_are_bounded(shared_store):
    from fastapi.testclient import TestClient

    from fleethealth.api import create_app
    from fleethealth.api.app import QueryLimits

    with TestClient(create_app(shared_store, token=None, open_reads=True, max_rows=1_000_000,
                               limits=QueryLimits(max_memory_bytes=8 * 1024**2, max_read_bytes=10**9,
                                                  max_result_bytes=64 * 1024))) as tight:
        hungry = tight.post("/v1/query", json={"sql": "SELECT length(groupArray(number)) FROM numbers(5000000)"})
        assert hungry.status_code == 400 and "memory" in hungry.json()["detail"].lower()
        wide = tight.post("/v1/query", json={"sql": "SELECT number FROM numbers(200000)"}).json()
        assert 0 < wide["row_count"] < 200_000  # cut at the byte bound, not the row bound
    with TestClient(create_app(shared_store, token=None, open_reads=True,
                               limits=QueryLimits(max_read_bytes=100_000))) as scan:
        big = scan.post("/v1/query", json={"sql": "SELECT sum(number) FROM numbers(1000000)"})
        assert big.status_code == 400 and "bytes" in big.json()["detail"].lower()
        small = scan.post("/v1/query", json={"sql": "SELECT sum(number) FROM numbers(1000)"})
        assert small.status_code == 200 and small.json()["rows"] == [[499500]]
