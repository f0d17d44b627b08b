"""Request conversion: an HTTP body -> what a node runs (prompt token ids + sampling options).

    body (JSON) --recipe *Request(body).convert(options)--> ConversationRequest
        --DeepseekV4Encoding.encode--> prompt_token_ids --resolve_max_tokens--> max_tokens
        + extras from the raw body (server/sampling.py) --> Prepared (-> ApiRequest, processor)

deepseek-recipe does the protocol work (validation, chat template, tool/response-format handling,
thinking mode, DeepSeek's error messages); this module adds what is ours: the served model name,
the model check (404), the image-URL policy, and the node-side options. ``prepare`` is CPU work
(tokenization of up to a million-token prompt), so handlers run it on the preparation pool
(server/preparation.py).

Before tokenizing, the rendered prompt's length in characters is checked against the context:
no token spells more than ``max_token_chars`` characters, so a prompt of ``n`` characters has at
least ``ceil(n / max_token_chars)`` tokens, and one that cannot fit is refused without tokenizing.
The bound is exact, never refusing a prompt that fits, hence loose (V4's longest tokens are runs
of 128 spaces or dots): it stops absurd bodies, and the pool bounds the rest.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import deepseek_recipe as recipe
import tokenizers

from deepinfer.server.errors import ApiError, bad_request
from deepinfer.server.protocol import OutputConstraint, SamplingOptions
from deepinfer.server.sampling import build_sampling_options, read_extra_sampling
from deepinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class ApiKind(Enum):
    CHAT = "chat_completions"
    RESPONSES = "responses"
    MESSAGES = "messages"


_REQUEST_CLASSES: dict[ApiKind, Any] = {
    ApiKind.CHAT: recipe.ChatCompletionRequest,
    ApiKind.RESPONSES: recipe.ResponsesRequest,
    ApiKind.MESSAGES: recipe.MessagesRequest,
}

# model_type of the checkpoint's config.json -> the recipe's version and prompt encoding.
_MODEL_VERSIONS = {
    "deepseek_v4": (recipe.ModelVersion.DeepseekV4Pro, recipe.DeepseekV4Encoding),
    "deepseek_v41": (recipe.ModelVersion.DeepseekV41Flash, recipe.DeepseekV41Encoding),
}

# The constraint kinds the recipe produces; a node enforces each with a grammar.
_ENFORCED_CONSTRAINTS = ("json", "regex", "tool_call_required", "tool_call")


@dataclass
class Prepared:
    """A converted request. Producer: ``Frontend.prepare`` (worker thread); consumer: the
    handler, which makes the ApiRequest and the recipe's chunk generator from it."""

    kind: ApiKind
    model: str  # the requested name, echoed in responses
    conversation_request: recipe.ConversationRequest
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    constraint: OutputConstraint | None
    cache_salt: str | None
    echo: recipe.ResponsesEcho | None = None  # Responses only
    namespace_tool_map: dict[str, tuple[str, str]] | None = None  # Responses only

    @property
    def stream(self) -> bool:
        return self.conversation_request.stream


class Frontend:
    """The served model's names, tokenizers, prompt encoding and conversion options."""

    def __init__(
        self,
        tokenizer_path: str | Path,
        served_model_name: str,
        *,
        model_type: str = "deepseek_v4",
        default_thinking_mode: bool = True,
        image_url_allowlist: tuple[str, ...] = (),
    ) -> None:
        if model_type not in _MODEL_VERSIONS:
            raise ValueError(
                f"model_type must be one of {sorted(_MODEL_VERSIONS)}, got {model_type!r}"
            )
        path = Path(tokenizer_path)
        if path.is_dir():
            path = path / "tokenizer.json"
        self.served_model_name = served_model_name
        self.model_type = model_type
        self.image_url_allowlist = frozenset(h.lower() for h in image_url_allowlist)
        self.recipe_tokenizer, self.tokenizer = _load_tokenizers(path.resolve())
        self.max_token_chars = _max_token_chars(self.tokenizer)
        version, encoding_cls = _MODEL_VERSIONS[model_type]
        self.encoding = encoding_cls().with_tokenizer(self.recipe_tokenizer)
        self.options = recipe.ConversionOptions(
            default_thinking_mode=default_thinking_mode
        ).with_model_alias(served_model_name, version)
        # Official names of other versions would need another encoding: accept only ours.
        self.model_names = sorted(
            name for name, v in self.options.model_versions_by_name.items() if v == version
        )
        self.options = self.options.with_model_versions_by_name(
            {name: version for name in self.model_names}
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    # ---- parsing ----------------------------------------------------------------------------

    @staticmethod
    def parse_json(raw: bytes) -> dict[str, Any]:
        if not raw:
            raise bad_request("Request body is empty; expected a JSON object")
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad_request(f"Invalid JSON body: {e}") from None
        if not isinstance(body, dict):
            raise bad_request(f"Request body must be a JSON object, got {type(body).__name__}")
        return body

    def check_model(self, name: Any) -> str:
        if name is None:
            raise bad_request("you must provide a model parameter", "model")
        if not isinstance(name, str):
            raise bad_request(f"Invalid model: expected a string, got {name!r}", "model")
        if name not in self.model_names:
            raise ApiError(
                404,
                f"The model `{name}` does not exist. Available models: "
                f"{', '.join(self.model_names)}",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )
        return name

    # ---- conversion (worker thread) ---------------------------------------------------------

    def convert(
        self, kind: ApiKind, body: dict[str, Any]
    ) -> tuple[recipe.ConversationRequest, Any]:
        """(the recipe's ConversationRequest, the protocol request read before conversion)."""
        self.check_model(body.get("model"))
        try:
            request = _REQUEST_CLASSES[kind](body)
        except ValueError as e:  # serde: wrong types, missing fields, unknown enum values
            raise bad_request(str(e)) from None
        extras: dict[str, Any] = {}
        try:
            if kind is ApiKind.RESPONSES:
                extras["echo"] = request.echo()
                extras["namespace_tool_map"] = request.namespace_tool_map(self.options)
            return request.convert(self.options), extras
        except recipe.ConversionError as e:
            raise _from_conversion_error(e) from None

    def encode(
        self, conversation_request: recipe.ConversationRequest, context_limit: int
    ) -> list[int]:
        """The prompt's token ids; refused (400) without tokenizing when its characters alone
        prove it longer than ``context_limit`` tokens."""
        conversation = conversation_request.conversation
        self._check_images(conversation)
        try:
            num_chars = len(self.encoding.render_conversation(conversation).prompt)
            self.check_prompt_chars(num_chars, context_limit)
            return self.encoding.encode(conversation)
        except RuntimeError as e:
            raise bad_request(f"The conversation cannot be encoded: {e}") from None

    def check_prompt_chars(
        self, num_chars: int, context_limit: int, param: str | None = None
    ) -> None:
        """Raises ApiError (400) when ``num_chars`` characters are more tokens than fit."""
        min_tokens = -(-num_chars // self.max_token_chars)
        if min_tokens > context_limit:
            raise bad_request(
                f"This model's maximum context length is {context_limit} tokens. However, your "
                f"prompt has at least {min_tokens} tokens ({num_chars} characters, and no token "
                f"is longer than {self.max_token_chars}). Please reduce the length of the prompt.",
                param,
            )

    def prepare(self, kind: ApiKind, body: dict[str, Any], context_limit: int) -> Prepared:
        """Everything from the body to the node's options. Raises ApiError (4xx)."""
        conversation_request, extras = self.convert(kind, body)
        prompt_token_ids = self.encode(conversation_request, context_limit)
        try:
            max_tokens = conversation_request.resolve_max_tokens(
                len(prompt_token_ids), context_limit
            )
        except recipe.ConversionError as e:  # prompt (+ max_tokens) longer than the context
            raise _from_conversion_error(e) from None
        inference = conversation_request.inference_options
        extra = read_extra_sampling(body, self.vocab_size)
        logprobs = (inference.top_logprobs or 0) if inference.logprobs else None
        sampling = build_sampling_options(
            temperature=inference.temperature if inference.temperature is not None else 1.0,
            top_p=inference.top_p if inference.top_p is not None else 1.0,
            seed=inference.seed,
            max_tokens=max_tokens,
            logprobs=logprobs,
            extra=extra,
        )
        constraint = inference.output_constraint
        return Prepared(
            kind=kind,
            model=body["model"],
            conversation_request=conversation_request,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            constraint=(
                OutputConstraint(kind=constraint.kind, schema=constraint.schema)
                if constraint is not None and constraint.kind in _ENFORCED_CONSTRAINTS
                else None
            ),
            cache_salt=extra.cache_salt,
            **extras,
        )

    def count_tokens(self, kind: ApiKind, body: dict[str, Any], context_limit: int) -> int:
        """The prompt's token count; a prompt that cannot fit the context is refused (400)."""
        conversation_request, _ = self.convert(kind, body)
        return len(self.encode(conversation_request, context_limit))

    def _check_images(self, conversation: recipe.Conversation) -> None:
        """Image URLs are fetched by the server, so they are an SSRF risk: only allow-listed
        hosts. (For V4 checkpoints, which have no vision tower, the recipe already replaced
        images with text and no source is left here.)"""
        for message in conversation.messages:
            for source in message.image_sources:
                host = (urlsplit(source.url or "").hostname or "").lower()
                if source.kind == "url" and host not in self.image_url_allowlist:
                    raise bad_request(
                        f"Image URLs are not allowed on this server (host {host!r} is not in "
                        f"server.image_url_allowlist); send the image as a data: URL",
                        source.path.lstrip(".") or None,
                    )
                # The node protocol carries no images yet: refuse rather than drop them.
                raise bad_request(
                    "Image inputs are not supported by this server yet",
                    source.path.lstrip(".") or None,
                )


@functools.lru_cache(maxsize=4)
def _load_tokenizers(path: Path) -> tuple[recipe.Tokenizer, Tokenizer]:
    """The recipe's tokenizer (prompt encoding, stream processing) and ours (/v1/completions
    detokenizes raw text, which the recipe's processor does not). Both are immutable and take
    ~0.3 s each to load, so apps built in one process (tests, ``serve``) share them."""
    ours = Tokenizer.from_folder(path.parent)
    if ours.path != path:
        ours = Tokenizer(tokenizers.Tokenizer.from_file(str(path)), path)
    return recipe.Tokenizer.from_file(str(path)), ours


def _max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters one token can stand for. Vocabulary strings of a byte-level BPE
    spell one character per byte, which is at least one decoded character."""
    return max(len(token) for token in tokenizer.backend.get_vocab(with_added_tokens=True))


def _from_conversion_error(e: recipe.ConversionError, param: str | None = None) -> ApiError:
    """The recipe's error keeps DeepSeek's status and message; its body is OpenAI-shaped."""
    status = getattr(e, "status_code", 400) or 400
    message = str(e)
    code = "invalid_request_error"
    try:
        error = json.loads(e.body)["error"]
        message = error.get("message") or message
        param = error.get("param") or param
        code = error.get("code") or code
    except (AttributeError, TypeError, KeyError, ValueError):
        logger.debug("ConversionError without a JSON body: %r", e)
    return ApiError(status, message, param=param, code=code)
