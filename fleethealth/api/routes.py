"""The routes: service (open), reads and writes (each behind its bearer token), over :mod:`fleethealth.api.views`.

Endpoints are plain ``def`` functions, so FastAPI runs them in its thread pool and a slow
store call never blocks the event loop. Path parameters are validated against the node and job
patterns (a malformed one is 422 before the store is asked); names that are well formed but
unknown are 404.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any

import orjson
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse, Response

from fleethealth.api import models, views
from fleethealth.api.analyst import QueryFailed
from fleethealth.api.sqlgate import QueryRefused
from fleethealth.errors import StoreError
from fleethealth.policy import persist
from fleethealth.policy import quarantine as qb
from fleethealth.schema import Action, EventKind, Guard

if TYPE_CHECKING:
    from fleethealth.store.protocol import StoreLike

__all__ = ["service_router", "read_router", "write_router"]

NodeName = Annotated[str, Path(pattern=models.NODE_PATTERN, description="node name, e.g. n0013")]
JobName = Annotated[str, Path(pattern=models.JOB_PATTERN, description="job id, e.g. train-1")]
RecId = Annotated[str, Path(pattern=r"^[0-9a-f]{8,64}$", description="recommendation id")]
_PROBLEMS = {404: {"model": models.Problem}, 422: {"description": "malformed parameter or body"}}
_WRITE_PROBLEMS = {**_PROBLEMS, 401: {"model": models.Problem, "description": "no bearer token"},
                   403: {"model": models.Problem, "description": "wrong token, or writes disabled"}}


def _store(request: Request) -> StoreLike:
    return request.app.state.store


def service_router() -> APIRouter:
    """``/healthz``: open, so a load balancer or kubelet probe needs no token; it reveals no data."""
    router = APIRouter()

    @router.get("/healthz", response_model=models.Health, tags=["service"])
    def healthz(request: Request) -> Any:
        try:
            _store(request).ping()
            state = "ok"
        except StoreError as exc:
            state = f"error: {exc}"
        from fleethealth import __version__

        return {"status": "ok" if state == "ok" else "degraded", "store": state, "version": __version__}

    return router


def read_router(dependencies: Sequence[Any] = ()) -> APIRouter:
    """Every read; ``dependencies`` carry the read-scope token check (none with ``--open-reads``)."""
    router = APIRouter(dependencies=list(dependencies))

    @router.get("/v1/recommendations", response_model=models.RecommendationList, tags=["recommendations"],
                responses=_PROBLEMS)
    def list_recommendations(
        request: Request,
        since: Annotated[float | None, Query(description="event time, epoch seconds (inclusive)")] = None,
        node: Annotated[str | None, Query(pattern=models.NODE_PATTERN)] = None,
        job: Annotated[str | None, Query(pattern=models.JOB_PATTERN)] = None,
        action: Action | None = None,
        guard: Guard | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    ) -> Any:
        items = views.recommendations(_store(request), since=since, node=node, job=job,
                                      action=None if action is None else action.value,
                                      guard=None if guard is None else guard.value, limit=limit)
        return {"count": len(items), "items": items}

    @router.get("/v1/nodes", response_model=models.NodeList, tags=["nodes"])
    def list_nodes(request: Request, limit: Annotated[int, Query(ge=1, le=100_000)] = 1000) -> Any:
        items = views.nodes(_store(request), limit=limit)
        return {"count": len(items), "items": items}

    @router.get("/v1/nodes/{node}", response_model=models.NodeDetail, tags=["nodes"], responses=_PROBLEMS)
    def get_node(request: Request, node: NodeName, limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> Any:
        return views.node_detail(_store(request), node, limit=limit)

    @router.get("/v1/runs/{job}/health", response_model=models.RunHealth, tags=["runs"], responses=_PROBLEMS)
    def run_health(request: Request, job: JobName) -> Any:
        return views.run_health(_store(request), job, interval=request.app.state.interval)

    @router.get("/v1/runs/{job}/timeline", tags=["runs"], responses=_PROBLEMS)
    def run_timeline(request: Request, job: JobName) -> dict[str, Any]:
        """Every interruption: cause, node, detector, lost steps, restart seconds, the four MTTR phases."""
        return views.run_timeline(_store(request), job)

    @router.get("/v1/quarantine", response_model=models.QuarantineList, tags=["quarantine"])
    def list_quarantine(request: Request) -> Any:
        items = [q.to_obj() for q in qb.quarantined(_store(request))]
        return {"count": len(items), "items": items}

    @router.get("/v1/breaker", response_model=models.BreakerOut, tags=["breaker"])
    def get_breaker(request: Request) -> Any:
        rec = persist.breaker_record(_store(request))
        return _breaker_obj(rec, engine=False)

    @router.post("/v1/query", response_model=models.QueryOut, tags=["query"],
                 responses={400: {"model": models.Problem, "description": "refused SQL, or a limit it ran into"},
                            429: {"model": models.Problem, "description": "analyst queries at their concurrency "
                                                                         "cap (see Retry-After)"},
                            504: {"model": models.Problem, "description": "not finished in time; cancelled"}})
    def query(request: Request, body: models.QueryIn) -> Response:
        """Analyst SQL: one SELECT (or WITH) statement, read-only, bounded in time, memory, rows read and
        returned, and concurrency (:mod:`fleethealth.api.analyst`)."""
        state = request.app.state
        try:
            statement = state.gate.check(body.sql)
        except QueryRefused as exc:
            state.metrics.query_refused.labels(exc.reason.value).inc()
            raise HTTPException(400, detail=exc.problem) from None
        limit = min(body.max_rows or state.max_rows, state.max_rows)
        start = time.perf_counter()
        try:
            result = state.analyst.run(statement, max_rows=limit)
        except QueryFailed as exc:
            state.metrics.query_limited.labels(exc.reason.value).inc()
            return JSONResponse({"detail": exc.detail, "reason": exc.reason.value}, status_code=exc.status,
                                headers=exc.headers())
        rows = result.rows[:limit]
        state.metrics.query_rows.inc(len(rows))
        out = {"columns": list(result.columns), "rows": [list(r) for r in rows], "row_count": len(rows),
               "truncated": len(result.rows) > limit, "elapsed_s": time.perf_counter() - start}
        return Response(orjson.dumps(out, default=_json_default, option=orjson.OPT_SERIALIZE_NUMPY
                                     | orjson.OPT_NON_STR_KEYS), media_type="application/json")

    return router


def write_router(require: Callable[..., str]) -> APIRouter:
    router = APIRouter(dependencies=[Depends(require)])

    @router.post("/v1/recommendations/{rec_id}/ack", response_model=models.AckOut, tags=["recommendations"],
                 responses=_WRITE_PROBLEMS)
    def ack(request: Request, rec_id: RecId, body: models.AckIn) -> Any:
        rec, fresh = views.ack(_store(request), rec_id, body.by, request.app.state.clock())
        if fresh:
            request.app.state.metrics.writes.labels("ack").inc()
        return {"acknowledged": fresh, "recommendation": rec}

    @router.post("/v1/quarantine/{node}/release", response_model=models.ReleaseOut, tags=["quarantine"],
                 responses={**_WRITE_PROBLEMS, 409: {"model": models.Problem,
                                                     "description": "no passing full self-test"}})
    def release(request: Request, node: NodeName, body: models.ReleaseIn) -> Any:
        store = _store(request)
        current = qb.record(store, node)
        if current is None:
            if not views.node_exists(store, node):
                raise views.NotFound(f"unknown node {node!r}")
            raise views.NotFound(f"node {node!r} is not in quarantine")
        evidence = _evidence(store, node, body, request.app.state.release_keys)
        if not qb.release(store, node, request.app.state.clock(), evidence):
            why = qb.check_release(node, current.since, evidence) or "release refused"
            raise HTTPException(409, detail=f"node {node} stays in quarantine: {why}")
        request.app.state.metrics.writes.labels("release").inc()
        return {"node": node, "released": True, "detail": f"released by {body.by}: passing full self-test"}

    @router.post("/v1/breaker/reset", response_model=models.BreakerOut, tags=["breaker"],
                 responses=_WRITE_PROBLEMS)
    def reset_breaker(request: Request, body: models.BreakerResetIn) -> Any:
        state = request.app.state
        by = body.by if not body.reason else f"{body.by}: {body.reason}"
        rec = persist.reset_breaker(_store(request), state.clock(), by)
        hook = state.on_breaker_reset
        if hook is not None:
            hook()
        state.metrics.writes.labels("breaker_reset").inc()
        return _breaker_obj(rec, engine=hook is not None)

    return router


def _breaker_obj(rec: persist.BreakerRecord | None, *, engine: bool) -> dict[str, Any]:
    if rec is None:
        return {"open": False, "tripped_ts": None, "reason": "", "reset_ts": None, "reset_by": None,
                "engine": engine}
    return {**rec.to_obj(), "reset_by": rec.reset_by or None, "engine": engine}


def _evidence(store: StoreLike, node: str, body: models.ReleaseIn, keys: Any = None) -> dict[str, Any]:
    """The stored self-test result ``body.event_id`` names, of ``node``: release evidence is never a record
    the caller supplies (issue 23 §3). What is stored came off ``fh.events`` through the detectors'
    signature check (with ``signing.mode = require``, signed by the node itself) or from the sweep."""
    if body.evidence is not None:
        raise HTTPException(422, detail="release evidence must name a stored self-test result by event_id; "
                                        "a record in the request body is not accepted")
    if body.event_id is None:
        raise HTTPException(422, detail="give event_id: the id of the node's stored passing full self-test")
    for event in store.events(kind=EventKind.SELFTEST.value, node=node):
        if event.id == body.event_id:
            if keys is not None:
                from fleethealth.signing import verify_record

                why = verify_record(keys, node, event.ts, event.kind.value, event.data)
                if why is not None:
                    raise HTTPException(409, detail=f"node {node} stays in quarantine: self-test {event.id} is not "
                                                    f"verified ({why}); signing.mode = require")
            return {"node": event.node, "ts": event.ts, "kind": event.kind.value, "data": event.data,
                    "event_id": event.id}
    raise views.NotFound(f"no selftest event {body.event_id!r} for node {node!r}")


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)
