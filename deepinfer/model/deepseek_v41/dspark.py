"""DSpark drafts (``speculative.method = "dspark"``): DeepSeek-V4.1's block drafter, run after
every step on what the step computed.

The drafter's layers (``mtp.{j}``) are sliding-window decoder layers with their own MoE. Their
keys at the request's positions ("main keys") come from the target model, inside its forward
(``DeepseekV41._write_main_keys``): the target layers' input streams, averaged over the streams
and concatenated, go through ``main_proj`` and ``main_norm``, then each drafter layer's own
``wkv`` and ``kv_norm``, roped at the position, into that layer's window ring. So the drafter
has no prefill of its own, and its rings are state parts like the stack's (snapshots, tiers and
hand-offs carry them; a rollback needs nothing, as for the stack's rings).

After a step whose request kept tokens up to position e (the last sampled one, g, at e)::

    block    positions e .. e + B - 1, tokens [g, noise x (B - 1)] (B = dspark_block_size)
    keys     the W main keys at e - W .. e - 1 (not before the window floor) and the B block
             rows (every row sees the whole block: drafting is bidirectional within it)
    row i    predicts draft i + 1: the head's logits of the last layer's collapsed streams,
             plus the Markov correction head(embed(previous)) (previous: g, then draft i)
    conf i   sigmoid([streams before the norm ; Markov embedding] . w): the confidence head's
             estimate that draft i + 1 is accepted once the ones before it are

The block's own keys never reach the cache: its rows are this pass's step rows. Drafts are the
argmax of the corrected logits, for sampled requests too: a one-token proposal, so the
equality rule of ``scheduler/drafts.py`` is the rejection sampler and the output distribution
stays the target's (DeepSeek's engine samples drafts with the request's temperature and keeps
their probabilities for the ratio rule; we do not). One block a step: the draft count is the
block size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch, SeqSpan, flatten, split_flat
from deepinfer.model.deepseek_v41 import step_plan
from deepinfer.model.deepseek_v41.model import DeepseekV41
from deepinfer.model.deepseek_v41.step_plan import CacheGeometry
from deepinfer.model.family import DraftedRequest


@dataclasses.dataclass(frozen=True)
class Block:
    """One request's draft block: its id, slot, window floor, the sampled token g and its
    position e."""

    request_id: str
    slot: int
    floor: int
    token: int
    position: int


class DSparkDrafts:
    """Runs the served DSpark layers of ``model`` after each step over ``cache``; one block of
    ``num_drafts`` (= dspark_block_size) drafts per sampled request. ``upload``: host int64 ->
    device (the runner's staging path)."""

    def __init__(
        self,
        model: DeepseekV41,
        cache: KVCache,
        geometry: CacheGeometry,
        num_drafts: int,
        upload: Callable[[np.ndarray], torch.Tensor],
    ) -> None:
        ds = model.args.dspark
        assert model.args.dspark_served and ds is not None, "the model serves no DSpark layers"
        if num_drafts != ds.block_size:
            raise ValueError(
                f"speculative.num_speculative_tokens={num_drafts} with speculative.method="
                f"'dspark': the drafter proposes one block of dspark_block_size={ds.block_size} "
                f"tokens a step, so the draft count must be {ds.block_size}"
            )
        self.model, self.cache, self.upload = model, cache, upload
        self.block_size, self.noise = ds.block_size, ds.noise_token_id
        v4 = dataclasses.replace(geometry.v4, ratios=(), dense_ratios=())
        self.geometry = dataclasses.replace(geometry, v4=v4, ngram=0, yoco_mode="off")
        # The confidence head's estimates of the last run's drafts, by request (kept for the
        # verification schedule).
        self.confidence: dict[str, list[float]] = {}

    @torch.inference_mode()
    def run(
        self,
        scheduled: list[DraftedRequest],
        hidden: torch.Tensor | None,
        kept: dict[str, list[int]],
    ) -> dict[str, list[int]]:
        """After a step of ``scheduled`` that kept ``kept`` tokens per sampled request: each
        one's block of drafts after its last kept token (``hidden`` is not read: the main keys
        were written by the forward)."""
        blocks = [
            Block(s.request_id, s.state_slot, s.window_floor, kept[s.request_id][-1], end - 1)
            for s in scheduled
            if s.do_sample and s.request_id in kept
            for end in [s.start_pos + s.num_tokens - s.num_draft_tokens + len(kept[s.request_id])]
        ]
        if not blocks:
            self.confidence = {}
            return {}
        batch = self._batch(blocks)
        logits, streams = self.model.dspark_forward(batch, self.cache)
        n, size = len(blocks), self.block_size
        logits, streams = logits.view(n, size, -1), streams.view(n, size, -1)
        head = self.model.mtp[-1]
        previous = batch.input_ids.view(n, size)[:, 0]
        drafts, confidence = [], []
        for i in range(size):
            markov = head.markov_head.embed(previous)  # [n, rank]
            corrected = logits[:, i] + head.markov_head.head(markov).float()
            previous = corrected.argmax(dim=-1)
            drafts.append(previous)
            features = torch.cat([streams[:, i], markov.to(streams.dtype)], dim=-1)
            confidence.append(torch.sigmoid(head.confidence_head.proj(features).float()[:, 0]))
        rows = torch.stack(drafts, dim=1).tolist()  # [n, B]; waits for the device
        rates = torch.stack(confidence, dim=1).tolist()
        ids = [b.request_id for b in blocks]
        self.confidence = dict(zip(ids, rates, strict=True))
        return dict(zip(ids, rows, strict=True))

    def _batch(self, blocks: list[Block]) -> ForwardBatch:
        """The draft blocks as one batch: tokens, positions and the window plan above (every
        row of a block sees its W main keys in the ring and the whole block), no ring writes."""
        size, window = self.block_size, self.geometry.v4.window
        ring = self.geometry.v4.ring_size
        n = len(blocks)
        position = np.asarray([b.position for b in blocks], dtype=np.int64)
        slot = np.asarray([b.slot for b in blocks], dtype=np.int64)
        floor = np.asarray([max(b.floor, 0) for b in blocks], dtype=np.int64)
        token_req = np.repeat(np.arange(n), size)
        key = (position[:, None] - window + np.arange(window))[token_req]  # [T, W] main keys
        ring_rows = np.where(
            key >= floor[token_req, None], slot[token_req, None] * ring + key % ring, -1
        )
        tokens = np.full((n, size), self.noise, dtype=np.int64)
        tokens[:, 0] = [b.token for b in blocks]
        host = {
            "input_ids": tokens.ravel(),
            "positions": (position[:, None] + np.arange(size)).ravel(),
            "logits_indices": np.arange(n * size),
            "token_req": token_req,
            "win_step": (token_req[:, None] * size + np.arange(size)),  # the whole block
            "win_ring": ring_rows,
            "ring_src": np.zeros(0, dtype=np.int64),
            "ring_dst": np.zeros(0, dtype=np.int64),
            "block_table": np.zeros((n, 1), dtype=np.int64),
        }
        dev = split_flat(self.upload(flatten(host)), host)
        seqs = [SeqSpan(i * size, size, b.position, b.slot, []) for i, b in enumerate(blocks)]
        return ForwardBatch(
            input_ids=dev["input_ids"],
            positions=dev["positions"],
            seqs=seqs,
            logits_indices=dev["logits_indices"],
            metadata=step_plan.metadata_views(dev, self.geometry),
        )
