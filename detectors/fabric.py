"""The NVLink fabric rule's core: which GPUs of one sample are not (properly) on the NVSwitch fabric.

Pure and columnar: one sample's :class:`~fleethealth.schema.fabric.Fabric` rows in, the GPUs each
reason holds for out (:func:`fabric_faults`). :class:`fleethealth.detectors.health.HealthRules` turns
them into ``fabric`` findings with its episodes. Reasons, in the order they are reported:

``registration_failed``  the GPU's registration completed with an error status (NVML ``COMPLETED``
                         with ``status`` other than ``NVML_SUCCESS``; DCGM's ``DcgmFMStatusFailure``)
``fabric_manager_down``  NVML's health mask says the fabric manager is disconnected (GFM state 2)
``not_registered``       ``NOT_STARTED`` or ``IN_PROGRESS`` for longer than ``grace_s`` of event time
                         since the probe first read that state (a fabric manager that never started
                         or stopped before registering the GPU; boot-time training takes minutes)

A GPU without a fabric (NOT_SUPPORTED, a sample without ``fabric``) never holds. DCGM's
``Unrecognized`` and ``NvmlTooOld`` (a driver and DCGM that do not match) are not faults of the GPU:
no finding.
"""

from __future__ import annotations

import numpy as np

from fleethealth.schema import Telemetry
from fleethealth.schema.fabric import GFM_DISCONNECTED, gfm_state

__all__ = ["fabric_faults", "REASONS"]

_COMPLETED, _NOT_STARTED, _IN_PROGRESS = 3, 1, 2
_FM_FAILURE = 4
REASONS: tuple[str, ...] = ("registration_failed", "fabric_manager_down", "not_registered")


def fabric_faults(sample: Telemetry, grace_s: float) -> list[tuple[str, np.ndarray]]:
    """``(reason, row indices)`` for each reason that holds on some GPU of ``sample`` (rows of
    ``sample.gpu``); empty for a sample without fabric rows."""
    fabric = sample.fabric
    if fabric is None:
        return []
    state, status = fabric.state, fabric.status
    failed = ((state == _COMPLETED) & (status != 0) & (status != -1)) | (fabric.fm_status == _FM_FAILURE)
    down = (gfm_state(fabric.health_mask) == GFM_DISCONNECTED) & ~failed
    waiting = (state == _NOT_STARTED) | (state == _IN_PROGRESS)
    with np.errstate(invalid="ignore"):
        late = waiting & (sample.ts - fabric.since > grace_s) & ~failed & ~down  # NaN since: never late
    out = []
    for reason, hit in zip(REASONS, (failed, down, late), strict=True):
        rows = np.flatnonzero(hit)
        if rows.size:
            out.append((reason, rows))
    return out
