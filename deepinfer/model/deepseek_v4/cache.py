"""DeepSeek-V4's cache spec: what each layer keeps per request (hd = head_dim, ihd =
index_head_dim, m = the layer's ratio, R = sliding_window + ring_margin, d = max_draft).

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
    CSA layer    (i, "comp.buf_kv"), (i, "comp.buf_gate")  [m-1+d, 2hd]  open window's raw
                     kv_proj / gate_proj (token p at row p % m)
                 (i, "comp.prev_kv"), (i, "comp.prev_gate")  [m, hd]  previous window's Ca half
                 (i, "idx.*")  the same for the indexer's compressor at ihd
    HCA layer    (i, "comp.buf_kv"), (i, "comp.buf_gate")  [m-1+d, hd]  open window's raw tokens

Gates are stored without the position bias. Snapshots (a block boundary) keep the rings and the
overlap state: the open-window buffers are empty there (block_size is a multiple of every
ratio). The payload order (every ring, then each compressor's parts in layer order) is what the
host and disk tiers store.
"""

from __future__ import annotations

from deepinfer.kv_cache.spec import CachePart, CacheSpec, RowFormat
from deepinfer.model.deepseek_v4.args import CSA, HCA, ModelArgs

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
    entry_format: RowFormat | None = None,
) -> CacheSpec:
    """The parts above. ``entry_format``: the compressed entries as packed rows (e.g. FP8 with
    in-row scales) instead of hd elements of the cache dtype."""
    if block_size % args.block_multiple:
        ratios = sorted({r for r in args.compress_ratios if r})
        raise ValueError(
            f"cache.block_size={block_size} must be a multiple of every compression "
            f"ratio of the model (got ratios {ratios})"
        )
    ring = ring_size(args, ring_margin)
    layers = list(enumerate(zip(args.layer_types, args.compress_ratios, strict=True)))
    entries: list[CachePart] = []
    index_keys: list[CachePart] = []
    for i, (layer_type, ratio) in layers:
        if ratio:
            row = entry_format or args.head_dim
            entries.append(CachePart((i, "entries"), "paged", block_size // ratio, row))
        if layer_type == CSA:
            index_keys.append(
                CachePart((i, "index_keys"), "paged", block_size // ratio, args.index_head_dim)
            )
    rings = [CachePart((i, "ring"), "state", ring, args.head_dim, snapshot=True) for i, _ in layers]
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
        salt=f"{block_size}:{ring}",
    )


def ring_size(args: ModelArgs, ring_margin: int) -> int:
    return args.sliding_window + ring_margin


def _compressor_parts(
    layer: int, prefix: str, ratio: int, dim: int, overlap: bool, max_draft: int
) -> list[CachePart]:
    """The open window's buffers (kv, gate) and, overlapping (CSA), the previous window's half."""
    width = 2 * dim if overlap else dim
    rows = ratio - 1 + max_draft
    parts = [
        CachePart((layer, f"{prefix}.buf_kv"), "state", rows, width),
        CachePart((layer, f"{prefix}.buf_gate"), "state", rows, width),
    ]
    if overlap:
        parts += [
            CachePart((layer, f"{prefix}.prev_kv"), "state", ratio, dim, snapshot=True),
            CachePart((layer, f"{prefix}.prev_gate"), "state", ratio, dim, snapshot=True),
        ]
    return parts
