"""vLLM's tokenizer endpoints: POST /tokenize and POST /detokenize, in vLLM's shapes.

    /tokenize   {"prompt": text, "add_special_tokens"?}  the text's token ids
                {"messages": [...], "tools"?}            the prompt's ids, as /v1/chat/completions
                                                         encodes it (DeepSeek's encoding)
                -> {"count", "max_model_len", "tokens", "token_strs" (with return_token_strs)}
    /detokenize {"tokens": [ids]} -> {"prompt": text}

``model`` is optional (the served model); another name is a 404 as on /v1. Chat bodies take what
/v1/chat/completions takes; vLLM's template switches are refused unless they ask for what the
encoding does (a generation prompt, no continued final message, no added special tokens): a
custom template cannot be run. A text prompt gets what the tokenizer's post-processor adds with
``add_special_tokens`` (nothing for DeepSeek V4's), as a Hugging Face tokenizer gives vLLM.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from deepinfer.server.conversion import ApiKind, Frontend
from deepinfer.server.errors import bad_request
from deepinfer.server.openai_api import ready_max_model_len
from deepinfer.server.service import CoordinatorService

# vLLM's chat-template fields: the value our encoding gives, the only one accepted (it writes
# its own special tokens and ends in the assistant's turn).
_CHAT_TEMPLATE_FIELDS = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "add_special_tokens": False,
    "chat_template": None,
}


class TokenizationApi:
    def __init__(self, frontend: Frontend, service: CoordinatorService) -> None:
        self.frontend = frontend
        self.service = service

    async def tokenize(self, request: web.Request) -> web.Response:
        raw = await request.read()
        tokens, token_strs = await asyncio.to_thread(
            lambda: self._tokenize(self.frontend.parse_json(raw))
        )
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": ready_max_model_len(self.service.registry),
                "tokens": tokens,
                "token_strs": token_strs,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = self.frontend.parse_json(await request.read())
        self._check_model(body)
        tokens = body.get("tokens")
        vocab_size = self.frontend.vocab_size
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in tokens
        ):
            raise bad_request(
                f"Invalid tokens: expected a list of token ids in [0, {vocab_size})", "tokens"
            )
        text = self.frontend.tokenizer.decode(tokens, skip_special_tokens=False)
        return web.json_response({"prompt": text})

    def _tokenize(self, body: dict[str, Any]) -> tuple[list[int], list[str] | None]:
        """(token ids, their token strings if asked). Worker thread."""
        self._check_model(body)
        return_token_strs = _flag(body, "return_token_strs", False)
        backend = self.frontend.tokenizer.backend
        if "messages" in body:
            for name, value in _CHAT_TEMPLATE_FIELDS.items():
                if body.get(name, value) != value:
                    raise bad_request(f"{name}={body[name]!r} is not supported", name)
            chat = {"model": self.frontend.served_model_name, **body}
            conversation = self.frontend.convert(ApiKind.CHAT, chat).conversation
            tokens = self.frontend.encode(conversation, context_limit=_NO_LIMIT)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad_request("Invalid prompt: expected a string (or give messages)", "prompt")
            add_special_tokens = _flag(body, "add_special_tokens", True)
            tokens = backend.encode(prompt, add_special_tokens=add_special_tokens).ids
        token_strs = [backend.id_to_token(t) for t in tokens] if return_token_strs else None
        return tokens, token_strs

    def _check_model(self, body: dict[str, Any]) -> None:
        if body.get("model") is not None:
            self.frontend.check_model(body["model"])


_NO_LIMIT = 2**62  # /tokenize counts any prompt; the body size limit bounds it


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"Invalid {name}: expected a boolean, got {value!r}", name)
    return value
