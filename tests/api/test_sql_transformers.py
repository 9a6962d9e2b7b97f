"""Column transformers against the real ``fleethealth serve --no-detect``: APPLY, REPLACE, EXCEPT.

``SELECT * APPLY(file) FROM (SELECT '/path' AS p)`` once passed the gate: ``EXPLAIN AST`` prints
``ColumnsApplyTransformer`` without the function it applies. The control shows each form is live
on this engine (embedded chDB reads absolute paths with ``file()``, and ``APPLY(file)`` reads them
too); then every variant goes to a real server process over HTTP, with the read token, and none
may return the canary or the server's write token. The server runs with ``--no-detect`` on a
store migrated beforehand, and refuses to start on one that was not (it checks, never migrates).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from fleethealth.api.client import server_running

CANARY = "canary-5d2b-transformers-never-leave"
TOKEN = "write-token-9a4e-transformer-secret"
READ = "read-token-transformer-analyst"

FUNCTIONS = ["file", "FILE", "File", "fIlE", "`file`", '"file"', "url", "URL", "sleep", "Sleep", "sleepEachRow",
             "x -> file(x)", "p -> FILE(p)", "x -> lower(file(x))", "(x) -> file(x)",
             "x -> arrayMap(y -> file(y), [x])[1]", "x -> if(1, file(x), '')", "x -> sleep(1)",
             "x -> url(x, 'LineAsString')", "lower", "toString"]
APPLIES = ["APPLY({f})", "apply({f})", "Apply({f})", "APPLY /* c */ ({f})", "APPLY\n({f})", "APPLY ( {f} )"]
BARE = ["APPLY {f}", "apply {f}"]
MATCHERS = ["*", "t.*", "COLUMNS('p')", "COLUMNS(p)", "t.COLUMNS('p')", "columns('^p$')", "* EXCEPT(q)",
            "* EXCEPT STRICT q", "* REPLACE(p AS p)"]
REPLACES = ["REPLACE({g}(p) AS p)", "replace({g}(p) AS p)", "REPLACE STRICT ({g}(p) AS p)",
            "REPLACE(arrayMap(x -> {g}(x), [p])[1] AS p)", "REPLACE(lower({g}(p)) AS p, 1 AS q)",
            "EXCEPT(q) REPLACE({g}(p) AS p)", "EXCEPT STRICT q REPLACE({g}(p) AS p)",
            "REPLACE((x -> {g}(x))(p) AS p)"]
REPLACED = ["file", "FILE", "`file`", "url", "sleep"]


def _wrap(select: str) -> Iterator[str]:
    yield select
    yield f"SELECT * FROM ({select})"
    yield f"WITH s AS ({select}) SELECT * FROM s"
    yield f"SELECT 1 AS p UNION ALL {select}"
    yield f"SELECT * FROM findings WHERE node IN ({select})"


def transformer_attacks(path: str) -> list[str]:
    source = f"(SELECT '{path}' AS p, 1 AS q) AS t"
    out: list[str] = []
    for matcher, function in itertools.product(MATCHERS, FUNCTIONS):
        out.append(f"SELECT {matcher} APPLY({function}) FROM {source}")
    for apply, function in itertools.product(APPLIES[1:], ["file", "`file`", "x -> file(x)", "sleep", "url"]):
        out.append(f"SELECT * {apply.format(f=function)} FROM {source}")
    for apply, function in itertools.product(BARE, FUNCTIONS[:11]):
        out.append(f"SELECT * {apply.format(f=function)} FROM {source}")
    for function in ("file", "x -> file(x)", "sleep"):
        out.extend(_wrap(f"SELECT * APPLY({function}) FROM {source}"))
    for replace, function in itertools.product(REPLACES, REPLACED):
        out.append(f"SELECT * {replace.format(g=function)} FROM {source}")
    for replace, matcher in itertools.product(REPLACES, ("t.*", "COLUMNS('p|q')")):
        out.append(f"SELECT {matcher} {replace.format(g='file')} FROM {source}")
    for replace in REPLACES[:2]:
        out.extend(_wrap(f"SELECT * {replace.format(g='file')} FROM {source}"))
    # transformers chained, and transformers in a nested select's list
    out += [f"SELECT * EXCEPT(q) REPLACE(file(p) AS p) APPLY(lower) FROM {source}",
            f"SELECT * APPLY(lower) APPLY(file) FROM {source}",
            f"SELECT * REPLACE(p AS p) APPLY(x -> file(x)) FROM {source}",
            f"SELECT (SELECT * APPLY(file) FROM {source})",
            f"SELECT arrayMap(x -> x, (SELECT groupArray(*) APPLY(file) FROM {source}))",
            f"SELECT * FROM (SELECT * APPLY(file) FROM (SELECT * APPLY(file) FROM {source}))"]
    return list(dict.fromkeys(out))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _migrate(dsn: str) -> None:
    code = f"from fleethealth.store import open_store\nwith open_store({dsn!r}) as s: s.migrate()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _serve(tmp_path, store_dsn: str, port: int, log_name: str = "serve.log") -> subprocess.Popen:
    log = (tmp_path / log_name).open("wb")
    env = {**os.environ, "FLEETHEALTH_API_TOKEN": "", "FLEETHEALTH_READ_TOKEN": ""}
    return subprocess.Popen([sys.executable, "-m", "fleethealth", "serve", "--no-detect", "--store", store_dsn,
                             "--port", str(port), "--token-file", str(tmp_path / "token"),
                             "--read-token-file", str(tmp_path / "read")],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, list[str], str]]:
    tmp_path = tmp_path_factory.mktemp("transformers")
    (tmp_path / "canary.txt").write_text(CANARY + "\n")
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "read").write_text(READ + "\n")
    store_dsn = f"chdb://{tmp_path}/store"
    _migrate(store_dsn)
    port = _free_port()
    proc = _serve(tmp_path, store_dsn, port)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while not server_running(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"fleethealth serve --no-detect did not come up: {(tmp_path / 'serve.log').read_text()}")
        time.sleep(0.2)
    try:
        yield url, [str(tmp_path / "canary.txt"), str(tmp_path / "token")], str(tmp_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _query(url: str, sql: str) -> tuple[int, str]:
    req = urllib.request.Request(f"{url}/v1/query", data=json.dumps({"sql": sql}).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {READ}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_transformer_attack_is_live_without_the_gate(tmp_path):
    """Control: embedded chDB, asked directly, reads an absolute path with file() and with APPLY(file)."""
    import chdb

    canary = tmp_path / "canary.txt"
    canary.write_text(CANARY + "\n")
    session = chdb.session.Session()
    try:
        assert CANARY in session.query(f"SELECT file('{canary}')", "CSV").bytes().decode()
        applied = session.query(f"SELECT * APPLY(file) FROM (SELECT '{canary}' AS p)", "CSV").bytes().decode()
        assert CANARY in applied
        replaced = session.query(f"SELECT * REPLACE(file(p) AS p) FROM (SELECT '{canary}' AS p)", "CSV")
        assert CANARY in replaced.bytes().decode()
    finally:
        session.close()


def test_no_transformer_variant_reads_the_canary_or_the_token(served):
    url, paths, _ = served
    attacks = [sql for path in paths for sql in transformer_attacks(path)]
    assert len(attacks) >= 600, len(attacks)
    leaks, answered = [], []
    for sql in attacks:
        status, text = _query(url, sql)
        if CANARY in text or TOKEN in text:
            leaks.append(sql)
        elif status != 400:
            answered.append((status, sql))
    assert not leaks, f"{len(leaks)} variants leaked, e.g. {leaks[:3]!r}"
    # every variant is refused by the gate before it runs (so APPLY(sleep) sleeps nowhere)
    assert not answered, f"{len(answered)} variants were not refused, e.g. {answered[:3]!r}"


def test_plain_transformers_still_serve_analysts(served):
    url, _, _ = served
    status, text = _query(url, "SELECT * EXCEPT(q) FROM (SELECT 1 AS p, 2 AS q)")
    assert status == 200 and json.loads(text)["rows"] == [[1]], text
    status, text = _query(url, "SELECT * REPLACE(p + 1 AS p) FROM (SELECT 1 AS p)")
    assert status == 200 and json.loads(text)["rows"] == [[2]], text
    status, text = _query(url, "SELECT * APPLY(toString) FROM (SELECT 1 AS p)")
    assert status == 400 and "APPLY" in text, text


def test_serve_no_detect_checks_the_schema_and_never_migrates(tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "read").write_text(READ + "\n")
    proc = _serve(tmp_path, f"chdb://{tmp_path}/empty", _free_port())
    try:
        assert proc.wait(timeout=90) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "serve.log").read_text()
    assert "pending migration(s): 001_core.sql" in log, log
    code = ("from fleethealth.store import open_store\n"
            f"with open_store('chdb://{tmp_path}/empty') as s:\n"
            "    print(s.query(\"SELECT count() FROM system.tables WHERE database = currentDatabase()\").rows)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[(0,)]", out.stdout  # nothing was created


@pytest.mark.parametrize("explain, why", [
    ("SelectWithUnionQuery (children 1)\n ExpressionList (children 1)\n  SelectQuery (children 1)\n"
     "   ExpressionList (children 1)\n    Asterisk (children 1)\n     ColumnsTransformerList (children 1)\n"
     "      ColumnsApplyTransformer\n", "APPLY"),
    ("SelectWithUnionQuery (children 1)\n ExpressionList (children 1)\n  SelectQuery (children 1)\n"
     "   ExpressionList (children 1)\n    Function (children 1)\n     ExpressionList\n", "does not show"),
    ("SelectWithUnionQuery (children 1)\n ExpressionList (children 1)\n  SelectQuery (children 1)\n"
     "   ExpressionList (children 1)\n    Asterisk file\n", "carries no name"),
    ("SelectWithUnionQuery (children 1)\n ExpressionList (children 1)\n  SelectQuery (children 1)\n"
     "   ExpressionList (children 1)\n    ColumnsFutureTransformer sleep\n", "not part of a plain SELECT"),
])
def test_what_the_parse_does_not_show_is_refused(explain, why):
    """Default-deny on the tree itself: a transformer whose function is not printed, a function line
    without a name, a name where none belongs, a node type the gate does not know."""
    from fleethealth.api.sqlast import AstRefused, check_ast, parse_explain

    with pytest.raises(AstRefused, match=why):
        check_ast(parse_explain(explain), tables=frozenset({"findings"}))
