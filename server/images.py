"""A request's images: checked, fetched and preprocessed by deepseek-recipe, for the node.

    conversation's image sources --check (count, hosts, data-URL sizes; nothing fetched yet)
        --recipe ImageResolver (fetch with the allow-list as its destination filter,
          OpenCvImagePreprocessor)--> MultiModalData: WebP bytes at the model's geometry
        --> ImageInput per image (GenerateRequest.images), the image token adjustment

Image URLs are fetched by the server, so they are an SSRF risk: only hosts on
``server.image_url_allowlist`` are fetched, and the fetcher connects only to addresses of those
hosts (a redirect elsewhere is refused). data: URLs are always accepted. Limits, each a 400
naming it: ``server.max_images_per_request`` images, ``server.max_image_bytes`` encoded bytes per
image and ``server.max_request_image_bytes`` all together. Resolving blocks on the network and
the decoder (the recipe releases the GIL), so it runs where ``Frontend.prepare`` runs: on the
preparation pool, never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urlsplit

import deepseek_recipe as recipe

from deepinfer.config import ServerConfig
from deepinfer.images import ImageInput
from deepinfer.server.errors import bad_request


@dataclass(frozen=True)
class ImageLimits:
    allowlist: frozenset[str]  # hosts, lower case
    max_images: int
    max_image_bytes: int
    max_request_image_bytes: int

    @classmethod
    def of(cls, config: ServerConfig) -> ImageLimits:
        return cls(
            allowlist=frozenset(h.lower() for h in config.image_url_allowlist),
            max_images=config.max_images_per_request,
            max_image_bytes=config.max_image_bytes,
            max_request_image_bytes=config.max_request_image_bytes,
        )


@dataclass
class ResolvedImages:
    images: list[ImageInput]
    num_extra_tokens: int  # prompt positions beyond one per placeholder


NO_IMAGES = ResolvedImages([], 0)


class ImageResolver:
    def __init__(self, limits: ImageLimits) -> None:
        self.limits = limits
        fetcher = recipe.ReqwestImageFetcher.with_max_bytes(limits.max_image_bytes)
        self._resolver = recipe.ImageResolver(
            fetcher.with_destination_filter(self._may_connect), recipe.OpenCvImagePreprocessor()
        )

    def _may_connect(self, host: str, address: str) -> bool:
        """The fetcher's destination filter: allow-listed hosts only (redirects included)."""
        return host.lower().rstrip(".") in self.limits.allowlist

    def resolve(self, conversation: recipe.Conversation) -> ResolvedImages:
        """The conversation's images, in placeholder order. Raises ApiError (400) naming the
        image (its request path) and the problem; nothing is fetched unless every check on the
        sources passes."""
        sources = _sources(conversation)
        if not sources:
            return NO_IMAGES
        self.check(sources)
        quota = recipe.ImageQuota()
        try:
            data = self._resolver.resolve(sources, quota)
            num_extra_tokens = data.image_token_adjustment()
        except recipe.ImageError as e:
            raise bad_request(str(e), "messages") from None
        except recipe.CalcResizeError as e:
            raise bad_request(f"An image cannot be fitted to the model: {e}", "messages") from None
        if quota.byte_size() > self.limits.max_request_image_bytes:
            raise bad_request(
                f"The request's images are {quota.byte_size()} bytes, more than the "
                f"{self.limits.max_request_image_bytes} this server accepts in one request "
                "(server.max_request_image_bytes)",
                "messages",
            )
        images = [ImageInput(i.data, i.width, i.height) for i in data.images]
        return ResolvedImages(images, num_extra_tokens)

    def check_conversation(self, conversation: recipe.Conversation) -> None:
        """``check`` of the conversation's image sources (before it is even encoded)."""
        self.check(_sources(conversation))

    def check(self, sources: list[recipe.ImageSource]) -> None:
        """What can be refused before fetching anything: the count, URL hosts, data-URL sizes."""
        limits = self.limits
        if len(sources) > limits.max_images:
            raise bad_request(
                f"The request has {len(sources)} images, more than the {limits.max_images} this "
                "server accepts (server.max_images_per_request)",
                "messages",
            )
        for source in sources:
            param = source.path.lstrip(".") or "messages"
            if source.kind == "url":
                host = (urlsplit(source.url or "").hostname or "").lower()
                if host not in limits.allowlist:
                    raise bad_request(
                        f"Image URLs are not allowed on this server (host {host!r} is not in "
                        f"server.image_url_allowlist); send the image as a data: URL",
                        param,
                    )
            elif source.kind == "data_url":
                size = _data_url_size(source.data_url or "")
                if size > limits.max_image_bytes:
                    raise bad_request(
                        f"An image is {size} bytes, more than the {limits.max_image_bytes} this "
                        "server accepts (server.max_image_bytes)",
                        param,
                    )


def _sources(conversation: recipe.Conversation) -> list[recipe.ImageSource]:
    return [s for message in conversation.messages for s in message.image_sources]


def _data_url_size(url: str) -> int:
    """The decoded size of a data: URL's body, from its length (base64: 3 bytes per 4)."""
    head, _, body = url.partition(",")
    if head.endswith(";base64"):
        body = body.strip()
        return len(body) * 3 // 4 - body[-2:].count("=")
    return len(unquote_to_bytes(body))
