"""The operator's routes: liveness (/health), readiness (/ready), Prometheus (/metrics) and the
token-protected POST /admin/reload (re-read the alias now, or retry a version that failed to load).
"""

from __future__ import annotations

import hmac

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from serve.api.metrics import CONTENT_TYPE
from serve.api.schemas import ApiError, ReloadRequest, error_body, parse, read_json
from serve.api.state import app_state

router = APIRouter()


@router.get("/health")
async def health():
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request):
    manager = app_state(request).manager
    lm = manager.current
    if lm is None:
        return JSONResponse({"status": "loading", "error": manager.last_error}, 503, headers={"Retry-After": "1"})
    return {"status": "ready", "model": lm.name, "version": lm.version}


@router.get("/metrics")
async def prometheus(request: Request):
    # render reads the engine's counters under its lock: in a thread, so the loop never waits for a step
    return Response(await anyio.to_thread.run_sync(app_state(request).metrics.render), media_type=CONTENT_TYPE)


@router.post("/admin/reload")
async def admin_reload(request: Request):
    state = app_state(request)
    token = state.admin_token
    if token is None:
        # Off unless an operator configured a token: indistinguishable from a missing route.
        raise ApiError(404, "admin endpoints are off; set the environment variable "
                       f"{state.config.admin_token_env} to enable them", "not_found_error")
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise ApiError(401, "missing or wrong bearer token", "authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})
    has_body = request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers
    body = (parse(ReloadRequest, await read_json(request, state.config.max_request_bytes)) if has_body
            else ReloadRequest())
    result = await anyio.to_thread.run_sync(state.manager.reload, body.force)
    out = {"changed": result.changed, "version": result.version, "previous": result.previous,
           "error": result.error}
    if result.error:
        return JSONResponse({**out, **error_body(result.error, "server_error", code="model_load_failed")}, 500)
    return out
