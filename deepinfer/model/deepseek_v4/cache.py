"""DeepSeek-V4's cache spec: what each layer keeps per request (hd = head_dim, ihd =
index_head_dim, m = the layer's ratio, R = sliding_window + ring_margin, d = max_draft, B =
m - 1 + d buffer rows, K = 1 + ceil(d / m) overlap windows).

    paged parts (one block table per request, shared by every layer; block = block_size tokens)
    ---------------------------------------------------------------------------------------
    CSA layer  (i, "entries")     [block_size/4, hd]    entry w <- tokens [4w, 4w+4)
               (i, "index_keys")  [block_size/4, ihd]   the Lightning indexer's keys
    HCA layer  (i, "entries")     [block_size/m, hd]    entry w <- tokens [mw, mw+m)
    sliding    (nothing paged)

        entry w of a layer with ratio m lives in block block_table[(w*m) // block_size]
        at row ((w*m) % block_size) // m.

    state parts (one slot per running request)
    ---------------------------------------------------------------------------------------
    every layer  (i, "ring")            [R, hd]            token p's post-rope K=V at row p % R
    MTP layer    (n + j, "ring"), (n + j, "mtp_hidden") [hc, D]: the stack's last hidden streams
                 (n = num_layers; only when served: speculative.method = "mtp", mtp.py)
    CSA layer    (i, "comp.buf_kv"), (i, "comp.buf_gate")  [B, 2hd]  raw kv_proj / gate_proj
                 (i, "comp.prev_kv"), (i, "comp.prev_gate")  [K*m, hd]  closed windows' Ca halves
                 (i, "idx.*")  the same for the indexer's compressor at ihd
    HCA layer    (i, "comp.buf_kv"), (i, "comp.buf_gate")  [B, hd]  raw tokens

The compressor buffer is a ring over the tokens that are not a window's last (those are pooled
in the step that computes them and never needed again): token p is the q-th such token, q = p -
p // m, and lives at row q % B. An open window's tokens are consecutive in q, so they sit in
consecutive rows (mod B); at d = 0 (B = m - 1) window w's i-th token is at row i::

    m = 4, d = 3, B = 6      positions  0 1 2 (3) 4 5 6 (7) 8 9 10 (11) 12 ...
                             q          0 1 2  -  3 4 5  -  6 7  8   -   9
                             row        0 1 2  -  3 4 5  -  0 1  2   -   3

The overlap state is a ring of K windows: window w's Ca half (kv, and the gate without its
position bias) at rows [(w % K) * m, (w % K + 1) * m) once w has closed; the window that closes
next, w + 1, reads it there.

Rollback (speculative decoding): a step computing positions s..e'-1 keeps in the buffer ring
every token of the windows that a rollback to e >= e' - d may reopen, and in the overlap ring
its last K closed windows. Rolled back to e, the open window's tokens [floor(e/m)*m, e) are in
the ring (they span at most m - 1 + d rows), its predecessor's Ca half was not overwritten (at
most K - 1 windows closed after it), and the rejected positions' ring rows held positions older
than any future window reads (d <= ring_margin). So a rollback moves no data (``rollback``).

Gates are stored without the position bias. Snapshots (a block boundary) keep the rings and the
overlap rings: the open-window buffers are empty there (block_size is a multiple of every
ratio). The payload order (every ring, then each compressor's parts in layer order) is what the
host and disk tiers store; d > 0 changes the payloads' shapes and layout, so it is in the salt.
"""

from __future__ import annotations

import torch

from deepinfer.kv_cache.pool import KVCache
from deepinfer.kv_cache.spec import CachePart, CacheSpec, RowFormat
from deepinfer.model.deepseek_v4.args import CSA, HCA, ModelArgs
from deepinfer.ops.attention.kv_fp8 import Fp8Layout, Fp8Rows, KVSource

# The compressors of a layer kind: (state prefix, row width attribute).
_COMPRESSORS = {
    CSA: (("comp", "head_dim"), ("idx", "index_head_dim")),
    HCA: (("comp", "head_dim"),),
}


def cache_spec(
    args: ModelArgs,
    *,
    block_size: int,
    ring_margin: int,
    max_draft: int = 0,
    kv_format: RowFormat | None = None,
) -> CacheSpec:
    """The parts above. ``kv_format``: the compressed entries and the window rings as packed
    rows (``kv_fp8_format(args)``: FP8 with in-row scales, cache.kv_dtype = "fp8") instead of
    hd elements of the cache dtype."""
    check_margins(args.compress_ratios, block_size, ring_margin, max_draft)
    ring = ring_size(args, ring_margin)
    layers = list(enumerate(zip(args.layer_types, args.compress_ratios, strict=True)))
    entries: list[CachePart] = []
    index_keys: list[CachePart] = []
    for i, (layer_type, ratio) in layers:
        if ratio:
            row = kv_format or args.head_dim
            entries.append(CachePart((i, "entries"), "paged", block_size // ratio, row))
        if layer_type == CSA:
            index_keys.append(
                CachePart((i, "index_keys"), "paged", block_size // ratio, args.index_head_dim)
            )
    kv_row = kv_format or args.head_dim
    rings = [CachePart((i, "ring"), "state", ring, kv_row, snapshot=True) for i, _ in layers]
    rings += mtp_parts(args, ring, kv_row)
    compressors: list[CachePart] = []
    for i, (layer_type, ratio) in layers:
        for prefix, width_attr in _COMPRESSORS.get(layer_type, ()):
            compressors += _compressor_parts(
                i, prefix, ratio, getattr(args, width_attr), layer_type == CSA, max_draft
            )
    return CacheSpec(
        block_size=block_size,
        parts=(*entries, *index_keys, *rings, *compressors),
        ring_margin=ring_margin,
        max_draft=max_draft,
        salt=f"{block_size}:{ring}"
        + (f":draft{max_draft}" if max_draft else "")
        + (f":mtp{args.mtp_served}" if args.mtp_served else "")
        + (f":{kv_format.name}" if kv_format else ""),
    )


def mtp_parts(args: ModelArgs, ring: int, kv_row: int | RowFormat) -> list[CachePart]:
    """A served MTP layer's state (layer id ``num_layers + i``): its window ring, and the stack's
    last hidden streams at the request's last computed position (what the layer reads there in
    the next step, when that position's next token is known)."""
    parts = []
    for i in range(args.num_layers, args.num_layers + args.mtp_served):
        parts.append(CachePart((i, "ring"), "state", ring, kv_row, snapshot=True))
        hidden = CachePart(
            (i, "mtp_hidden"), "state", args.hc_mult, args.hidden_size, snapshot=True
        )
        parts.append(hidden)
    return parts


def kv_fp8_layout(args: ModelArgs) -> Fp8Layout:
    """The FP8 rows of this model's KV (entries and rings): NoPE e4m3, RoPE bf16."""
    return Fp8Layout(args.head_dim, args.rope_head_dim)


def kv_fp8_format(args: ModelArgs) -> RowFormat:
    """Those rows as the cache spec's packed row (cache.kv_dtype = "fp8")."""
    layout = kv_fp8_layout(args)
    return RowFormat(layout.name, layout.row_bytes)


def kv_rows(cache: KVCache, key: tuple[int, str], args: ModelArgs) -> KVSource:
    """A KV part (entries or a ring) as flat rows: [groups * rows, hd] of the cache dtype, or
    ``Fp8Rows`` when the part is packed (cache.kv_dtype = "fp8")."""
    part = cache[key]
    if part.dtype == torch.uint8:  # a packed row (the cache dtype is never uint8)
        return Fp8Rows.of(part, kv_fp8_layout(args))
    return part.flatten(0, 1)


def check_margins(
    ratios: tuple[int, ...], block_size: int, ring_margin: int, max_draft: int
) -> None:
    """A block holds whole compression windows of every ratio; a rollback never reaches past
    the ring's margin. ValueError naming the key otherwise."""
    if any(r and block_size % r for r in ratios):
        shown = sorted({r for r in ratios if r})
        raise ValueError(
            f"cache.block_size={block_size} must be a multiple of every compression "
            f"ratio of the model (got ratios {shown})"
        )
    if max_draft > ring_margin:
        raise ValueError(
            f"cache.max_draft_tokens={max_draft} must be <= cache.ring_margin={ring_margin}: "
            "rejected drafts overwrite the sliding-window ring rows of that many older tokens"
        )


def ring_size(args: ModelArgs, ring_margin: int) -> int:
    return args.sliding_window + ring_margin


def buffer_rows(ratio: int, max_draft: int) -> int:
    """B: rows of a compressor's buffer ring per slot."""
    return ratio - 1 + max_draft


def overlap_windows(ratio: int, max_draft: int) -> int:
    """K: closed windows an overlap ring keeps per slot (a rollback reopens at most K - 1)."""
    return 1 + -(-max_draft // ratio)


def rollback(cache: KVCache, slot: int, end_pos: int, num_tokens: int) -> None:
    """Forget the last ``num_tokens`` positions of the step that ended at ``end_pos`` in
    ``slot``: the slot then reads as if only positions < end_pos - num_tokens were computed.

    Nothing moves (the module's docstring says why that is exact); what a later step reads is
    decided by its start position. Entries the rejected positions wrote in paged blocks are not
    visible from the earlier positions and are rewritten when their windows close again.
    """
    spec = cache.spec
    if not 0 <= num_tokens <= spec.max_draft or num_tokens >= end_pos:
        raise ValueError(
            f"cannot roll slot {slot} back by {num_tokens} tokens from position {end_pos}: "
            f"at most cache.max_draft_tokens={spec.max_draft}, and at least one token stays"
        )


def _compressor_parts(
    layer: int, prefix: str, ratio: int, dim: int, overlap: bool, max_draft: int
) -> list[CachePart]:
    """The buffer ring (kv, gate) and, overlapping (CSA), the overlap ring."""
    width = 2 * dim if overlap else dim
    rows = buffer_rows(ratio, max_draft)
    parts = [
        CachePart((layer, f"{prefix}.buf_kv"), "state", rows, width),
        CachePart((layer, f"{prefix}.buf_gate"), "state", rows, width),
    ]
    if overlap:
        windows = overlap_windows(ratio, max_draft) * ratio
        parts += [
            CachePart((layer, f"{prefix}.prev_kv"), "state", windows, dim, snapshot=True),
            CachePart((layer, f"{prefix}.prev_gate"), "state", windows, dim, snapshot=True),
        ]
    return parts
