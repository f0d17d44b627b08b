"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/responses, /v1/models.

Request and response shapes are deepseek-recipe's (DeepSeek's API); see server/streaming.py for
how a request runs. /v1/completions (raw prompts, ours) lives in server/completions.py.
"""

from __future__ import annotations

import time

from aiohttp import web

from deepinfer.server.conversion import ApiKind, Frontend
from deepinfer.server.service import CoordinatorService
from deepinfer.server.streaming import serve_recipe_request


class OpenAIApi:
    def __init__(self, frontend: Frontend, service: CoordinatorService, timeout: float) -> None:
        self.frontend = frontend
        self.service = service
        self.timeout = timeout
        self.created = int(time.time())

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await serve_recipe_request(
            request, ApiKind.CHAT, self.frontend, self.service, self.timeout
        )

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await serve_recipe_request(
            request, ApiKind.RESPONSES, self.frontend, self.service, self.timeout
        )

    async def models(self, request: web.Request) -> web.Response:
        """The served name first, then the official names of the same model version."""
        served = self.frontend.served_model_name
        names = [served, *(n for n in self.frontend.model_names if n != served)]
        registry = self.service.registry
        max_model_len = max((n.max_model_len for n in registry.ready_nodes()), default=None)
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "deepinfer",
                "root": served,
                "max_model_len": max_model_len,
            }
            for name in names
        ]
        return web.json_response({"object": "list", "data": data})
