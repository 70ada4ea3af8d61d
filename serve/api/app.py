"""The OpenAI-compatible HTTP server's entry point: ``create_app`` assembles the ASGI app.

    app = create_app("models:/smollm2-135m@champion", ServeConfig())   # or an artifact folder
    uvicorn.run(app, host="127.0.0.1", port=8000)

The parts, each in its own module:

- serve/api/schemas.py: request schemas, body reading, the OpenAI error body
- serve/api/chat_template.py: messages -> prompt text (sandboxed Jinja)
- serve/api/streaming.py: server-sent events
- serve/api/state.py: what the routes share (manager, result cache, metrics, config, admin token)
- serve/api/routes_openai.py: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /version
- serve/api/routes_admin.py: /health, /ready, /metrics, /admin/reload

Errors use OpenAI's body: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve.api import routes_admin
from serve.api import routes_openai
# Re-exported: the names callers and tests reach through serve.api.app.
from serve.api.chat_template import render_chat
from serve.api.metrics import ServerMetrics
from serve.api.result_cache import ResultCache
from serve.api.schemas import ApiError, ChatMessage, error_body
from serve.api.state import AppState
from serve.config import ServeConfig
from serve.registry.source import ModelManager

__all__ = ["AdminTokenFromEnv", "ApiError", "ChatMessage", "create_app", "render_chat"]


class AdminTokenFromEnv:
    """create_app's default ``admin_token``: read it from the environment variable named by
    ``serve.admin_token_env`` (a sentinel, because None already means "admin endpoints off")."""


def create_app(model: str | ModelManager, config: ServeConfig | None = None, *, tracking_uri: str | None = None,
               served_name: str | None = None,
               admin_token: str | None | type[AdminTokenFromEnv] = AdminTokenFromEnv) -> FastAPI:
    """The ASGI app. ``model``: models:/NAME@alias, models:/NAME/VERSION, an artifact folder, or a
    ModelManager (already loaded, e.g. by the CLI). ``admin_token``: default from the environment
    variable named by ``serve.admin_token_env``; None or "" turns /admin/* off. ``served_name``: the
    model id clients use (default: the registered model name or the folder name)."""
    config = config or ServeConfig()
    manager = (model if isinstance(model, ModelManager)
               else ModelManager(model, config, tracking_uri=tracking_uri, served_name=served_name))
    cache = ResultCache(config.result_cache_size)
    manager.on_swap.append(lambda new, old: cache.clear())
    metrics = ServerMetrics(manager, cache)
    token = os.environ.get(config.admin_token_env) if admin_token is AdminTokenFromEnv else admin_token

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = None
        if not manager.ready:
            loader = asyncio.get_running_loop().run_in_executor(None, manager.load_until_ready)
        manager.start_polling()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(manager.shutdown)
            if loader is not None:
                await loader

    app = FastAPI(title="compressor OpenAI-compatible server", lifespan=lifespan)
    app.state.server = AppState(manager, cache, metrics, config, token or None)
    # The parts tests and tools inspect directly.
    app.state.manager, app.state.cache, app.state.metrics, app.state.config = manager, cache, metrics, config
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(ShedWhenFull, state=app.state.server, max_body=config.max_request_bytes)
    app.add_middleware(CountRequests, counter=metrics.requests)  # added last: outermost, so it counts the 429s too
    app.include_router(routes_openai.router)
    app.include_router(routes_admin.router)
    return app


async def _api_error(request: Request, e: ApiError):
    return e.response()


async def _http_error(request: Request, e: StarletteHTTPException):
    # FastAPI's own 404/405 in OpenAI's error body too, so clients parse one shape.
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(e.detail), kind), e.status_code, headers=getattr(e, "headers", None))


class CountRequests:
    """Pure ASGI middleware (it must not buffer streams): counts responses by route and status."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.counter.labels(path, str(status["code"])).inc()


class _ShedRoute:
    """What CountRequests reads from ``scope["route"]`` for a request the shedder answered before routing."""

    def __init__(self, path: str):
        self.path = path


class ShedWhenFull:
    """Pure ASGI middleware: a completion that arrives while the waiting queue is full gets its 429 here, before
    routing, JSON parsing and validation, which are most of what a refused request costs the event loop. In a
    burst of hundreds of requests that is what keeps /health, /metrics and the 429s quick (docs/serving.md,
    "The event loop under bursts"). The check reads the queue length without the engine's lock; the engine
    decides again, exactly, when a request is added. The body is read and dropped so the connection stays
    usable (up to ``max_body`` bytes; a longer one closes the connection after the answer)."""

    PATHS = ("/v1/completions", "/v1/chat/completions")

    def __init__(self, app, state: AppState, max_body: int):
        self.app, self.state, self.max_body = app, state, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.PATHS:
            lm = self.state.manager.current
            sched = lm.engine.scheduler if lm is not None and not lm.closed else None
            if sched is not None and self.state.queue_full(lm):
                read, more = 0, True
                while more and read <= self.max_body:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    read += len(msg.get("body", b""))
                    more = msg.get("more_body", False)
                scope["route"] = _ShedRoute(scope["path"])
                await routes_openai.queue_full(sched.queue_full_error()).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

