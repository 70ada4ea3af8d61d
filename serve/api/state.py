"""What the routes share: the model manager, the result cache, the metrics, the config and the admin token.

One ``AppState`` per app, built by ``serve.api.app.create_app`` and kept on ``app.state.server``; the
route functions (serve/api/routes_openai.py, serve/api/routes_admin.py) take it from the request.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request

from serve.api.metrics import ServerMetrics
from serve.api.result_cache import ResultCache
from serve.api.schemas import ApiError
from serve.config import ServeConfig
from serve.registry.source import LoadedModel, ModelManager, NotReadyError


@dataclass
class AppState:
    manager: ModelManager
    cache: ResultCache
    metrics: ServerMetrics
    config: ServeConfig
    admin_token: str | None  # None: /admin/* is off
    # Worker threads for blocking request work (chat template, tokenizing, admission); few, because they and
    # the event loop share one GIL: more threads would only make the loop wait longer for it.
    off_loop_threads: int = 2
    _limiter: Any = field(default=None, repr=False)
    # Completions between the shedding check and Engine.add_request (tokenizing, waiting for a worker thread).
    # Changed on the event loop only.
    admitting: int = 0

    def queue_full(self, lm: LoadedModel) -> bool:
        """The engine's waiting queue plus the requests on their way to it reach ``serve.max_waiting``."""
        sched = lm.engine.scheduler
        return len(sched.waiting) + self.admitting >= sched.max_waiting

    async def off_loop(self, fn: Callable, *args) -> Any:
        """``fn(*args)`` in a worker thread, so the event loop keeps answering while it runs."""
        if self._limiter is None:  # created on the loop that uses it
            self._limiter = anyio.CapacityLimiter(self.off_loop_threads)
        return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=self._limiter)

    def lease(self) -> LoadedModel:
        """The current model, held until ``manager.release``: a live swap never cuts a response short."""
        try:
            return self.manager.acquire()
        except NotReadyError as e:
            raise ApiError(503, f"no model is loaded yet: {e}", "service_unavailable", code="model_not_ready",
                           headers={"Retry-After": "1"}) from None


def app_state(request: Request) -> AppState:
    return request.app.state.server
