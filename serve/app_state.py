"""What the routes share: the model manager, the result cache, the metrics, the config and the admin token.

One ``AppState`` per app, built by ``serve.api.create_app`` and kept on ``app.state.server``; the
route functions (serve/routes_openai.py, serve/routes_admin.py) take it from the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from serve.api_schemas import ApiError
from serve.config import ServeConfig
from serve.metrics import ServerMetrics
from serve.model_source import LoadedModel, ModelManager, NotReadyError
from serve.result_cache import ResultCache


@dataclass
class AppState:
    manager: ModelManager
    cache: ResultCache
    metrics: ServerMetrics
    config: ServeConfig
    admin_token: str | None  # None: /admin/* is off

    def lease(self) -> LoadedModel:
        """The current model, held until ``manager.release``: a live swap never cuts a response short."""
        try:
            return self.manager.acquire()
        except NotReadyError as e:
            raise ApiError(503, f"no model is loaded yet: {e}", "service_unavailable", code="model_not_ready",
                           headers={"Retry-After": "1"}) from None


def app_state(request: Request) -> AppState:
    return request.app.state.server
