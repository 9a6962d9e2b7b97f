"""The import graph keeps the floors of ``docs/architecture.md``: imports point down, never in a circle.

Read from the source with :mod:`ast` (nothing is imported), every ``import`` counts, including the
ones inside functions and under ``if TYPE_CHECKING:`` — except that a ``TYPE_CHECKING`` import of a
contract (a module on floor 1) is allowed from anywhere, since a type annotation is not a runtime
dependency. Floors, top down:

5. ``fleethealth.commands`` (the CLI), ``fleethealth.demo``, ``fleethealth.__main__``
4. the wings: ``detectors``, ``probe``, ``api``, ``sweeps``, ``report`` — never importing each other
3. ``bus`` and ``store`` (the only modules that talk to Kafka and ClickHouse)
2. ``config``, ``broker``, ``sim``, ``policy``, ``adapters``
1. contracts (``schema``, ``payloads``, ``errors``, ``store.protocol`` …) and the two libraries that
   run on a GPU node without the service: ``injob`` and ``kernels``

Within one floor a unit may import only itself and the contracts, so ``injob`` and ``kernels`` (both
on floor 1) stay apart, and the wings stay apart.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

# unit -> floor; the unit of a module is the longest prefix listed here.
_FLOORS: dict[str, int] = {
    "fleethealth.commands": 5,
    "fleethealth.detectors": 4, "fleethealth.probe": 4, "fleethealth.api": 4, "fleethealth.sweeps": 4,
    "fleethealth.report": 4,
    "fleethealth.bus": 3, "fleethealth.store": 3,
    "fleethealth.config": 2, "fleethealth.broker": 2, "fleethealth.sim": 2, "fleethealth.policy": 2,
    "fleethealth.adapters": 2, "fleethealth.endpoints": 2,
    "fleethealth.injob": 1, "fleethealth.kernels": 1,
}
# The top floor is one unit: the commands and the demo harness they drive wire everything together.
_TOP = ("fleethealth.commands", "fleethealth.demo", "fleethealth.demo_injob", "fleethealth.demo_injob_worker",
        "fleethealth.__main__")
# Contracts: floor 1, importable by every unit (the hubs).
_CONTRACTS = ("fleethealth", "fleethealth.schema", "fleethealth.errors", "fleethealth.payloads",
              "fleethealth.wire", "fleethealth.lazy", "fleethealth.ids", "fleethealth.xid",
              "fleethealth.params", "fleethealth.nodename", "fleethealth.store.protocol", "fleethealth.evidence",
              "fleethealth.signing", "fleethealth.buildinfo",
              "fleethealth.scenarios", "fleethealth.migrations")


def _is_contract(module: str) -> bool:
    return any(module == c or (c != "fleethealth" and module.startswith(c + ".")) for c in _CONTRACTS)


def _unit(module: str) -> str:
    if _is_contract(module):
        return "contracts"
    if any(module == t or module.startswith(t + ".") or module.startswith(t + "_") for t in _TOP):
        return "fleethealth.commands"
    best = max((u for u in _FLOORS if module == u or module.startswith(u + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{module} has no floor: add it to docs/architecture.md and to _FLOORS")
    return best


def _floor(unit: str) -> int:
    return 1 if unit == "contracts" else _FLOORS[unit]


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def _edges(modules: dict[str, pathlib.Path]) -> dict[str, set[tuple[str, bool]]]:
    """module -> {(imported module, typing only)} for imports of project modules."""
    edges: dict[str, set[tuple[str, bool]]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            # the most specific project module each import names
            for name in names:
                if name in modules and name != module:
                    edges[module].add((name, node.lineno in typing_only))
                    break
    return edges


def test_every_module_has_a_floor(source_modules) -> None:
    for module in source_modules:
        _unit(module)


def test_imports_point_down(source_modules) -> None:
    wrong = []
    for module, targets in _edges(source_modules).items():
        here = _unit(module)
        for target, typing_only in targets:
            there = _unit(target)
            if there == here or there == "contracts":
                continue
            if typing_only and _is_contract(target):
                continue
            if _floor(there) >= _floor(here):
                wrong.append(f"{module} (floor {_floor(here)}) imports {target} (floor {_floor(there)})")
    assert not wrong, "imports that do not point down:\n" + "\n".join(sorted(wrong))


def test_streaming_side_never_imports_the_injob_library(source_modules) -> None:
    wrong = [f"{m} imports {t}" for m, ts in _edges(source_modules).items() for t, _ in ts
             if t.startswith("fleethealth.injob") and not m.startswith("fleethealth.injob")
             and _unit(m) in {"fleethealth.detectors", "fleethealth.policy", "fleethealth.sim", "fleethealth.store",
                              "fleethealth.bus", "fleethealth.api", "fleethealth.adapters", "contracts"}]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circle(source_modules) -> None:
    edges = {m: {t for t, typing_only in ts if not typing_only} for m, ts in _edges(source_modules).items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                circles.append(" -> ".join([*stack[stack.index(target):], target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(circles)


@pytest.mark.parametrize("floor", [1, 2, 3, 4, 5])
def test_each_floor_is_populated(floor: int, source_modules) -> None:
    """The table is not stale: every floor it names still holds a module."""
    units = {_unit(m) for m in source_modules}
    assert any(_floor(u) == floor for u in units)
