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
            "fleethealth.sweeps", "fleethealth.injob", "fleethealth.probe", "fleethealth.api", "fleethealth.adapters",
            "fleethealth.policy", "fleethealth.sim", "fleethealth.store", "fleethealth.commands", "fleethealth.report"]
HEAVY = ("chdb", "torch", "cupy", "fastapi", "sklearn")


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__all__, f"{package} declares no public names"
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert not missing


@pytest.mark.parametrize("package", ["fleethealth", "fleethealth.schema", "fleethealth.injob", "fleethealth.probe",
                                     "fleethealth.api", "fleethealth.detectors", "fleethealth.commands",
                                     "fleethealth.store"])
def test_importing_stays_light(package: str) -> None:
    code = f"import sys, {package}; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "", f"importing {package} loaded {loaded}"
