"""Compressor steps for the ``compress_windows`` tests (CPU interpreter and CUDA): the real
planners' plans (deepseek_v4/compress_plan.py) over random rings and projections.

``CASES`` name (ratio, overlapping, max_draft, graphed, spans as (start_pos, num_tokens,
num_pad)); ``compress_step`` builds one at a width and batch size. Slot ``len(spans)`` is the
scratch slot, where discarded writes land in no set order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.model.batch import SeqSpan
from deepinfer.model.deepseek_v4.compress_plan import (
    CompressPlan,
    compress_plan,
    graphed_compress_plan,
)
from deepinfer.model.deepseek_v4.compressor import CompressorState, compress_rows
from deepinfer.model.deepseek_v4.plan_inputs import CacheGeometry, Requests
from deepinfer.ops.norm import CompressRows, rope_cos_sin

BLOCK_SIZE = 128

CASES = {
    # a prefill from 0 (window 0 has no previous half), a chunk after 2 buffered tokens that
    # closes 3 windows (the first one's previous half from the ring, whose row the last one
    # rewrites; the buffered rows refilled by the chunk's open window), a decode step closing one
    "csa_chunks": (4, True, 0, False, [(0, 11, 0), (6, 13, 0), (7, 1, 0)]),
    "csa_drafts": (4, True, 2, False, [(0, 11, 0), (6, 13, 0), (7, 3, 0)]),
    # a graphed verify step: every request pools its candidate windows, pads write scratch
    "csa_graphed": (4, True, 2, True, [(5, 3, 0), (10, 3, 1), (3, 3, 2)]),
    "hca_chunks": (8, False, 0, False, [(0, 19, 0), (5, 12, 0), (15, 1, 0)]),
    "hca_graphed": (8, False, 0, True, [(7, 1, 0), (2, 1, 0)]),
    "no_window_closes": (4, True, 0, False, [(4, 2, 0), (9, 1, 0)]),
    # decode steps (one token a request, no drafts): the keeps can run in the pooling's launch
    # (CompressRows.keep_in_pool): graphed (every request pools a candidate) and not
    "csa_decode": (4, True, 0, False, [(7, 1, 0), (5, 1, 0), (11, 1, 0), (2, 1, 0)]),
    "csa_decode_graphed": (4, True, 0, True, [(7, 1, 0), (5, 1, 0), (3, 1, 0)]),
    "hca_decode": (8, False, 0, False, [(15, 1, 0), (9, 1, 0)]),
    "decode_no_window_closes": (4, True, 0, False, [(5, 1, 0), (9, 1, 0)]),
}
# The cases whose steps are decode steps (CompressPlan.one_token).
ONE_TOKEN = [name for name, (_, _, d, _, spans) in CASES.items() if not d and
             all(n == 1 for _, n, _ in spans)]  # fmt: skip


@dataclass
class CompressStep:
    plan: dict[str, np.ndarray]
    ratio: int
    kv: torch.Tensor  # [T, width], a column block of a wider tensor (as fused projections are)
    gate: torch.Tensor
    ape: torch.Tensor | None
    weight: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    # buf_kv, buf_gate [slots, b, width]; prev_* [slots, K*m, d]; entries [blocks, per block, d]
    state: dict[str, torch.Tensor]

    @property
    def num_windows(self) -> int:
        return self.plan["window_rows"].size // self.ratio

    def fresh_state(self) -> dict[str, torch.Tensor]:
        return {key: value.clone() for key, value in self.state.items()}

    def rows(self, state: dict[str, torch.Tensor], one_token: bool = False) -> CompressRows:
        """CompressRows over ``state``, as the model's compressors build them (``one_token``:
        a decode step's plan, CompressPlan.one_token)."""
        device = self.kv.device
        plan = CompressPlan(
            **{k: torch.from_numpy(np.asarray(v)).to(device) for k, v in self.plan.items()},
            one_token=one_token,
        )
        return compress_rows(
            plan,
            CompressorState(
                state["buf_kv"], state["buf_gate"], state.get("prev_kv"), state.get("prev_gate")
            ),
            state["entries"].flatten(0, 1),
        )


def compress_step(
    case: str,
    dim: int,
    bias_rope: bool,
    seed: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    ratio: int | None = None,
    repeat: int = 1,
) -> CompressStep:
    """Case ``case`` with entries of ``dim`` channels (the width is 2 * dim overlapping), its
    spans repeated ``repeat`` times (more requests), ``ratio`` in place of the case's. Values
    are drawn in fp32 on the CPU, then put in ``dtype`` on ``device`` (the gate bias, the norm
    weight and the RoPE tables stay fp32). ``bias_rope`` False: no bias and no rotation
    (DeepSeek-V4.1's compressor)."""
    case_ratio, overlap, max_draft, graphed, spans = CASES[case]
    ratio = ratio or case_ratio
    spans = [(start * ratio // case_ratio, n, pad) for start, n, pad in spans] * repeat
    gen = torch.Generator().manual_seed(seed)
    num_slots = len(spans) + 1
    geometry = CacheGeometry(
        window=8,
        ring_size=8,
        block_size=BLOCK_SIZE,
        ratios=(ratio,),
        scratch_slot=num_slots - 1,
        scratch_block=2 * num_slots - 1,
        max_draft=max_draft,
    )
    seqs, offset = [], 0
    for i, (start, num_tokens, num_pad) in enumerate(spans):
        seqs.append(SeqSpan(offset, num_tokens, start, i, [2 * i, 2 * i + 1], num_pad=num_pad))
        offset += num_tokens
    if graphed:
        plan = graphed_compress_plan(Requests.of(seqs, 2), geometry, ratio)
    else:
        plan = compress_plan(Requests.of(seqs), geometry, ratio)
    width = 2 * dim if overlap else dim
    b, k = ratio - 1 + max_draft, 1 + -(-max_draft // ratio)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=gen)

    wide = draw(offset, 3 * width).to(device, dtype)
    state = {"buf_kv": draw(num_slots, b, width), "buf_gate": draw(num_slots, b, width)}
    state["entries"] = draw(2 * num_slots, BLOCK_SIZE // ratio, dim)  # the last: scratch
    if overlap:
        state["prev_kv"] = draw(num_slots, k * ratio, dim)
        state["prev_gate"] = draw(num_slots, k * ratio, dim)
    cos = sin = None
    if bias_rope:
        rope_dim = 64 if dim >= 128 else 8  # V4's 64 at its widths
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rope_dim, 2) / rope_dim)
        cos, sin = rope_cos_sin(torch.from_numpy(plan["window_ids"]) * ratio, inv_freq)
        cos, sin = cos.to(device), sin.to(device)
    return CompressStep(
        plan=plan,
        ratio=ratio,
        kv=wide[:, :width],
        gate=wide[:, 2 * width :],
        ape=draw(ratio, width).to(device) if bias_rope else None,
        weight=(0.5 + torch.rand(dim, generator=gen)).to(device),
        cos=cos,
        sin=sin,
        state={key: value.to(device, dtype) for key, value in state.items()},
    )
