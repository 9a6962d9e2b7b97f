"""One table from the probe's telemetry columns to DCGM field ids and Prometheus metric names.

Each column has two exported names. By default the probe serves its own,
``fleethealth_gpu_<name>_<unit>`` (counters end in ``_total``), so it can run on a node beside
dcgm-exporter without Prometheus holding two series per GPU under one name. In dcgm-exporter
compatibility mode (``--dcgm-exporter-compat``) it serves dcgm-exporter's ``DCGM_FI_*`` names with
dcgm-exporter's Prometheus types (those of its ``etc/default-counters.csv`` and
``etc/dcp-metrics-included.csv``: counters as counters, the rest gauges), for fleets that run the
probe instead of it.

Field ids are those of ``dcgm_fields.h`` in DCGM 3.3 to 4.6 (checked against the DCGM sources:
ECC 310–313, retired pages 390–392, row remap 393–396, PCIe max gen/width 235/236 and current
237/238, NVLink totals 409/419/429/439, clock-event reasons 112, framebuffer free/used 251/252,
energy 156, tensor activity 1004, Xid 230, recovery action 1523). DCGM 4.6 renamed many fields
(``DCGM_FI_DEV_GPU_TEMP`` became ``DCGM_FI_DEV_GPU_TEMP_CELSIUS``) but kept their ids;
dcgm-exporter keeps the older names, and so does the compatibility mode. ``since`` is the first
DCGM release that knows a field, where that is later than 3.3.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleethealth.schema import GPU_FIELDS

__all__ = ["FieldSpec", "FIELDS", "DCGM_XID_ERRORS", "DCGM_GPU_RECOVERY_ACTION", "RECOVERY_ACTIONS",
           "DCGM_FABRIC_FIELDS", "XID_METRIC", "DCGM_XID_METRIC", "FIELD_SINCE", "by_column"]


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """A telemetry column (``column``, a key of :data:`schema.GPU_FIELDS`), its DCGM field id
    (``None`` where DCGM has no per-GPU field for it), the probe's own metric name ``metric`` and
    ``scale`` (value × scale, to Prometheus base units), the dcgm-exporter name ``dcgm_metric``
    (``None`` where dcgm-exporter has none), whether the value is a ``counter`` under the probe's
    name, and the Prometheus type dcgm-exporter gives it (``dcgm_type``)."""

    column: str
    dcgm_id: int | None
    metric: str
    dcgm_metric: str | None
    counter: bool = False
    scale: float = 1.0
    dcgm_type: str = "gauge"

    @property
    def help(self) -> str:
        return GPU_FIELDS[self.column]


def _spec(column: str, dcgm_id: int | None, metric: str, dcgm_metric: str | None, *, counter: bool = False,
          scale: float = 1.0, dcgm_type: str | None = None) -> FieldSpec:
    if column not in GPU_FIELDS:
        raise ImportError(f"fleethealth.probe.fields: {column!r} is not a GPU telemetry field")
    if counter != metric.endswith("_total"):
        raise ImportError(f"fleethealth.probe.fields: {metric} must end in _total exactly when it is a counter")
    return FieldSpec(column, dcgm_id, metric, dcgm_metric, counter, scale,
                     dcgm_type or ("counter" if counter else "gauge"))


_G = "fleethealth_gpu_"
FIELDS: tuple[FieldSpec, ...] = (
    _spec("temp_c", 150, _G + "temperature_celsius", "DCGM_FI_DEV_GPU_TEMP"),
    _spec("mem_temp_c", 140, _G + "memory_temperature_celsius", "DCGM_FI_DEV_MEMORY_TEMP"),
    _spec("power_w", 155, _G + "power_watts", "DCGM_FI_DEV_POWER_USAGE"),
    _spec("power_limit_w", 164, _G + "power_limit_watts", "DCGM_FI_DEV_ENFORCED_POWER_LIMIT"),
    _spec("sm_clock_mhz", 100, _G + "sm_clock_hertz", "DCGM_FI_DEV_SM_CLOCK", scale=1e6),
    _spec("sm_clock_max_mhz", 113, _G + "sm_clock_max_hertz", "DCGM_FI_DEV_MAX_SM_CLOCK", scale=1e6),
    _spec("mem_clock_mhz", 101, _G + "memory_clock_hertz", "DCGM_FI_DEV_MEM_CLOCK", scale=1e6),
    _spec("clock_reasons", 112, _G + "clock_event_reasons", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"),
    _spec("util_pct", 203, _G + "utilization_ratio", "DCGM_FI_DEV_GPU_UTIL", scale=0.01),
    _spec("ecc_sbe_volatile", 310, _G + "ecc_corrected_volatile_total", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
          counter=True),
    _spec("ecc_dbe_volatile", 311, _G + "ecc_uncorrected_volatile_total", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
          counter=True),
    _spec("ecc_sbe_aggregate", 312, _G + "ecc_corrected_aggregate_total", "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
          counter=True),
    _spec("ecc_dbe_aggregate", 313, _G + "ecc_uncorrected_aggregate_total", "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
          counter=True),
    _spec("retired_sbe", 390, _G + "retired_pages_corrected_total", "DCGM_FI_DEV_RETIRED_SBE", counter=True),
    _spec("retired_dbe", 391, _G + "retired_pages_uncorrected_total", "DCGM_FI_DEV_RETIRED_DBE", counter=True),
    _spec("retired_pending", 392, _G + "retired_pages_pending", "DCGM_FI_DEV_RETIRED_PENDING", dcgm_type="counter"),
    _spec("remap_uncorrectable", 393, _G + "remapped_rows_uncorrectable_total",
          "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", counter=True),
    _spec("remap_correctable", 394, _G + "remapped_rows_correctable_total",
          "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", counter=True),
    _spec("remap_failure", 395, _G + "row_remap_failure", "DCGM_FI_DEV_ROW_REMAP_FAILURE"),
    _spec("remap_pending", 396, _G + "row_remap_pending", "DCGM_FI_DEV_ROW_REMAP_PENDING"),
    _spec("nvlink_links_up", None, _G + "nvlink_links_up", None),
    _spec("nvlink_links_max", None, _G + "nvlink_links_max", None),
    _spec("nvlink_crc_flit", 409, _G + "nvlink_crc_flit_errors_total", "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
          counter=True),
    _spec("nvlink_crc_data", 419, _G + "nvlink_crc_data_errors_total", "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
          counter=True),
    _spec("nvlink_replay", 429, _G + "nvlink_replay_errors_total", "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
          counter=True),
    _spec("nvlink_recovery", 439, _G + "nvlink_recovery_errors_total",
          "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", counter=True),
    _spec("pcie_replay", 202, _G + "pcie_replays_total", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", counter=True),
    _spec("pcie_gen", 237, _G + "pcie_link_gen", "DCGM_FI_DEV_PCIE_LINK_GEN"),
    _spec("pcie_gen_max", 235, _G + "pcie_link_gen_max", "DCGM_FI_DEV_PCIE_MAX_LINK_GEN"),
    _spec("pcie_width", 238, _G + "pcie_link_width", "DCGM_FI_DEV_PCIE_LINK_WIDTH"),
    _spec("pcie_width_max", 236, _G + "pcie_link_width_max", "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH"),
    _spec("fb_used_mib", 252, _G + "memory_used_bytes", "DCGM_FI_DEV_FB_USED", scale=float(1 << 20)),
    _spec("fb_free_mib", 251, _G + "memory_free_bytes", "DCGM_FI_DEV_FB_FREE", scale=float(1 << 20)),
    _spec("energy_mj", 156, _G + "energy_joules_total", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", counter=True,
          scale=1e-3),
    _spec("tensor_active", 1004, _G + "tensor_active_ratio", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"),
    _spec("slowdown_temp_c", 158, _G + "slowdown_temperature_celsius", "DCGM_FI_DEV_SLOWDOWN_TEMP"),
)
"""Every column of :data:`schema.GPU_FIELDS`, each once."""

DCGM_XID_ERRORS = 230
"""``DCGM_FI_DEV_XID_ERRORS``: the value is the last Xid code."""
DCGM_GPU_RECOVERY_ACTION = 1523
"""``DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION`` (``nvmlDeviceGpuRecoveryAction_t``), DCGM 4.5.0 and later."""
DCGM_FABRIC_FIELDS: dict[str, int] = {"fm_status": 170, "fm_error": 171, "cluster_uuid": 172, "clique_id": 173,
                                      "health_mask": 174}
"""NVSwitch fabric registration (``fleethealth.schema.fabric``): ``DCGM_FI_DEV_FABRIC_MANAGER_STATUS``
(``dcgmFabricManagerStatus_t``), ``..._FABRIC_MANAGER_ERROR_CODE`` (``..._FABRIC_MANAGER_ERROR`` in 4.6;
a ``dcgmReturn_t``), ``DCGM_FI_DEV_FABRIC_CLUSTER_UUID`` (a string), ``DCGM_FI_DEV_FABRIC_CLIQUE_ID``,
in ``dcgmlib/dcgm_fields.h`` from DCGM 4.0.0 on (not in 3.3.9); ``DCGM_FI_DEV_FABRIC_HEALTH_MASK`` (NVML's
health mask, read with NVML's ``NVML_GPU_FABRIC_HEALTH_TEST``) from 4.4.2 on (not in 4.4.1)."""
FIELD_SINCE: dict[int, tuple[int, int, int]] = {DCGM_GPU_RECOVERY_ACTION: (4, 5, 0),
                                                **dict.fromkeys(DCGM_FABRIC_FIELDS.values(), (4, 0, 0)),
                                                DCGM_FABRIC_FIELDS["health_mask"]: (4, 4, 2)}
"""First DCGM release that knows a field, for the fields newer than DCGM 3.3."""
RECOVERY_ACTIONS: dict[int, str] = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p",
                                    4: "drain_and_reset"}
XID_METRIC = "fleethealth_gpu_xid_errors"
"""Counter of Xid errors per GPU and code (dcgm-exporter's Xid gauge never resets; this counts)."""
DCGM_XID_METRIC = "DCGM_FI_DEV_XID_ERRORS"
"""dcgm-exporter's gauge: the last Xid code per GPU (0 before any), with ``err_code``/``err_msg``."""


def by_column() -> dict[str, FieldSpec]:
    """The table keyed by column name."""
    return {spec.column: spec for spec in FIELDS}


if sorted(spec.column for spec in FIELDS) != sorted(GPU_FIELDS):  # a schema change must update this table
    raise ImportError("fleethealth.probe.fields is out of step with schema.GPU_FIELDS")
