"""ModelArgs: DeepSeek-V4.1's architecture read from a checkpoint's ``config.json`` (torch-free).

The release nests the text model's keys under ``text_config`` (beside ``vision_config`` and the
top-level ``quantization_config``, ``bos_token_id``, ...); a flat config is read the same way.
Every hyper-parameter comes from the file; what the file cannot say (the hyper-connections'
post multiplier 2, interleaved RoPE, no per-head q norm) is fixed by the architecture.

Layers by their ``compress_ratios`` entry: 0 = sliding window only, 1 = C1 (one compressed
entry per token), 2 = C2 (one per two tokens); both compressed kinds are sparse (top-k by the
Lightning indexer). Cross-layer sharing, by source layer ids (each layer at or after the first
source reads the nearest source at or before it)::

    kv_source_layer_ids        compressed KV entries (the compressor)
    index_k_source_layer_ids   the indexer's keys (default: the KV sources)
    index_source_layer_ids     the indexer's top-k selection (its queries and weights)
    candidate_source_layer_id  candidate blocks: later indexers score only inside them

Segments nest (top-k within index keys within KV) and none crosses the YoCo boundary (the first
C1 layer: it and every layer after it are the consumer half).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from deepinfer.model.deepseek_v4.args import RopeArgs, _one_rope
from deepinfer.model.deepseek_v41.engram import EngramArgs
from deepinfer.model.deepseek_v41.vision_args import ImagePrompt, VisionArgs

RATIOS = (0, 1, 2)
YOCO_MODES = ("off", "mask", "compact")


@dataclass(frozen=True)
class DSparkArgs:
    """The block drafter's layers (``mtp.{i}.*``): loaded and kept; speculative decoding runs
    them. ``target_layer_ids``: main layers whose residual streams feed the drafter."""

    block_size: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    noise_token_id: int
    num_experts: int
    num_experts_per_tok: int


@dataclass(frozen=True)
class ModelArgs:
    model_type: str = "deepseek_v41"
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_layers: int = 40
    num_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = ()
    kv_source_layer_ids: tuple[int, ...] = ()
    index_k_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    num_experts: int = 384
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    main_rope: RopeArgs = field(default_factory=lambda: RopeArgs(theta=10000.0))
    compress_rope: RopeArgs = field(default_factory=lambda: RopeArgs(theta=160000.0))
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    engram: EngramArgs | None = None
    vision: VisionArgs | None = None  # the vision tower (config.json's vision_config)
    num_mtp_layers: int = 0
    dspark: DSparkArgs | None = None
    torch_dtype: str = "bfloat16"
    quantization: dict[str, Any] | None = None
    # YoCo prefill truncation (a serving option, [model] yoco_truncation / yoco_keep_tokens, not
    # config.json): "off", "mask" or "compact"; the consumer half computes only each prompt's
    # last yoco_keep tokens ("mask": all, with the same narrowed window).
    yoco_mode: str = "off"
    yoco_keep: int = 0
    # The block drafter served (a serving option: speculative.method = "dspark"): its layers'
    # window rings get cache parts and the forward writes their main-token keys.
    dspark_served: bool = False

    def __post_init__(self) -> None:
        n = self.num_layers
        if len(self.compress_ratios) != n:
            raise ValueError(
                f"config: compress_ratios has {len(self.compress_ratios)} main-layer entries "
                f"for num_hidden_layers={n}"
            )
        bad = sorted({r for r in self.compress_ratios if r not in RATIOS})
        if bad:
            raise ValueError(f"config: compress_ratios entries must be 0, 1 or 2, got {bad}")
        if self.num_heads % self.o_groups:
            raise ValueError(
                f"config: num_attention_heads={self.num_heads} is not a multiple of "
                f"o_groups={self.o_groups}"
            )
        if self.rope_head_dim % 2 or self.rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(f"config: bad qk_rope_head_dim {self.rope_head_dim}")
        for key in ("kv_source_layer_ids", "index_k_source_layer_ids", "index_source_layer_ids"):
            for layer in getattr(self, key):
                if not 0 <= layer < n or not self.compress_ratios[layer]:
                    raise ValueError(
                        f"config: {key} names layer {layer}, which is not a compressed layer"
                    )
        self._check_sharing()
        self._check_candidates()
        self._check_yoco()
        if self.dspark_served and (self.dspark is None or not self.num_mtp_layers):
            raise ValueError(
                "speculative.method='dspark': this checkpoint has no DSpark layers "
                "(num_nextn_predict_layers=0)"
            )
        if self.dspark is not None:
            sides = {t >= self.n_prefill_layer for t in self.dspark.target_layer_ids}
            if any(not 0 <= t < n for t in self.dspark.target_layer_ids) or len(sides) > 1:
                raise ValueError(
                    f"config: dspark_target_layer_ids {list(self.dspark.target_layer_ids)} must "
                    "be main layers on one side of the YoCo boundary "
                    f"(layer {self.n_prefill_layer})"
                )

    def _check_sharing(self) -> None:
        """Each map's consumers have their source's ratio (so no segment crosses the YoCo
        boundary, the first C1 layer after C2 ones); top-k segments nest in index-key segments,
        those in KV segments."""
        maps = {
            "kv_source_layer_ids": self.kv_source,
            "index_k_source_layer_ids": self.index_k_source,
            "index_source_layer_ids": self.index_source,
        }
        for key, source in maps.items():
            for layer in range(self.num_layers):
                src = source(layer)
                if self.compress_ratios[src] != self.compress_ratios[layer]:
                    raise ValueError(
                        f"config: {key}: layer {layer} (ratio {self.compress_ratios[layer]}) "
                        f"would read layer {src} (ratio {self.compress_ratios[src]})"
                    )
        for layer in range(self.num_layers):
            if self.index_k_source(self.index_source(layer)) != self.index_k_source(layer):
                raise ValueError(
                    f"config: index_source_layer_ids: layer {layer}'s top-k source "
                    f"{self.index_source(layer)} is in another index-key segment"
                )
            if self.kv_source(self.index_k_source(layer)) != self.kv_source(layer):
                raise ValueError(
                    f"config: index_k_source_layer_ids: layer {layer}'s index-key source "
                    f"{self.index_k_source(layer)} is in another KV segment"
                )

    def _check_yoco(self) -> None:
        if self.yoco_mode not in YOCO_MODES:
            raise ValueError(
                f"model.yoco_truncation must be one of {list(YOCO_MODES)}, got {self.yoco_mode!r}"
            )
        if self.yoco_mode == "off":
            return
        if self.n_prefill_layer == self.num_layers:
            raise ValueError(
                "model.yoco_truncation: this checkpoint has no C1 layer (no YoCo half)"
            )
        if self.yoco_keep < 1:
            raise ValueError(f"model.yoco_keep_tokens must be >= 1, got {self.yoco_keep}")
        late = [
            i for i in (self.engram.layer_ids if self.engram else ()) if i >= self.n_prefill_layer
        ]
        if late:
            raise ValueError(
                f"model.yoco_truncation: engram layers {late} are in the consumer half "
                f"(from layer {self.n_prefill_layer}), which truncation does not compute whole"
            )

    @property
    def truncates(self) -> bool:
        return self.yoco_mode != "off"

    def _check_candidates(self) -> None:
        src = self.candidate_source_layer_id
        if src is None:
            return
        if not 0 <= src < self.num_layers or self.index_source(src) != src:
            raise ValueError(
                f"config: candidate_source_layer_id={src} must be one of index_source_layer_ids"
            )
        if self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0:
            raise ValueError(
                f"config: candidate_topk_blocks={self.candidate_topk_blocks} and "
                f"candidate_block_size={self.candidate_block_size} must be positive"
            )
        for layer in range(src + 1, self.num_layers):
            if self.compress_ratios[layer] != self.compress_ratios[src]:
                raise ValueError(
                    f"config: layer {layer} after candidate_source_layer_id={src} has ratio "
                    f"{self.compress_ratios[layer]}, the source {self.compress_ratios[src]}"
                )
        capacity = self.candidate_topk_blocks * self.candidate_block_size
        if capacity < self.index_topk:
            raise ValueError(
                f"config: candidate_topk_blocks * candidate_block_size = {capacity} is below "
                f"index_topk={self.index_topk}"
            )

    # Sharing maps: the nearest source at or before the layer (the layer itself before the
    # first source and on sliding-window layers).

    def kv_source(self, layer: int) -> int:
        return _nearest(self.kv_source_layer_ids, layer, self.compress_ratios)

    def index_k_source(self, layer: int) -> int:
        ids = self.index_k_source_layer_ids or self.kv_source_layer_ids
        return _nearest(ids, layer, self.compress_ratios)

    def index_source(self, layer: int) -> int:
        return _nearest(self.index_source_layer_ids, layer, self.compress_ratios)

    def candidate_source(self, layer: int) -> int | None:
        """The candidate source whose blocks bound this layer's indexer (None: unbounded)."""
        src = self.candidate_source_layer_id
        return src if src is not None and layer > src else None

    @property
    def n_prefill_layer(self) -> int:
        """YoCo boundary: the first C1 layer (num_layers without one)."""
        return next((i for i, r in enumerate(self.compress_ratios) if r == 1), self.num_layers)

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    @property
    def block_multiple(self) -> int:
        """What cache.block_size must be a multiple of: every compression ratio."""
        return math.lcm(*(r for r in self.compress_ratios if r), 1)

    @property
    def hc_mix_size(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def mtp_layer_ids(self) -> range:
        return range(self.num_mtp_layers)

    @property
    def served_mtp_layers(self) -> range:
        """Cache layer ids of the drafter's layers when served (after the stack's)."""
        n = self.num_mtp_layers if self.dspark_served else 0
        return range(self.num_layers, self.num_layers + n)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelArgs:
        model_type = cfg.get("model_type", "deepseek_v41")
        if model_type != "deepseek_v41":
            raise ValueError(f"config: model_type {model_type!r} is not deepseek_v41")
        text = {**cfg, **(cfg.get("text_config") or {})}
        n = int(text["num_hidden_layers"])
        nextn = int(text.get("num_nextn_predict_layers", 0))
        ratios = [int(r) for r in text.get("compress_ratios", [])]
        if len(ratios) not in (n, n + nextn):
            raise ValueError(
                f"config: compress_ratios has {len(ratios)} entries; expected "
                f"num_hidden_layers + num_nextn_predict_layers = {n + nextn}"
            )
        if any(ratios[n:]):
            raise ValueError("config: compress_ratios of the MTP layers must be 0")
        main_rope = RopeArgs(theta=float(text.get("rope_theta", 10000.0)))
        compress_theta = float(text.get("compress_rope_theta", 160000.0))
        scaling = dict(text.get("rope_scaling") or {})
        compress_rope = _one_rope({**scaling, "rope_theta": compress_theta}, compress_theta)
        eos = cfg.get("eos_token_id", text.get("eos_token_id", 1))
        if isinstance(eos, list):
            eos = eos[0]
        quantization = cfg.get("quantization_config")
        candidate = text.get("candidate_source_layer_id")
        images = ImagePrompt.from_config(cfg)
        return cls(
            vocab_size=images.vocab_size,
            hidden_size=int(text["hidden_size"]),
            num_layers=n,
            num_heads=int(text["num_attention_heads"]),
            head_dim=int(text.get("head_dim", 512)),
            rope_head_dim=int(text.get("qk_rope_head_dim", 64)),
            q_lora_rank=int(text["q_lora_rank"]),
            o_groups=int(text.get("o_groups", 8)),
            o_lora_rank=int(text.get("o_lora_rank", 1024)),
            sliding_window=int(text.get("sliding_window", 128)),
            compress_ratios=tuple(ratios[:n]),
            kv_source_layer_ids=_ids(text, "kv_source_layer_ids"),
            index_k_source_layer_ids=_ids(text, "index_k_source_layer_ids"),
            index_source_layer_ids=_ids(text, "index_source_layer_ids"),
            candidate_source_layer_id=None if candidate is None else int(candidate),
            candidate_topk_blocks=int(text.get("candidate_topk_blocks") or 0),
            candidate_block_size=int(text.get("candidate_block_size") or 0),
            index_n_heads=int(text.get("index_n_heads", 32)),
            index_head_dim=int(text.get("index_head_dim", 128)),
            index_topk=int(text.get("index_topk", 512)),
            num_experts=int(text["n_routed_experts"]),
            num_experts_per_tok=int(text["num_experts_per_tok"]),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            routed_scaling_factor=float(text.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(text.get("swiglu_limit", 10.0)),
            hc_mult=int(text.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(text.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(text.get("hc_eps", 1e-6)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-20)),
            main_rope=main_rope,
            compress_rope=compress_rope,
            max_position_embeddings=int(text.get("max_position_embeddings", 1048576)),
            bos_token_id=int(cfg.get("bos_token_id", text.get("bos_token_id", 0)) or 0),
            eos_token_id=int(eos if eos is not None else 1),
            pad_token_id=int(cfg.get("pad_token_id", text.get("pad_token_id", 2)) or 0),
            image_token_id=images.image_token_id,
            engram=EngramArgs.from_dict(text),
            vision=images.vision,
            num_mtp_layers=nextn,
            dspark=_dspark(text) if nextn else None,
            torch_dtype=str(cfg.get("dtype", cfg.get("torch_dtype", "bfloat16"))),
            quantization=quantization if isinstance(quantization, dict) else None,
        )._checked_unsupported(text)

    def _checked_unsupported(self, text: dict[str, Any]) -> ModelArgs:
        """Refuse the variants the architecture names but this model does not implement."""
        fixed = {
            "num_key_value_heads": 1,
            "hc_shifted": True,
            "compress_overlap": False,
            "use_ape": False,
            "use_qnorm": False,
        }
        for key, expected in fixed.items():
            if key in text and text[key] != expected:
                raise ValueError(f"config: {key}={text[key]!r} is not supported ({expected!r})")
        if int(text.get("n_shared_experts", 1)) != 1:
            raise ValueError(f"config: n_shared_experts={text['n_shared_experts']} must be 1")
        return self


def _ids(text: dict[str, Any], key: str) -> tuple[int, ...]:
    return tuple(sorted(int(i) for i in text.get(key) or ()))


def _nearest(source_ids: tuple[int, ...], layer: int, ratios: tuple[int, ...]) -> int:
    if not ratios[layer]:
        return layer
    before = [s for s in source_ids if s <= layer]
    return max(before) if before else layer


def _dspark(text: dict[str, Any]) -> DSparkArgs:
    return DSparkArgs(
        block_size=int(text.get("dspark_block_size", 5)),
        target_layer_ids=tuple(int(i) for i in text.get("dspark_target_layer_ids", ())),
        markov_rank=int(text["dspark_markov_rank"]),
        noise_token_id=int(text.get("dspark_noise_token_id", 0)),
        num_experts=int(text.get("dspark_n_routed_experts", text["n_routed_experts"])),
        num_experts_per_tok=int(
            text.get("dspark_num_experts_per_tok", text["num_experts_per_tok"])
        ),
    )
