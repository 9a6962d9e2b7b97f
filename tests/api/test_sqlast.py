"""The AST gate's own rules: the function allow-list against this ClickHouse's catalogue, a misread
parse refused, and the shipped read-only ClickHouse user (a fixture of the server config: no server runs here)."""

from __future__ import annotations

import pathlib
import xml.etree.ElementTree as ET

import pytest

from fleethealth.api.sqlast import AstRefused, check_ast, function_allowed, parse_explain

_DANGEROUS_WORDS = ("file", "url", "dict", "join", "setting", "sleep", "host", "user", "server", "filesystem",
                    "macro", "remote", "s3", "hdfs", "azure", "mysql", "postgres", "executable", "address",
                    "demangle", "catboost", "zookeeper", "role", "profile", "query")


def test_no_function_that_reaches_outside_is_allowed(store):
    names = [row[0] for row in store.query("SELECT name FROM system.functions").rows]
    allowed = [n for n in names if function_allowed(n)]
    risky = [n for n in allowed if any(w in n.lower() for w in _DANGEROUS_WORDS)]
    # every allowed name with a risky word in it is a pure string, array or JSON function
    assert all(n.startswith(("to", "array", "JSONExtract", "splitBy", "simpleJSON", "groupConcat"))
               or n in {"hasToken", "hasTokenOrNull", "replaceRegexpOne"} for n in risky), risky
    for name in ("file", "FILE", "url", "dictGet", "dictGetOrNull", "joinGet", "getSetting", "sleep",
                 "sleepEachRow", "hostName", "currentUser", "filesystemAvailable", "demangle"):
        assert not function_allowed(name), name
    for name in ("count", "COUNT", "quantileIf", "sumState", "toStartOfMinute", "arrayMap", "multiIf", "if"):
        assert function_allowed(name), name
    assert len(allowed) > 300  # a useful analyst vocabulary, not a toy


def test_a_misread_parse_is_refused():
    text = "SelectWithUnionQuery (children 1)\n ExpressionList (children 2)\n  Literal UInt64_1\n"
    with pytest.raises(AstRefused, match="printed 2 children"):
        parse_explain(text)
    with pytest.raises(AstRefused, match="no parent"):
        parse_explain("SelectWithUnionQuery (children 1)\n   Literal UInt64_1\n")
    with pytest.raises(AstRefused, match="not part of a plain SELECT"):
        check_ast(parse_explain("SelectWithUnionQuery (children 1)\n Set\n"), tables=frozenset())


def test_shipped_readonly_user_grants_select_on_fleethealth_only():
    path = pathlib.Path(__file__).parents[2] / "deploy/clickhouse/access/fleethealth-api.xml"
    root = ET.parse(path).getroot()
    profile = root.find("profiles/fleethealth_api")
    assert profile.findtext("readonly") == "2" and profile.findtext("allow_introspection_functions") == "0"
    constraints = profile.find("constraints")
    for limit in ("max_execution_time", "max_memory_usage", "max_rows_to_read", "max_bytes_to_read",
                  "max_result_rows", "max_threads"):
        assert constraints.find(f"{limit}/max") is not None, limit
    assert constraints.find("max_concurrent_queries_for_user/const") is not None
    assert profile.findtext("timeout_overflow_mode") == "throw" and profile.findtext("read_overflow_mode") == "throw"
    from fleethealth.api.analyst import QueryLimits

    api = QueryLimits()  # what the API sends stays within what the server allows
    assert int(constraints.findtext("max_memory_usage/max")) == api.max_memory_bytes
    assert int(constraints.findtext("max_rows_to_read/max")) == api.max_read_rows
    assert int(constraints.findtext("max_bytes_to_read/max")) == api.max_read_bytes
    assert int(constraints.findtext("max_threads/max")) == api.max_threads
    user = root.find("users/fleethealth_api")
    assert user.findtext("profile") == "fleethealth_api" and user.findtext("access_management") == "0"
    grants = [q.text.strip() for q in user.findall("grants/query")]
    assert grants == ["GRANT SELECT ON fleethealth.*"]
