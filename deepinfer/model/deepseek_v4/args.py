"""ModelArgs: the architecture read from a checkpoint's ``config.json`` (torch-free).

Accepts transformers' keys (``layer_types``, ``mlp_layer_types``, ``compress_rates``,
``rope_parameters``, ``num_local_experts``, ...) and DeepSeek's upstream keys (``compress_ratios``,
``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``, ``n_routed_experts``, ...).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"

_RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class RopeArgs:
    """One RoPE flavour: plain (``rope_type`` "default") or YaRN without mscale."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class ModelArgs:
    model_type: str = "deepseek_v4"
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_layers: int = 43
    num_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_experts: int = 256
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    main_rope: RopeArgs = field(default_factory=lambda: RopeArgs(theta=10000.0))
    compress_rope: RopeArgs = field(default_factory=lambda: RopeArgs(theta=160000.0))
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    torch_dtype: str = "bfloat16"
    quantization: dict[str, Any] | None = None
    # Next-token-prediction layers the checkpoint ships (``mtp.{i}.*``), their compression
    # ratios (compress_ratios past the stack; sliding-only when the config lists none), and how
    # many of them the engine builds and runs (a serving option: speculative.method = "mtp").
    num_mtp_layers: int = 0
    mtp_ratios: tuple[int, ...] = ()
    mtp_served: int = 0

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"config: layer_types has {len(self.layer_types)} entries for "
                f"num_hidden_layers={self.num_layers}"
            )
        if len(self.mlp_layer_types) != self.num_layers:
            raise ValueError(
                f"config: mlp_layer_types has {len(self.mlp_layer_types)} entries for "
                f"num_hidden_layers={self.num_layers}"
            )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"config: unknown layer_types {bad}; expected {list(LAYER_TYPES)}")
        bad = [t for t in self.mlp_layer_types if t not in (HASH_MOE, MOE)]
        if bad:
            raise ValueError(f"config: unknown mlp_layer_types {bad}; expected hash_moe or moe")
        if CSA in self.layer_types and self.csa_ratio != 4:
            raise ValueError(f"config: the CSA compress rate must be 4, got {self.csa_ratio}")
        if self.num_heads % self.o_groups:
            raise ValueError(
                f"config: num_attention_heads={self.num_heads} is not a multiple of "
                f"o_groups={self.o_groups}"
            )
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            raise ValueError(f"config: bad rope head dim {self.rope_head_dim}")
        if self.mtp_served > self.num_mtp_layers:
            raise ValueError(
                f"speculative.method=mtp: the checkpoint has num_nextn_predict_layers="
                f"{self.num_mtp_layers}, no next-token-prediction layer to draft with"
            )
        if any(self.mtp_ratios[: self.mtp_served]):
            raise ValueError(
                f"speculative.method=mtp: MTP layers with compression (compress_ratios "
                f"{list(self.mtp_ratios)} past the stack) are not supported, only sliding-window"
            )

    def with_mtp(self) -> ModelArgs:
        """The stack with its served MTP layers appended as layers ``num_layers ..``:
        sliding-window attention, a scored router (what ``Block`` builds them from)."""
        n = self.mtp_served
        return dataclasses.replace(
            self,
            num_layers=self.num_layers + n,
            layer_types=self.layer_types + (SLIDING,) * n,
            mlp_layer_types=self.mlp_layer_types + (MOE,) * n,
            num_mtp_layers=0,
            mtp_ratios=(),
            mtp_served=0,
        )

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        """Per layer: 0 (sliding only), csa_ratio or hca_ratio."""
        ratio = {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}
        return tuple(ratio[t] for t in self.layer_types)

    def compress_ratio(self, layer_id: int) -> int:
        return self.compress_ratios[layer_id]

    @property
    def block_multiple(self) -> int:
        """What cache.block_size must be a multiple of: every compression ratio."""
        return math.lcm(*(r for r in self.compress_ratios if r), 1)

    @property
    def hc_mix_size(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelArgs:
        model_type = cfg.get("model_type", "deepseek_v4")
        if model_type != "deepseek_v4":
            raise ValueError(f"config: model_type {model_type!r} is not supported (deepseek_v4)")
        n = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim", 512))

        rates = dict(cfg.get("compress_rates") or {})
        csa = int(cfg.get("compress_rate_csa", rates.get(CSA, 4)))
        hca = int(cfg.get("compress_rate_hca", rates.get(HCA, 128)))
        layer_types = cfg.get("layer_types")
        num_mtp = int(cfg.get("num_nextn_predict_layers", 0) or 0)
        mtp_ratios = tuple(int(r) for r in (cfg.get("compress_ratios") or [])[n : n + num_mtp])
        mtp_ratios += (0,) * (num_mtp - len(mtp_ratios))  # unlisted: sliding-window
        if layer_types is None and cfg.get("compress_ratios") is not None:
            try:
                layer_types = [_RATIO_TO_LAYER_TYPE[int(r)] for r in cfg["compress_ratios"]]
            except KeyError as e:
                raise ValueError(
                    f"config: compress_ratios entries must be 0, 4 or 128, got {e.args[0]}"
                ) from None
        if layer_types is None:
            interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            layer_types = [HCA] * min(n, 2) + interleave
        mlp_layer_types = cfg.get("mlp_layer_types")
        if mlp_layer_types is None:
            n_hash = int(cfg.get("num_hash_layers", 3))
            mlp_layer_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)

        if cfg.get("partial_rotary_factor") is not None:
            rope_head_dim = int(head_dim * float(cfg["partial_rotary_factor"]))
        else:
            rope_head_dim = int(cfg.get("qk_rope_head_dim", 64))
        main_rope, compress_rope = _rope_args(cfg)

        quantization = cfg.get("quantization_config")
        if isinstance(quantization, dict) and cfg.get("expert_dtype") is not None:
            # V4 ships expert_dtype ("fp4") at the top level; transformers folds it in here.
            quantization = {"expert_dtype": cfg["expert_dtype"], **quantization}
        eos = cfg.get("eos_token_id", 1)
        if isinstance(eos, list):
            eos = eos[0]
        return cls(
            model_type=model_type,
            vocab_size=int(cfg.get("vocab_size", 129280)),
            hidden_size=int(cfg.get("hidden_size", cfg.get("dim", 4096))),
            num_layers=n,
            num_heads=int(cfg.get("num_attention_heads", cfg.get("n_heads", 64))),
            head_dim=head_dim,
            rope_head_dim=rope_head_dim,
            q_lora_rank=int(cfg.get("q_lora_rank", 1024)),
            o_groups=int(cfg.get("o_groups", 8)),
            o_lora_rank=int(cfg.get("o_lora_rank", 1024)),
            sliding_window=int(cfg.get("sliding_window", cfg.get("window_size", 128))),
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_layer_types[:n]),
            csa_ratio=csa,
            hca_ratio=hca,
            index_n_heads=int(cfg.get("index_n_heads", 64)),
            index_head_dim=int(cfg.get("index_head_dim", 128)),
            index_topk=int(cfg.get("index_topk", 512)),
            num_experts=int(cfg.get("num_local_experts", cfg.get("n_routed_experts", 256))),
            num_experts_per_tok=int(
                cfg.get("num_experts_per_tok", cfg.get("n_activated_experts", 6))
            ),
            moe_intermediate_size=int(
                cfg.get("moe_intermediate_size", cfg.get("intermediate_size", 2048))
            ),
            routed_scaling_factor=float(
                cfg.get("routed_scaling_factor", cfg.get("route_scale", 1.5))
            ),
            swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
            hc_mult=int(cfg.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(cfg.get("hc_eps", 1e-6)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", cfg.get("norm_eps", 1e-6))),
            main_rope=main_rope,
            compress_rope=compress_rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 1048576)),
            bos_token_id=int(cfg.get("bos_token_id", 0) or 0),
            eos_token_id=int(eos if eos is not None else 1),
            torch_dtype=str(cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))),
            quantization=quantization,
            num_mtp_layers=num_mtp,
            mtp_ratios=mtp_ratios,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelArgs:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _rope_args(cfg: dict[str, Any]) -> tuple[RopeArgs, RopeArgs]:
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return _one_rope(rp["main"], 10000.0), _one_rope(rp["compress"], 160000.0)
    scaling = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    if cfg.get("rope_scaling"):
        scaling = dict(cfg["rope_scaling"])
    main = RopeArgs(theta=float(cfg.get("rope_theta", 10000.0)))
    compress_theta = float(cfg.get("compress_rope_theta", 160000.0))
    return main, _one_rope({**scaling, "rope_theta": compress_theta}, compress_theta)


def _one_rope(d: dict[str, Any], default_theta: float) -> RopeArgs:
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"config: rope type {rope_type!r} is not supported (default, yarn)")
    return RopeArgs(
        theta=float(d.get("rope_theta", default_theta)),
        rope_type=rope_type,
        factor=float(d.get("factor", 1.0) or 1.0),
        original_max_position_embeddings=int(d.get("original_max_position_embeddings", 4096)),
        beta_fast=float(d.get("beta_fast") or 32.0),
        beta_slow=float(d.get("beta_slow") or 1.0),
        truncate=bool(d.get("truncate", True)),
    )
