"""``/metrics`` and ``/healthz`` over the standard library's HTTP server, for the long-running
processes that have no API of their own (the probe, ``fleethealth act``).

``/healthz`` answers 200 with ``{"status": "ok"}`` while the process is healthy and 503 with
``{"status": "degraded", "reasons": [...]}`` when it is not, so a readiness probe, a load balancer
or an alert sees the difference. Point a *liveness* probe at ``/metrics`` (the process answers),
not at ``/healthz``: a degraded probe (a GPU stalling its driver calls, a broker away) must keep
running and reporting, not be restarted in a loop.

:func:`health_body` is the pure part: a health callable's answer as a status code and a body.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["Endpoints", "health_body", "PROMETHEUS_CONTENT_TYPE"]

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Health = Callable[[], Sequence[str]]
"""Returns the reasons the process is degraded; empty when it is healthy."""


def health_body(reasons: Sequence[str]) -> tuple[int, bytes]:
    """The status code and JSON body of ``/healthz`` for these degradation ``reasons``."""
    if reasons:
        return 503, json.dumps({"status": "degraded", "reasons": list(reasons)}).encode()
    return 200, b'{"status": "ok"}'


class Endpoints:
    """Serves ``metrics()`` (bytes in the Prometheus text format) on ``/metrics`` and ``health()``
    (see :data:`Health`) on ``/healthz`` from a daemon thread; :meth:`serve` returns the server
    (``shutdown()`` stops it). ``name`` names the thread."""

    def __init__(self, *, metrics: Callable[[], bytes], health: Health, name: str = "fh-endpoints",
                 content_type: str = PROMETHEUS_CONTENT_TYPE) -> None:
        self.metrics = metrics
        self.health = health
        self.name = name
        self.content_type = content_type

    def answer(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of ``path``."""
        path = path.split("?", 1)[0]
        if path in ("/metrics", "/"):
            return 200, self.content_type, self.metrics()
        if path == "/healthz":
            try:
                reasons = list(self.health())
            except Exception as exc:  # a health check that fails is itself a degradation
                reasons = [f"health check raised {type(exc).__name__}: {exc}"]
            code, body = health_body(reasons)
            return code, "application/json", body
        return 404, "text/plain", b"not found\n"

    def serve(self, port: int, addr: str = "0.0.0.0") -> ThreadingHTTPServer:
        endpoints = self

        class _Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server hook name
                code, ctype, body = endpoints.answer(self.path)
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # scrapes are not worth a log line each
                return

        server = ThreadingHTTPServer((addr, port), _Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name=self.name, daemon=True).start()
        return server
