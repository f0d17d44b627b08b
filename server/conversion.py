"""Request conversion: an HTTP body -> what a node runs (prompt token ids + sampling options).

    body (JSON) --_recipe_body--> --recipe *Request(body).convert(options)--> ConversationRequest
        --_require_tool_call (Messages' tool_choice any)--> Converted
        --DeepseekV4Encoding.encode--> prompt_token_ids --resolve_max_tokens--> max_tokens
        + extras from the raw body (server/sampling.py, server/structured_output.py)
        --> Prepared (-> ApiRequest, processor)

deepseek-recipe does the protocol work (validation, chat template, tool/response-format handling,
thinking mode, DeepSeek's error messages); this module adds what is ours: the served model name,
the model check (404), the request's images (server/images.py), the node-side options, and what
recipe 0.2.0 drops or misreads: ``max_completion_tokens``, ``thinking`` on Responses, strict
schemas whose root is not an object, Messages without ``max_tokens`` (a 400, as Anthropic's API)
and with ``tool_choice: any`` (a required tool call). The ``max_tokens`` bound is the context
limit where that is below DeepSeek's 384K. ``prepare`` is CPU and network work (tokenization of
up to a million-token prompt, fetching and preprocessing images), so handlers run it on the
preparation pool (server/preparation.py).

Before tokenizing, the rendered prompt's length in characters is checked against the context:
no token spells more than ``max_token_chars`` characters, so a prompt of ``n`` characters has at
least ``ceil(n / max_token_chars)`` tokens, and one that cannot fit is refused without tokenizing.
The bound is exact, never refusing a prompt that fits, hence loose (V4's longest tokens are runs
of 128 spaces or dots): it stops absurd bodies, and the pool bounds the rest.

One file of ~430 lines: the pipeline above, step by step, each of recipe's gaps patched where
it occurs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import deepseek_recipe as recipe
import tokenizers

from deepinfer.config import ServerConfig
from deepinfer.images import PromptImage
from deepinfer.model.families import FAMILIES, ExpandImages
from deepinfer.server.errors import ApiError, bad_request
from deepinfer.server.images import ImageLimits, ImageResolver, ResolvedImages
from deepinfer.server.protocol import OutputConstraint, SamplingOptions
from deepinfer.server.sampling import _integer, build_sampling_options, read_extra_sampling
from deepinfer.server.structured_output import accept_strict_schema, read_output_constraint
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


# The constraint kinds the recipe produces; a node enforces each with a grammar.
_ENFORCED_CONSTRAINTS = ("json", "regex", "tool_call_required", "tool_call")

# DeepSeek's largest max_tokens (384K), the recipe's default bound in both modes.
_MAX_TOKENS_BOUND = recipe.ConversionOptions().thinking_max_tokens_upper_bound

# The recipe's refusal of a forced tool call in thinking mode (the prompt cannot open one).
_THINKING_TOOL_CHOICE = "Thinking mode does not support this tool_choice"


@dataclass
class Converted:
    """A body as the recipe converted it, with our corrections. Producer: ``Frontend.convert``;
    consumers: ``Frontend.prepare``, ``count_tokens``, ``/tokenize``."""

    request: recipe.ConversationRequest  # inference options, stream, the chunk generator
    conversation: recipe.Conversation  # what is encoded: the request's, or a corrected one
    parsing_options: recipe.ParsingOptions
    constraint: OutputConstraint | None
    echo: recipe.ResponsesEcho | None = None  # Responses only
    namespace_tool_map: dict[str, tuple[str, str]] | None = None  # Responses only


@dataclass
class Prepared:
    """A converted request. Producer: ``Frontend.prepare`` (worker thread); consumer: the
    handler, which makes the ApiRequest and the recipe's chunk generator from it."""

    kind: ApiKind
    model: str  # the requested name, echoed in responses
    conversation_request: recipe.ConversationRequest
    parsing_options: recipe.ParsingOptions
    prompt_token_ids: list[int]  # one placeholder per image
    images: ResolvedImages
    # The prompt as the node grows it (its images' positions), for the routing keys; None:
    # ``prompt_token_ids`` (no images), or, with ``routing_images`` empty, its ids up to the
    # first image when the checkpoint's image geometry is not known here.
    routing_token_ids: list[int] | None
    routing_images: list[PromptImage]
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
        default_max_tokens: int | None = None,
        image_limits: ImageLimits | None = None,
        expand_images: ExpandImages | None = None,
    ) -> None:
        if model_type not in FAMILIES:
            raise ValueError(f"model_type must be one of {sorted(FAMILIES)}, got {model_type!r}")
        path = Path(tokenizer_path)
        if path.is_dir():
            path = path / "tokenizer.json"
        self.served_model_name = served_model_name
        self.model_type = model_type
        self.default_max_tokens = default_max_tokens
        self.images = ImageResolver(image_limits or ImageLimits.of(ServerConfig()))
        self.expand_images = expand_images  # as the node grows images (None: not known here)
        self.recipe_tokenizer, self.tokenizer = _load_tokenizers(path.resolve())
        self.max_token_chars = _max_token_chars(self.tokenizer)
        # What the encoding writes for each image (a placeholder the node grows to its size).
        self.image_token_id = self.tokenizer.token_to_id(recipe.SpecialToken.Image.default_str())
        # The family table names the recipe's version and prompt encoding of the checkpoint.
        family = FAMILIES[model_type]
        version = getattr(recipe.ModelVersion, family.recipe_version)
        encoding_cls = getattr(recipe, family.recipe_encoding)
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
            body = json.loads(raw, parse_constant=_refuse_constant)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad_request(f"Invalid JSON body: {e}") from None
        except RecursionError:
            raise bad_request("Invalid JSON body: nested too deeply") from None
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
        self, kind: ApiKind, body: dict[str, Any], context_limit: int | None = None
    ) -> Converted:
        """The recipe's conversion of ``body``; ``context_limit`` bounds ``max_tokens``."""
        self.check_model(body.get("model"))
        bound = min(_MAX_TOKENS_BOUND, context_limit or _MAX_TOKENS_BOUND)
        body = _recipe_body(kind, body, bound)
        try:
            request = _REQUEST_CLASSES[kind](body)
        except ValueError as e:  # serde: wrong types, missing fields, unknown enum values
            raise bad_request(str(e)) from None
        except OverflowError:  # an integer anywhere in the body past what JSON numbers hold
            raise bad_request(
                "Invalid request body: an integer is out of range (at most 2^64 - 1)"
            ) from None
        except RecursionError:
            raise bad_request("Invalid request body: nested too deeply") from None
        options = self.options.with_thinking_max_tokens_upper_bound(
            bound
        ).with_non_thinking_max_tokens_upper_bound(bound)
        try:
            extras = {}
            if kind is ApiKind.RESPONSES:
                extras["echo"] = request.echo()
                extras["namespace_tool_map"] = request.namespace_tool_map(self.options)
            conversation_request = request.convert(options)
        except recipe.ConversionError as e:
            raise _from_conversion_error(e) from None
        constraint = conversation_request.inference_options.output_constraint
        converted = Converted(
            request=conversation_request,
            conversation=conversation_request.conversation,
            parsing_options=conversation_request.parsing_options,
            constraint=(
                OutputConstraint(kind=constraint.kind, schema=constraint.schema)
                if constraint is not None and constraint.kind in _ENFORCED_CONSTRAINTS
                else None
            ),
            **extras,
        )
        if kind is ApiKind.MESSAGES and _tool_choice_type(body) == "any":
            return _require_tool_call(converted)
        return converted

    def encode(self, conversation: recipe.Conversation, context_limit: int) -> list[int]:
        """The prompt's token ids, one placeholder per image; refused (400) without tokenizing
        when its characters alone prove it longer than ``context_limit`` tokens."""
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
        if kind is ApiKind.MESSAGES and body.get("max_tokens") is None:
            raise bad_request("max_tokens: Field required", "max_tokens")  # Anthropic's words
        converted = self.convert(kind, body, context_limit)
        conversation_request = converted.request
        self.images.check_conversation(converted.conversation)  # before any work
        prompt_token_ids = self.encode(converted.conversation, context_limit)
        images = self.images.resolve(converted.conversation)
        num_prompt = len(prompt_token_ids) + images.num_extra_tokens
        try:
            max_tokens = conversation_request.resolve_max_tokens(num_prompt, context_limit)
        except recipe.ConversionError as e:  # prompt (+ max_tokens) longer than the context
            raise _from_conversion_error(e) from None
        inference = conversation_request.inference_options
        if inference.max_tokens is None and self.default_max_tokens is not None:
            max_tokens = max(1, min(self.default_max_tokens, context_limit - num_prompt))
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
        return Prepared(
            kind=kind,
            model=body["model"],
            conversation_request=conversation_request,
            parsing_options=converted.parsing_options,
            prompt_token_ids=prompt_token_ids,
            images=images,
            **self._routing_prompt(prompt_token_ids, images),
            sampling=sampling,
            constraint=read_output_constraint(body, converted.constraint),
            cache_salt=extra.cache_salt,
            echo=converted.echo,
            namespace_tool_map=converted.namespace_tool_map,
        )

    def _routing_prompt(self, ids: list[int], images: ResolvedImages) -> dict[str, Any]:
        """``Prepared``'s routing fields: the prompt grown as the node grows it, when the
        checkpoint's image geometry is known; else its ids up to the first image (past it the
        node's keys hold the images' digests and positions, which are not known here)."""
        if not images.images:
            return {"routing_token_ids": None, "routing_images": []}
        if self.expand_images is not None:
            try:
                grown, spans = self.expand_images(ids, images.images)
                return {"routing_token_ids": grown, "routing_images": spans}
            except ValueError:
                pass  # the node refuses the request with the reason
        first = ids.index(self.image_token_id) + 1 if self.image_token_id in ids else len(ids)
        return {"routing_token_ids": ids[:first], "routing_images": []}

    def count_tokens(self, kind: ApiKind, body: dict[str, Any], context_limit: int) -> int:
        """The prompt's token count, each image at its positions (its sources are fetched);
        a prompt that cannot fit the context is refused (400)."""
        conversation = self.convert(kind, body).conversation
        num_tokens = len(self.encode(conversation, context_limit))
        return num_tokens + self.images.resolve(conversation).num_extra_tokens


def _refuse_constant(name: str) -> None:
    """json.loads takes NaN and Infinity, which are not JSON: every range check passes them."""
    raise bad_request(f"Invalid JSON body: {name} is not a valid JSON number")


def _recipe_body(kind: ApiKind, body: dict[str, Any], max_tokens_bound: int) -> dict[str, Any]:
    """``body`` with the fields recipe 0.2.0 drops or refuses put in the terms it reads."""
    body = dict(body)
    if kind is ApiKind.CHAT:
        # OpenAI's current name; it wins over max_tokens, as in vLLM.
        limit = _integer(body, "max_completion_tokens", 1, max_tokens_bound)
        body.pop("max_completion_tokens", None)
        if limit is not None:
            body["max_tokens"] = limit
        response_format = body.get("response_format")
        if isinstance(response_format, dict) and "json_schema" in response_format:
            schema = accept_strict_schema(response_format["json_schema"])
            body["response_format"] = {**response_format, "json_schema": schema}
    elif kind is ApiKind.RESPONSES:
        if body.get("thinking") is not None:
            body["reasoning"] = _reasoning_of(body.pop("thinking"), body.get("reasoning"))
        text = body.get("text")
        if isinstance(text, dict) and isinstance(text.get("format"), dict):
            body["text"] = {**text, "format": accept_strict_schema(text["format"])}
    return body


def _reasoning_of(thinking: Any, reasoning: Any) -> Any:
    """DeepSeek's ``thinking`` on Responses, as chat reads it: it decides whether the model
    reasons (over an effort: off is ``effort: none``), ``reasoning.effort`` how much."""
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled"):
        raise bad_request(
            f'Invalid thinking {thinking!r}: expected {{"type": "enabled"}} or '
            '{"type": "disabled"}',
            "thinking",
        )
    if reasoning is not None and not isinstance(reasoning, dict):
        return reasoning  # the recipe names the type error
    reasoning = dict(reasoning or {})
    if kind == "disabled":
        reasoning["effort"] = "none"
    elif reasoning.get("effort") in (None, "none"):
        reasoning["effort"] = "high"  # thinking mode's default effort
    return reasoning


def _tool_choice_type(body: dict[str, Any]) -> Any:
    tool_choice = body.get("tool_choice")
    return tool_choice.get("type") if isinstance(tool_choice, dict) else None


def _require_tool_call(converted: Converted) -> Converted:
    """Anthropic's ``tool_choice: {"type": "any"}`` (call one of the tools), which recipe 0.2.0
    reads as auto: a required tool call, as OpenAI's ``"required"`` converts (the prompt opens
    the DSML block, parsing starts inside it, the grammar enforces the calls), and refused in
    thinking mode as the recipe refuses ``{"type": "tool"}``."""
    conversation = converted.conversation
    if conversation.thinking_mode:
        raise bad_request(_THINKING_TOOL_CHOICE, "tool_choice")
    if not conversation.tools:
        raise bad_request("tool_choice any needs tools", "tool_choice")
    assert converted.constraint is not None and converted.constraint.kind == "tool_call", (
        f"the recipe's constraint for tool_choice any: {converted.constraint!r}"
    )
    assert conversation.response_format == "text", conversation.response_format
    parsing_options = converted.parsing_options
    parsing_options.starts_in_tool_calls = True
    return dataclasses.replace(
        converted,
        conversation=recipe.Conversation(
            conversation.messages,
            thinking_mode=False,
            tools=conversation.tools,
            tool_choice="required",
            reasoning_effort=conversation.reasoning_effort,
        ),
        parsing_options=parsing_options,
        constraint=OutputConstraint(kind="tool_call_required", schema=converted.constraint.schema),
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
