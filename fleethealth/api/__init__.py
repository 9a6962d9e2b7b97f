"""HTTP API (FastAPI): recommendations, nodes, runs, quarantine, breaker and analyst SQL.

``create_app(store, token=...)`` builds the application (``fleethealth serve`` runs it under
uvicorn); ``query_via_api`` is the CLI's client for ``POST /v1/query``. FastAPI is imported only
when ``create_app`` is first used, so ``fleethealth.api.client`` works without it.
"""

from __future__ import annotations

from fleethealth.lazy import lazy_exports

_EXPORTS = {
    "create_app": "app",
    "query_via_api": "client",
    "server_running": "client",
    "check_select": "sqlgate",
    "QueryRefused": "sqlgate",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
