"""Every package's public surface resolves, and importing a package stays light.

``import fleethealth`` (and the probe and in-job packages, which run on GPU nodes and inside
training processes) must not drag in chDB, torch, CuPy, FastAPI or scikit-learn.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = ["fleethealth", "fleethealth.schema", "fleethealth.bus", "fleethealth.detectors", "fleethealth.kernels",
            "fleethealth.sweeps", "fleethealth.injob", "fleethealth.injob.ckptcheck", "fleethealth.probe",
            "fleethealth.api", "fleethealth.adapters", "fleethealth.policy", "fleethealth.sim", "fleethealth.store",
            "fleethealth.commands", "fleethealth.report"]
HEAVY = ("chdb", "torch", "cupy", "fastapi", "sklearn")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__all__, f"{package} declares no public names"
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing


@pytest.mark.parametrize("package", ["fleethealth", "fleethealth.schema", "fleethealth.injob",
                                     "fleethealth.injob.ckptcheck.rules", "fleethealth.probe",
                                     "fleethealth.api", "fleethealth.detectors", "fleethealth.commands",
                                     "fleethealth.store"])
def test_importing_stays_light(package: str) -> None:
    code = f"import sys, {package}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "", f"importing {package} loaded {loaded}"


def test_every_package_folder_is_in_the_wheel() -> None:
    """pyproject.toml names its packages one by one, so a new package folder (a module that became a
    package) must be named there too, or the wheel the image installs goes without it."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join([name, *init.parent.relative_to(root / folder).parts])
             for name, folder in config["package-dir"].items() for init in (root / folder).rglob("__init__.py")}
    assert sorted(found - set(config["packages"])) == []
