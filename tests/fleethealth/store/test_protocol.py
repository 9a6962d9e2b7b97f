"""The store's contract holds: :class:`Store` has every member of :class:`StoreLike` with the same
parameters, each member has one role and each package calls only its role's members, the protocol
module imports only the contract's floor, callers type against it, and no application SQL is written
outside ``fleethealth/store/`` (the analyst's own passes the gate)."""

from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

import pytest

from fleethealth.store import Store, StoreLike
from fleethealth.store import protocol as protocol_module
from fleethealth.store.protocol import ApiStore, DetectorStore, OpsStore, PolicyStore, StoreBase
from fleethealth.store.queries import (
    ApiQueries,
    DetectorQueries,
    NamedQueries,
    OpsQueries,
    PolicyQueries,
    ReportQueries,
)

ROOT = Path(__file__).resolve().parents[3]
CODE = [ROOT / d for d in ("fleethealth", "detectors", "kernels", "sweeps", "bench")]
SQL_HOME = ROOT / "fleethealth" / "store"
ANALYST_GATE = ROOT / "fleethealth" / "api" / "sqlgate.py"
_SQL = re.compile(r"^\(*\s*(SELECT|INSERT\s+INTO|ALTER\s+TABLE|OPTIMIZE\s+TABLE|CREATE\s+TABLE|DROP\s+TABLE|"
                  r"TRUNCATE|WITH\s+\w+\s+AS)\b", re.IGNORECASE)


ROLES = (StoreBase, DetectorStore, PolicyStore, ApiStore, OpsStore)
# package -> the roles whose members it may call on a store (the rest take the whole StoreLike)
# the policy's checkpoint interval (policy/interval.py advise, history) reads the stored history the API reads
ROLE_OF_PACKAGE = {"fleethealth/policy": (PolicyStore, ApiStore), "detectors": (StoreBase, DetectorStore),
                   "fleethealth/api": (StoreBase, ApiStore), "fleethealth/report": (ApiStore,), "kernels": (OpsStore,)}


def _own(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items()
            if callable(value) and (not name.startswith("_") or name in ("__enter__", "__exit__"))}


def _members() -> list[str]:
    return sorted(set().union(*(_own(c) for c in StoreLike.__mro__ if c in ROLES or c is StoreLike)))


def _sources() -> list[Path]:
    return sorted(p for d in CODE for p in d.rglob("*.py"))


def test_the_protocol_names_the_small_contract_and_the_named_queries() -> None:
    members = set(_members())
    assert {"query", "insert", "command", "migrate", "close", "__enter__", "__exit__"} <= members
    assert {"findings", "insert_findings", "quarantine_row", "breaker_row", "selftest_throughput_medians"} <= members


def test_each_member_has_one_role_and_store_like_is_every_role() -> None:
    owned = [name for role in ROLES for name in _own(role)]
    assert sorted(owned) == _members() and len(owned) == len(set(owned))
    assert not _own(StoreLike) and all(role in StoreLike.__mro__ for role in ROLES)


@pytest.mark.parametrize("package", sorted(ROLE_OF_PACKAGE))
def test_each_package_calls_only_its_roles_members(package: str) -> None:
    allowed = set().union(*(_own(role) for role in ROLE_OF_PACKAGE[package]))
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in _members() and node.attr not in allowed \
                    and "store" in ast.unparse(node.value).lower():
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, f"{package} calls store members outside its role (add them to its role in " \
                      f"fleethealth/store/protocol.py, or widen ROLE_OF_PACKAGE):\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", _members())
def test_store_has_each_protocol_member_with_the_same_parameters(name: str) -> None:
    def shape(fn: object) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert hasattr(Store, name), f"Store lacks {name}"
    assert shape(getattr(Store, name)) == shape(getattr(StoreLike, name))


# each query module's mixin -> the role it serves (the API's role is served by two modules)
ROLE_OF_QUERIES = {DetectorQueries: DetectorStore, PolicyQueries: PolicyStore, ApiQueries: ApiStore,
                   ReportQueries: ApiStore, OpsQueries: OpsStore}


def test_each_query_module_serves_one_role_and_together_every_named_query() -> None:
    served: dict[type, set[str]] = {}
    for mixin, role in ROLE_OF_QUERIES.items():
        mine = {name for name in _own(mixin) if not name.startswith("_")}
        outside = mine - _own(role)
        assert not outside, f"{mixin.__module__} holds {sorted(outside)}, not members of {role.__name__}"
        served.setdefault(role, set()).update(mine)
    for role in set(ROLE_OF_QUERIES.values()):
        assert served[role] == _own(role), f"{role.__name__} members without a query: {_own(role) - served[role]}"
    assert set(NamedQueries.__mro__) >= set(ROLE_OF_QUERIES) and Store.__mro__[1] is NamedQueries


def test_an_open_store_is_store_like(store: Store) -> None:
    assert isinstance(store, StoreLike)
    assert not isinstance(object(), StoreLike)


def test_the_protocol_module_imports_only_the_standard_library_schema_and_errors() -> None:
    tree = ast.parse(Path(protocol_module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    allowed = {"fleethealth.schema", "fleethealth.errors"}
    outside = {m for m in imported if m not in allowed and m.split(".")[0] not in sys.stdlib_module_names}
    assert imported & allowed and not outside


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value))
        elif isinstance(node, ast.JoinedStr):  # an f-string: its literal parts, placeholders as {}
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            out.append((node.lineno, text))
    return out


def test_no_application_sql_outside_the_store() -> None:
    found = []
    for path in _sources():
        if path.is_relative_to(SQL_HOME) or path == ANALYST_GATE:
            continue
        for line, text in _strings(ast.parse(path.read_text(), str(path))):
            if _SQL.match(text.strip()):
                found.append(f"{path.relative_to(ROOT)}:{line}: {text.strip()[:60]}")
    assert not found, "SQL belongs in fleethealth/store/queries/:\n" + "\n".join(found)


def test_the_sql_rule_sees_sql() -> None:
    code = 'q = "SELECT 1"\nr = f"  insert into {t} VALUES"\ns = "the statement, e.g. SELECT 1"'
    assert {line for line, text in _strings(ast.parse(code)) if _SQL.match(text.strip())} == {1, 2}


def test_callers_type_against_store_like_not_any() -> None:
    pattern = re.compile(r"\bstore: ['\"]?Any\b")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in _sources()
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found


@pytest.mark.parametrize("folder", ["fleethealth/policy", "kernels"])
def test_modules_below_the_store_name_it_only_for_type_checking(folder: str) -> None:
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for n in ast.walk(node)}
        for node in ast.walk(tree):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name == "fleethealth.store" or name.startswith("fleethealth.store."):
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    assert id(node) in guarded and name == "fleethealth.store.protocol", where
