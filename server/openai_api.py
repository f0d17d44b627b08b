"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/responses (and GET /v1/responses/{id}),
/v1/models (and GET /v1/models/{id}).

Request and response shapes are deepseek-recipe's (DeepSeek's API); see server/streaming.py for
how a request runs and server/response_store.py for what Responses keep. /v1/completions (raw
prompts, ours) lives in server/completions.py.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from deepinfer.server.conversion import ApiKind, Frontend
from deepinfer.server.registry import NodeRegistry
from deepinfer.server.response_store import ResponseStore
from deepinfer.server.service import CoordinatorService
from deepinfer.server.streaming import serve_recipe_request


class OpenAIApi:
    def __init__(
        self,
        frontend: Frontend,
        service: CoordinatorService,
        timeout: float,
        response_store: ResponseStore,
    ) -> None:
        self.frontend = frontend
        self.service = service
        self.timeout = timeout
        self.response_store = response_store
        self.created = int(time.time())

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await serve_recipe_request(
            request, ApiKind.CHAT, self.frontend, self.service, self.timeout
        )

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await serve_recipe_request(
            request,
            ApiKind.RESPONSES,
            self.frontend,
            self.service,
            self.timeout,
            self.response_store,
        )

    async def get_response(self, request: web.Request) -> web.Response:
        return web.json_response(self.response_store.get(request.match_info["response_id"]))

    async def models(self, request: web.Request) -> web.Response:
        """The served name first, then the official names of the same model version."""
        served = self.frontend.served_model_name
        names = [served, *(n for n in self.frontend.model_names if n != served)]
        return web.json_response({"object": "list", "data": [self._model(n) for n in names]})

    async def model(self, request: web.Request) -> web.Response:
        """One of /v1/models; an unknown name is OpenAI's 404 ``model_not_found``."""
        return web.json_response(
            self._model(self.frontend.check_model(request.match_info["model"]))
        )

    def _model(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "deepinfer",
            "root": self.frontend.served_model_name,
            "max_model_len": ready_max_model_len(self.service.registry),
        }


def ready_max_model_len(registry: NodeRegistry) -> int | None:
    """The longest context a request may ask for (the largest of the ready nodes': routing
    picks one it fits), None while none is ready."""
    return max((n.max_model_len for n in registry.routes()), default=None)
