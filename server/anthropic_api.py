"""Anthropic-compatible endpoints: /v1/messages and /v1/messages/count_tokens.

Shapes are deepseek-recipe's (DeepSeek's Anthropic API); errors are Anthropic-shaped
(``{"type": "error", "error": {...}}``, chosen by path in server/errors.py).
"""

from __future__ import annotations

from aiohttp import web

from deepinfer.server.conversion import ApiKind, Frontend
from deepinfer.server.service import CoordinatorService
from deepinfer.server.streaming import serve_recipe_request


class AnthropicApi:
    def __init__(self, frontend: Frontend, service: CoordinatorService, timeout: float) -> None:
        self.frontend = frontend
        self.service = service
        self.timeout = timeout

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await serve_recipe_request(
            request, ApiKind.MESSAGES, self.frontend, self.service, self.timeout
        )

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt's token count as the model would see it. No node runs it, but it is
        admitted and prepared as a request is, and one that cannot fit the context is a 400."""
        frontend = self.frontend
        num_tokens = await self.service.prepare(
            request,
            lambda body, limit: frontend.count_tokens(
                ApiKind.MESSAGES, frontend.parse_json(body), limit
            ),
        )
        return web.json_response({"input_tokens": num_tokens})
