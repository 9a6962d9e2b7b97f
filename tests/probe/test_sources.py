"""The source registry, the stall guard's error path, the package surface, and DCGM's host-engine check."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fleethealth.probe as probe_pkg
from fleethealth.errors import ConfigError, DeviceError
from fleethealth.probe.dcgm import DcgmSource
from fleethealth.probe.sources import SOURCES, StallGuard, create_source, register_source


def test_exported_names_resolve() -> None:
    assert probe_pkg.__all__ == sorted(probe_pkg.__all__)
    for name in probe_pkg.__all__:
        assert getattr(probe_pkg, name).__name__ == name
    with pytest.raises(AttributeError):
        probe_pkg.NoSuchThing  # noqa: B018


def test_importing_the_probe_loads_no_gpu_library_or_simulator() -> None:
    code = ("import sys, fleethealth.probe, fleethealth.probe.daemon; "
            "print(sorted(m for m in ('pynvml', 'pydcgm', 'fleethealth.sim', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unknown_source_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="dcgm, none, nvml, sim"):
        create_source("ipmi", node="n0", rack="r0")
    with pytest.raises(ConfigError, match="package.module:Class"):
        register_source("x", "no-colon")
    assert set(SOURCES) >= {"dcgm", "nvml", "sim"}


class _Raising:
    name = "raising"

    def open(self) -> None:
        return None

    def sample(self, ts: float):
        raise OSError("ioctl failed")

    def close(self) -> None:
        return None


def test_a_raising_source_is_an_error_result_not_a_crash() -> None:
    guard = StallGuard(_Raising(), node="n0", timeout_s=1.0)
    try:
        for _ in range(3):
            result = guard.sample(1.0)
            assert result.sample is None and result.error == "OSError: ioctl failed"
        assert guard.errors_total == 3 and guard.stalls_total == 0
    finally:
        guard.close()
    with pytest.raises(ConfigError):
        StallGuard(_Raising(), node="n0", timeout_s=0)


_FAKE_READER = '''
class DcgmReader:
    """Behaves as the DCGM 4 DcgmReader does when nv-hostengine is not running: Init() logs
    "Can't connect to nv-hostengine" and leaves the handle unset instead of raising."""
    def __init__(self, **kwargs):
        self.m_dcgmHandle = None
    def Init(self, libpath=None):
        self.m_dcgmHandle = None
'''


def test_dcgm_without_a_host_engine_is_one_clear_line(tmp_path, monkeypatch) -> None:
    """Bindings present, host engine absent: a stand-in for the bindings' documented behaviour
    (this machine has no DCGM install)."""
    (tmp_path / "pydcgm.py").write_text("")
    (tmp_path / "dcgm_structs.py").write_text("class DCGMError(Exception):\n    pass\n"
                                              "def _dcgmInit(libDcgmPath=None):\n    pass\n")
    (tmp_path / "dcgm_fields.py").write_text("def DcgmFieldGetById(fid):\n    return object()\n")
    (tmp_path / "dcgm_agent.py").write_text("def dcgmVersionInfo():\n    raise RuntimeError('old library')\n")
    (tmp_path / "DcgmReader.py").write_text(_FAKE_READER)
    monkeypatch.setenv("DCGM_BINDINGS", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("pydcgm", "dcgm_structs", "dcgm_fields", "dcgm_agent", "DcgmReader"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(DeviceError) as info:
        DcgmSource("n0", "r0", hostname="localhost").open()
    text = str(info.value)
    assert "nv-hostengine" in text and "localhost:5555" in text and "--source nvml" in text and "\n" not in text
