"""The FastAPI application: ``create_app(store, token=..., read_token=...)`` builds it around one open store.

Two scopes, each a bearer token (``Authorization: Bearer <token>``): the **read** scope (every
``GET`` but ``/healthz`` and ``/metrics``, and analyst SQL) takes the read token or the write
token; the **write** scope (acknowledge, release, breaker reset, config reload) only the write token. No token
gives 401 (with ``WWW-Authenticate: Bearer``), a wrong one 403; a server started without a write
token refuses writes with 403, and one started without a read token refuses reads with 403
unless it was started with ``open_reads=True`` (``fleethealth serve --open-reads``), which logs a
warning: anyone who reaches the port then reads the store. Tokens are compared in constant time.
Errors are ``{"detail": ...}`` objects: 404 for unknown nodes, jobs and
recommendations, 422 for malformed parameters or bodies, 400 for refused SQL (with ``reason``),
409 for a release without a passing full self-test, 503 when the store fails; analyst SQL that
runs into a limit is 400 (with ``reason``: timeout, memory, read_limit), 429 with ``Retry-After``
when the analyst queries are at their concurrency cap, 504 when the wall-clock guard answered first
(:mod:`fleethealth.api.analyst`).

``/metrics`` serves the app's own Prometheus registry (``fleethealth_api_*``); a registry can be
passed in, so two apps in one process (or one test) never share counters.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fleethealth import __version__, buildinfo
from fleethealth.api import config_routes, routes
from fleethealth.api.analyst import AnalystQueries, QueryLimits
from fleethealth.api.sqlgate import SqlGate
from fleethealth.api.views import NotFound
from fleethealth.errors import StoreError
from fleethealth.policy.interval import IntervalEstimator

if TYPE_CHECKING:
    from fleethealth.store.protocol import StoreLike

__all__ = ["create_app", "ApiMetrics", "DEFAULT_MAX_ROWS", "DEFAULT_MAX_EXECUTION_S", "QueryLimits"]

log = logging.getLogger("fleethealth.api")

DEFAULT_MAX_ROWS = 10_000
DEFAULT_MAX_EXECUTION_S = 10.0


class ApiMetrics:
    """The API's Prometheus metrics, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        buildinfo.register(registry)
        self.requests = Counter("fleethealth_api_requests_total", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=registry)
        self.latency = Histogram("fleethealth_api_request_duration_seconds", "HTTP request latency",
                                 ["route"], registry=registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.auth_failures = Counter("fleethealth_api_auth_failures_total", "write requests refused for the token",
                                     ["reason"], registry=registry)
        self.query_refused = Counter("fleethealth_api_query_refused_total", "analyst SQL refused before running",
                                     ["reason"], registry=registry)
        self.query_rows = Counter("fleethealth_api_query_rows_total", "rows returned by analyst SQL",
                                  registry=registry)
        self.query_limited = Counter("fleethealth_api_query_limited_total",
                                     "analyst SQL stopped by a limit, the concurrency cap or the wall-clock guard",
                                     ["reason"], registry=registry)
        self.query_running = Gauge("fleethealth_api_query_running", "analyst SQL statements the engine is running",
                                   registry=registry)
        self.writes = Counter("fleethealth_api_writes_total", "accepted write requests by kind", ["kind"],
                              registry=registry)


def _bearer(tokens: tuple[str | None, ...], metrics: ApiMetrics, *, scope: str) -> Callable[..., str]:
    """A dependency accepting any of ``tokens`` (``None`` entries ignored) for the ``scope`` named."""
    expected = [t.encode() for t in tokens if t]
    scheme = HTTPBearer(auto_error=False, description="the token of `fleethealth serve --token-file` "
                                                      "(writes) or `--read-token-file` (reads)")

    def require_token(creds: HTTPAuthorizationCredentials | None = Depends(scheme)) -> str:  # noqa: B008
        if creds is None or not creds.credentials:
            metrics.auth_failures.labels("missing").inc()
            raise HTTPException(401, f"a bearer token with the {scope} scope is required for this endpoint",
                                headers={"WWW-Authenticate": "Bearer"})
        if not expected:
            metrics.auth_failures.labels(f"{scope}s_disabled").inc()
            raise HTTPException(403, f"this server was started without a {scope} token: {scope}s are disabled")
        given = creds.credentials.encode()
        # every candidate is compared, so the time taken does not tell which one matched
        if not sum(hmac.compare_digest(given, e) for e in expected):
            metrics.auth_failures.labels("wrong").inc()
            raise HTTPException(403, "wrong token")
        return creds.credentials

    return require_token


def create_app(store: StoreLike, *, token: str | None, read_token: str | None = None, open_reads: bool = False,
               max_rows: int = DEFAULT_MAX_ROWS,
               max_execution_s: float = DEFAULT_MAX_EXECUTION_S, registry: CollectorRegistry | None = None,
               on_breaker_reset: Callable[[], None] | None = None,
               clock: Callable[[], float] = time.time, limits: QueryLimits | None = None,
               query_store: StoreLike | None = None, release_keys: Any = None,
               interval: IntervalEstimator | None = None, live: Any = None,
               live_at_batches: bool = False) -> FastAPI:
    """Build the API around an open :class:`~fleethealth.store.StoreLike`.

    ``token`` guards the write endpoints (``None``: writes refused); ``read_token`` (or ``token``)
    the reads, unless ``open_reads`` opens them to anyone (a warning is logged). ``max_rows`` and
    ``max_execution_s`` bound ``POST /v1/query``, with ``limits`` (memory, bytes read, result
    bytes, rows read, threads, concurrency, the wall-clock guard; :class:`QueryLimits`), run on
    ``query_store`` when given: a handle of its own on the same store, so an analyst query neither
    queues the detector's writes behind it nor waits behind them, and a cancel (on ``store``) does
    not queue behind the query it cancels. ``on_breaker_reset`` is called after a reset is stored, so a
    policy engine in the same process closes its breaker at once (others pick the reset up from
    the ``breaker`` table). ``clock`` stamps acknowledgements and resets. ``release_keys`` (a
    :class:`fleethealth.signing.KeyRing`): a release then also needs the stored self-test record to
    carry the node's own signature (:func:`fleethealth.signing.verify_record`). ``interval`` estimates
    each run's checkpoint interval (``GET /v1/runs/{job}/health``; default: the ``policy.interval.*`` defaults).
    ``live`` (a :class:`fleethealth.config.LiveSettings`) is shown by ``GET /v1/config`` and reloaded by
    ``POST /v1/config/reload``; ``live_at_batches``: a detector in this process applies a reload at its
    next batch boundary (otherwise the route applies it at once).
    """
    if max_rows < 1 or max_execution_s <= 0:
        raise ValueError(f"max_rows must be >= 1 and max_execution_s > 0, got {max_rows}, {max_execution_s}")
    metrics = ApiMetrics(registry if registry is not None else CollectorRegistry())
    app = FastAPI(title="fleethealth", version=__version__,
                  description="Fleet health and silent-data-corruption detection: recommendations, nodes, "
                              "runs, quarantine and analyst SQL. Write endpoints need a bearer token.")
    app.state.store = store
    app.state.metrics = metrics
    app.state.max_rows = max_rows
    app.state.max_execution_s = max_execution_s
    app.state.limits = limits if limits is not None else QueryLimits()
    app.state.analyst = AnalystQueries((query_store or store).query, store.command, limits=app.state.limits,
                                       max_execution_s=max_execution_s)
    metrics.query_running.set_function(lambda: app.state.analyst.running)
    app.state.on_breaker_reset = on_breaker_reset
    app.state.clock = clock
    app.state.release_keys = release_keys
    app.state.interval = interval if interval is not None else IntervalEstimator()
    app.state.live = live
    app.state.live_at_batches = live_at_batches
    require = _bearer((token,), metrics, scope="write")
    if open_reads:
        log.warning("reads are open: anyone who reaches this API can read the store (--open-reads)")
    read_dependencies = [] if open_reads else [Depends(_bearer((read_token, token), metrics, scope="read"))]
    app.state.gate = SqlGate(store.explain_ast)

    @app.middleware("http")
    async def _count(request: Request, call_next: Callable[[Request], Any]) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        name = getattr(route, "path", None) or "unmatched"
        metrics.requests.labels(name, request.method, str(response.status_code)).inc()
        metrics.latency.labels(name).observe(time.perf_counter() - start)
        return response

    @app.exception_handler(NotFound)
    async def _not_found(_: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(StoreError)
    async def _store_failed(_: Request, exc: StoreError) -> JSONResponse:
        log.warning("store error: %s", exc)
        return JSONResponse({"detail": f"store error: {exc}"}, status_code=503)

    @app.get("/metrics", include_in_schema=True, tags=["service"], response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus exposition"}})
    def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(routes.read_router(read_dependencies))
    app.include_router(routes.service_router())
    app.include_router(routes.write_router(require))
    app.include_router(config_routes.config_read_router(read_dependencies))
    app.include_router(config_routes.config_write_router(require))
    return app
