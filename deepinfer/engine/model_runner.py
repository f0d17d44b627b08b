"""ModelRunner: turns a SchedulerOutput into one forward pass, logits, samples and logprobs.

SchedulerOutput (CPU) -> tier moves (tier_io.py) -> ForwardBatch (device; staging.py on CUDA)
-> the model: eager, a decode graph (cuda_graphs.py) or one token per forward (deterministic.py)
-> logits -> prompt logprobs, sampler (step_outputs.py) -> LaunchedStep
-> ModelRunnerOutput (host values) -> Scheduler.update()

At start: the weights (weights_loading.py), the KV cache (sized here: device memory in
``deepinfer.engine.memory`` on CUDA, cache.memory_budget_gib on CPU), then on CUDA the decode
graphs and the eager step shapes (warm_up.py), before the node reports ready.

Lock-step ranks (a ``RankGroup``): the device is the rank's, the weights hold its share of the
routed experts, the MoE backend exchanges tokens with the other ranks, and ``run_placeholder``
runs a step with no tokens of its own.

One file of ~420 lines: start-up (weights, cache sizing, graphs) and the step share the runner's
state; what each step stage does lives in the modules named above.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepinfer.config import Config, KernelConfig
from deepinfer.device import resolve_device, resolve_dtype, use_ieee_float32
from deepinfer.engine.cuda_graphs import DecodeGraphs
from deepinfer.engine.deterministic import deterministic_rows, forward_split
from deepinfer.engine.image_embeddings import ImageEmbeddings
from deepinfer.engine.memory import MemoryProfile, fit_num_blocks, profile_memory
from deepinfer.engine.planner import StepPlanner
from deepinfer.engine.staging import PinnedStaging
from deepinfer.engine.step_outputs import LastSamples, LaunchedStep, prompt_logprobs, sample
from deepinfer.engine.tier_io import move_between_tiers
from deepinfer.engine.warm_up import warm_up_eager
from deepinfer.engine.weights_loading import cache_salt, image_salt, load_model
from deepinfer.images import ImageInput, PromptImage, overlapping
from deepinfer.kv_cache.pool import KVCache
from deepinfer.kv_cache.spec import CacheSpec
from deepinfer.kv_cache.tiered import KVTiers
from deepinfer.model.batch import ForwardBatch, SeqSpan, flatten
from deepinfer.model.families import cache_salt as cache_format_salt
from deepinfer.model.families import load_family
from deepinfer.ops import select_kernels
from deepinfer.parallel.group import RankGroup
from deepinfer.scheduler.output import (
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model weights and the KV cache of one device (of one rank of ``group``)."""

    def __init__(
        self, config: Config, model_dir: Path, args: Any, group: RankGroup | None = None
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self.args = args  # the family's architecture arguments
        self.family = load_family(args.model_type)
        self.group = group
        self.device = group.device if group else resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.max_model_len = config.model.max_model_len or args.max_position_embeddings
        self._init_threads()
        self._init_precision()
        ep = group is not None and group.expert_parallel
        if ep and (getattr(args, "mtp_served", 0) or getattr(args, "dspark_served", False)):
            raise ValueError(
                "speculative decoding with the model's drafter layers (mtp, dspark) and expert "
                "parallelism over ranks is not supported: the drafter's steps would need every "
                "rank in lock-step (use ngram)"
            )
        self.kernels = select_kernels(
            kernel_config(config), self.device, experts=group.moe_context() if ep else None
        )
        # The routed experts this rank holds (None: all of them), over how many ranks.
        self.experts = group.experts(self.family.num_experts(args)) if ep else None
        self.expert_ranks = group.world_size if ep else 1
        self._init_model(model_dir)
        self.memory_profile: MemoryProfile | None = None  # set when sized on CUDA
        self._init_kv_cache()
        self._init_staging()
        self.images = self._image_embeddings()
        self.step_drafts = self.family.drafts(
            self.model,
            self.kv_cache,
            self.planner.geometry,
            config.cache.max_draft_tokens,
            self._upload,
        )
        self._init_graphs()
        self._warm_up_eager()
        self.cache_salt = self._cache_salt(model_dir)
        # The sampler draws unseeded rows from this generator on the logits' device.
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        # The host/disk tiers of the KV cache (set by the engine when configured).
        self.tiers: KVTiers | None = None
        self._last_samples = LastSamples(self.device)  # what the next launch's placeholders are

    def _init_threads(self) -> None:
        if self.config.kernel.num_threads > 0:
            torch.set_num_threads(self.config.kernel.num_threads)

    def _init_precision(self) -> None:
        if use_ieee_float32(self.device, self.dtype):
            logger.info("float32 on CUDA: TF32 off for matmuls and cuDNN (IEEE float32)")

    def _init_model(self, model_dir: Path) -> None:
        loaded = load_model(
            self.config.model,
            self.family,
            model_dir,
            self.args,
            self.kernels,
            self.device,
            self.dtype,
            self.experts,
        )
        self.model = loaded.model
        self.fp8_weights = loaded.fp8_weights  # FP8 weights change activations: in the salt
        self.fp8_experts = loaded.fp8_experts  # so do FP8 experts
        self.weight_bytes = loaded.weight_bytes

    def _init_kv_cache(self) -> None:
        cache = self.config.cache
        num_slots = cache.num_state_slots or self.config.scheduler.max_num_seqs
        num_snapshots = 0
        if cache.enable_prefix_caching:
            num_snapshots = cache.num_snapshots
            if num_snapshots is None:
                num_snapshots = 2 * num_slots
        num_blocks = cache.num_blocks
        if num_blocks is None:
            num_blocks = self._size_num_blocks(num_slots, num_snapshots)
        self.kv_cache = self._new_kv_cache(num_blocks, num_slots, num_snapshots)
        self.kv_cache.log_sizes()
        self.planner = StepPlanner.of(self.model, self.kv_cache)
        blocks_per_request = self._blocks_per_request
        logger.info(
            "KV capacity: %d blocks = %d tokens of KV, %d state slots, %d snapshots; "
            "%d requests of max_model_len=%d at once",
            num_blocks,
            num_blocks * cache.block_size,
            num_slots,
            num_snapshots,
            min(num_slots, num_blocks // blocks_per_request),
            self.max_model_len,
        )

    def _new_kv_cache(self, num_blocks: int, num_slots: int, num_snapshots: int) -> KVCache:
        return KVCache(
            self.cache_spec,
            num_blocks=num_blocks,
            num_slots=num_slots,
            num_snapshots=num_snapshots,
            dtype=self.dtype,
            device=self.device,
        )

    @property
    def cache_spec(self) -> CacheSpec:
        cache = self.config.cache
        return self.family.cache_spec(
            self.args,
            block_size=cache.block_size,
            ring_margin=cache.ring_margin,
            max_draft=cache.max_draft_tokens,
            kv_dtype=cache.kv_dtype,
        )

    @property
    def _blocks_per_request(self) -> int:
        return math.ceil(self.max_model_len / self.config.cache.block_size)

    def _size_num_blocks(self, num_slots: int, num_snapshots: int) -> int:
        """As many blocks as the memory budget holds after the state slots and snapshots (CPU:
        cache.memory_budget_gib; CUDA: what the profile leaves of gpu_memory_utilization), at
        most what max_num_seqs requests of max_model_len can use: more would only waste memory.
        """
        cache = self.config.cache
        # A minimal cache: its sizes per slot/snapshot/block, and the profile step's scratch.
        scratch = self._new_kv_cache(num_blocks=1, num_slots=1, num_snapshots=0)
        if self.device.type == "cuda":
            self.memory_profile = profile_memory(
                self.model,
                self.kernels,
                scratch,
                utilization=cache.gpu_memory_utilization,
                num_tokens=min(self.config.scheduler.max_num_batched_tokens, self.max_model_len),
                context=self.max_model_len,
                graph_batch=self._graph_batch,
                graph_tokens=self._graph_tokens,
            )
            budget = self.memory_profile.kv_budget
            source = f"cache.gpu_memory_utilization={cache.gpu_memory_utilization}"
        else:
            budget = int(cache.memory_budget_gib * 2**30)
            source = f"cache.memory_budget_gib={cache.memory_budget_gib}"
        spec = scratch.spec
        fixed = num_slots * spec.bytes_per_slot(self.dtype)
        fixed += num_snapshots * spec.bytes_per_snapshot(self.dtype)
        max_useful = self.config.scheduler.max_num_seqs * self._blocks_per_request
        num_blocks = fit_num_blocks(
            budget,
            bytes_per_block=spec.bytes_per_block(self.dtype),
            fixed_bytes=fixed,
            max_useful=max_useful,
        )
        if num_blocks < 1:
            raise ValueError(
                f"{source} leaves {budget / 2**30:.3f} GiB for the KV cache: no room for a block "
                f"after {num_slots} state slots and {num_snapshots} snapshots "
                f"({fixed / 2**30:.3f} GiB)"
            )
        if num_blocks == max_useful:
            logger.info(
                "KV cache: %d blocks, capped at what %d requests of max_model_len=%d can use",
                num_blocks,
                self.config.scheduler.max_num_seqs,
                self.max_model_len,
            )
        return num_blocks

    def _init_staging(self) -> None:
        """CUDA: a copy stream and a pinned host buffer for each step's index tensors."""
        self._staging: PinnedStaging | None = None
        if self.device.type == "cuda":
            self._staging = PinnedStaging(self.device, copy_stream=True)

    @property
    def _graph_batch(self) -> int:
        """The most requests a decode graph runs (0: no graphs)."""
        kernel = self.config.kernel
        if self.device.type != "cuda" or kernel.deterministic:
            return 0
        if self.expert_ranks > 1:
            # The exchange's split sizes come from the routing (a host sync): not capturable.
            logger.info("decode graphs off: expert parallelism over ranks runs eager steps")
            return 0
        return min(kernel.cuda_graph_max_batch, self.config.scheduler.max_num_seqs)

    @property
    def _graph_tokens(self) -> int:
        """The most tokens of a request in a graphed step: its last and its drafts (as many as
        the scheduler verifies: cache.max_draft_tokens)."""
        return 1 + self.config.cache.max_draft_tokens if self.config.speculative.enabled else 1

    def _init_graphs(self) -> None:
        """CUDA: decode and verify steps replay graphs (cuda_graphs.py), all captured here, at
        start-up, so that no request waits for a capture."""
        self.graphs: DecodeGraphs | None = None
        if self._graph_batch > 0:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_cache,
                self._graph_batch,
                max_positions=self.max_model_len,
                max_tokens=self._graph_tokens,
            )
            self.graphs.capture_all()

    def _warm_up_eager(self) -> None:
        """CUDA: the eager step shapes' kernels compiled before the node reports ready."""
        warm_up_eager(
            self.model,
            self.kv_cache,
            max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            device=self.device,
        )

    def _image_embeddings(self) -> ImageEmbeddings | None:
        """The vision tower's embeddings cache, when the model has a tower."""
        encoder = self.family.image_encoder(self.model)
        if encoder is None:
            return None
        return ImageEmbeddings.from_config(
            self.config.cache,
            partial(self.family.encode_images, encoder),
            self.device,
            self._upload,
            image_salt(self.model_dir, self.config.model, self.dtype),
        )

    def expand_images(
        self, token_ids: list[int], images: list[ImageInput]
    ) -> tuple[list[int], list[PromptImage]]:
        """The prompt with its image placeholders grown to the images' positions (the
        family's); ValueError when the model takes no images or they do not fit."""
        return self.family.expand_images(self.args, token_ids, images)

    def _cache_salt(self, model_dir: Path) -> bytes:
        """Model fingerprint + what changes the cached bytes (dtype, block layout)."""
        spec_salt = self.kv_cache.spec.salt
        layout = cache_format_salt(self.family.model_type, dtype=str(self.dtype), layout=spec_salt)
        return cache_salt(
            model_dir, self.config.model, self.fp8_weights, layout, fp8_experts=self.fp8_experts
        )

    @property
    def replay_tokens(self) -> int:
        """Tokens to replay on a prefix hit with no snapshot (the family's receptive field)."""
        return self.family.replay_tokens(self.args)

    @property
    def recompute_tokens(self) -> int:
        """Prompt tokens a prefix hit leaves to compute (the family's)."""
        return self.family.recompute_tokens(self.args)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        return self.args.eos_token_id

    @property
    def num_snapshots(self) -> int:
        return self.kv_cache.num_snapshots

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def num_slots(self) -> int:
        return self.kv_cache.num_slots

    def run_placeholder(self) -> None:
        """A lock-step step with no tokens of this rank: its MoE layers' collectives only."""
        self.family.run_placeholder(self.model)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return host-side samples and logprobs."""
        return self.launch(scheduler_output).result()

    def launch(
        self,
        scheduler_output: SchedulerOutput,
        before_sampling: Callable[[], None] | None = None,
    ) -> LaunchedStep:
        """Queue one step on the device; its samples come back through ``result()``.

        CUDA: nothing here waits for the device (except prompt logprobs, whose dicts are built
        at once), so the host can schedule the next step while this one runs. A placeholder
        token is the one this runner sampled for the same request in the previous launch: it is
        gathered on the device, never read back first. ``before_sampling`` runs on the host
        once the forward is queued and before the sampler's inputs are built (the engine
        applies the previous step there when grammar masks need its tokens).
        """
        if scheduler_output.is_empty:
            return LaunchedStep(ModelRunnerOutput())
        launched_at = time.perf_counter()
        move_between_tiers(scheduler_output, self.kv_cache, self.tiers)
        scheduled = scheduler_output.scheduled
        hidden: torch.Tensor | None = None  # the last layer's output, for the MTP layer
        one_by_one = deterministic_rows(scheduler_output, self.config.kernel.deterministic)
        if (
            not one_by_one
            and self.graphs is not None
            and self.graphs.can_run(scheduler_output)
            and not _touches_images(scheduled)
        ):
            step = self.graphs.run(
                scheduler_output,
                lambda ids, rows: self._last_samples.fill_placeholders(scheduled, ids, rows),
            )
            logits, sample_rows = step.logits, _graph_sample_rows(scheduled, step.rows)
            prompt_rows: list[tuple[int, int, int]] = []
            if step.hidden is not None and self.step_drafts is not None:
                hidden = step.hidden[self._upload(_graph_token_rows(scheduled, step.rows))]
        elif one_by_one:
            _, sample_rows, prompt_rows = _logits_layout(scheduled)
            logits = forward_split(
                scheduler_output,
                sample_rows,
                prompt_rows,
                one_by_one,
                forward=self._forward,
                vocab_size=self.args.vocab_size,
                device=self.device,
            )
        else:
            batch, sample_rows, prompt_rows = self._prepare(scheduler_output)
            logits, hidden = self.model(batch, self.kv_cache), batch.hidden
        snapshots = [
            (s.state_slot, s.save_snapshot) for s in scheduled if s.save_snapshot is not None
        ]
        # With drafter layers a snapshot waits for their part of the step (``after``).
        after = (
            None
            if self.step_drafts is None
            else partial(self._after_drafts, scheduled, hidden, snapshots)
        )
        if after is None:
            self._save_snapshots(snapshots)
        output = ModelRunnerOutput()
        prompt_logprobs(self.kernels.sampling, scheduler_output, logits, prompt_rows, output)
        if before_sampling is not None:
            before_sampling()
        samples = sample(
            self.kernels.sampling,
            scheduler_output,
            logits,
            sample_rows,
            eos_token_id=self.args.eos_token_id,
            generator=self.generator,
            last_samples=self._last_samples,
        )
        if samples is None:
            self._last_samples.clear()
            if after is not None:
                after(output)
            return LaunchedStep(output)
        request_ids = [scheduled[i].request_id for i, _ in sample_rows]
        self._last_samples.record(samples.token_ids, request_ids)
        ready = None
        host = samples.to_host()
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        drafted = {s.request_id: s for s in scheduled if s.num_draft_tokens}
        return LaunchedStep(
            output, request_ids, host, ready, drafted, self._roll_back, after, launched_at
        )

    def _save_snapshots(self, snapshots: list[tuple[int, int]]) -> None:
        for slot, snapshot_id in snapshots:
            self.kv_cache.save_snapshot(slot, snapshot_id)

    def _after_drafts(
        self,
        scheduled: list[ScheduledRequest],
        hidden: torch.Tensor | None,
        snapshots: list[tuple[int, int]],
        output: ModelRunnerOutput,
    ) -> None:
        """Once a step's kept tokens are known: the drafter layers' part of the step (their
        drafts into ``output``), then the step's snapshots."""
        assert self.step_drafts is not None
        output.draft_token_ids = self.step_drafts.run(scheduled, hidden, output.sampled_token_ids)
        # A drafter with a confidence head (DSpark) says how likely each draft is accepted.
        output.draft_confidence = getattr(self.step_drafts, "confidence", None)
        self._save_snapshots(snapshots)

    def _roll_back(self, sched: ScheduledRequest, num_rejected: int) -> None:
        """The cache state of ``sched``'s request as if its last ``num_rejected`` drafts had
        not been computed."""
        end_pos = sched.start_pos + sched.num_tokens
        self.family.rollback(self.kv_cache, sched.state_slot, end_pos, num_rejected)

    def _prepare(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[ForwardBatch, list[tuple[int, int]], list[tuple[int, int, int]]]:
        """Flatten the step and upload it in one copy. Returns the batch and ``_logits_layout``'s
        rows."""
        scheduled = scheduler_output.scheduled
        logits_indices, sample_rows, prompt_rows = _logits_layout(scheduled)
        seqs, token_ids, offset = [], [], 0
        for sched in scheduled:
            seqs.append(SeqSpan.of(offset, sched, self.planner.num_history))
            token_ids.extend(sched.token_ids)
            offset += sched.num_tokens
        host = self.planner.arrays(seqs, token_ids, logits_indices)
        batch = self.planner.views(self._upload(flatten(host)), host, seqs)
        if self.images is not None:
            self.images.place(batch, scheduled)
        self._last_samples.fill_placeholders(scheduled, batch.input_ids)
        return batch, sample_rows, prompt_rows

    def _forward(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[torch.Tensor, list[tuple[int, int]], list[tuple[int, int, int]]]:
        """One eager forward of the step: logits [N, V] fp32 and ``_prepare``'s rows."""
        batch, sample_rows, prompt_rows = self._prepare(scheduler_output)
        return self.model(batch, self.kv_cache), sample_rows, prompt_rows

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        """Host int64 [n] -> the same on the device (CUDA: through the pinned staging buffer, on
        the copy stream, the compute stream waiting for it)."""
        if self._staging is None:
            return torch.from_numpy(values).to(self.device)
        return self._staging.upload(values)


def kernel_config(config: Config) -> KernelConfig:
    """``config.kernel``, with ``linear = "auto"`` taken as the torch reference when no FP8
    linears are kept: only they call the linear family, so auto would probe for nothing (the
    DeepGEMM probe runs a child process and compiles a kernel)."""
    kernel = config.kernel
    if not config.model.fp8_weights and kernel.linear == "auto":
        return dataclasses.replace(kernel, linear="torch_ref")
    return kernel


def _touches_images(scheduled: list[ScheduledRequest]) -> bool:
    """Whether a chunk of the step computes image positions (never a graphed step's)."""
    return any(
        overlapping(s.request.images, s.start_pos, s.start_pos + s.num_tokens)
        for s in scheduled
        if s.request.images
    )


def _graph_sample_rows(scheduled: list[ScheduledRequest], rows: int) -> list[tuple[int, int]]:
    """``_logits_layout``'s sample rows in a graphed step (request i's token j at row i * rows
    + j): every sampled position of each request, in order."""
    return [
        (i, i * rows + j)
        for i, sched in enumerate(scheduled)
        for j in range(sched.num_tokens - sched.num_sampled_positions, sched.num_tokens)
    ]


def _graph_token_rows(scheduled: list[ScheduledRequest], rows: int) -> np.ndarray:
    """The rows of a graphed step's real tokens, in flat-batch order (the packed layout)."""
    return np.concatenate([i * rows + np.arange(s.num_tokens) for i, s in enumerate(scheduled)])


def _logits_layout(
    scheduled: list[ScheduledRequest],
) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int, int]]]:
    """Which batch rows get logits: (logits_indices, (scheduled index, logits row) per sampled
    position (a request's last, and each of its drafts', in order), (scheduled index, first
    logits row, count) per request with prompt logprobs)."""
    logits_indices: list[int] = []
    sample_rows: list[tuple[int, int]] = []
    prompt_rows: list[tuple[int, int, int]] = []
    offset = 0
    for i, sched in enumerate(scheduled):
        if sched.num_prompt_logprob_positions:
            count = sched.num_prompt_logprob_positions
            prompt_rows.append((i, len(logits_indices), count))
            logits_indices.extend(range(offset, offset + count))
        for position in range(sched.num_tokens - sched.num_sampled_positions, sched.num_tokens):
            sample_rows.append((i, len(logits_indices)))
            logits_indices.append(offset + position)
        offset += sched.num_tokens
    return logits_indices, sample_rows, prompt_rows
