"""Fleet-scale rows generated in SQL, for the benchmarks (``bench/store_scale.py --fleet16k``,
``bench/node_throughput.py``): ``INSERT ... SELECT FROM numbers()`` writes hundreds of millions of rows
at the store's own speed, where generating them in Python would take hours. Not used by the service."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleethealth.store.protocol import StoreLike

__all__ = ["gpu_samples", "rank_steps", "active_parts", "gpu_samples_since"]

_LEAN = ("max_threads = 2, max_insert_threads = 1, min_insert_block_size_rows = 262144, "
         "max_memory_usage = 3000000000")
"""An insert of generated rows in blocks of a quarter million, under 3 GB (the machine is shared)."""


def _sql_rows(gpus: int, start: float, interval: float, first: int, count: int, gpus_per_node: int,
              nodes_per_rack: int) -> str:
    """``INSERT ... SELECT FROM numbers()`` of ``count`` time steps of ``gpus`` GPUs from step ``first``,
    in the stored columns (013), every field populated: rows in poll order (a time step of every GPU,
    then the next), per-node timestamps with 0-19 ms of jitter, temperatures on a per-GPU level and a
    slow sine with noise, power around a per-GPU level with noise, 1 % of samples clocked down with the
    power-cap reason, counters rising, energy accumulating the GPU's power."""
    g, k, nd = f"(number % {gpus})", f"intDiv(number, {gpus})", f"intDiv(number % {gpus}, {gpus_per_node})"
    hg = f"cityHash64({g})"
    t = f"({start} + {k} * {interval})"
    noise = lambda salt, m: f"(cityHash64({g}, {k}, {salt}) % {m})"  # noqa: E731
    capped = f"({noise(4, 100)} = 0)"
    cols = {
        "node": f"concat('n', leftPad(toString({nd}), 5, '0'))",
        "rack": f"concat('r', leftPad(toString(intDiv({nd}, {nodes_per_rack})), 3, '0'))",
        "gpu": f"toUInt16({g} % {gpus_per_node})",
        "ts": f"toDateTime64({t} + (cityHash64({nd}, {k}) % 20) / 1000, 3, 'UTC')",
        "model": "'NVIDIA H100 80GB HBM3'", "uuid": f"concat('GPU-', lower(hex({hg})))",
        "nic_util_pm": f"toUInt16(600 + cityHash64({nd}, {k}, 1) % 200)",
        "temp_dc": f"toInt16(550 + {hg} % 200 + round(50 * sin({t} / 900 + {hg} % 7)) + {noise(2, 6)})",
        "mem_temp_dc": f"toInt16(630 + {hg} % 200 + round(50 * sin({t} / 900 + {hg} % 7)) + {noise(7, 6)})",
        "power_dw": f"toUInt32(5500 + {hg} % 1300 + {noise(3, 500)})", "power_limit_w": "700",
        "sm_clock_mhz": f"if({capped}, 1755, 1980)", "sm_clock_max_mhz": "1980", "mem_clock_mhz": "2619",
        "clock_reasons": f"if({capped}, 4, 0)", "util_pct_i": f"toUInt8(90 + {noise(5, 11)})",
        "ecc_sbe_volatile": f"toFloat64({hg} % 100 + intDiv({k}, 997))", "ecc_dbe_volatile": "0",
        "ecc_sbe_aggregate": f"toFloat64({hg} % 1000 + intDiv({k}, 997))", "ecc_dbe_aggregate": "0",
        "retired_sbe": "0", "retired_dbe": "0", "retired_pending": "0", "remap_correctable": f"{hg} % 5",
        "remap_uncorrectable": "0", "remap_pending": "0", "remap_failure": "0", "nvlink_links_up": "18",
        "nvlink_links_max": "18", "nvlink_crc_flit": f"toFloat64(intDiv({k}, 101))",
        "nvlink_crc_data": f"toFloat64(intDiv({k}, 1009))", "nvlink_replay": f"toFloat64(intDiv({k}, 503))",
        "nvlink_recovery": "0", "pcie_replay": f"toFloat64(intDiv({k}, 2003))", "pcie_gen": "5",
        "pcie_gen_max": "5", "pcie_width": "16", "pcie_width_max": "16", "fb_used_mib": "70000",
        "fb_free_mib": "11559", "energy_j": f"toUInt64({hg} % 100000000 + {k} * {interval} * (550 + {hg} % 130))",
        "tensor_active_pm": f"toUInt16(550 + {noise(6, 100)})", "slowdown_temp_c": "87",
    }
    return (f"INSERT INTO gpu_samples ({', '.join(cols)}) SELECT {', '.join(cols.values())} "
            f"FROM numbers({first * gpus}, {count * gpus}) SETTINGS {_LEAN}")


def gpu_samples(store: StoreLike, gpus: int, start: float, seconds: float, interval: float, chunk_rows: int,
                gpus_per_node: int, nodes_per_rack: int) -> tuple[int, float]:
    """``gpus`` GPUs' samples every ``interval`` s for ``seconds`` from ``start``, generated in SQL in chunks
    of about ``chunk_rows`` rows: (rows inserted, wall seconds)."""
    steps = int(round(seconds / interval))
    # at most 8 minutes an insert: the minute view holds a group per GPU-minute of the insert
    per = max(1, min(chunk_rows // gpus, int(8 * 60 / interval)))
    t = time.perf_counter()
    for first in range(0, steps, per):
        store.command(_sql_rows(gpus, start, interval, first, min(per, steps - first), gpus_per_node, nodes_per_rack))
    return steps * gpus, time.perf_counter() - t


def rank_steps(store: StoreLike, job: str, ranks: int, first: int, steps: int, start: float, interval: float,
               gpus_per_node: int) -> None:
    """Steps ``first`` .. ``first + steps - 1`` of job ``job`` over ``ranks`` ranks, a step every ``interval`` s
    from ``start``, generated in SQL into ``rank_steps``: per-rank levels around 1.9-2.1 s with noise,
    per-node timestamps with 0-19 ms of jitter."""
    store.command(
        "INSERT INTO rank_steps (job, step, rank, node, gpu, ts, compute_s, rank_group) "
        f"SELECT {_quote(job)}, {first} + intDiv(number, {ranks}) AS s, number % {ranks} AS r, "
        f"concat('n', leftPad(toString(intDiv(r, {gpus_per_node})), 5, '0')), r % {gpus_per_node}, "
        f"toDateTime64({start} + s * {interval} + (cityHash64(intDiv(r, {gpus_per_node}), s) % 20) / 1000, "
        "3, 'UTC'), "
        "round(1.9 + (cityHash64(r) % 200) / 1000 + (cityHash64(r, s) % 40) / 1000, 6), -1 "
        f"FROM numbers({steps * ranks}) SETTINGS {_LEAN}")


def active_parts(store: StoreLike, table: str) -> int:
    """The number of active parts of ``table`` (how far merges have kept up)."""
    return int(store.query("SELECT count() FROM system.parts WHERE database = currentDatabase() "
                           "AND table = {t:String} AND active", {"t": table}).rows[0][0])


def gpu_samples_since(store: StoreLike, ts: float) -> int:
    """Rows of ``gpu_samples`` at or after event time ``ts``."""
    return int(store.query("SELECT count() FROM gpu_samples WHERE ts >= {t:Float64}", {"t": ts}).rows[0][0])


def _quote(text: str) -> str:
    if not text.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"job name {text!r}: letters, digits, '-' and '_' only")
    return f"'{text}'"
