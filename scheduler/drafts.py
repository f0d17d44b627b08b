"""Draft tokens for speculative decoding: who proposes them, and how many a step may verify.

    schedule(): a decoding request's chunk [its last token] -> [its last token, d1 .. dk]
    executor:   samples s0 .. sk at those k + 1 positions; keeps s0, then s(j) while d(j) == s(j-1)
    update():   appends the kept tokens (stops apply to each), rolls num_computed_tokens back
                over the rejected drafts (the executor rolls the cache state back)

Drafts are proposed only where a verification step gives exactly the tokens a plain run would:
a request decoding with every token on the host (no token in flight), not deterministic (those
run one token per forward), and, with prefix caching, drafts that stay inside the current block
(a block boundary is where a snapshot of the state is saved, and it must not include rejected
drafts). A grammar masks each drafted position with its state after the drafts before it
(``step_outputs.DraftedMatcher``).
"""

from __future__ import annotations

from typing import Protocol

from deepinfer.scheduler.request import Request


class Drafter(Protocol):
    """Proposes up to ``max_tokens`` guesses of the tokens after ``request``'s last one (from
    its prompt and output tokens); fewer, or none, is fine."""

    def propose(self, request: Request, max_tokens: int) -> list[int]: ...


def num_draft_slots(
    request: Request,
    *,
    end: int,
    max_draft_tokens: int,
    budget: int,
    max_num_tokens: int,
    block_size: int | None,
) -> int:
    """How many drafts a chunk ending at ``end`` (the request's known tokens) may verify:
    bounded by the cache's rollback margin, the step's token budget left, the length limits
    (the drafts and the token after them must fit) and, with prefix caching (``block_size``),
    the current block."""
    params = request.sampling_params
    if (
        max_draft_tokens <= 0
        or request.num_pending_tokens
        or end != request.num_tokens
        or params.deterministic
    ):
        return 0
    room = min(max_draft_tokens, budget, max_num_tokens - request.num_tokens - 1)
    if params.max_tokens is not None:
        room = min(room, params.max_tokens - request.num_output_tokens - 1)
    if block_size is not None:
        room = min(room, 0 if end % block_size == 0 else block_size - end % block_size - 1)
    return max(room, 0)


def accepted(drafts: list[int], samples: list[int]) -> list[int]:
    """The tokens a verification step keeps: ``samples[0]``, then each next sample while the
    draft fed at its position equals the sample before it (len(samples) == len(drafts) + 1)."""
    assert len(samples) == len(drafts) + 1, f"{len(samples)} samples for {len(drafts)} drafts"
    kept = samples[:1]
    for draft, sample in zip(drafts, samples[1:], strict=True):
        if draft != kept[-1]:
            break
        kept.append(sample)
    return kept
