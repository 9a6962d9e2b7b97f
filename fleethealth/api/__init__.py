"""HTTP API (FastAPI): recommendations, nodes, runs, quarantine, breaker and analyst SQL.

``create_app(store, token=...)`` builds the application (``fleethealth serve`` runs it under
uvicorn); ``query_via_api`` is the CLI's client for ``POST /v1/query``. FastAPI is imported only
when ``create_app`` is first used, so ``fleethealth.api.client`` works without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "query_via_api", "server_running", "check_select", "QueryRefused"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from fleethealth.api.app import create_app

        return create_app
    if name in ("query_via_api", "server_running"):
        from fleethealth.api import client

        return getattr(client, name)
    if name in ("check_select", "QueryRefused"):
        from fleethealth.api import sqlgate

        return getattr(sqlgate, name)
    raise AttributeError(f"module 'fleethealth.api' has no attribute {name!r}")
