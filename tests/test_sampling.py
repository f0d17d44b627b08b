"""Torch reference sampler (ops/sampling/torch_ref.py): exact effects of every option."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.ops.sampling import (
    SamplingMetadata,
    apply_logits_processors,
    compute_logprobs,
    keyed,
    nucleus,
    sample,
    seeded_key,
)
from deepinfer.sampling_params import SamplingParams

NEG_INF = float("-inf")


def _metadata(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    positions: list[int] | None = None,
    eos_token_id: int | None = None,
) -> SamplingMetadata:
    num_rows = len(params)
    return SamplingMetadata.build(
        params,
        prompts or [[] for _ in range(num_rows)],
        outputs or [[] for _ in range(num_rows)],
        positions or [0] * num_rows,
        eos_token_id,
        "cpu",
    )


def _random_logits(num_rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed))


def _sample(logits: torch.Tensor, params: SamplingParams, seed: int = 0) -> torch.Tensor:
    metadata = _metadata([params] * logits.shape[0])
    return sample(logits, metadata, torch.Generator().manual_seed(seed)).token_ids


def test_greedy_is_argmax_with_ties_to_lowest_id():
    logits = _random_logits(8, 50)
    logits[0] = torch.tensor([1.0, 3.0, 3.0] + [0.0] * 47)
    original = logits.clone()
    token_ids = _sample(logits, SamplingParams(temperature=0.0))
    assert token_ids.dtype == torch.int64
    assert token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert token_ids[0].item() == 1
    assert torch.equal(logits, original)


def test_low_temperature_is_greedy_limit():
    # Gaps of 1.0 between logits: at T = 1e-3 the runner-up has probability ~exp(-1000).
    perms = [torch.randperm(40, generator=torch.Generator().manual_seed(i)) for i in range(16)]
    logits = torch.stack(perms).float()
    token_ids = _sample(logits, SamplingParams(temperature=1e-3))
    assert token_ids.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)],
    ids=["top_k=1", "top_p=1e-6", "min_p=1"],
)
def test_filters_that_keep_only_the_top_token_are_greedy(params: SamplingParams):
    logits = _random_logits(64, 100, seed=1)
    assert _sample(logits, params).tolist() == logits.argmax(dim=-1).tolist()


PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize(
    ("params", "survivors"),
    [
        (SamplingParams(min_p=0.5), {0, 1}),  # threshold 0.5 * 0.5 = 0.25
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # threshold 0.1
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_p=0.7), {0, 1}),  # 0.5 < 0.7 <= 0.8
        (SamplingParams(top_p=0.9), {0, 1, 2}),  # 0.8 < 0.9 <= 0.95
        (SamplingParams(top_k=3, top_p=0.7), {0, 1}),
        (SamplingParams(), {0, 1, 2, 3}),
    ],
)
def test_min_p_top_k_top_p_survivors(params: SamplingParams, survivors: set[int]):
    logits = torch.tensor(PROBS).log().expand(2000, -1).contiguous()
    assert set(_sample(logits, params).tolist()) == survivors


def test_logit_bias_forces_a_token_and_leaves_logprobs_raw():
    logits = _random_logits(2, 30, seed=2)
    weak = int(logits[0].argmin())
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, logit_bias={weak: 100.0}, logprobs=0)
        out = sample(logits[:1], _metadata([params]), torch.Generator().manual_seed(0))
        assert out.token_ids.tolist() == [weak]
        assert out.logprobs[0] == {weak: torch.log_softmax(logits[0], dim=-1)[weak].item()}


def test_logit_bias_adds_exactly():
    logits = torch.zeros(2, 5)
    params = [SamplingParams(logit_bias={1: 2.5, 4: -1.0}), SamplingParams()]
    processed = apply_logits_processors(logits, _metadata(params))
    assert processed.tolist() == [[0.0, 2.5, 0.0, 0.0, -1.0], [0.0] * 5]


ROW = [2.0, -2.0, 1.0, 0.5, -1.0]
PROMPT = [0, 1]
OUTPUT = [2, 2, 3]  # token 2 twice, token 3 once; token 4 never seen


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # Seen = prompt + output = {0, 1, 2, 3}: positive logits / 2, negative * 2.
        (SamplingParams(repetition_penalty=2.0), [1.0, -4.0, 0.5, 0.25, -1.0]),
        # Output counts only (prompt tokens 0 and 1 are not penalised): -count * 0.5.
        (SamplingParams(frequency_penalty=0.5), [2.0, -2.0, 0.0, 0.0, -1.0]),
        (SamplingParams(presence_penalty=0.5), [2.0, -2.0, 0.5, 0.0, -1.0]),
        (SamplingParams(frequency_penalty=-1.0), [2.0, -2.0, 3.0, 1.5, -1.0]),
        (
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.5),
            [1.0, -4.0, -1.0, -0.75, -1.0],
        ),
    ],
)
def test_penalties_exact(params: SamplingParams, expected: list[float]):
    # A second row without penalties and a longer history checks the padding counts nothing.
    logits = torch.tensor([ROW, ROW])
    metadata = _metadata(
        [params, SamplingParams()], prompts=[PROMPT, [0, 1, 2, 3, 4]], outputs=[OUTPUT, [4] * 7]
    )
    assert apply_logits_processors(logits, metadata).tolist() == [expected, ROW]


@pytest.mark.parametrize(
    ("num_outputs", "ignore_eos", "masked"),
    [(1, False, {1, 3}), (1, True, {3}), (2, False, set())],
)
def test_min_tokens_masks_eos_and_stop_ids(num_outputs: int, ignore_eos: bool, masked: set[int]):
    params = SamplingParams(min_tokens=2, stop_token_ids=[3], ignore_eos=ignore_eos)
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 2.0]])
    metadata = _metadata([params], outputs=[[4] * num_outputs], eos_token_id=1)
    processed = apply_logits_processors(logits, metadata)[0].tolist()
    assert processed == [NEG_INF if t in masked else logits[0, t].item() for t in range(5)]


def test_min_tokens_changes_the_greedy_choice():
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[3])
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 2.0]])
    out = sample(logits, _metadata([params], eos_token_id=1), None)
    assert out.token_ids.tolist() == [4]


def test_logprobs_are_raw_log_softmax_with_chosen_plus_top_k():
    logits = _random_logits(4, 20, seed=3)
    raw = torch.log_softmax(logits, dim=-1)
    order = raw.argsort(dim=-1, descending=True)
    low = order[3, -1].item()  # forced by logit_bias: outside the top 3
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=3, logit_bias={low: 1e3}),
    ]
    out = sample(logits, _metadata(params), None)
    chosen = out.token_ids.tolist()
    assert chosen[3] == low
    assert out.logprobs[1] is None
    assert out.logprobs[2] == {chosen[2]: raw[2, chosen[2]].item()}
    # Greedy's choice is the top token itself: exactly k entries.
    assert list(out.logprobs[0]) == order[0, :3].tolist()
    # Chosen first, then the top 3 in descending order: k + 1 entries.
    assert list(out.logprobs[3]) == [low, *order[3, :3].tolist()]
    for row in (0, 3):
        assert out.logprobs[row] == {t: raw[row, t].item() for t in out.logprobs[row]}


def test_compute_logprobs_for_prompt_positions():
    logits = _random_logits(5, 12, seed=4)
    next_ids = torch.tensor([3, 3, 0, 11, 7])
    raw = torch.log_softmax(logits, dim=-1)
    dicts = compute_logprobs(logits, next_ids, num_top=2)
    for p, entry in enumerate(dicts):
        top2 = raw[p].topk(2).indices.tolist()
        expected_ids = [next_ids[p].item(), *(t for t in top2 if t != next_ids[p].item())]
        assert list(entry) == expected_ids
        assert entry == {t: raw[p, t].item() for t in expected_ids}


def test_seeded_key_is_splitmix64():
    # splitmix64's first output from state 0 is 0xE220A8397B1DCDAF; the key keeps 63 bits.
    assert seeded_key(0, 0) == 0xE220A8397B1DCDAF & (2**63 - 1)
    assert seeded_key(7, 3) != seeded_key(7, 4) != seeded_key(8, 3)


def _splitmix_uniform(key: int, token_id: int) -> float:
    """keyed_uniforms' documented recipe, in Python integers."""
    mask = 2**64 - 1
    z = key ^ ((token_id + 1) * 0x9E3779B97F4A7C15 & mask)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return (z >> 40) / 2**24


def test_seeded_draw_follows_the_documented_recipe():
    logits = _random_logits(1, 500, seed=5)
    out = sample(logits, _metadata([SamplingParams(seed=99)], positions=[42]), None)
    key = seeded_key(99, 42)
    uniforms = torch.tensor([_splitmix_uniform(key, t) for t in range(500)])
    assert torch.equal(keyed.keyed_uniforms(torch.tensor([key]), 500)[0], uniforms)
    expected = (logits[0].softmax(dim=-1) / -uniforms.log()).argmax()
    assert out.token_ids.tolist() == [expected.item()]


def test_keyed_uniforms_look_uniform():
    """Mean, spread and the low and high tails of 1M draws over 8 keys, against U[0, 1)."""
    keys = torch.tensor([seeded_key(s, p) for s in (0, 1, 7, 2**40) for p in (0, 99)])
    u = keyed.keyed_uniforms(keys, 125_000).flatten()
    n = u.numel()
    assert ((u >= 0) & (u < 1)).all()
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / n) ** 0.5
    assert abs(u.var().item() - 1 / 12) < 1e-3
    for edge in (0.01, 0.99):
        share = (u < edge).float().mean().item()
        assert abs(share - edge) < 5 * (edge * (1 - edge) / n) ** 0.5


def test_seeded_row_ignores_batch_composition_and_order():
    vocab_size = 1000
    target_logits = torch.zeros(1, vocab_size)  # uniform: the draw alone decides the token
    target = SamplingParams(seed=1234, top_p=0.9)
    alone = sample(target_logits, _metadata([target], positions=[17]), None).token_ids.item()

    others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=5, top_k=3)]
    other_logits = _random_logits(3, vocab_size, seed=6)
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]):
        rows = [*others, target]
        logits = torch.cat([other_logits, target_logits])[order]
        metadata = _metadata([rows[i] for i in order], positions=[[9, 9, 3, 17][i] for i in order])
        for generator_seed in (0, 1):
            token_ids = sample(logits, metadata, torch.Generator().manual_seed(generator_seed))
            assert token_ids.token_ids[order.index(3)].item() == alone


def test_seeded_draws_differ_across_positions_and_seeds():
    logits = torch.zeros(64, 1000)
    by_position = _metadata([SamplingParams(seed=7)] * 64, positions=list(range(64)))
    by_seed = _metadata([SamplingParams(seed=s) for s in range(64)], positions=[5] * 64)
    # 64 uniform draws from 1000 tokens have ~62 distinct values; a constant draw would have 1.
    assert len(set(sample(logits, by_position, None).token_ids.tolist())) >= 55
    assert len(set(sample(logits, by_seed, None).token_ids.tolist())) >= 55
    again = sample(logits, by_position, None).token_ids
    assert torch.equal(again, sample(logits, by_position, None).token_ids)


def test_mixed_greedy_and_random_rows():
    logits = _random_logits(6, 40, seed=7)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1)] * 3
    assert _sample(logits, params[0]).tolist() == logits.argmax(dim=-1).tolist()
    out = sample(logits, _metadata(params), torch.Generator().manual_seed(0))
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), [0.1, 0.2, 0.3, 0.4]),
        (SamplingParams(temperature=0.5), [1 / 30, 4 / 30, 9 / 30, 16 / 30]),  # p^2 renormalised
        (SamplingParams(top_k=2), [0.0, 0.0, 3 / 7, 4 / 7]),
    ],
    ids=["plain", "temperature=0.5", "top_k=2"],
)
def test_empirical_distribution_within_3_sigma(params: SamplingParams, expected: list[float]):
    num_draws = 4000
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().expand(num_draws, -1).contiguous()
    counts = torch.bincount(_sample(logits, params, seed=123), minlength=4).tolist()
    for count, p in zip(counts, expected, strict=True):
        sigma = math.sqrt(num_draws * p * (1 - p))
        assert abs(count - num_draws * p) <= 3 * sigma, (counts, expected)


# (top_k, top_p, logits kind) rows for a vocabulary larger than the candidate list: nuclei that
# close inside it, flat rows whose nucleus does not (the full sort), top_k past the candidates
# (kthvalue; with top_p: the full sort), integer logits with ties at the cutoff, -inf entries,
# and rows that filter nothing.
_FILTER_ROWS = [
    (0, 0.9, "peaked"),
    (0, 0.5, "flat"),
    (50, 1.0, "flat"),
    (2000, 1.0, "flat"),
    (2000, 0.5, "flat"),
    (10, 0.3, "peaked"),
    (0, 1.0, "flat"),
    (7, 1.0, "ties"),
    (0, 0.35, "ties"),
    (3000, 1.0, "ties"),
    (5, 0.8, "masked"),
    (0, 0.999, "masked"),
]


def _filter_logits(kind: str, vocab_size: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "peaked":
        return torch.randn(vocab_size, generator=gen) * 4
    if kind == "ties":
        return torch.randint(0, 6, (vocab_size,), generator=gen).float()
    logits = torch.randn(vocab_size, generator=gen) * 0.1
    if kind == "masked":
        logits[torch.rand(vocab_size, generator=gen) < 0.99] = NEG_INF
    return logits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_top_p_from_candidates_equals_a_full_sort(seed: int) -> None:
    """The candidate-list filter keeps exactly the tokens a stable full sort keeps (ties broken
    by the lower id), alone and batched, on a vocabulary past the candidate list."""
    gen = torch.Generator().manual_seed(seed)
    vocab_size = 5000
    logits = torch.stack([_filter_logits(kind, vocab_size, gen) for _, _, kind in _FILTER_ROWS])
    top_k = torch.tensor([k for k, _, _ in _FILTER_ROWS])
    top_p = torch.tensor([p for _, p, _ in _FILTER_ROWS])
    fast = nucleus.apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(fast, nucleus.sorted_top_k_top_p(logits, top_k, top_p))
    # The sync-free form (asynchronous GPU steps) selects the same rows on the device.
    assert torch.equal(nucleus.apply_top_k_top_p(logits, top_k, top_p, may_need_sort=True), fast)
    # Rows the candidates always decide (top_k inside them, no top_p): nothing to sort.
    small = [i for i, (k, p, _) in enumerate(_FILTER_ROWS) if k <= 1024 and p == 1.0]
    assert torch.equal(
        nucleus.apply_top_k_top_p(logits[small], top_k[small], top_p[small], may_need_sort=False),
        fast[small],
    )
    for i in range(len(_FILTER_ROWS)):
        row = nucleus.apply_top_k_top_p(logits[i : i + 1], top_k[i : i + 1], top_p[i : i + 1])
        assert torch.equal(row, fast[i : i + 1])


def test_a_pending_output_token_counts_as_if_it_were_listed() -> None:
    """A row's newest output token given on the device (``pending``, asynchronous scheduling)
    weighs in penalties and min_tokens exactly as the same token in the output history."""
    logits = _random_logits(3, 64, seed=5)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, presence_penalty=2.0, min_tokens=2),
        SamplingParams(temperature=0.0, min_tokens=3),
    ]
    prompts = [[1, 2], [3], [4]]
    outputs = [[7, 9], [logits[1].argmax().item(), 11], [5]]
    full = SamplingMetadata.build(params, prompts, outputs, [9, 9, 9], 5, "cpu")
    newest = torch.tensor([outputs[0][-1], outputs[1][-1]])
    listed = [out[:-1] for out in outputs[:2]] + [outputs[2]]
    split = SamplingMetadata.build(
        params, prompts, listed, [9, 9, 9], 5, "cpu", pending=([0, 1], newest)
    )
    assert torch.equal(
        apply_logits_processors(logits, full), apply_logits_processors(logits, split)
    )
    # Row 1 reaches min_tokens 2 only with its pending token; row 2 (one token of 3) does not.
    assert (split.banned_rows.tolist(), split.banned_token_ids.tolist()) == ([2], [5])
