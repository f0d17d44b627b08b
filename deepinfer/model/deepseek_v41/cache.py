"""DeepSeek-V4.1's cache spec: what each layer keeps per request (hd = head_dim, ihd =
index_head_dim, m = the layer's ratio, R = sliding_window + ring_margin, d = max_draft, B =
m - 1 + d buffer rows).

    paged parts (one block table per request, shared by every layer; block = block_size tokens)
    ---------------------------------------------------------------------------------------
    KV source         (i, "entries")     [block_size/m, hd]    entry w <- tokens [mw, mw+m)
    index-key source  (i, "index_keys")  [block_size/m, ihd]   the indexer's keys of those entries
    consumers         (nothing paged: they read their source's parts, by key)

    state parts (one slot per running request)
    ---------------------------------------------------------------------------------------
    every layer       (i, "ring")        [R, hd]     token p's post-rope K=V at row p % R
    DSpark layers     (n + j, "ring")    [R, hd]     served only: drafter layer j's main-token
                                                     keys (the forward writes them, dspark.py)
    C2 KV source      (i, "comp.buf_kv"), (i, "comp.buf_gate")  [B, hd]  raw latent / score rows
    C1 layers         (no compressor state: every token closes its own window)

The compressed entries, their rows and the compressor's buffer ring are DeepSeek-V4's
(``deepseek_v4/cache.py`` draws them, and its rollback argument holds unchanged: C2 is V4's
non-overlapping compressor at ratio 2, C1 keeps nothing between tokens); the step plans are
V4's too. What V4.1 changes is who owns bytes: a consumer layer allocates no compressed-KV or
index-key bytes, and ``CacheGeometry`` sees the parts of the sources only.

Payload order (every ring, then the compressor buffers in layer order) is what the host and
disk tiers store. Under YoCo truncation the consumer half's rings hold only the kept rows of
each prompt; nothing reads the others (a kept query's window starts at its keep point, and a
prefix hit recomputes at least the kept tokens: ``recompute_tokens``), and the salt keeps those
snapshots apart from an untruncated engine's.
"""

from __future__ import annotations

from deepinfer.kv_cache.spec import CachePart, CacheSpec
from deepinfer.model.deepseek_v4.cache import buffer_rows, check_margins
from deepinfer.model.deepseek_v41.args import ModelArgs


def cache_spec(
    args: ModelArgs, *, block_size: int, ring_margin: int, max_draft: int = 0
) -> CacheSpec:
    """The parts above."""
    check_margins(args.compress_ratios, block_size, ring_margin, max_draft)
    if args.truncates and args.yoco_keep < args.sliding_window + max_draft:
        raise ValueError(
            f"model.yoco_keep_tokens={args.yoco_keep} must be >= the sliding window "
            f"({args.sliding_window}) + cache.max_draft_tokens ({max_draft}): decoding reads "
            "the consumer half's window rows of that many prompt tokens"
        )
    ring = args.sliding_window + ring_margin
    layers = range(args.num_layers)
    entries: list[CachePart] = []
    index_keys: list[CachePart] = []
    compressors: list[CachePart] = []
    for i in layers:
        ratio = args.ratio(i)
        if not ratio:
            continue
        if args.kv_source(i) == i:
            entries.append(CachePart((i, "entries"), "paged", block_size // ratio, args.head_dim))
            if ratio > 1:
                rows = buffer_rows(ratio, max_draft)
                compressors += [
                    CachePart((i, "comp.buf_kv"), "state", rows, args.head_dim),
                    CachePart((i, "comp.buf_gate"), "state", rows, args.head_dim),
                ]
        if args.index_k_source(i) == i:
            width = args.index_head_dim
            index_keys.append(CachePart((i, "index_keys"), "paged", block_size // ratio, width))
    ring_layers = [*layers, *args.served_mtp_layers]
    rings = [
        CachePart((i, "ring"), "state", ring, args.head_dim, snapshot=True) for i in ring_layers
    ]
    return CacheSpec(
        block_size=block_size,
        parts=(*entries, *index_keys, *rings, *compressors),
        ring_margin=ring_margin,
        max_draft=max_draft,
        salt=f"{block_size}:{ring}"
        + (f":draft{max_draft}" if max_draft else "")
        + (":dspark" if args.dspark_served else "")
        # Truncated prefills leave other consumer-half rings in the snapshots.
        + (f":yoco-{args.yoco_mode}{args.yoco_keep}" if args.truncates else ""),
    )
