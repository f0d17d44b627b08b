"""Matcher: one request's position in its grammar; allowed_token_mask: a step's [B, V] mask.

Producer of masks: the model runner's ``_sample`` (CPU bitmask, unpacked on the logits' device).
Consumer: the sampler, which sets disallowed logits to -inf. ``Scheduler.update`` advances the
matcher with each appended token (``accept``).

Bitmask layout (xgrammar's): int32 words, bit ``b`` of word ``w`` allows token ``32 * w + b``::

    word 0: bit0 = token 0, bit1 = token 1, ... bit31 = token 31;  word 1: tokens 32..63; ...

Preemption by recompute keeps the matcher: the output tokens it accepted stay in the request and
are recomputed, not resampled, so its state remains that of ``output_token_ids``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from deepinfer.constraints.kinds import THINK_END_TOKEN_ID

if TYPE_CHECKING:
    import torch
    import xgrammar

logger = logging.getLogger(__name__)

# Per accepted token, what it did: the history lets rollback(k) undo gate tokens too.
_FREE = 0  # reasoning before </think>: not seen by the grammar
_GRAMMAR = 1  # consumed by the grammar
_OPENS = 2  # the </think> that started the grammar


class Matcher:
    """Grammar state of one request (CPU, not thread-safe: the engine thread owns it).

    With ``wait_for_think_end`` the matcher is inactive (everything allowed, tokens not fed to
    the grammar) until ``</think>`` is accepted. ``token_filter`` (packed int32 [ceil(V/32)]):
    tokens allowed at all, ANDed into every grammar mask (see compiler.Compiled).
    """

    def __init__(
        self,
        compiled: xgrammar.CompiledGrammar,
        *,
        wait_for_think_end: bool,
        token_filter: torch.Tensor | None = None,
    ) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._token_filter = token_filter
        self._waits_initially = wait_for_think_end
        self.is_active = not wait_for_think_end
        self._history: list[int] = []

    @property
    def is_terminated(self) -> bool:
        """True after the grammar accepted its stop token (EOS)."""
        return self.is_active and self._matcher.is_terminated()

    @property
    def num_accepted(self) -> int:
        return len(self._history)

    def fill_mask(self, bitmask_row: torch.Tensor) -> None:
        """Write the allowed next tokens into ``bitmask_row`` [ceil(V/32)] int32 (CPU): all
        tokens while inactive, only EOS once terminated (the request stops on it anyway)."""
        if not self.is_active:
            bitmask_row.fill_(-1)
        elif self._matcher.is_terminated():
            bitmask_row.zero_()
            eos = self._matcher.stop_token_ids[0]
            bitmask_row[eos // 32] = _bit(eos % 32)
        else:
            self._matcher.fill_next_token_bitmask(bitmask_row.unsqueeze(0), 0)
            if self._token_filter is not None:
                bitmask_row.bitwise_and_(self._token_filter)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar rejects it."""
        if not self.is_active:
            if token_id == THINK_END_TOKEN_ID:
                self.is_active = True
                self._history.append(_OPENS)
            else:
                self._history.append(_FREE)
            return True
        if not self._matcher.accept_token(token_id):
            return False
        self._history.append(_GRAMMAR)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding's rejected drafts)."""
        assert 0 <= num_tokens <= len(self._history), (
            f"rollback of {num_tokens} tokens, {len(self._history)} accepted"
        )
        undone = self._history[len(self._history) - num_tokens :]
        del self._history[len(self._history) - num_tokens :]
        num_grammar = undone.count(_GRAMMAR)
        if num_grammar:
            self._matcher.rollback(num_grammar)
        if _OPENS in undone:
            self.is_active = False

    def reset(self) -> None:
        """Back to the state before the first output token."""
        self._matcher.reset()
        self._history.clear()
        self.is_active = not self._waits_initially


def _bit(index: int) -> int:
    """Bit ``index`` of an int32 word, as a signed value (bit 31 is the sign)."""
    return (1 << index) - (1 << 32 if index == 31 else 0)


def allowed_token_mask(
    matchers: list[Matcher | None], vocab_size: int, device: torch.device | str
) -> torch.Tensor | None:
    """[B, vocab_size] bool on ``device`` (True = allowed) for rows ``matchers``; None when no row
    is constrained this step. Unconstrained and inactive rows are all True.

    The bitmask is filled on the CPU (xgrammar), copied as int32 (V/8 bytes per row), and
    unpacked on ``device``.
    """
    import torch

    from deepinfer.device import to_device

    rows = [i for i, m in enumerate(matchers) if m is not None and m.is_active]
    if not rows:
        return None
    num_words = (vocab_size + 31) // 32
    bitmask = torch.empty(len(rows), num_words, dtype=torch.int32)
    for j, i in enumerate(rows):
        matcher = matchers[i]
        assert matcher is not None
        matcher.fill_mask(bitmask[j])
    # Unpack through a byte lookup table: bit i of word w is token 32w + i, and the words are
    # little-endian, so byte b of the row's bytes holds tokens 8b .. 8b+7. One gather of
    # [R, 4W] -> [R, 4W, 8] instead of 32 shifts per word.
    table = _byte_table(device)
    row_bytes = to_device(bitmask.view(torch.uint8), device).long()  # [R, 4W]
    unpacked = table[row_bytes].view(len(rows), num_words * 32)[:, :vocab_size]
    allowed = torch.ones(len(matchers), vocab_size, dtype=torch.bool, device=device)
    allowed[torch.tensor(rows, device=device)] = unpacked
    return allowed


_BYTE_TABLES: dict[str, torch.Tensor] = {}


def _byte_table(device: torch.device | str) -> torch.Tensor:
    """[256, 8] bool: bit j of byte value v."""
    import torch

    key = str(device)
    if key not in _BYTE_TABLES:
        values = torch.arange(256).unsqueeze(1)
        _BYTE_TABLES[key] = ((values >> torch.arange(8)) & 1).bool().to(device)
    return _BYTE_TABLES[key]
