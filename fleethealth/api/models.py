"""Request and response bodies of the HTTP API (pydantic), as the published OpenAPI schema shows them.

Times are event time in epoch seconds. Nested objects the policy layer defines (goodput reports,
timelines, quarantine records, events) are passed through as their ``to_obj()`` form.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fleethealth.adapters.base import NODE_PATTERN

__all__ = [
    "NODE_PATTERN",
    "JOB_PATTERN",
    "Health",
    "RecommendationOut",
    "RecommendationList",
    "AckIn",
    "AckOut",
    "NodeSummary",
    "NodeList",
    "NodeDetail",
    "RunHealth",
    "QuarantineOut",
    "QuarantineList",
    "ReleaseIn",
    "ReleaseOut",
    "BreakerResetIn",
    "BreakerOut",
    "QueryIn",
    "QueryOut",
    "Problem",
]

JOB_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,127}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Problem(BaseModel):
    """An error: ``detail`` says what was wrong; ``reason`` names the rule for refused SQL."""

    detail: str
    reason: str | None = None


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    store: str
    version: str


class RecommendationOut(BaseModel):
    id: str
    action: str
    node: str
    job: str | None
    reason: str
    guard: str
    ts: float
    finding_id: str | None
    dry_run: bool
    evidence: dict[str, Any]
    acked_at: float | None = Field(description="when an operator acknowledged it (wall clock, epoch s)")
    acked_by: str | None


class RecommendationList(BaseModel):
    count: int
    items: list[RecommendationOut]


class AckIn(_Strict):
    by: str = Field(min_length=1, max_length=128, description="who acknowledges (user or system name)")


class AckOut(BaseModel):
    acknowledged: bool = Field(description="false when it had already been acknowledged (kept as it was)")
    recommendation: RecommendationOut


class NodeSummary(BaseModel):
    node: str
    rack: str | None
    gpus: int
    last_seen: float | None
    max_temp_c: float | None = Field(description="hottest GPU in each GPU's latest sample, °C")
    findings: int
    open_recommendations: int = Field(description="recommendations not yet acknowledged")
    quarantined: bool


class NodeList(BaseModel):
    count: int
    items: list[NodeSummary]


class NodeDetail(BaseModel):
    node: str
    rack: str | None
    gpus: list[dict[str, Any]]
    findings: list[dict[str, Any]]
    recommendations: list[RecommendationOut]
    events: list[dict[str, Any]]
    quarantine: dict[str, Any] | None
    quarantine_history: list[dict[str, Any]]


class CheckpointAdvice(BaseModel):
    """The checkpoint interval from measured inputs (seed 000 §3 ``interval: "auto"``, §6): seconds, and
    overheads as fractions of wall-clock (lower is better); ``basis`` states the window, the estimator
    and where each input came from (:mod:`fleethealth.policy.interval`)."""

    interval_s_now: float | None = Field(description="median spacing of the job's recent checkpoints; null "
                                                     "with fewer than two")
    interval_s_recommended: float = Field(description="Young's (or Daly's) interval for mtbf_s and c_s, clamped")
    mtbf_s: float = Field(description="the job's MTBF: pooled estimate, see basis.mtbf")
    c_s: float = Field(description="checkpoint cost: mean time a save blocked training")
    r_s: float = Field(description="restart cost: mean of the four measured MTTR phases")
    overhead_now: float | None
    overhead_at_optimum: float
    restart_term: float = Field(description="R/M: the part of the overhead no interval changes")
    at: float = Field(description="event time the window ends at, epoch seconds")
    basis: dict[str, Any]


class RunHealth(BaseModel):
    """Seed 000 §3 ``GET /runs/{id}/health``; the step time is the slowest rank's compute time."""

    job: str
    steps: int
    first_step: int | None
    last_step: int | None
    step_time_p50: float | None
    step_time_max: float | None
    slowest_rank: dict[str, Any] | None
    goodput: dict[str, Any] | None = Field(description="(1 − overhead) × ideal / actual step time, and its parts")
    ettr: float | None
    interruptions: list[dict[str, Any]]
    quarantined_nodes: list[dict[str, Any]]
    sdc_checks: dict[str, Any] = Field(description="last check, its status (pass | fail | none), counts")
    checkpoint: CheckpointAdvice | None = Field(default=None, description="the checkpoint interval from the "
                                                "measured failure rate, checkpoint and restart costs")


class QuarantineOut(BaseModel):
    node: str
    reason: str
    since: float
    runs_affected: list[str]
    finding_id: str | None
    summary: str


class QuarantineList(BaseModel):
    count: int
    items: list[QuarantineOut]


class ReleaseIn(_Strict):
    """The evidence for a release: the event id of the node's stored passing full self-test. A record in
    the body (``evidence``) is refused with 422: release evidence is never what the caller supplies."""

    evidence: dict[str, Any] | None = Field(default=None, description="refused (422): name a stored result by event_id")
    event_id: str | None = Field(default=None, max_length=64, description="id of a selftest event in the store")
    by: str = Field(default="api", min_length=1, max_length=128)


class ReleaseOut(BaseModel):
    node: str
    released: bool
    detail: str


class BreakerResetIn(_Strict):
    by: str = Field(min_length=1, max_length=128)
    reason: str = Field(default="", max_length=1000)


class BreakerOut(BaseModel):
    open: bool
    tripped_ts: float | None
    reason: str
    reset_ts: float | None
    reset_by: str | None
    engine: bool = Field(description="true when a policy engine in this process was reset too")


class QueryIn(_Strict):
    sql: str = Field(min_length=1, max_length=100_000, description="one SELECT or WITH statement")
    max_rows: int | None = Field(default=None, ge=1, description="at most the server's limit")


class QueryOut(BaseModel):
    columns: list[str]
    rows: list[list[Any]]
    row_count: int
    truncated: bool = Field(description="true when the result was cut at max_rows")
    elapsed_s: float
