"""``GET /v1/config`` (read scope) and ``POST /v1/config/reload`` (write scope, the operator's token).

The GET shows the settings in force (:meth:`fleethealth.config.LiveSettings.to_obj`): every key's
value, its source and whether it is live, the file's path and digest; DSNs lose their user
information and passwords, and key files are shown by path, never their contents. The POST reads
the file again as ``SIGHUP`` does and answers what changed (``applied``), what needs a restart
(``ignored``), or 422 with the reason when the file is refused (the old values stay). The live
changes take effect at the detector's next batch boundary (``pending`` until then); a server without
a detector in the process applies them at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request

from fleethealth.config import LiveSettings, shown_value
from fleethealth.errors import ConfigError

__all__ = ["config_read_router", "config_write_router"]


def _live(request: Request) -> LiveSettings:
    live = getattr(request.app.state, "live", None)
    if live is None:
        raise HTTPException(404, "this server was started without a configuration to show or reload")
    return live


def config_read_router(dependencies: Sequence[Any] = ()) -> APIRouter:
    router = APIRouter(dependencies=list(dependencies))

    @router.get("/v1/config", tags=["config"])
    def get_config(request: Request) -> dict[str, Any]:
        return _live(request).to_obj()

    return router


def config_write_router(require: Callable[..., str]) -> APIRouter:
    router = APIRouter(dependencies=[Depends(require)])

    @router.post("/v1/config/reload", tags=["config"],
                 responses={401: {"description": "no bearer token"}, 403: {"description": "wrong token"},
                            422: {"description": "the file was refused; the old values stay"}})
    def reload_config(request: Request) -> dict[str, Any]:
        live = _live(request)
        try:
            plan = live.reload()
        except ConfigError as exc:
            raise HTTPException(422, f"config reload refused, the old values stay: {exc}") from None
        if not getattr(request.app.state, "live_at_batches", False):
            live.take()  # no detector in this process: nothing to wait for

        def pairs(changes: dict[str, tuple[Any, Any]]) -> dict[str, dict[str, Any]]:
            return {n: {"old": shown_value(n, a), "new": shown_value(n, b)} for n, (a, b) in sorted(changes.items())}

        request.app.state.metrics.writes.labels("config_reload").inc()
        return {"applied": pairs(plan.applied), "ignored_until_restart": pairs(plan.ignored),
                "digest": plan.digest, "pending": live.pending}

    return router
