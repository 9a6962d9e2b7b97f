"""Fixtures of the probe tests: the recorded NVML / DCGM answers under ``recordings/``.

These machines have no GPU and no DCGM host engine, so the NVML and DCGM adapters are tested
against recorded field values replayed through objects with the libraries' call surface
(:mod:`fleethealth.probe.recorded`); ``bench/gpu_nvml.py`` runs the NVML source on a real GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

RECORDINGS = Path(__file__).parent / "recordings"


@pytest.fixture
def recording() -> Callable[[str], Path]:
    """``recording("nvml_h100_faults.json")`` -> the path of a recording."""

    def path(name: str) -> Path:
        found = RECORDINGS / name
        if not found.is_file():
            raise FileNotFoundError(found)
        return found

    return path
