"""The payload module is the only meeting point of the in-job library and the streaming side.

Read from the source (static imports, including those inside functions): the payloads import only
the schema, the errors, the standard library and NumPy; nothing outside ``fleethealth/injob/``
imports the in-job library but a training job (the in-job demo's) and the checkpoint command (the
in-job library's checkpoint validation, run on the training side before a resume); and the in-job
modules import each other without a circle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_payloads_import_only_the_floor_below(source_modules) -> None:
    allowed = ("fleethealth.payloads", "fleethealth.schema", "fleethealth.errors", "numpy")
    for name, path in source_modules.items():
        if not name.startswith("fleethealth.payloads"):
            continue
        for imp in _imports(path):
            top = imp.split(".")[0]
            assert top in sys.stdlib_module_names or imp.startswith(allowed), f"{name} imports {imp}"


# training jobs are the in-job library's users, not part of the streaming side: like examples/, the
# in-job demo's training job imports the library (its launcher does not)
_TRAINING_JOBS = ("fleethealth.demo_injob_worker",)
# `fleethealth checkpoint validate` runs the in-job validation of fleethealth.injob.ckptcheck on a spare
# node before a resume: the training side's tool, never loaded by the streaming tier
_TRAINING_SIDE_COMMANDS = ("fleethealth.commands.checkpoint",)


def test_nothing_outside_the_injob_package_imports_it(source_modules) -> None:
    offenders = [(name, imp) for name, path in source_modules.items()
                 if not name.startswith("fleethealth.injob") and name not in _TRAINING_JOBS + _TRAINING_SIDE_COMMANDS
                 for imp in _imports(path) if imp == "fleethealth.injob" or imp.startswith("fleethealth.injob.")]
    assert offenders == []


def test_the_injob_modules_form_no_circle(source_modules) -> None:
    injob = {n: p for n, p in source_modules.items() if n.startswith("fleethealth.injob.")}
    graph = {n: {i for i in _imports(p) if i in injob and i != n} for n, p in injob.items()}
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        if node in path:
            raise AssertionError(f"import circle: {' -> '.join((*path[path.index(node):], node))}")
        if node in done:
            return
        for nxt in graph[node]:
            visit(nxt, (*path, node))
        done.add(node)

    for n in graph:
        visit(n, ())
