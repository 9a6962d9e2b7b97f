"""The operators' named queries (:class:`~fleethealth.store.protocol.OpsStore`): self-test baselines
(``selftest`` events), and what the benches measure (the engine's memory, stored rank-steps, storage
accounting for ``bench/store_scale.py``)."""

from __future__ import annotations

import re
from typing import Any

from fleethealth.errors import ConfigError, StoreError
from fleethealth.store.queries.sql import QueriesBase

__all__ = ["OpsQueries"]

_ENGINE_METRICS = {"MemoryTracking": "tracked", "MarkCacheBytes": "mark_cache", "PrimaryIndexCacheBytes": "pk_cache",
                   "QueryConditionCacheBytes": "condition_cache", "UncompressedCacheBytes": "uncompressed_cache",
                   "CompiledExpressionCacheBytes": "compiled_cache", "QueryCacheBytes": "query_cache",
                   "MergesMutationsMemoryTracking": "merges"}
_JEMALLOC = re.compile(r"Allocated: (\d+), active: (\d+), metadata: (\d+).*?resident: (\d+), mapped: (\d+), "
                       r"retained: (\d+)")

_COLUMN_TYPE = re.compile(r"[A-Za-z0-9_]+(\(\d+\))?( CODEC\([A-Za-z0-9_(), ]+\))?")


class OpsQueries(QueriesBase):
    """What the self-tests and the benches read."""

    def engine_memory(self) -> dict[str, float]:
        """What the engine holds, bytes: its memory tracker and each cache (``system.metrics``),
        jemalloc's allocated, metadata, resident and retained bytes (where the engine reports them)
        and the active parts (a count) — to tell the engine's memory from its host process's."""
        names = ", ".join(f"'{m}'" for m in _ENGINE_METRICS)
        out = {_ENGINE_METRICS[m]: float(v) for m, v in
               self.query(f"SELECT metric, value FROM system.metrics WHERE metric IN ({names})").rows}
        try:
            stats = self.query("SELECT stats FROM system.jemalloc_stats").rows
        except StoreError:  # a server without the table
            stats = []
        match = _JEMALLOC.search(stats[0][0]) if stats else None
        if match:
            allocated, metadata, resident, retained = (float(match.group(i)) for i in (1, 3, 4, 6))
            out.update(jemalloc_allocated=allocated, jemalloc_metadata=metadata, jemalloc_resident=resident,
                       jemalloc_retained=retained)
        out["active_parts"] = float(self.query("SELECT count() FROM system.parts WHERE active").rows[0][0])
        return out

    def rank_step_count(self, job: str, *, first_step: int = 0) -> int:
        """Stored ``rank_steps`` rows of ``job`` at or after ``first_step`` (replays not collapsed)."""
        return int(self.query("SELECT count() FROM rank_steps WHERE job = {j:String} AND step >= {first:UInt64}",
                              {"j": job, "first": first_step}).rows[0][0])

    # ================================================================ self-test baselines
    def selftest_throughput_medians(self, *, since: float | None = None) -> list[tuple[str, str, str, float, int]]:
        """``(model, suite, test, median throughput, count)`` over the ``selftest`` events with verdict
        ``pass`` or ``slow`` and a positive throughput, at or after event time ``since``."""
        where = "" if since is None else " AND ts_s >= {since:Float64}"
        res = self.query(
            "SELECT JSONExtractString(data, 'model') AS model, JSONExtractString(data, 'suite') AS suite, "
            "JSONExtractString(data, 'test') AS test, median(JSONExtractFloat(data, 'throughput')) AS value, "
            "count() AS n FROM events FINAL WHERE kind = 'selftest' "
            "AND JSONExtractString(data, 'verdict') IN ('pass', 'slow') "
            f"AND JSONExtractFloat(data, 'throughput') > 0{where} GROUP BY model, suite, test",
            None if since is None else {"since": float(since)})
        return [(str(model), str(suite), str(test), float(value), int(n)) for model, suite, test, value, n in res.rows]

    # ================================================================ storage accounting (bench/store_scale.py)
    def optimize_final(self, table: str) -> None:
        """Merge every part of ``table`` (``OPTIMIZE TABLE ... FINAL``): what compression gives at rest."""
        self.command(f"OPTIMIZE TABLE {_table_name(table)} FINAL")

    def wide_parts(self, table: str) -> None:
        """Store ``table``'s new parts column by column however small (``min_bytes_for_wide_part = 0``),
        so :meth:`column_bytes` sizes every column: a small part is compact and has no per-column sizes."""
        self.command(f"ALTER TABLE {_table_name(table)} MODIFY SETTING min_bytes_for_wide_part = 0")

    def column_bytes_as(self, column_type: str, values: Any) -> int:
        """Compressed bytes of ``values`` stored, in the order given, as one column of ``column_type``
        (a type with its codec, e.g. ``Float32 CODEC(ZSTD(6))``): what another type would cost."""
        if not _COLUMN_TYPE.fullmatch(column_type):
            raise ConfigError(f"not a column type: {column_type!r}")
        self.command("DROP TABLE IF EXISTS what_if_column")
        self.command(f"CREATE TABLE what_if_column (v {column_type}) ENGINE = MergeTree ORDER BY tuple() "
                     "SETTINGS min_bytes_for_wide_part = 0")
        try:
            self.insert("what_if_column", {"v": values})
            self.optimize_final("what_if_column")
            return sum(compressed for compressed, _ in self.column_bytes("what_if_column").values())
        finally:
            self.command("DROP TABLE IF EXISTS what_if_column")

    def column_bytes(self, table: str) -> dict[str, tuple[int, int]]:
        """``column -> (compressed, uncompressed bytes)`` of ``table``'s active parts."""
        res = self.query("SELECT name, data_compressed_bytes, data_uncompressed_bytes FROM system.columns "
                         "WHERE database = currentDatabase() AND table = {t:String}", {"t": table})
        return {str(n): (int(c), int(u)) for n, c, u in res.rows}

    def table_rows(self, table: str) -> int:
        """Rows in ``table``'s active parts."""
        res = self.query("SELECT sum(rows) FROM system.parts WHERE database = currentDatabase() "
                         "AND table = {t:String} AND active", {"t": table})
        return int(res.rows[0][0] or 0) if res.rows else 0


def _table_name(table: str) -> str:
    if not table.replace("_", "a").isalnum() or not table[:1].isalpha():
        raise ConfigError(f"not a table name: {table!r}")
    return table
