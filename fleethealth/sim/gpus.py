"""GPU models the simulator can play, and which memory-repair fields each one reports.

Real GPUs differ in what NVML and DCGM can tell about their memory repairs: Volta retires pages
(``nvmlDeviceGetRetiredPages``) and has no row remapper; Ampere, Hopper and later remap rows
(``nvmlDeviceGetRemappedRows``) and retire no pages, so NVML answers ``NOT_SUPPORTED`` for the
retired-page fields and DCGM leaves them blank. The simulator reports exactly what the model it
plays would: the columns a model does not have are NaN in every sample, whatever a fault does to
them, so the probe, the store and the detectors see what they would see on that hardware.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["GpuModel", "GPU_MODELS", "DEFAULT_GPU_MODEL", "RETIRED_PAGE_FIELDS", "ROW_REMAP_FIELDS"]

RETIRED_PAGE_FIELDS = ("retired_sbe", "retired_dbe", "retired_pending")
ROW_REMAP_FIELDS = ("remap_correctable", "remap_uncorrectable", "remap_pending", "remap_failure")


@dataclass(frozen=True)
class GpuModel:
    """``name`` as ``nvmlDeviceGetName`` answers it; ``retires_pages`` / ``remaps_rows`` whether
    the model reports retired pages / remapped rows."""

    name: str
    retires_pages: bool
    remaps_rows: bool

    @property
    def unsupported(self) -> tuple[str, ...]:
        """Telemetry columns this model does not report (NaN in every sample)."""
        return (() if self.retires_pages else RETIRED_PAGE_FIELDS) + (() if self.remaps_rows else ROW_REMAP_FIELDS)

    def mask(self, cols: dict[str, np.ndarray]) -> None:
        """Set the columns this model does not report to NaN, in place."""
        for name in self.unsupported:
            cols[name][...] = np.nan


GPU_MODELS: dict[str, GpuModel] = {
    "V100": GpuModel("Tesla V100-SXM2-32GB", retires_pages=True, remaps_rows=False),
    "A100": GpuModel("NVIDIA A100-SXM4-80GB", retires_pages=False, remaps_rows=True),
    "H100": GpuModel("NVIDIA H100 80GB HBM3", retires_pages=False, remaps_rows=True),
    "H200": GpuModel("NVIDIA H200", retires_pages=False, remaps_rows=True),
}
"""The models a scenario's ``fleet.gpu_model`` may name."""

DEFAULT_GPU_MODEL = "H100"
