"""Index plans of one DeepSeek-V4.1 step: DeepSeek-V4's (``deepseek_v4/step_plan.py``: the
sliding window, the compressed entries and the compressors of each ratio, here 1 and 2) plus
the engram's n-gram windows.

    engram_history [B * (n - 1)]  raw token ids of each request's n - 1 positions before the
                                  step (-1: before position 0), from ``SeqSpan.history``
    engram_src     [T, n]         per token, its window (positions p, p - 1, .., p - n + 1:
                                  newest first) as rows of cat(engram_history, input_ids)

The window is gathered on the device from the uploaded input ids, so a decode token that is
still on the device when the step is planned (asynchronous scheduling) joins its own window;
every earlier token is known on the host. Shapes depend only on the token and request counts
(a graphed decode step keeps them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch, SeqSpan, flatten, split_flat
from deepinfer.model.deepseek_v4 import step_plan as v4_plan
from deepinfer.model.deepseek_v4.plan_inputs import CacheGeometry as V4Geometry
from deepinfer.model.deepseek_v4.plan_inputs import starts
from deepinfer.model.deepseek_v41.args import ModelArgs


@dataclass(frozen=True)
class CacheGeometry:
    """V4's geometry of the cache, the engram's window length n (0: no engram), and YoCo
    truncation: its mode and the prompt tokens the consumer half keeps."""

    v4: V4Geometry
    ngram: int = 0
    yoco_mode: str = "off"
    yoco_keep: int = 0

    @classmethod
    def of(cls, cache: KVCache, args: ModelArgs) -> CacheGeometry:
        ngram = args.engram.max_ngram_size if args.engram is not None else 0
        return cls(V4Geometry.of(cache), ngram, args.yoco_mode, args.yoco_keep)


@dataclass
class StepMetadata(v4_plan.StepMetadata):
    """V4's plans (``deepseek_v4/step_plan.py``), the engram's (module docstring) and, when a
    YoCo truncation narrows this step, the consumer half's: ``consumer`` its plans (compact:
    over the kept rows only; mask: every row, the narrowed windows), ``yoco_rows`` [Tk] the
    kept rows of the batch and ``yoco_logits`` [N] the logits rows among them (compact)."""

    engram_history: torch.Tensor | None = None
    engram_src: torch.Tensor | None = None
    consumer: StepMetadata | None = None
    yoco_rows: torch.Tensor | None = None
    yoco_logits: torch.Tensor | None = None


def build_metadata(batch: ForwardBatch, cache: KVCache, args: ModelArgs) -> StepMetadata:
    """The plans of a batch built without them (a plain copy to input_ids' device)."""
    geometry = CacheGeometry.of(cache, args)
    host = plan_step(batch.seqs, geometry)
    host.update(yoco_plan(batch.seqs, geometry, batch.logits_indices.tolist()))
    flat = torch.from_numpy(flatten(host)).to(batch.input_ids.device)
    return metadata_views(split_flat(flat, host), geometry)


def step_arrays(
    seqs: list[SeqSpan],
    token_ids: list[int],
    logits_indices: list[int],
    geometry: CacheGeometry,
    decode_context: int | None = None,
) -> dict[str, np.ndarray]:
    """Everything a step uploads, host int64 by name (V4's arrays, then the engram's)."""
    host = v4_plan.step_arrays(seqs, token_ids, logits_indices, geometry.v4, decode_context)
    host.update(engram_plan(seqs, geometry.ngram))
    host.update(yoco_plan(seqs, geometry, logits_indices))
    return host


def plan_step(
    seqs: list[SeqSpan], geometry: CacheGeometry, decode_context: int | None = None
) -> dict[str, np.ndarray]:
    host = v4_plan.plan_step(seqs, geometry.v4, decode_context)
    host.update(engram_plan(seqs, geometry.ngram))
    return host


def batch_views(
    flat: torch.Tensor,
    host: dict[str, np.ndarray],
    seqs: list[SeqSpan],
    geometry: CacheGeometry,
) -> ForwardBatch:
    dev = split_flat(flat, host)
    return ForwardBatch(
        input_ids=dev["input_ids"],
        positions=dev["positions"],
        seqs=seqs,
        logits_indices=dev["logits_indices"],
        metadata=metadata_views(dev, geometry),
    )


def metadata_views(dev: dict[str, torch.Tensor], geometry: CacheGeometry) -> StepMetadata:
    v4 = v4_plan.metadata_views(dev, geometry.v4)
    fields = {f: getattr(v4, f) for f in v4.__dataclass_fields__}
    meta = StepMetadata(
        **fields,
        engram_history=dev.get("engram_history"),
        engram_src=dev.get("engram_src"),
    )
    consumer = {k[2:]: v for k, v in dev.items() if k.startswith("y.")}
    if not consumer:
        return meta
    if geometry.yoco_mode == "mask":  # the full plans, the consumer half's windows
        consumer = {**{k: v for k, v in dev.items() if not _is_window(k)}, **consumer}
    inner = v4_plan.metadata_views(consumer, geometry.v4)
    meta.consumer = StepMetadata(**{f: getattr(inner, f) for f in inner.__dataclass_fields__})
    meta.yoco_rows, meta.yoco_logits = dev.get("y.rows"), dev.get("y.logits")
    return meta


def yoco_plan(
    seqs: list[SeqSpan], geometry: CacheGeometry, logits_indices: list[int]
) -> dict[str, np.ndarray]:
    """The consumer half's plans under YoCo truncation, prefixed ``y.``; nothing when it is off
    or when no window of the step reaches before its request's kept tokens (decode steps:
    keep >= window, so a position past the prompt never looks that far back).

    A request keeps the positions from ``keep_from = num_prompt_tokens - keep`` on, and its
    consumer-half windows see no key before keep_from (those rows are never computed). A chunk
    wholly before keep_from keeps its last token as a placeholder row, which sees no window key:
    every request has a row, and the rows a later kept query reads are its own kept ones.
    compact: the V4 plans of those kept spans, ``y.rows`` (their rows in the batch) and
    ``y.logits`` (the logits rows among them); mask: the windows of the same spans narrowed.
    """
    if geometry.yoco_mode == "off" or not seqs:
        return {}
    keep_from = [max(0, s.num_prompt_tokens - geometry.yoco_keep) for s in seqs]
    reach = geometry.v4.window - 1
    if all(s.start_pos - reach >= k for s, k in zip(seqs, keep_from, strict=True)):
        return {}
    if geometry.yoco_mode == "mask":
        narrowed = [
            dataclasses.replace(s, window_floor=max(s.window_floor, k))
            for s, k in zip(seqs, keep_from, strict=True)
        ]
        plan = v4_plan.plan_step(narrowed, geometry.v4)
        return {f"y.{k}": v for k, v in plan.items() if _is_window(k)}
    kept, rows, offset = [], [], 0
    for s, k in zip(seqs, keep_from, strict=True):
        start = min(max(s.start_pos, k), s.end_pos - 1)
        num = s.end_pos - start
        rows.append(np.arange(s.offset + start - s.start_pos, s.offset + s.num_tokens))
        kept.append(
            dataclasses.replace(
                s,
                offset=offset,
                num_tokens=num,
                start_pos=start,
                window_floor=max(s.window_floor, k),
            )
        )
        offset += num
    kept_rows = np.concatenate(rows)
    where = {int(r): i for i, r in enumerate(kept_rows)}
    assert all(r in where for r in logits_indices), "logits of a row the consumer half drops"
    plan = v4_plan.plan_step(kept, geometry.v4)
    out = {f"y.{k}": v for k, v in plan.items()}
    out["y.rows"] = kept_rows.astype(np.int64)
    out["y.logits"] = np.asarray([where[r] for r in logits_indices], dtype=np.int64)
    return out


def engram_plan(seqs: list[SeqSpan], ngram: int) -> dict[str, np.ndarray]:
    """``engram_history`` and ``engram_src`` (module docstring); nothing without an engram.
    A span's history holds the tokens just before it (fewer near position 0); missing ones
    read as padding."""
    if not ngram:
        return {}
    back = ngram - 1
    num = len(seqs)
    history = np.full((num, back), -1, dtype=np.int64)
    for b, seq in enumerate(seqs):
        known = seq.history[-back:] if back else []
        if known:
            history[b, back - len(known) :] = known
    counts = np.asarray([s.num_tokens for s in seqs], dtype=np.int64)
    req = np.repeat(np.arange(num), counts)  # [T]
    local = np.arange(req.shape[0]) - np.repeat(starts(counts), counts)  # [T] index in chunk
    # Element r of token t's window is position p - r, i.e. chunk index local - r.
    rel = local[:, None] - np.arange(ngram)[None, :]  # [T, n]
    in_step = rel >= 0
    step_rows = num * back + (np.asarray([s.offset for s in seqs])[req])[:, None] + rel
    history_rows = req[:, None] * back + back + rel  # rel in [-back, 0): row of history
    src = np.where(in_step, step_rows, history_rows)
    return {"engram_history": history.ravel(), "engram_src": src}


def _is_window(name: str) -> bool:
    """Whether a plan array is the window's: its lists (win_step, win_ring) or what the device
    derives them from (v4_plan.WindowPlan)."""
    return name.startswith("win_")
