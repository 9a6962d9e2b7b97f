"""Analyst SQL against an attacker: about 1,500 variants try to read a canary file and the server's token file.

Everything runs for real: the FastAPI app over a real chDB store, the gate parsing with
ClickHouse's own ``EXPLAIN AST``. A control proves the attack is live — the same store, asked
directly, does read the canary with ``file()`` — so a leak through the API would show. Variants:
quoting and casing of the function name, ASCII and Unicode whitespace and comments between the
name and its parenthesis, homoglyphs, nesting (WITH, subqueries, joins, arrays, lambdas, IN,
UNION), every table function this ClickHouse knows, dictionaries, system tables, SETTINGS,
FORMAT and INTO OUTFILE. None may return the secret.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

CANARY = "canary-7f3a9c-never-leave-the-server"
TOKEN = "write-token-7c1e-secret"
READ = "read-token-analyst"

NAMES = ["file", "FILE", "File", '"file"', "`file`"]
SPACES = ["", " ", "\t", "\n", "/* c */", "--c\n", "\u00a0", "\u1680", "\u2000", "\u2003", "\u2009", "\u200a",
          "\u200b", "\u200c", "\u200d", "\u2028", "\u2029", "\u202f", "\u205f", "\u2060", "\u3000", "\ufeff",
          "\u0085", "\u180e", "\u000b", "\u000c", " \u00a0 ", "\r"]
CONTEXTS = [
    "SELECT {f}",
    "SELECT ({f})",
    "SELECT [{f}][1]",
    "SELECT x FROM (SELECT {f} AS x)",
    "WITH ({f}) AS x SELECT x",
    "WITH t AS (SELECT {f} AS x) SELECT * FROM t",
    "SELECT arrayMap(y -> {f}, [1])",
    "SELECT 1 FROM findings WHERE node IN (SELECT {f})",
    "SELECT * FROM findings AS a JOIN (SELECT {f} AS x) AS b ON 1",
    "SELECT if(1, {f}, '')",
    "(SELECT {f})",
    "SELECT 1 UNION ALL SELECT {f}",
    "SELECT tuple({f}).1",
    "SELECT lower({f})",
    "SELECT * FROM findings WHERE {f} != ''",
    "SELECT {f} FROM findings ORDER BY 1 LIMIT 1",
]
HOMOGLYPHS = ["fil\u0435", "f\u0456le", "\uff46ile", "fi\u217ce", "\u0066ile"]  # Cyrillic e, i, fullwidth f …
OTHER = [
    "SELECT * FROM system.users", "SELECT * FROM system.settings", "SELECT * FROM system.processes",
    "SELECT * FROM system.query_log", "SELECT name FROM system.tables", "SELECT * FROM system.dictionaries",
    "SELECT * FROM `system`.`users`", "SELECT * FROM \"system\".\"settings\"",
    "SELECT * FROM information_schema.tables",
    "SELECT dictGet('d', 'a', 1)", "SELECT * FROM dictionary('d')", "SELECT joinGet('j', 'a', 1)",
    "SELECT getSetting('max_threads')", "SELECT hostName()", "SELECT currentUser()", "SELECT 1 SETTINGS readonly=0",
    "SELECT 1 FORMAT JSON", "SELECT 1 INTO OUTFILE '/tmp/fh-leak'",
    "SELECT * FROM findings FINAL SETTINGS max_threads=1",
    "SELECT x FROM findings WHERE x IN system.users", "SELECT * FROM merge('system', '.*')",
    "SELECT * FROM loop(system.users)", "SELECT * FROM view(SELECT * FROM system.users)",
    "SELECT $$a$$", "SELECT 1 # comment", "SELECT /* /* nested */ */ 1", "SELECT 1; SELECT 2",
    "SELECT * FROM fleethealth.findings", "SELECT * FROM default.findings", "SET readonly=0",
    "SHOW TABLES", "DESCRIBE findings", "EXPLAIN SELECT 1", "SELECT sleepEachRow(1) FROM findings",
    "SELECT filesystemAvailable()", "SELECT demangle('x')", "SELECT catboostEvaluate('m', 1)",
]


def _attacks(paths: list[str], table_functions: list[str]) -> Iterator[str]:
    for path in paths:
        arg = f"('{path}')"
        for name, space in itertools.product(NAMES, SPACES):
            yield CONTEXTS[0].format(f=f"{name}{space}{arg}")
            yield f"SELECT * FROM {name}{space}('{path}', 'LineAsString')"
        for name, context in itertools.product(NAMES, CONTEXTS[1:]):
            yield context.format(f=f"{name}{arg}")
        for space, context in itertools.product(SPACES[6:], CONTEXTS[1:6]):
            yield context.format(f=f"file{space}{arg}")
        for glyph in HOMOGLYPHS:
            yield f"SELECT {glyph}{arg}"
        for function in table_functions:
            yield f"SELECT * FROM {function}('{path}')"
            yield f"SELECT * FROM {function}('{path}', 'LineAsString', 'line String')"
            yield f"SELECT * FROM findings WHERE node IN (SELECT * FROM {function}('{path}'))"
    yield from OTHER


@pytest.fixture(scope="module")
def attack_store(tmp_path_factory) -> Iterator[tuple[object, list[str]]]:
    from fleethealth.store import open_store

    root = tmp_path_factory.mktemp("attack")
    canary = root / "canary.txt"
    canary.write_text(CANARY + "\n")
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    with open_store(f"chdb://{root}/store") as store:
        store.migrate()
        yield store, [str(canary), str(token_file)]


def test_the_attack_is_live_without_the_gate(attack_store):
    """Control: the store itself reads the canary through file(), so a leak through the API would show."""
    store, (canary, _) = attack_store
    rows = store.query(f"SELECT file('{canary}')").rows
    assert CANARY in str(rows)


def test_no_variant_reads_the_canary_or_the_token(attack_store):
    from fastapi.testclient import TestClient

    from fleethealth.api import create_app

    store, paths = attack_store
    functions = [row[0] for row in store.query("SELECT name FROM system.table_functions ORDER BY name").rows]
    assert len(functions) > 50
    attacks = list(dict.fromkeys(_attacks(paths, functions)))
    assert len(attacks) >= 1000, len(attacks)
    leaks, passed = [], []
    with TestClient(create_app(store, token=TOKEN, read_token=READ),
                    headers={"Authorization": f"Bearer {READ}"}) as client:
        for sql in attacks:
            response = client.post("/v1/query", json={"sql": sql})
            if CANARY in response.text or TOKEN in response.text:
                leaks.append(sql)
            elif response.status_code == 200:
                passed.append(sql)
        # the gate still serves ordinary analyst SQL
        ok = client.post("/v1/query", json={"sql": "SELECT kind, count() FROM findings GROUP BY kind"})
        assert ok.status_code == 200
    assert not leaks, f"{len(leaks)} variants leaked, e.g. {leaks[:5]!r}"
    # what got through at all is values(), which returns its arguments as literals: nothing was read
    assert all("FROM values(" in sql for sql in passed), [sql for sql in passed if "FROM values(" not in sql][:5]


def test_reads_need_the_read_scope(attack_store):
    from fastapi.testclient import TestClient

    from fleethealth.api import create_app

    store, _ = attack_store
    with TestClient(create_app(store, token=TOKEN, read_token=READ)) as client:
        body = {"sql": "SELECT count() FROM findings"}
        assert client.post("/v1/query", json=body).status_code == 401
        assert client.post("/v1/query", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert client.post("/v1/query", json=body, headers={"Authorization": f"Bearer {READ}"}).status_code == 200
        assert client.post("/v1/query", json=body, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        assert client.get("/v1/nodes").status_code == 401
        assert client.get("/healthz").status_code == 200  # the service probe stays open, and shows no data
    with TestClient(create_app(store, token=None)) as closed:
        assert closed.get("/v1/nodes", headers={"Authorization": "Bearer x"}).status_code == 403
