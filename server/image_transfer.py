"""Images' embeddings from an encode node to the node that runs the request's prompt.

    coordinator (server/encoding.py)     encode node                      prefill / mixed node
    POST /internal/encode ─────────────▶ decode the images (400: bad)
      (images, route: key, transfer id)  queue them (AsyncImageEncoder)
                           ◀─Reserved──  its pairs' store: host:port
    POST /internal/generate (images, images_from: the route and that store) ──▶ joins the pair
                                         the tower runs (batched with    (beside the encode)
                           ◀─Encoded──   other requests' images)
    POST /internal/collect ─────────────────────────────────────────────▶ recv(transfer id)
                                         send(transfer id) ════ pair ═══▶ checked: the request's
                           ◀─HandedOff─                                   images, in order
                                                                          -> the engine, each
                                                                          image with its
                                                                          embeddings

The receiver posts its receive only once the embeddings exist (``collect``), so that no receive
waits on the tower: every wait on a pair is bounded by ``kv_transfer.lease_s``. The encode node
hosts the pairs' store (rank 0), as a decode node does for caches (server/kv_transfer.py, whose
pairs these are). One transfer: a msgpack header (the images' digests, in order) and one part
per image, [num_tokens, D] in the tower's dtype.

A failure ends both sides: an encode node that dies fails the receive at once (or the join:
its store is gone), a receiver that goes away fails the send at the lease; the coordinator
names the encode node in the error either way (server/encoding.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import msgspec

from deepinfer.engine.image_encoder import AsyncImageEncoder, EncoderClosedError
from deepinfer.images import ImageInput, decode_images
from deepinfer.parallel.transfer import TransferError
from deepinfer.server.kv_transfer import KVTransfers
from deepinfer.server.protocol import (
    Encoded,
    EncodeRequest,
    GenerateRequest,
    HandedOff,
    Reserved,
)
from deepinfer.server.routing import NodeError


async def encode_frames(
    encoder: AsyncImageEncoder, transfers: KVTransfers, message: EncodeRequest
) -> AsyncIterator[Reserved | Encoded | HandedOff]:
    """An encode node's stream for one request: Reserved, Encoded once the embeddings exist,
    HandedOff once its node has them. Raises NodeError: 400 (no images, or one does not
    decode), 503 (the encoder is stopping; is_node_failure), 500 (the tower failed), 502 (the
    transfer failed)."""
    began = time.monotonic()
    route = message.route
    if not message.images:
        raise NodeError(400, f"request {message.request_id!r}: no images to encode")
    try:
        images = await asyncio.to_thread(decode_images, message.image_inputs())
    except ValueError as error:
        raise NodeError(400, f"request {message.request_id!r}: {error}") from error
    transfers.join(route)  # joins beside the encoding
    host, port = transfers.store_address
    yield Reserved(
        request_id=message.request_id,
        store_host=host,
        store_port=port,
        incarnation=transfers.incarnation,
    )
    try:
        embeddings = await encoder.encode(images)
    except EncoderClosedError as error:
        raise NodeError(503, str(error), is_node_failure=True) from error
    except Exception as error:
        raise NodeError(500, f"the vision tower failed: {error!r}") from error
    yield Encoded(
        request_id=message.request_id,
        num_images=len(images),
        seconds=time.monotonic() - began,
    )
    header = msgspec.msgpack.encode([image.digest for image in images])
    try:
        num_bytes, seconds = await transfers.send_parts(route, header, embeddings)
    except TransferError as error:
        raise NodeError(502, f"sending the embeddings to {route.peer} failed: {error}") from error
    yield HandedOff(request_id=message.request_id, num_bytes=num_bytes, seconds=seconds)


async def received_images(transfers: KVTransfers, message: GenerateRequest) -> list[ImageInput]:
    """A prefill or mixed node: the message's images, each with the embeddings its encode node
    sent (received once the coordinator says they are being sent). Raises NodeError 502 (the
    transfer failed, or what came is not this request's images)."""
    route = message.images_from
    assert route is not None
    request_id = message.request_id
    images = message.image_inputs()
    collected = transfers.expect(request_id)
    try:
        transfers.join(route)
        await collected.wait()
        header, parts = await transfers.recv_parts(route)
    except TransferError as error:
        raise NodeError(
            502, f"receiving the images' embeddings from {route.peer} failed: {error}"
        ) from error
    finally:
        transfers.forget(request_id)
    try:
        digests = msgspec.msgpack.decode(header, type=list[bytes])
    except msgspec.DecodeError as error:
        raise NodeError(502, f"malformed embeddings from {route.peer}: {error}") from error
    if digests != [image.digest for image in images] or len(parts) != len(images):
        raise NodeError(
            502, f"request {request_id!r}: the embeddings from {route.peer} are other images'"
        )
    return [
        dataclasses.replace(image, embeds=part) for image, part in zip(images, parts, strict=True)
    ]
