"""One table from the probe's telemetry columns to DCGM field ids and dcgm-exporter metric names.

The DCGM source reads a column by its field id; the Prometheus endpoint exports it under the
same ``DCGM_FI_*`` name that dcgm-exporter uses, so existing Grafana dashboards keep working.
Field ids are those of ``dcgm_fields.py`` in DCGM 3.x/4.x (checked against the DCGM sources:
ECC 310–313, retired pages 390–392, row remap 393–396, PCIe max gen/width 235/236 and current
237/238, NVLink totals 409/419/429/439, clock-event reasons 112, Xid 230, recovery action 1523).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleethealth.schema import GPU_FIELDS

__all__ = ["FieldSpec", "FIELDS", "DCGM_XID_ERRORS", "DCGM_GPU_RECOVERY_ACTION", "RECOVERY_ACTIONS",
           "XID_METRIC", "by_column"]


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """A telemetry column (``column``, a key of :data:`schema.GPU_FIELDS`), its DCGM field id
    (``None`` where DCGM has no per-GPU field for it) and the Prometheus metric it is exported as."""

    column: str
    dcgm_id: int | None
    metric: str
    help: str


def _spec(column: str, dcgm_id: int | None, metric: str) -> FieldSpec:
    return FieldSpec(column, dcgm_id, metric, GPU_FIELDS[column])


FIELDS: tuple[FieldSpec, ...] = (
    _spec("temp_c", 150, "DCGM_FI_DEV_GPU_TEMP"),
    _spec("mem_temp_c", 140, "DCGM_FI_DEV_MEMORY_TEMP"),
    _spec("power_w", 155, "DCGM_FI_DEV_POWER_USAGE"),
    _spec("power_limit_w", 164, "DCGM_FI_DEV_ENFORCED_POWER_LIMIT"),
    _spec("sm_clock_mhz", 100, "DCGM_FI_DEV_SM_CLOCK"),
    _spec("sm_clock_max_mhz", 113, "DCGM_FI_DEV_MAX_SM_CLOCK"),
    _spec("mem_clock_mhz", 101, "DCGM_FI_DEV_MEM_CLOCK"),
    _spec("clock_reasons", 112, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"),
    _spec("util_pct", 203, "DCGM_FI_DEV_GPU_UTIL"),
    _spec("ecc_sbe_volatile", 310, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"),
    _spec("ecc_dbe_volatile", 311, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"),
    _spec("ecc_sbe_aggregate", 312, "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"),
    _spec("ecc_dbe_aggregate", 313, "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"),
    _spec("retired_sbe", 390, "DCGM_FI_DEV_RETIRED_SBE"),
    _spec("retired_dbe", 391, "DCGM_FI_DEV_RETIRED_DBE"),
    _spec("retired_pending", 392, "DCGM_FI_DEV_RETIRED_PENDING"),
    _spec("remap_uncorrectable", 393, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"),
    _spec("remap_correctable", 394, "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"),
    _spec("remap_failure", 395, "DCGM_FI_DEV_ROW_REMAP_FAILURE"),
    _spec("remap_pending", 396, "DCGM_FI_DEV_ROW_REMAP_PENDING"),
    _spec("nvlink_links_up", None, "fleethealth_gpu_nvlink_links_up"),
    _spec("nvlink_links_max", None, "fleethealth_gpu_nvlink_links_max"),
    _spec("nvlink_crc_flit", 409, "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"),
    _spec("nvlink_crc_data", 419, "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"),
    _spec("nvlink_replay", 429, "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"),
    _spec("nvlink_recovery", 439, "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"),
    _spec("pcie_replay", 202, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"),
    _spec("pcie_gen", 237, "DCGM_FI_DEV_PCIE_LINK_GEN"),
    _spec("pcie_gen_max", 235, "DCGM_FI_DEV_PCIE_MAX_LINK_GEN"),
    _spec("pcie_width", 238, "DCGM_FI_DEV_PCIE_LINK_WIDTH"),
    _spec("pcie_width_max", 236, "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH"),
)
"""Every column of :data:`schema.GPU_FIELDS`, each once."""

DCGM_XID_ERRORS = 230
"""``DCGM_FI_DEV_XID_ERRORS``: the value is the last Xid code."""
DCGM_GPU_RECOVERY_ACTION = 1523
"""``DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION`` (``nvmlDeviceGpuRecoveryAction_t``)."""
RECOVERY_ACTIONS: dict[int, str] = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p",
                                    4: "drain_and_reset"}
XID_METRIC = "fleethealth_gpu_xid_errors"
"""Counter of Xid errors per GPU and code (dcgm-exporter's Xid gauge never resets; this counts)."""


def by_column() -> dict[str, FieldSpec]:
    """The table keyed by column name."""
    return {spec.column: spec for spec in FIELDS}


if sorted(spec.column for spec in FIELDS) != sorted(GPU_FIELDS):  # a schema change must update this table
    raise ImportError("fleethealth.probe.fields is out of step with schema.GPU_FIELDS")
