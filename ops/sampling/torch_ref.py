"""Torch reference sampler: the oracle that every fast sampling backend is tested against.

Data flow of one step (tensors on the logits' device, dicts on the CPU)::

    engine (CPU) --SamplingParams + token history--> SamplingMetadata.build()
    model runner --logits [B, V] fp32------------->  sample(logits, metadata, generator)
        1. logprobs of the RAW logits (log_softmax, fp32)     -> SamplerOutput.logprobs
        2. logit_bias
        3. min_tokens: EOS (unless ignore_eos) and stop_token_ids -> -inf
        4. penalties: repetition (prompt + output), frequency and presence (output)
        5. grammar mask (structured output): disallowed tokens -> -inf
        6. greedy rows: argmax; other rows: / temperature, min_p, top_k, top_p, exponential race
                                                              -> SamplerOutput.token_ids [B] int64

The order follows vLLM v1, so that logprobs describe the model, not the processed distribution.

Randomness: a row samples ``argmax(probs / q)`` with ``q = -log(u) ~ Exp(1)``, which picks token t
with probability ``probs[t]``. Seeded rows use keyed (counter-based) generation: ``u[t]`` is a hash
of the key ``splitmix64(seed, position)`` and the token id (``keyed_uniforms``), so the draw for
the token at absolute position ``p`` depends only on ``(seed, p)``; batch composition, row order,
chunking, preemption and the device cannot change it. Unseeded rows share the caller's generator.

One file of ~440 lines: the oracle's steps in the order drawn above, so that a fast backend can
be checked against it step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.device import to_device
from deepinfer.ops.registry import Backend
from deepinfer.ops.sampling.keyed import keyed_uniforms, seeded_key
from deepinfer.ops.sampling.nucleus import NUM_CANDIDATES, apply_top_k_top_p
from deepinfer.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5  # same threshold as SamplingParams.is_greedy


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs of one step.

    Producer: the engine, via ``build`` (CPU lists -> tensors on ``device``). Consumer: ``sample``.
    Row ``i`` is the ``i``-th request that samples this step. Tensors are ``[B]`` unless noted.
    Token-history tensors are padded with id 0 and a 0.0 weight, so that ``scatter_add_`` of the
    weights counts only real tokens; rows without penalties contribute no history at all.
    """

    temperature: torch.Tensor  # fp32; 1.0 on greedy rows so that dividing is a no-op
    is_greedy: torch.Tensor  # bool
    top_p: torch.Tensor  # fp32; 1.0 = off
    top_k: torch.Tensor  # int64; 0 = off
    min_p: torch.Tensor  # fp32; 0.0 = off
    presence_penalties: torch.Tensor  # fp32
    frequency_penalties: torch.Tensor  # fp32
    repetition_penalties: torch.Tensor  # fp32
    prompt_token_ids: torch.Tensor | None  # [B, Lp] int64, None when no row has penalties
    prompt_weights: torch.Tensor | None  # [B, Lp] fp32, 1.0 on real tokens
    output_token_ids: torch.Tensor | None  # [B, Lo] int64
    output_weights: torch.Tensor | None  # [B, Lo] fp32
    # Newest output tokens still on the device (asynchronous scheduling): row i of
    # pending_rows [P] has output token pending_token_ids[i] [P] beyond output_token_ids.
    # None when no row with penalties has one.
    pending_rows: torch.Tensor | None
    pending_token_ids: torch.Tensor | None
    bias_rows: torch.Tensor | None  # [nnz] int64 (row, token, bias) triples of logit_bias
    bias_token_ids: torch.Tensor | None  # [nnz] int64
    bias_values: torch.Tensor | None  # [nnz] fp32
    banned_rows: torch.Tensor | None  # [nnz] int64 (row, token) pairs masked by min_tokens
    banned_token_ids: torch.Tensor | None  # [nnz] int64
    seeded_rows: list[int]
    seeded_keys: list[int]  # seeded_key(seed, position) of each seeded row
    num_logprobs: list[int | None]  # top alternatives asked per row; None = no logprobs
    # [B, V] bool, True = allowed by the row's grammar; None when no row is constrained.
    allowed_token_mask: torch.Tensor | None
    max_token_id: int  # largest id named by logit_bias / min_tokens, checked against V
    all_greedy: bool
    all_random: bool
    has_penalties: bool
    has_min_p: bool
    has_top_k_top_p: bool
    may_need_sort: bool  # some row's top-k/top-p may need the full sort (nucleus.py)

    @property
    def num_rows(self) -> int:
        return len(self.num_logprobs)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        positions: list[int],
        eos_token_id: int | None,
        device: torch.device | str,
        allowed_token_mask: torch.Tensor | None = None,
        pending: tuple[list[int], torch.Tensor] | None = None,
    ) -> SamplingMetadata:
        """Build the metadata of ``len(params)`` rows.

        ``positions[i]`` is the absolute position of the token row ``i`` samples (its current
        number of tokens); it keys seeded randomness. ``allowed_token_mask`` [B, V] bool on
        ``device`` comes from the grammar matchers (deepinfer.constraints.allowed_token_mask).
        ``pending``: (rows, token ids [len(rows)] int64 on ``device``): each of those rows has
        one more output token than ``output_token_ids`` lists, known only on the device (the
        previous step's sample, asynchronous scheduling); min_tokens and penalties count it.
        """
        num_rows = len(params)
        assert len(prompt_token_ids) == len(output_token_ids) == len(positions) == num_rows, (
            f"{num_rows} params, {len(prompt_token_ids)} prompts, {len(output_token_ids)} outputs, "
            f"{len(positions)} positions"
        )

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.float32), device)

        is_greedy = [p.is_greedy for p in params]
        has_penalties = any(p.has_penalties for p in params)
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        pending_rows, pending_ids = pending if pending is not None else ([], None)
        num_outputs = [len(out) for out in output_token_ids]
        for i in pending_rows:
            num_outputs[i] += 1
        banned = [
            (i, t)
            for i, (p, n) in enumerate(zip(params, num_outputs, strict=True))
            if n < p.min_tokens
            for t in _min_tokens_banned_ids(p, eos_token_id)
        ]
        has_pending_history = has_penalties and bool(pending_rows)
        seeded = [
            (i, seeded_key(p.seed, pos))
            for i, (p, pos) in enumerate(zip(params, positions, strict=True))
            if p.seed is not None
        ]
        named_ids = [t for _, t, _ in bias] + [t for _, t in banned]
        return cls(
            temperature=floats([1.0 if p.is_greedy else p.temperature for p in params]),
            is_greedy=to_device(torch.tensor(is_greedy, dtype=torch.bool), device),
            top_p=floats([p.top_p for p in params]),
            top_k=to_device(torch.tensor([p.top_k for p in params], dtype=torch.int64), device),
            min_p=floats([p.min_p for p in params]),
            presence_penalties=floats([p.presence_penalty for p in params]),
            frequency_penalties=floats([p.frequency_penalty for p in params]),
            repetition_penalties=floats([p.repetition_penalty for p in params]),
            **_padded("prompt", params, prompt_token_ids, device),
            **_padded("output", params, output_token_ids, device),
            pending_rows=_ids(pending_rows, device) if has_pending_history else None,
            pending_token_ids=pending_ids if has_pending_history else None,
            bias_rows=_ids([i for i, _, _ in bias], device),
            bias_token_ids=_ids([t for _, t, _ in bias], device),
            bias_values=floats([b for _, _, b in bias]) if bias else None,
            banned_rows=_ids([i for i, _ in banned], device),
            banned_token_ids=_ids([t for _, t in banned], device),
            seeded_rows=[i for i, _ in seeded],
            seeded_keys=[key for _, key in seeded],
            num_logprobs=[p.logprobs for p in params],
            allowed_token_mask=allowed_token_mask,
            max_token_id=max(named_ids, default=-1),
            all_greedy=all(is_greedy),
            all_random=not any(is_greedy),
            has_penalties=has_penalties,
            has_min_p=any(p.min_p > 0.0 for p in params),
            has_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
            may_need_sort=any(p.top_p < 1.0 or p.top_k > NUM_CANDIDATES for p in params),
        )


def _min_tokens_banned_ids(params: SamplingParams, eos_token_id: int | None) -> list[int]:
    banned = list(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        banned.append(eos_token_id)
    return banned


def _ids(values: list[int], device: torch.device | str) -> torch.Tensor | None:
    return to_device(torch.tensor(values, dtype=torch.int64), device) if values else None


def _padded(
    name: str,
    params: list[SamplingParams],
    token_ids: list[list[int]],
    device: torch.device | str,
) -> dict[str, torch.Tensor | None]:
    """``{name}_token_ids`` [B, L] int64 padded with 0 and ``{name}_weights`` [B, L] fp32.

    Only rows with penalties need their history; all None when no row has penalties.
    """
    if not any(p.has_penalties for p in params):
        return {f"{name}_token_ids": None, f"{name}_weights": None}
    rows = [ids if p.has_penalties else [] for p, ids in zip(params, token_ids, strict=True)]
    width = max((len(r) for r in rows), default=0)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    weights = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
        weights[i, : len(row)] = 1.0
    return {
        f"{name}_token_ids": to_device(ids, device),
        f"{name}_weights": to_device(weights, device),
    }


@dataclass
class SamplerOutput:
    """What one step sampled, as tensors (on the logits' device until ``to_host``).

    Producer: ``sample``. Consumer: the model runner. ``token_ids`` [B] int64. The rows that
    asked for logprobs (``num_logprobs[i]`` not None), in order, have ``chosen_logprobs`` [R]
    and the ``top_ids`` / ``top_logprobs`` [R, K] of the RAW logits; ``logprobs`` turns them into
    one ``{token_id: logprob}`` per row (None where not asked): the chosen token first, then the
    row's top-k in descending order (the chosen token is not repeated when it is among them).
    """

    token_ids: torch.Tensor
    num_logprobs: list[int | None]
    chosen_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    def to_host(self) -> SamplerOutput:
        """The same on the CPU. From CUDA the copies are queued into pinned memory and not
        waited for: synchronize with the stream (an event recorded after this) before reading."""
        if self.token_ids.device.type == "cpu":
            return self

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        return SamplerOutput(
            token_ids=host(self.token_ids),
            num_logprobs=self.num_logprobs,
            chosen_logprobs=host(self.chosen_logprobs),
            top_ids=host(self.top_ids),
            top_logprobs=host(self.top_logprobs),
        )

    @property
    def logprobs(self) -> list[dict[int, float] | None]:
        out: list[dict[int, float] | None] = [None] * len(self.num_logprobs)
        rows = [i for i, n in enumerate(self.num_logprobs) if n is not None]
        if not rows:
            return out
        assert self.chosen_logprobs is not None and self.top_ids is not None
        dicts = _logprob_dicts(
            self.token_ids[rows],
            self.chosen_logprobs,
            self.top_ids,
            self.top_logprobs,
            [self.num_logprobs[i] for i in rows],
        )
        for row, entry in zip(rows, dicts, strict=True):
            out[row] = entry
        return out


def sample(
    logits: torch.Tensor,
    metadata: SamplingMetadata,
    generator: torch.Generator | None = None,
) -> SamplerOutput:
    """Sample one token per row of ``logits`` [B, V] fp32 (not modified). No host sync on CUDA.

    ``generator`` drives the unseeded rows and must live on ``logits.device``; None means torch's
    default generator.
    """
    num_rows, vocab_size = logits.shape
    assert num_rows == metadata.num_rows, f"{num_rows} logits rows, {metadata.num_rows} metadata"
    assert metadata.max_token_id < vocab_size, (
        f"token id {metadata.max_token_id} in logit_bias/stop_token_ids, vocab size {vocab_size}"
    )
    logprob_rows = [i for i, n in enumerate(metadata.num_logprobs) if n is not None]
    raw_logprobs = None
    if logprob_rows:
        rows = _ids(logprob_rows, logits.device)
        raw_logprobs = torch.log_softmax(logits[rows].float(), dim=-1)  # [R, V]

    logits = apply_logits_processors(logits, metadata)
    if metadata.all_greedy:
        token_ids = logits.argmax(dim=-1)
    else:
        sampled = _sample_random(logits, metadata, generator)
        if metadata.all_random:
            token_ids = sampled
        else:
            token_ids = torch.where(metadata.is_greedy, logits.argmax(dim=-1), sampled)

    output = SamplerOutput(token_ids=token_ids, num_logprobs=metadata.num_logprobs)
    if raw_logprobs is not None:
        num_top = max(metadata.num_logprobs[i] for i in logprob_rows)
        output.chosen_logprobs, output.top_ids, output.top_logprobs = _logprob_tensors(
            raw_logprobs, token_ids[rows], num_top
        )
    return output


def apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Steps 2-5: logit_bias, min_tokens masking, penalties, grammar mask. Returns a new [B, V]
    fp32 tensor. The grammar mask comes last so that no later step can revive a banned token."""
    logits = logits.float().clone()
    if metadata.bias_rows is not None:
        logits.index_put_(
            (metadata.bias_rows, metadata.bias_token_ids), metadata.bias_values, accumulate=True
        )
    if metadata.banned_rows is not None:
        logits[metadata.banned_rows, metadata.banned_token_ids] = float("-inf")
    if metadata.has_penalties:
        logits = _apply_penalties(logits, metadata)
    if metadata.allowed_token_mask is not None:
        logits = logits.masked_fill(~metadata.allowed_token_mask, float("-inf"))
    return logits


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> list[dict[int, float]]:
    """``{token_id: logprob}`` per row of ``logits`` [N, V]: ``token_ids`` [N] int64 first, then
    the top ``num_top`` in descending order. Logprobs are ``log_softmax`` in fp32.

    For prompt logprobs row ``p`` holds the logits at position ``p`` and ``token_ids[p]`` is the
    prompt token at ``p + 1``. Memory is ``N * V * 4`` bytes: callers chunk long prompts.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen, top_ids, top_values = _logprob_tensors(logprobs, token_ids, num_top)
    return _logprob_dicts(token_ids, chosen, top_ids, top_values, [num_top] * logits.shape[0])


def _logprob_tensors(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From ``logprobs`` [N, V] fp32: the logprob of each row's ``token_ids`` [N], and the ids and
    logprobs of its top ``num_top`` ([N, num_top], descending)."""
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)  # [N]
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    return chosen, top_ids, top_values


def _logprob_dicts(
    token_ids: torch.Tensor,
    chosen: torch.Tensor,
    top_ids: torch.Tensor,
    top_values: torch.Tensor,
    num_tops: list[int],
) -> list[dict[int, float]]:
    """One dict per row: its token first, then its top ``num_tops[i]`` (a prefix of the K)."""
    dicts = []
    for token_id, logprob, values, ids, num_top in zip(
        token_ids.tolist(),
        chosen.tolist(),
        top_values.tolist(),
        top_ids.tolist(),
        num_tops,
        strict=True,
    ):
        entry = {token_id: logprob}
        for top_id, value in zip(ids[:num_top], values[:num_top], strict=True):
            entry.setdefault(top_id, value)
        dicts.append(entry)
    return dicts


def _apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition on tokens seen in prompt + output, then frequency and presence on output counts.

    ``logits`` [B, V] fp32. Repetition divides positive logits and multiplies negative ones, so it
    always pushes a seen token towards less likely (for penalty > 1).
    """
    assert metadata.prompt_token_ids is not None and metadata.output_token_ids is not None
    output_counts = torch.zeros_like(logits)
    output_counts.scatter_add_(1, metadata.output_token_ids, metadata.output_weights)
    if metadata.pending_rows is not None:
        ones = torch.ones_like(metadata.pending_token_ids, dtype=logits.dtype)
        index = (metadata.pending_rows, metadata.pending_token_ids)
        output_counts.index_put_(index, ones, accumulate=True)
    seen = output_counts.clone()
    seen.scatter_add_(1, metadata.prompt_token_ids, metadata.prompt_weights)
    repetition = metadata.repetition_penalties.unsqueeze(1)  # [B, 1]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen > 0, penalized, logits)
    logits -= metadata.frequency_penalties.unsqueeze(1) * output_counts
    logits -= metadata.presence_penalties.unsqueeze(1) * (output_counts > 0).float()
    return logits


def _sample_random(
    logits: torch.Tensor, metadata: SamplingMetadata, generator: torch.Generator | None
) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p, then the exponential race. ``logits`` [B, V] fp32."""
    logits = logits / metadata.temperature.unsqueeze(1)
    if metadata.has_min_p:
        probs = logits.softmax(dim=-1)
        threshold = metadata.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if metadata.has_top_k_top_p:
        # The CPU finds the rows that need the full sort (cheap there); a GPU must not wait.
        may_need_sort = None if logits.device.type == "cpu" else metadata.may_need_sort
        logits = apply_top_k_top_p(
            logits, metadata.top_k, metadata.top_p, may_need_sort=may_need_sort
        )
    probs = logits.softmax(dim=-1)
    exponentials = -torch.log(_uniforms(metadata, logits.shape, logits.device, generator))
    # argmax(probs / q) with q ~ Exp(1) i.i.d. picks token t with probability probs[t]; u = 0 gives
    # q = inf, a 0 score, never chosen over a live token.
    return (probs / exponentials).argmax(dim=-1)


def _uniforms(
    metadata: SamplingMetadata,
    shape: torch.Size,
    device: torch.device,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Uniforms in [0, 1) of shape [B, V] fp32: keyed per seeded row, shared generator otherwise."""
    num_rows, vocab_size = shape
    if len(metadata.seeded_rows) == num_rows:
        uniforms = torch.empty(shape, dtype=torch.float32, device=device)
    else:
        uniforms = torch.rand(shape, generator=generator, dtype=torch.float32, device=device)
    if metadata.seeded_rows:
        rows = _ids(metadata.seeded_rows, device)
        keys = _ids(metadata.seeded_keys, device)
        uniforms[rows] = keyed_uniforms(keys, vocab_size)
    return uniforms


class TorchRefSamplingBackend(Backend):
    """The oracle as a backend object: this module's sampler and the metadata type it reads;
    it keeps no state."""

    SamplingMetadata = SamplingMetadata
    sample = staticmethod(sample)
    compute_logprobs = staticmethod(compute_logprobs)
