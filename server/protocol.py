"""Internal messages between the coordinator and the nodes (msgspec structs, msgpack on the wire).

    coordinator --GenerateRequest--> node  POST /internal/generate   (body: one msgpack message)
    coordinator <--Frame stream---- node   response body: length-prefixed msgpack frames
    coordinator --AbortRequest-----> node  POST /internal/abort
    coordinator --FinishRequest----> node  POST /internal/finish    (a stop string matched on text)
    coordinator --GenerateRequest--> decode node  POST /internal/decode  (with ``hand_off``):
                <--Reserved, then TokenDeltas      blocks kept, then the request decoded
    coordinator --CollectRequest---> decode node  POST /internal/collect (the prefill node sends)
    a prefill node's /internal/generate with ``hand_off`` ends with HandedOff (kv_transfer.py)
    node --NodeRegistration--> coordinator POST /internal/register  (reply: NodeLease)
    node --NodeHeartbeat-----> coordinator POST /internal/heartbeat (carries the lease id)
    node --CacheEventBatch---> coordinator POST /internal/cache_events   (reply: CacheSync)
    node --CacheSnapshot-----> coordinator POST /internal/cache_snapshot (reply: CacheSync)

Frames on the generate stream: 4-byte big-endian length, then one msgpack-encoded ``StreamFrame``
(a tagged union of TokenDelta and StreamError). Token ids only: nodes never see text.
Never pickle across a socket.

Content types: request bodies and non-stream replies are ``MESSAGE_CONTENT_TYPE`` (one msgpack
message); the generate stream is ``FRAME_CONTENT_TYPE``. A request the node refuses before
streaming (bad body, bad sampling options, unsupported constraint, prompt too long) gets an HTTP
4xx/5xx whose body is one msgpack StreamError; errors after streaming began are a StreamError frame.
"""

from __future__ import annotations

import struct
from typing import TypeVar

import msgspec

from deepinfer.config import SchedulerConfig
from deepinfer.images import ImageInput
from deepinfer.kv_cache.events import CacheEvent, CacheLayout
from deepinfer.sampling_params import SamplingParams


class SamplingOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """SamplingParams on the wire (token-level options only; stop strings stay on the text side)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    deterministic: bool = False

    def to_sampling_params(self) -> SamplingParams:
        """Raises ValueError (naming the field) on out-of-range values."""
        return SamplingParams(**msgspec.structs.asdict(self))


class OutputConstraint(msgspec.Struct, kw_only=True):
    """deepseek-recipe's OutputConstraint: kind "json" | "regex" | "tool_call_required" |
    "tool_call"; ``schema`` the JSON schema / regex / tool grammar source."""

    kind: str
    schema: str = ""


class HandOffRoute(msgspec.Struct, kw_only=True, frozen=True):
    """One request's way between a pair of nodes (server/kv_transfer.py): its cache from a
    prefill node to a decode node, or its images' embeddings from an encode node to its prefill
    or mixed node. Producers: the coordinator's PairedBackend (server/pairing.py) and
    EncodedBackend (server/encoding.py). Consumers: both nodes."""

    pair_key: str  # the pair's process group; a new key after any failure on the pair
    transfer_id: int  # this request's transfer on the pair (the tag of its messages)
    peer: str  # the other node's id (for logs)
    # The pairs' store of the node that hosts it (the decode or encode node) and that node
    # process's incarnation, from its Reserved frame (the host itself gets them empty): a host
    # that restarted has a new incarnation, so no peer reuses a pair with its former process.
    store_host: str = ""
    store_port: int = 0
    store_incarnation: str = ""


class ImageData(msgspec.Struct, kw_only=True, frozen=True):
    """One image of a prompt, preprocessed by the request side (server/images.py): encoded
    bytes (WebP) and its size in pixels, a multiple of the model's patch."""

    data: bytes
    width: int
    height: int


class GenerateRequest(msgspec.Struct, kw_only=True):
    """``images``: one per image placeholder of ``prompt_token_ids`` (the tokenizer's image
    token), in order; the node grows each placeholder to the image's positions."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    constraint: OutputConstraint | None = None
    cache_salt: str | None = None
    hand_off: HandOffRoute | None = None  # a prefill or decode node's part of a hand-off
    images: list[ImageData] = []
    # The images' embeddings come from an encode node on this route (after a CollectRequest).
    images_from: HandOffRoute | None = None

    def image_inputs(self) -> list[ImageInput]:
        return image_inputs(self.images)


class EncodeRequest(msgspec.Struct, kw_only=True):
    """An encode node: encode ``images`` and send their embeddings on ``route`` (to the node
    that hosts the request's prompt)."""

    request_id: str
    images: list[ImageData]
    route: HandOffRoute

    def image_inputs(self) -> list[ImageInput]:
        return image_inputs(self.images)


def image_inputs(images: list[ImageData]) -> list[ImageInput]:
    """``images`` as the engine takes them."""
    return [ImageInput(i.data, i.width, i.height) for i in images]


class CollectRequest(msgspec.Struct, kw_only=True):
    """Decode node: the prefill node is sending the request's cache now; receive it. Prefill or
    mixed node: the encode node is sending the request's images' embeddings now."""

    request_id: str


class TokenDelta(msgspec.Struct, tag="delta", kw_only=True, omit_defaults=True):
    """New tokens of one request (one frame per engine step), and finish info on the last frame.

    ``logprobs``: one ``{token_id: logprob}`` per new token when asked. ``prompt_logprobs``: one
    dict per prompt position delivered in this step. Counts are filled on the first and last
    frames: ``num_prompt_tokens``, ``num_cached_tokens`` (prompt tokens served from the cache).
    """

    request_id: str
    token_ids: list[int] = []
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # a FinishReason: "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class StreamError(msgspec.Struct, tag="error", kw_only=True):
    """The request failed on the node; ``status`` is the HTTP status the API should answer."""

    request_id: str
    status: int
    message: str


class Reserved(msgspec.Struct, tag="reserved", kw_only=True):
    """A decode node's first frame: blocks and a slot are kept for the request; the prefill
    node joins the pair on the store at ``store_host:store_port``. An encode node's first
    frame: the request's images are queued; its node joins the pair there."""

    request_id: str
    store_host: str
    store_port: int
    incarnation: str  # this node process's (random at its start)

    def route(self, route: HandOffRoute, peer: str) -> HandOffRoute:
        """``route`` as its other node takes it: on this store, ``peer`` the node that sent
        this frame."""
        return msgspec.structs.replace(
            route,
            peer=peer,
            store_host=self.store_host,
            store_port=self.store_port,
            store_incarnation=self.incarnation,
        )


class Encoded(msgspec.Struct, tag="encoded", kw_only=True):
    """An encode node's second frame: the embeddings are ready and being sent (the coordinator
    tells the receiving node to collect them)."""

    request_id: str
    num_images: int
    seconds: float  # from the request's arrival to its embeddings (queue and tower)


class HandedOff(msgspec.Struct, tag="handed_off", kw_only=True):
    """A prefill node's last frame: the decode node has the request's cache. An encode node's:
    the request's node has the embeddings."""

    request_id: str
    num_bytes: int
    seconds: float


StreamFrame = TokenDelta | StreamError | Reserved | Encoded | HandedOff


class AbortRequest(msgspec.Struct, kw_only=True):
    request_ids: list[str]


class NodeLoad(msgspec.Struct, kw_only=True):
    """Producer: the node (AsyncEngine.load() through server/node_stream.py's node_load).
    Consumer: the coordinator's router. ``is_draining``: the node got SIGTERM and takes no new
    requests. ``is_healthy``: its engine loop turns (False once it failed or while one step is
    stuck: out of rotation)."""

    num_running: int = 0
    num_waiting: int = 0
    num_prefill_tokens: int = 0  # prompt tokens still to compute there (a prefill node's load)
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_used_slots: int = 0
    is_draining: bool = False
    is_healthy: bool = True


class NodeRegistration(msgspec.Struct, kw_only=True):
    node_id: str
    url: str  # where the coordinator reaches the node's internal API
    role: str  # "mixed" | "prefill" | "decode" | "encode"
    model: str  # the checkpoint's served name
    max_model_len: int
    max_num_seqs: int = SchedulerConfig.max_num_seqs  # requests it runs at once
    load: NodeLoad = msgspec.field(default_factory=NodeLoad)
    # Ranks of one model in lock-step (config [parallel]): every rank of an instance registers
    # with its id, its rank and the instance's size; an instance serves only with all of them.
    instance_id: str = ""  # "": the node is an instance of one
    rank: int = 0
    num_ranks: int = 1
    # Set: the node publishes its prefix cache's events (CacheEventBatch) for routing, and
    # names its blocks so (the coordinator hashes prompts the same way).
    cache: CacheLayout | None = None


class NodeLease(msgspec.Struct, kw_only=True):
    """The coordinator's answer to a registration. Producer: NodeRegistry.register; consumer:
    the node's heartbeat loop. Only heartbeats carrying ``lease_id`` speak for ``node_id``; a
    later registration of the same node (a restart) gets a new lease."""

    node_id: str
    lease_id: str
    heartbeat_timeout_s: float


class NodeHeartbeat(msgspec.Struct, kw_only=True):
    node_id: str
    load: NodeLoad
    lease_id: str = ""  # from the node's NodeLease


class CacheEventBatch(msgspec.Struct, kw_only=True):
    """Changes to what a node's prefix cache holds. Producer: the node's publisher
    (server/cache_events.py); consumer: the coordinator's CacheIndex. ``events[i]`` is the
    node's event number ``first_seq + i``."""

    node_id: str
    lease_id: str
    first_seq: int
    events: list[CacheEvent]


class CacheSnapshot(msgspec.Struct, kw_only=True):
    """Everything a node's prefix cache holds after its event ``seq``: block keys by tier."""

    node_id: str
    lease_id: str
    seq: int
    held: dict[str, list[int]]


class CacheSync(msgspec.Struct, kw_only=True):
    """The coordinator's answer to either: the events it applied up to ``applied_seq``, or
    (``needs_snapshot``) none: it knows nothing of the node, or saw a gap."""

    applied_seq: int = 0
    needs_snapshot: bool = False


class FinishRequest(msgspec.Struct, kw_only=True):
    """End a request with finish_reason "stop": the text side matched a stop string.

    Producer: the coordinator's StreamProcessor. Consumer: the node (AsyncEngine.finish).
    ``stop_reason`` is reported back on the request's last TokenDelta.
    """

    request_id: str
    stop_reason: int | str | None = None


MESSAGE_CONTENT_TYPE = "application/x-msgpack"
FRAME_CONTENT_TYPE = "application/x-msgpack-stream"

MessageT = TypeVar("MessageT", bound=msgspec.Struct)

_ENCODER = msgspec.msgpack.Encoder()
_FRAME_DECODER = msgspec.msgpack.Decoder(StreamFrame)
_LENGTH = struct.Struct(">I")


def encode(message: msgspec.Struct) -> bytes:
    return _ENCODER.encode(message)


def decode(data: bytes, kind: type[MessageT]) -> MessageT:
    """Raises msgspec.ValidationError / DecodeError on a malformed or mistyped message."""
    return msgspec.msgpack.decode(data, type=kind)


def encode_frame(frame: StreamFrame) -> bytes:
    payload = _ENCODER.encode(frame)
    return _LENGTH.pack(len(payload)) + payload


class FrameReader:
    """Splits a byte stream into StreamFrames; feed chunks as they arrive."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[StreamFrame]:
        self._buffer += data
        frames: list[StreamFrame] = []
        while len(self._buffer) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self._buffer)
            end = _LENGTH.size + size
            if len(self._buffer) < end:
                break
            frames.append(_FRAME_DECODER.decode(bytes(self._buffer[_LENGTH.size : end])))
            del self._buffer[:end]
        return frames

    @property
    def has_partial_frame(self) -> bool:
        return bool(self._buffer)
