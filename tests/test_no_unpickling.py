"""Nothing in fleethealth unpickles: no ``pickle.load(s)``, ``Unpickler``, ``joblib.load``, ``marshal``,
``dill`` / ``cloudpickle`` or ``numpy.load(allow_pickle=True)`` anywhere in the source tree, so no
bytes read from the bus or the store can become code. The one exception, named here: the failure
predictor's :func:`~fleethealth.detectors.predict.load_model` loads the model file at the path the
configuration gives (never a path from a message or a snapshot: ``test_snapshot.py`` checks that).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("fleethealth", "detectors", "kernels", "sweeps", "bench", "examples")
_MODULES = {"pickle", "_pickle", "cPickle", "joblib", "dill", "cloudpickle", "marshal", "shelve"}
_CALLS = {"load", "loads", "Unpickler", "_loads"}
ALLOWED = {("detectors/predict.py", "load_model", "joblib.load")}
"""(file, enclosing function, call): the predictor's configured model file."""


def _findings(path: Path, root: Path = ROOT) -> list[tuple[str, str, str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = str(path.relative_to(root))
    aliases: dict[str, str] = {}  # local name -> "module" or "module.name"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in _MODULES:
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _MODULES:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    out = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else where
            if isinstance(child, ast.Call):
                f = child.func
                called = None
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in aliases \
                        and f.attr in _CALLS:
                    called = f"{aliases[f.value.id]}.{f.attr}"
                elif isinstance(f, ast.Name) and f.id in aliases and aliases[f.id].rsplit(".", 1)[-1] in _CALLS:
                    called = aliases[f.id]
                elif isinstance(f, ast.Attribute) and f.attr == "load" and any(
                        k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                        for k in child.keywords):
                    called = "numpy.load(allow_pickle=...)"
                if called is not None:
                    out.append((rel, where, called, child.lineno))
            if isinstance(child, ast.Name) and child.id == "Unpickler" or \
                    isinstance(child, ast.Attribute) and child.attr == "Unpickler":
                out.append((rel, where, "Unpickler", child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return out


def test_nothing_unpickles_except_the_configured_model_file() -> None:
    found = [f for d in SOURCES if (ROOT / d).is_dir() for p in sorted((ROOT / d).rglob("*.py"))
             for f in _findings(p)]
    unexpected = [f for f in found if f[:3] not in ALLOWED]
    assert not unexpected, f"unpickling in the source tree (file, function, call, line): {unexpected}"
    assert {f[:3] for f in found} == ALLOWED, "the named exception moved: update ALLOWED with care"


def test_the_scan_sees_what_it_forbids(tmp_path) -> None:
    """The scan itself: each forbidden form in a file is found."""
    sample = tmp_path / "sample.py"
    text = ("import pickle\nimport joblib as jl\nfrom pickle import loads as l2\nimport numpy as np\n"
            "def f(b):\n    pickle.loads(b)\n    jl.load(b)\n    l2(b)\n    np.load(b, allow_pickle=True)\n"
            "    class U(pickle.Unpickler):\n        pass\n")
    sample.write_text(text)
    calls = {c for _, _, c, _ in _findings(sample, tmp_path)}
    assert calls == {"pickle.loads", "joblib.load", "numpy.load(allow_pickle=...)", "Unpickler"}
