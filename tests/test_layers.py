"""The import graph keeps the floors of ``docs/architecture.md``: imports point down, never in a circle.

The floors are read from the page's table ("Layers: who may import whom"), not copied here: each
path in backticks in a row is a unit of that row's floor (a folder ending in ``/`` a package with
everything in it, a ``.py`` one module; paths without ``fleethealth/`` are relative to it, and
``detectors/``, ``kernels/``, ``sweeps/`` are installed as ``fleethealth.detectors`` …). The top floor is
one unit, and the ``contracts`` row is floor 1, importable by every unit.

Read from the source with :mod:`ast` (nothing is imported), every ``import`` counts, including the
ones inside functions and under ``if TYPE_CHECKING:`` — except that a ``TYPE_CHECKING`` import of a
contract is allowed from anywhere, since a type annotation is not a runtime dependency. Within one
floor a unit may import only itself and the contracts, so ``injob`` and ``kernels`` (both on floor 1)
stay apart, and the wings stay apart.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

_PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
_SECTION = "## Layers: who may import whom"
_PATH = re.compile(r"`([A-Za-z_][\w/]*(?:/|\.py))`")
_TOP_FLOOR = 5


def _read_floors(page: str) -> tuple[dict[str, int], set[str], set[str]]:
    """The page's table as (unit -> floor, the units that are contracts, the units that are single
    modules); a unit is a module name (``fleethealth.store.protocol``) or a package (``fleethealth.bus``)."""
    if _SECTION not in page:
        raise AssertionError(f"{_PAGE} has no section {_SECTION!r}: test_layers reads its floors from it")
    section = page.split(_SECTION, 1)[1].split("\n## ", 1)[0]
    floors: dict[str, int] = {}
    contracts: set[str] = set()
    modules: set[str] = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|", 1)]
        if not line.startswith("|") or len(cells) != 2 or not (cells[0].isdigit() or cells[0] == "contracts"):
            continue
        floor = 1 if cells[0] == "contracts" else int(cells[0])
        for path in _PATH.findall(cells[1]):
            parts = path.removeprefix("fleethealth/").removesuffix("/").removesuffix(".py").split("/")
            unit = ".".join(["fleethealth", *(p for p in parts if p != "__init__")])
            floors[unit] = floor
            if path.endswith(".py"):
                modules.add(unit)
            if cells[0] == "contracts":
                contracts.add(unit)
    if sorted(set(floors.values())) != list(range(1, _TOP_FLOOR + 1)) or not contracts:
        raise AssertionError(f"the floor table of {_PAGE} should name floors 1 to {_TOP_FLOOR} and the contracts")
    return floors, contracts, modules


_FLOORS, _CONTRACT_UNITS, _MODULE_UNITS = _read_floors(_PAGE.read_text())


def _covering(module: str) -> str | None:
    """The most specific unit of the page that holds ``module``."""
    return max((u for u in _FLOORS if module == u or (u not in _MODULE_UNITS and module.startswith(u + "."))),
               key=len, default=None)


def _is_contract(module: str) -> bool:
    return _covering(module) in _CONTRACT_UNITS


def _unit(module: str) -> str:
    best = _covering(module)
    if best is None:
        raise AssertionError(f"{module} has no floor: add it to the floor table of docs/architecture.md")
    if best in _CONTRACT_UNITS:
        return "contracts"
    if _FLOORS[best] == _TOP_FLOOR:
        return "top"
    return best


def _floor(unit: str) -> int:
    if unit == "contracts":
        return 1
    return _TOP_FLOOR if unit == "top" else _FLOORS[unit]


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


def test_every_unit_the_page_names_exists(source_modules) -> None:
    """Each path of the floor table is a module or package of the source tree."""
    missing = sorted(u for u in _FLOORS if not any(m == u or m.startswith(u + ".") for m in source_modules))
    assert not missing, f"docs/architecture.md names units the source does not have: {missing}"


def test_the_table_is_read_as_written() -> None:
    """A few rows of the page, as this test reads them."""
    assert _unit("fleethealth.schema.telemetry") == "contracts" and _unit("fleethealth") == "contracts"
    assert _unit("fleethealth.store.protocol") == "contracts"
    assert _unit("fleethealth.store.queries") == _unit("fleethealth.store.queries.api") == "fleethealth.store"
    assert _unit("fleethealth.policy.rules.straggler") == _unit("fleethealth.policy.engine") == "fleethealth.policy"
    assert _unit("fleethealth.bus.consumer") == "fleethealth.bus" and _floor("fleethealth.bus") == 3
    assert _unit("fleethealth.demo_injob_worker") == _unit("fleethealth.commands.detect") == "top"
    assert _floor(_unit("fleethealth.kernels.gemm")) == 1 != _unit("fleethealth.kernels.gemm")
