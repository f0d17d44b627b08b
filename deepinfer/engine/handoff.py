"""Prefill/decode hand-off, engine side: a request's cache leaves one engine, continues on another.

    prefill engine                                   decode engine
    add_request(..., hand_off=True)
    steps: the prompt in chunks (its own prefix
    cache), then the first token is sampled:
    the request is held (blocks + slot kept)
    export_request(id) -> RequestState  ──────────▶  import_request(state, params)
      tokens, the first token's logprobs, every        reserves blocks + a slot, writes every
      paged part of the prompt's blocks and the        part, and the request runs on from
      whole state slot, copied to the host             position len(prompt), its first token
    release_hand_off(id) once the other side has it    as the next input
      (the full blocks stay in the prefix cache)

The state slot carries everything that is not paged (window rings, the compressors' open
windows, the indexer's), so the decode engine continues from exactly the prefill engine's state:
the same tokens and logprobs as one engine computing both. Both sides must run the same model and
cache layout (``Executor.cache_salt``; checked). ``pack_state``/``unpack_state`` give a transport
(deepinfer/parallel/transfer.py) one header and a list of parts. When each side gives up what it
holds is the serving layer's business; a held request that nobody exports is released with
``release_hand_off`` (its blocks go back at once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import torch

from deepinfer.images import PromptImage
from deepinfer.kv_cache.pool import KVCache
from deepinfer.kv_cache.spec import CachePart
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.request import Request
from deepinfer.scheduler.scheduler import Scheduler


@dataclass
class RequestState:
    """One request's hand-off. Producer: ``export_request`` (prefill engine). Consumer:
    ``import_request`` (decode engine). Tensors in the cache spec's part order, on the host
    (or, exported ``on_device``, on the prefill engine's device)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the first token (sampled by the prefill engine)
    output_logprobs: list[dict[int, float]]  # its logprobs when asked for
    num_cached_tokens: int  # prompt tokens the prefill engine found in its prefix cache
    cache_salt: str | None  # the request's tenant salt (prefix cache isolation)
    model_salt: bytes  # the prefill engine's cache salt: model, weights, cache layout
    # Per paged part, the prompt's blocks' rows stacked: [num_blocks, *row_shape].
    blocks: list[torch.Tensor]
    slot: list[torch.Tensor]  # the state slot's parts


@dataclass
class HandOffExport:
    """Where ``AsyncEngine.generate(..., hand_off=export)`` puts a prefill-side request's state
    when it leaves the engine; None while it has not (or if it finished there, with its first
    token). ``on_device``: asked when the state leaves; True keeps its tensors on the device
    (a transport that moves them from there: CUDA IPC), else they are copied to the host."""

    state: RequestState | None = None
    on_device: Callable[[], bool] = lambda: False


class _StateHeader(msgspec.Struct):
    """A RequestState without its tensors, for a transport's header (msgpack)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_logprobs: list[dict[int, float]]
    num_cached_tokens: int
    cache_salt: str | None
    model_salt: bytes
    num_paged_parts: int


def pack_state(state: RequestState) -> tuple[bytes, list[torch.Tensor]]:
    """(header, parts) for a transport (deepinfer/parallel/transfer.py): the paged parts (each
    every block's rows), then the slot's."""
    header = _StateHeader(
        state.request_id,
        state.prompt_token_ids,
        state.output_token_ids,
        state.output_logprobs,
        state.num_cached_tokens,
        state.cache_salt,
        state.model_salt,
        len(state.blocks),
    )
    return msgspec.msgpack.encode(header), [*state.blocks, *state.slot]


def unpack_state(header: bytes, tensors: list[torch.Tensor]) -> RequestState:
    """``pack_state``'s inverse (ValueError on a malformed header or part count)."""
    try:
        h = msgspec.msgpack.decode(header, type=_StateHeader)
    except msgspec.DecodeError as error:
        raise ValueError(f"a hand-off header that does not decode: {error}") from error
    if len(tensors) < h.num_paged_parts:
        raise ValueError(f"{len(tensors)} parts for {h.num_paged_parts} paged parts")
    return RequestState(
        h.request_id,
        h.prompt_token_ids,
        h.output_token_ids,
        h.output_logprobs,
        h.num_cached_tokens,
        h.cache_salt,
        h.model_salt,
        tensors[: h.num_paged_parts],
        tensors[h.num_paged_parts :],
    )


def export_request(
    scheduler: Scheduler,
    cache: KVCache,
    model_salt: bytes,
    request_id: str,
    on_device: bool = False,
) -> RequestState:
    """The held hand-off ``request_id``'s state (KeyError if it is not held: not sampled yet,
    released, or never a hand-off): copies on the host, or ``on_device`` on the cache's device
    (queued there behind the steps: later steps that reuse the blocks run after the copies).
    It stays held until ``Scheduler.release_held``."""
    request = scheduler.held_request(request_id)
    if request is None:
        raise KeyError(f"request {request_id!r} is not a held hand-off")
    assert request.state_slot is not None
    return RequestState(
        request_id=request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        output_token_ids=list(request.output_token_ids),
        output_logprobs=list(request.output_logprobs),
        num_cached_tokens=request.num_cached_tokens,
        cache_salt=request.cache_salt,
        model_salt=model_salt,
        blocks=[_leave(t, on_device) for t in cache.blocks_payload(request.block_table)],
        slot=[_leave(t, on_device) for t in cache.slot_payload(request.state_slot)],
    )


def _leave(tensor: torch.Tensor, on_device: bool) -> torch.Tensor:
    return tensor if on_device else tensor.cpu()


def import_request(
    scheduler: Scheduler,
    cache: KVCache,
    model_salt: bytes,
    state: RequestState,
    params: SamplingParams,
    eos_token_id: int | None,
    images: Sequence[PromptImage] = (),
) -> Request:
    """Continue ``state`` on this engine: check, write, run. Its blocks and slot are the
    request id's reservation (``Scheduler.reserve_hand_off``, made when the hand-off was
    announced), else reserved now. ``images``: the prompt's, so that its blocks are cached
    under the keys a prefill of it gives (and a recompute has the pixels). Raises ValueError
    (other model or layout, malformed state, no room now) with nothing taken: a reservation
    stays the caller's."""
    if state.model_salt != model_salt:
        raise ValueError(
            f"request {state.request_id!r}: its cache comes from another model or cache layout"
        )
    num_prompt = len(state.prompt_token_ids)
    num_blocks = -(-num_prompt // scheduler.block_size)
    sent = sorted({len(t) for t in state.blocks})
    if sent != [num_blocks] or not state.output_token_ids:
        raise ValueError(
            f"request {state.request_id!r}: {'/'.join(map(str, sent))} blocks for {num_prompt} "
            f"prompt tokens and {len(state.output_token_ids)} output tokens"
        )
    request = Request(
        request_id=state.request_id,
        prompt_token_ids=list(state.prompt_token_ids),
        sampling_params=params,
        eos_token_id=eos_token_id,
        cache_salt=state.cache_salt,
        output_token_ids=list(state.output_token_ids),
        output_logprobs=list(state.output_logprobs),
        num_cached_tokens=state.num_cached_tokens,
        images=tuple(images),
    )
    _check_parts(state.request_id, "block", cache.spec.paged, state.blocks, cache.dtype, 1)
    _check_parts(state.request_id, "state slot", cache.spec.state, state.slot, cache.dtype, 0)
    reservation = scheduler.reservation(state.request_id)
    block_ids, slot = reservation or scheduler.reserve_hand_off(state.request_id, num_prompt)
    if len(block_ids) != num_blocks:
        raise ValueError(
            f"request {state.request_id!r}: {len(block_ids)} blocks reserved for {num_blocks} sent"
        )
    cache.write_blocks(block_ids, state.blocks)
    cache.write_slot(slot, [t.to(cache.device) for t in state.slot])
    scheduler.add_handed_off(request)
    return request


def _check_parts(
    request_id: str,
    kind: str,
    parts: tuple[CachePart, ...],
    payload: list[torch.Tensor],
    cache_dtype: torch.dtype,
    num_leading: int,
) -> None:
    """Every part of a payload has its part's row shape (after ``num_leading`` dimensions, the
    blocks') and dtype: a copy would broadcast a mis-shaped one."""
    want = [(part.row_shape(), part.tensor_dtype(cache_dtype)) for part in parts]
    got = [(tuple(t.shape[num_leading:]), t.dtype) for t in payload]
    if got != want:
        raise ValueError(
            f"request {request_id!r}: its {kind} parts do not fit this cache: {got} != {want}"
        )
