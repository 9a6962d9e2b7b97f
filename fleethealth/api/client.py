"""A small client of the HTTP API for the CLI: analyst SQL through ``POST /v1/query``.

Standard library only (``urllib``), so ``fleethealth query`` works without the ``api`` extra.
In embedded mode one process (``fleethealth serve``) owns the chDB store; every other process
asks it through this client instead of opening the store::

    if server_running("http://127.0.0.1:8080"):
        result = query_via_api("http://127.0.0.1:8080", "SELECT count() FROM findings")

A refused or failing statement raises :class:`ConfigError` with the server's reason (nothing was
executed for a refusal); an unreachable or failing server raises :class:`StoreError`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from fleethealth.errors import ConfigError, StoreError
from fleethealth.store import QueryResult

__all__ = ["query_via_api", "server_running", "DEFAULT_URL"]

DEFAULT_URL = "http://127.0.0.1:8080"


def _request(url: str, *, body: dict[str, Any] | None = None, token: str | None = None,
             timeout_s: float = 30.0) -> Any:
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - http(s) URL checked below
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read()).get("detail")
        except (ValueError, AttributeError):
            detail = exc.reason
        if isinstance(detail, list):  # FastAPI's validation errors
            detail = "; ".join(str(d.get("msg", d)) for d in detail if isinstance(d, dict))
        if 400 <= exc.code < 500:
            raise ConfigError(f"{url}: HTTP {exc.code}: {detail}") from None
        raise StoreError(f"{url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise StoreError(f"{url}: no answer from the fleethealth API ({getattr(exc, 'reason', exc)})") from exc


def _base(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"API URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


def server_running(url: str = DEFAULT_URL, *, timeout_s: float = 0.5) -> bool:
    """True when a fleethealth API answers ``GET /healthz`` at ``url``."""
    try:
        body = _request(f"{_base(url)}/healthz", timeout_s=timeout_s)
    except (StoreError, ConfigError):
        return False
    return isinstance(body, dict) and "status" in body


def query_via_api(url: str, sql: str, token: str | None = None, *, max_rows: int | None = None,
                  timeout_s: float = 60.0) -> QueryResult:
    """Run one read-only SELECT through the API at ``url``; return its columns and rows."""
    body: dict[str, Any] = {"sql": sql}
    if max_rows is not None:
        body["max_rows"] = int(max_rows)
    out = _request(f"{_base(url)}/v1/query", body=body, token=token, timeout_s=timeout_s)
    return QueryResult(tuple(out["columns"]), [tuple(r) for r in out["rows"]])
