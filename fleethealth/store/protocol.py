"""The store's contract: :class:`StoreLike`, what every caller of the store types against, and its roles.

Detectors, the runner, the API, policy, sweeps and kernels take a store, never a concrete client.
:class:`StoreLike` is every role at once; a caller that needs one role names that role:

* :class:`StoreBase` — the small contract: ``query`` (-> :class:`QueryResult`), ``insert``
  (columnar), ``command``, ``migrate``, ``close``, and the context manager;
* :class:`DetectorStore` — the detector tier's: typed writers of the core tables (schema
  dataclasses in), the outbox, detector snapshots;
* :class:`PolicyStore` — the policy's: its state, eviction outcomes, the breaker, the quarantine book;
* :class:`ApiStore` — the HTTP API's and the report's: typed readers of the core tables (schema
  dataclasses out), node and run views, report views, the long-range analyst queries;
* :class:`OpsStore` — the self-tests' baselines, and what the benches read (engine memory, stored
  rank-steps, storage accounting).

The named queries' SQL lives in :mod:`fleethealth.store.queries` (one module a role) and nowhere
else; rows come back as ``dict`` keyed by column name where a caller turns them into its own
records. A role a caller uses is checked by ``tests/fleethealth/store/test_protocol.py`` (each
package calls only the members of its role, each query module serves one role).

This module imports only the standard library, :mod:`fleethealth.schema` and
:mod:`fleethealth.errors`, so modules below the store (policy, kernels) may name it under
``TYPE_CHECKING`` without an import pointing up a floor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

from fleethealth.errors import StoreError

if TYPE_CHECKING:
    import os

    from fleethealth.schema import Event, Finding, Recommendation, StepBatch, Telemetry

__all__ = ["QueryResult", "StoreLike", "StoreBase", "DetectorStore", "PolicyStore", "ApiStore", "OpsStore"]


@dataclass(frozen=True)
class QueryResult:
    """Rows of a query: ``columns`` names them, ``rows`` holds one tuple per row."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]

    def dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]

    def column(self, name: str) -> list[Any]:
        if not self.columns and not self.rows:
            return []  # chDB names no columns for an empty result
        try:
            i = self.columns.index(name)
        except ValueError:
            raise StoreError(f"no column {name!r} in the result (columns: {', '.join(self.columns)})") from None
        return [row[i] for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)


class StoreBase(Protocol):
    """The small contract every store has: SQL in, rows or columns out, migrations, closing."""

    dsn: str

    # ---------------------------------------------------------------- the small contract
    def query(self, sql: str, parameters: Mapping[str, Any] | None = None, *,
              readonly: bool = False) -> QueryResult:
        """Run a SELECT; ``readonly`` makes the server refuse anything that writes."""
        ...

    def command(self, sql: str, parameters: Mapping[str, Any] | None = None) -> None:
        """Run a statement that returns no rows (DDL, ALTER, OPTIMIZE, ...)."""
        ...

    def insert(self, table: str, columns: Mapping[str, Any], *, dedup_token: str | None = None) -> int:
        """Insert columns (name -> NumPy array or sequence, all of one length); return the row count."""
        ...

    def migrate(self, directory: str | os.PathLike[str] | None = None, **kwargs: Any) -> list[str]:
        """Apply the migrations not yet applied, under the store's migration lock; return their names
        (``kwargs``: :func:`fleethealth.store.migrator.migrate`'s ``owner``, ``lock_ttl_s``,
        ``break_lock``, ``hook``)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


class DetectorStore(Protocol):
    """What the detector tier writes and keeps: the core tables, the outbox, detector snapshots."""

    # ---------------------------------------------------------------- typed writers (core tables)
    def insert_telemetry(self, samples: Sequence[Telemetry], *, dedup_token: str | None = None) -> int: ...

    def insert_gpu_samples(self, columns: dict[str, Any], *, dedup_token: str | None = None) -> int: ...

    def insert_steps(self, batches: Sequence[StepBatch], *, dedup_token: str | None = None) -> int: ...

    def insert_events(self, events: Sequence[Event], *, dedup_token: str | None = None) -> int: ...

    def insert_findings(self, findings: Sequence[Finding], *, dedup_token: str | None = None) -> int: ...

    def insert_recommendations(self, recs: Sequence[Recommendation], *, dedup_token: str | None = None) -> int: ...

    # ---------------------------------------------------------------- named queries: the outbox
    def write_outbox(self, rows: Sequence[tuple[str, str, str, float, str]], *, published: bool,
                     dedup_token: str | None = None) -> int: ...

    def pending_outbox(self, *, limit: int = 10_000) -> list[tuple[str, str, str, float, str]]: ...

    # ---------------------------------------------------------------- named queries: detector snapshots
    def save_snapshot(self, group: str, partition: int, seq: int, ts: float,
                      offsets: Mapping[tuple[str, int], int], blob: bytes) -> None: ...

    def load_snapshot(self, group: str, partition: int) -> tuple[int, dict[tuple[str, int], int], bytes] | None: ...


class PolicyStore(Protocol):
    """What the policy keeps (``fleethealth/policy/``): its state, eviction outcomes, the breaker and the
    quarantine book."""

    # ---------------------------------------------------------------- named queries: policy state, outcomes, breaker
    def policy_state(self, key: str) -> str | None: ...

    def write_policy_state(self, key: str, ts: float, state: str) -> None: ...

    def insert_eviction_outcome(self, *, ts: float, node: str, job: str, diagnosis: str, finding_id: str,
                                resolved: bool) -> None: ...

    def eviction_outcome_rows(self) -> list[dict[str, Any]]: ...

    def breaker_row(self, name: str) -> dict[str, Any] | None: ...

    def write_breaker(self, name: str, *, open_: bool, tripped_ts: float | None, reason: str,
                      reset_ts: float | None, reset_by: str) -> None: ...

    # ---------------------------------------------------------------- named queries: quarantine book
    def quarantine_row(self, node: str) -> dict[str, Any] | None: ...

    def quarantined_rows(self) -> list[dict[str, Any]]: ...

    def write_quarantine_row(self, row: Mapping[str, Any]) -> None: ...

    def append_quarantine_log(self, node: str, ts: float, action: str, detail: str,
                              evidence: Mapping[str, Any]) -> None: ...

    def quarantine_log_rows(self, node: str) -> list[dict[str, Any]]: ...


class ApiStore(Protocol):
    """What the HTTP API and the report read (and the API's acknowledgements): the core tables as
    schema messages, node and run views, report views and the long-range analyst queries."""

    # ---------------------------------------------------------------- typed readers (core tables)
    def findings(self, *, kind: str | None = None, node: str | None = None, job: str | None = None,
                 since: float | None = None, until: float | None = None,
                 limit: int | None = None) -> list[Finding]: ...

    def recommendations(self, *, node: str | None = None, job: str | None = None, action: str | None = None,
                        since: float | None = None, until: float | None = None,
                        limit: int | None = None) -> list[Recommendation]: ...

    def events(self, kind: str | None = None, node: str | None = None, *, job: str | None = None,
               since: float | None = None, until: float | None = None, limit: int | None = None) -> list[Event]: ...

    def steps(self, job: str, *, first_step: int = 0, last_step: int | None = None,
              node: str | None = None) -> list[StepBatch]: ...

    def telemetry(self, *, node: str | None = None, since: float | None = None,
                  until: float | None = None) -> list[Telemetry]: ...

    # ---------------------------------------------------------------- named queries: nodes, runs, API views
    def ping(self) -> None: ...

    def explain_ast(self, statement: str) -> str: ...

    def node_exists(self, node: str) -> bool: ...

    def job_exists(self, job: str) -> bool: ...

    def job_nodes(self, job: str) -> set[str]: ...

    def recommendation_rows(self, *, since: float | None = None, node: str | None = None, job: str | None = None,
                            action: str | None = None, guard: str | None = None,
                            limit: int = 100) -> list[dict[str, Any]]: ...

    def recommendation_row(self, rec_id: str) -> dict[str, Any] | None: ...

    def write_recommendation_row(self, row: Mapping[str, Any]) -> None: ...

    def node_summaries(self, *, source: str = "latest") -> list[dict[str, Any]]: ...

    def finding_counts_by_node(self) -> dict[str, int]: ...

    def open_recommendations_by_node(self) -> dict[str, int]: ...

    def recent_events(self, *, node: str | None = None, job: str | None = None, kind: str | None = None,
                      limit: int = 10_000) -> list[Event]: ...

    def node_gpu_latest(self, node: str, *, source: str = "latest") -> list[dict[str, Any]]: ...

    def node_finding_rows(self, node: str, *, limit: int = 50) -> list[dict[str, Any]]: ...

    def job_step_times(self, job: str, *, limit: int, source: str = "rollup") -> list[tuple[Any, ...]]: ...

    def rank_median_compute(self, job: str, *, after_step: int) -> list[dict[str, Any]]: ...

    def sdc_check_counts(self, job: str) -> tuple[int, int]: ...

    # ---------------------------------------------------------------- named queries: report views
    def report_jobs(self) -> list[tuple[str, int]]: ...

    def report_job_span(self, job: str) -> tuple[int, int, float, float] | None: ...

    def report_rank_compute(self, job: str, *, step_bin: int = 1) -> list[tuple[int, str, int, float]]: ...

    def report_node_racks(self, nodes: Sequence[str]) -> dict[str, str]: ...

    def report_rack_temperature(self, nodes: Sequence[str], *, since: float, until: float,
                                bin_s: float) -> list[tuple[str, int, float, float, int]]: ...

    def breaker_history(self, name: str) -> list[dict[str, Any]]: ...

    # ---------------------------------------------------------------- named queries: long ranges (the rollups)
    def range_table(self, query: str, *, since: float, until: float, source: str = "auto") -> str: ...

    def rack_temperature(self, *, since: float, until: float,
                         source: str = "auto") -> list[tuple[str, float, float, float]]: ...

    def hot_gpus(self, *, since: float, until: float, limit: int = 20,
                 source: str = "auto") -> list[dict[str, Any]]: ...

    def gpu_minutes(self, node: str, gpu: int, *, since: float, until: float,
                    source: str = "auto") -> list[dict[str, Any]]: ...

    # ---------------------------------------------------------------- named queries: the checkpoint interval
    def job_spans(self, *, since: float, until: float) -> list[tuple[str, int, float, float]]: ...


class OpsStore(Protocol):
    """What the self-tests and the benches read: self-test baselines (``kernels/baseline.py``), the
    engine's memory and stored rank-steps (``bench/``), and the storage accounting."""

    # ---------------------------------------------------------------- named queries: self-test baselines
    def selftest_throughput_medians(self, *, since: float | None = None) -> list[tuple[str, str, str, float, int]]:
        ...

    # ---------------------------------------------------------------- named queries: what the benches measure
    def engine_memory(self) -> dict[str, float]: ...

    def rank_step_count(self, job: str, *, first_step: int = 0) -> int: ...

    # ---------------------------------------------------------------- named queries: storage accounting
    def optimize_final(self, table: str) -> None: ...

    def wide_parts(self, table: str) -> None: ...

    def column_bytes_as(self, column_type: str, values: Any) -> int: ...

    def column_bytes(self, table: str) -> dict[str, tuple[int, int]]: ...

    def table_rows(self, table: str) -> int: ...


@runtime_checkable
class StoreLike(StoreBase, DetectorStore, PolicyStore, ApiStore, OpsStore, Protocol):
    """An open store: every role at once. :class:`fleethealth.store.Store` is the implementation (chDB or a
    ClickHouse server); every failure is a :class:`~fleethealth.errors.StoreError`."""
