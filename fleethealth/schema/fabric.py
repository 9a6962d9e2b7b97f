"""Each GPU's NVLink fabric registration (NVSwitch systems), carried in a telemetry sample as ``"fabric"``.

Sources, and what each value means:

- NVML ``nvmlDeviceGetGpuFabricInfoV`` (``nvmlGpuFabricInfoV_t``; the older
  ``nvmlDeviceGetGpuFabricInfo`` with ``nvmlGpuFabricInfo_t``), pynvml's bindings of the same names:
  ``state`` is ``nvmlGpuFabricState_t`` (``NVML_GPU_FABRIC_STATE_NOT_SUPPORTED`` 0, ``NOT_STARTED`` 1,
  ``IN_PROGRESS`` 2, ``COMPLETED`` 3), ``status`` the ``nvmlReturn_t`` of the registration (meaningful
  once ``COMPLETED``: ``NVML_SUCCESS`` 0, else the error), ``cliqueId``, ``clusterUuid`` (16 bytes), and
  in the V form ``healthMask``, whose bits 14-15 (``NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_GFM_STATE`` 14,
  width mask 3) say whether the fabric manager is connected (1) or disconnected (2).
- DCGM ``DCGM_FI_DEV_FABRIC_MANAGER_STATUS`` (170, ``dcgmFabricManagerStatus_t``: ``DcgmFMStatusNotSupported``
  0, ``NotStarted`` 1, ``InProgress`` 2, ``Success`` 3, ``Failure`` 4, ``Unrecognized`` 5, ``NvmlTooOld`` 6),
  ``DCGM_FI_DEV_FABRIC_MANAGER_ERROR_CODE`` (171, the ``dcgmReturn_t`` of a failed registration),
  ``DCGM_FI_DEV_FABRIC_CLUSTER_UUID`` (172) and ``DCGM_FI_DEV_FABRIC_CLIQUE_ID`` (173). DCGM derives
  the status from NVML's (``COMPLETED`` with an error status is ``Failure``): the probe maps it to the
  same ``state`` / ``status`` and keeps DCGM's own value in ``fm_status``.

(References: NVIDIA's ``nvml.h`` and ``dcgm_fields.h`` / ``dcgm_structs.h``; pynvml 13.x,
``c_nvmlGpuFabricInfoV_t``.) A GPU without NVSwitch answers NOT_SUPPORTED: the probe sends no
``fabric`` at all for a node none of whose GPUs has one, and the rule never fires there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fleethealth.errors import SchemaError
from fleethealth.schema.fields import _array, _jsonable

__all__ = ["Fabric", "FABRIC_STATES", "FM_STATUSES", "GFM_DISCONNECTED", "gfm_state"]

FABRIC_STATES: dict[int, str] = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
"""``nvmlGpuFabricState_t``; -1 on the wire: not read."""
FM_STATUSES: dict[int, str] = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "success", 4: "failure",
                               5: "unrecognized", 6: "nvml_too_old"}
"""``dcgmFabricManagerStatus_t``; -1 on the wire: not read (an NVML source)."""
GFM_SHIFT, GFM_MASK, GFM_DISCONNECTED = 14, 3, 2
"""``NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_GFM_STATE``, ``..._WIDTH_GFM_STATE``, ``..._GFM_STATE_DISCONNECTED``."""
_MAX_UUID = 64


def gfm_state(health_mask: np.ndarray) -> np.ndarray:
    """The fabric manager's state bits of each health mask (0 not supported, 1 connected, 2 disconnected)."""
    return (np.asarray(health_mask, dtype=np.int64) >> GFM_SHIFT) & GFM_MASK


@dataclass(frozen=True, eq=False)
class Fabric:
    """Fabric registration of each GPU of a sample, aligned with :attr:`Telemetry.gpu` (shape ``(g,)``).

    ``state`` (-1: not read), ``status`` (0 registered without error; -1 unknown), ``fm_status``
    (DCGM's Fabric Manager status, -1 from NVML), ``health_mask`` (NVML's, 0 unknown), ``since`` the
    event time the probe first read the GPU's current ``state`` (its first sample when it started in
    that state; NaN unknown), ``clique_id`` (-1 unknown), ``cluster_uuid`` (hex, ``""`` unknown).
    """

    state: np.ndarray
    status: np.ndarray
    fm_status: np.ndarray
    health_mask: np.ndarray
    since: np.ndarray
    clique_id: np.ndarray
    cluster_uuid: tuple[str, ...]

    INTS: ClassVar[dict[str, tuple[int, int]]] = {
        "state": (-1, 3), "status": (-(2**31), 2**32 - 1), "fm_status": (-1, 255),
        "health_mask": (0, 2**32 - 1), "clique_id": (-1, 2**32 - 1)}

    @classmethod
    def build(cls, n: int, **values: Any) -> Fabric:
        """``n`` GPUs, every value unknown unless given (arrays of length ``n``)."""
        unknown = set(values) - {*cls.INTS, "since", "cluster_uuid"}
        if unknown:
            raise SchemaError(f"fabric.{sorted(unknown)[0]}", "not a fabric field")
        ints = {name: np.asarray(values.get(name, np.full(n, 0 if name == "health_mask" else -1)),
                                 dtype=np.int64).reshape(n) for name in cls.INTS}
        since = np.asarray(values.get("since", np.full(n, np.nan)), dtype=np.float64).reshape(n)
        uuid = tuple(values.get("cluster_uuid", ("",) * n))
        if len(uuid) != n:
            raise SchemaError("fabric.cluster_uuid", f"expected {n} values, got {len(uuid)}")
        return cls(cluster_uuid=uuid, since=since, **ints)

    def to_obj(self) -> dict[str, Any]:
        return {**{name: getattr(self, name).tolist() for name in self.INTS}, "since": _jsonable(self.since),
                "cluster_uuid": list(self.cluster_uuid)}

    @classmethod
    def from_obj(cls, obj: Any, n: int, ts: float) -> Fabric:
        """Decode, default-deny: exactly the known keys, ``n`` values each, integers in their C types'
        ranges, ``since`` finite and not after the sample's ``ts``."""
        if not isinstance(obj, dict):
            raise SchemaError("fabric", f"expected an object, got {type(obj).__name__}")
        unknown = set(obj) - {*cls.INTS, "since", "cluster_uuid"}
        if unknown:
            raise SchemaError(f"fabric.{sorted(unknown)[0]}", "not a fabric field")
        ints = {}
        for name, (low, high) in cls.INTS.items():
            try:
                ints[name] = _array(obj, name, np.int64, length=n, minimum=low, maximum=high)
            except SchemaError as exc:
                raise SchemaError(f"fabric.{name}", exc.problem) from None
        try:
            since = _array(obj, "since", np.float64, length=n, nan_ok=True, minimum=0.0, maximum=ts)
        except SchemaError as exc:
            raise SchemaError("fabric.since", exc.problem) from None
        uuid = obj.get("cluster_uuid")
        if (not isinstance(uuid, list) or len(uuid) != n
                or not all(isinstance(u, str) and len(u) <= _MAX_UUID for u in uuid)):
            raise SchemaError("fabric.cluster_uuid", f"expected an array of {n} strings of at most {_MAX_UUID} "
                                                     "characters")
        return cls(cluster_uuid=tuple(uuid), since=since, **ints)

    def take(self, index: Sequence[int] | np.ndarray) -> Fabric:
        """The rows ``index`` (a subset of the GPUs)."""
        idx = np.asarray(index, dtype=np.int64)
        return Fabric(cluster_uuid=tuple(self.cluster_uuid[i] for i in idx.tolist()),
                      since=self.since[idx], **{name: getattr(self, name)[idx] for name in self.INTS})

    def describe(self, i: int) -> dict[str, Any]:
        """GPU row ``i`` as plain evidence values."""
        since = float(self.since[i])
        return {"state": FABRIC_STATES.get(int(self.state[i]), "unknown"), "status": int(self.status[i]),
                "fm_status": FM_STATUSES.get(int(self.fm_status[i]), "unknown"),
                "health_mask": int(self.health_mask[i]), "since": None if math.isnan(since) else since,
                "clique_id": int(self.clique_id[i]), "cluster_uuid": self.cluster_uuid[i]}
