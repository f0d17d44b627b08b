"""DeepSeek-V4-Flash shapes with fewer layers, for benchmarks with random weights.

BENCH.md: a full V4-Flash checkpoint does not fit here; benchmark random weights in the real
shapes (hidden 4096, 64 heads of 512, 256 experts top-6, window 128, CSA 4 / HCA 128, indexer
64 x 128 top-512, YaRN on compressed layers) with fewer layers, and report per-layer figures next
to full-depth extrapolations (43 layers: 2 sliding, 21 CSA, 20 HCA).
"""

from __future__ import annotations

import json
from pathlib import Path

FULL_DEPTH = 43

V4_FLASH = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "num_local_experts": 256,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}


def write_config(folder: str | Path, layer_types: list[str]) -> Path:
    """A config.json of V4-Flash shapes with these layers (routed MoE on every layer)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(V4_FLASH)
    config["num_hidden_layers"] = len(layer_types)
    config["layer_types"] = layer_types
    config["mlp_layer_types"] = ["moe"] * len(layer_types)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
