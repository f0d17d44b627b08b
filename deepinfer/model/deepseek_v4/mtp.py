"""MTP drafts (``speculative.method = "mtp"``): DeepSeek-V4's next-token-prediction layer, run
after every step on what the step computed.

At position p the layer reads the stack's last hidden streams h_p and token p + 1, and predicts
token p + 2. A step that computed positions a .. e - 1 of a request (e: computed after its
drafts were accepted or rolled back) knows every token up to e (the sampled one), so::

    commit   positions a - 1 .. e - 1    h_(a-1) from the slot (the previous step's last), the
             (e - 2 without a sample)    rest from this step; tokens: the chunk's inputs, then
                                         the kept samples. Writes the layer's window ring.
    draft 1  argmax of the output at e - 1 (the token after the sampled one)
    draft j  the layer again at e - 2 + j on (its own output streams, draft j - 1)
    slot     h_(e-1) for the next step's commit

The chained positions' ring rows are overwritten by the next step's commit before any query
reads them (the ring keeps ``ring_margin`` >= the drafts rows beyond the window). A replay from
an empty slot (``window_floor``) starts the commit at the floor: the slot has no h_(a-1) there.
Drafts are argmax: a one-token proposal, so the equality rule of ``scheduler/drafts.py`` is the
rejection sampler (README, "Verification steps").

The driver runs on the host between steps: every position is known by then, so the plans are
the stack's sliding-window plans (``step_plan.plan_step`` with no compression ratios) and the
chained steps are one token per request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from deepinfer.kv_cache.pool import KVCache
from deepinfer.model.batch import ForwardBatch, SeqSpan, flatten, split_flat
from deepinfer.model.deepseek_v4 import step_plan
from deepinfer.model.deepseek_v4.model import DeepseekV4
from deepinfer.model.deepseek_v4.plan_inputs import CacheGeometry
from deepinfer.model.family import DraftedRequest


@dataclasses.dataclass
class _Commit:
    """The commit pass of one step, host side (built by ``_plan_commit``)."""

    seqs: list[SeqSpan] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    from_slot: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (row, slot)
    from_step: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (row, step row)
    slot_updates: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (slot, row)
    drafting: list[str] = dataclasses.field(default_factory=list)  # request ids, in row order
    draft_spans: list[SeqSpan] = dataclasses.field(default_factory=list)  # their commit spans

    @property
    def draft_rows(self) -> list[int]:
        """The drafting requests' last commit rows (where draft 1 is read)."""
        return [s.offset + s.num_tokens - 1 for s in self.draft_spans]


class MtpDrafts:
    """Runs the served MTP layer (layer 0 of ``model.mtp``) after each step of ``model`` over
    ``cache``; ``num_drafts`` per sampled request. ``upload``: host int64 -> device (the
    runner's staging path)."""

    def __init__(
        self,
        model: DeepseekV4,
        cache: KVCache,
        geometry: CacheGeometry,
        num_drafts: int,
        upload: Callable[[np.ndarray], torch.Tensor],
    ) -> None:
        assert model.args.mtp_served, "the model was built without its MTP layer"
        self.model, self.cache, self.num_drafts, self.upload = model, cache, num_drafts, upload
        self.geometry = dataclasses.replace(geometry, ratios=(), dense_ratios=())
        self.slot_hidden = cache[model.args.num_layers, "mtp_hidden"]  # [slots, hc, D]

    @torch.inference_mode()
    def run(
        self,
        scheduled: list[DraftedRequest],
        hidden: torch.Tensor | None,
        kept: dict[str, list[int]],
    ) -> dict[str, list[int]]:
        """After a step of ``scheduled`` whose forward left ``hidden`` [T, hc, D] and kept
        ``kept`` tokens per sampled request: commit, draft, and return each sampled request's
        ``num_drafts`` guesses of the tokens after its last kept one."""
        assert hidden is not None, "a model serving its MTP layer keeps its last streams"
        plan = _plan_commit(scheduled, kept)
        commit = None
        if plan.seqs:
            extra = {
                "dst_slot": [r for r, _ in plan.from_slot],
                "src_slot": [s for _, s in plan.from_slot],
                "dst_step": [r for r, _ in plan.from_step],
                "src_step": [s for _, s in plan.from_step],
            }
            batch, dev = self._batch(plan.seqs, plan.token_ids, plan.draft_rows, extra)
            x = hidden.new_empty(len(plan.token_ids), *hidden.shape[1:])
            x[dev["dst_slot"]] = self.slot_hidden[dev["src_slot"]]
            x[dev["dst_step"]] = hidden[dev["src_step"]]
            commit = self.model.mtp_forward(x, batch, self.cache)
        if plan.slot_updates:
            slots, rows = zip(*plan.slot_updates, strict=True)
            index = self.upload(np.asarray(slots + rows, dtype=np.int64))
            self.slot_hidden[index[: len(slots)]] = hidden[index[len(slots) :]]
        if commit is None or not plan.drafting:
            return {}
        logits, out = commit
        drafts = [logits.argmax(dim=-1)]
        streams = out[batch.logits_indices]
        for j in range(1, self.num_drafts):
            # One token per drafting request, after its last: (its own streams, draft j).
            seqs = [
                SeqSpan(r, 1, s.end_pos - 1 + j, s.slot, [], window_floor=s.window_floor)
                for r, s in enumerate(plan.draft_spans)
            ]
            batch, _ = self._batch(seqs, [0] * len(seqs), list(range(len(seqs))), {})
            batch.input_ids = drafts[-1]
            logits, streams = self.model.mtp_forward(streams, batch, self.cache)
            drafts.append(logits.argmax(dim=-1))
        rows = torch.stack(drafts, dim=1).tolist()  # [R, num_drafts]; waits for the device
        return dict(zip(plan.drafting, rows, strict=True))

    def _batch(
        self,
        seqs: list[SeqSpan],
        token_ids: list[int],
        logits_indices: list[int],
        extra: dict[str, list[int]],
    ) -> tuple[ForwardBatch, dict[str, torch.Tensor]]:
        """The sliding-window batch of ``seqs`` (one upload, with the ``extra`` index lists)."""
        host = step_plan.step_arrays(seqs, token_ids, logits_indices, self.geometry)
        host.update({name: np.asarray(v, dtype=np.int64) for name, v in extra.items()})
        dev = split_flat(self.upload(flatten(host)), host)
        batch = ForwardBatch(
            input_ids=dev["input_ids"],
            positions=dev["positions"],
            seqs=seqs,
            logits_indices=dev["logits_indices"],
            metadata=step_plan.metadata_views(dev, self.geometry),
        )
        return batch, dev


def _plan_commit(scheduled: list[DraftedRequest], kept: dict[str, list[int]]) -> _Commit:
    """Which positions the commit pass runs (module docstring), their tokens and hidden rows,
    the slots' new hidden rows and the rows the drafts are read from."""
    plan = _Commit()
    step_offset = 0
    for sched in scheduled:
        a, n = sched.start_pos, sched.num_tokens
        samples = kept.get(sched.request_id) if sched.do_sample else None
        n_inputs = n - sched.num_draft_tokens  # the chunk's tokens that are not drafts
        end = a + n_inputs + (len(samples) - 1 if samples else 0)
        plan.slot_updates.append((sched.state_slot, step_offset + end - 1 - a))
        first = a - 1 if a > sched.window_floor else a
        last = end - 1 if samples else end - 2
        first_sampled = a + n_inputs - 1
        if last >= first:
            row = len(plan.token_ids)
            span = SeqSpan(
                row, last - first + 1, first, sched.state_slot, [], window_floor=sched.window_floor
            )
            plan.seqs.append(span)
            for p in range(first, last + 1):
                if samples and p >= first_sampled:
                    plan.token_ids.append(samples[p - first_sampled])
                else:
                    plan.token_ids.append(sched.token_ids[p + 1 - a])
                if p < a:
                    plan.from_slot.append((row + p - first, sched.state_slot))
                else:
                    plan.from_step.append((row + p - first, step_offset + p - a))
            if samples:
                plan.drafting.append(sched.request_id)
                plan.draft_spans.append(span)
        step_offset += n
    return plan
