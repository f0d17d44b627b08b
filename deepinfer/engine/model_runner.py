"""ModelRunner: turns a SchedulerOutput into one forward pass, logits, samples and logprobs.

SchedulerOutput (CPU) -> ForwardBatch (device) -> DeepseekV4 -> logits -> sampler
-> ModelRunnerOutput (host values) -> Scheduler.update()

Device memory is sized in ``deepinfer.engine.memory`` (CUDA) or by cache.memory_budget_gib (CPU).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from deepinfer.config import Config
from deepinfer.constraints.matcher import allowed_token_mask
from deepinfer.device import resolve_device, resolve_dtype, to_device
from deepinfer.engine.attention_metadata import batch_views, flatten, step_arrays
from deepinfer.engine.cuda_graphs import DecodeGraphs
from deepinfer.engine.forward_batch import ForwardBatch, SeqSpan
from deepinfer.engine.memory import MemoryProfile, fit_num_blocks, profile_memory
from deepinfer.engine.staging import PinnedStaging
from deepinfer.kv_cache.pool import KVCache
from deepinfer.kv_cache.tiered import KVTiers
from deepinfer.model.config import ModelArgs
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.layers import use_fp8_linears
from deepinfer.model.loader import checkpoint_fingerprint, fp8_block, load_checkpoint
from deepinfer.model.tiny import random_weights
from deepinfer.ops import select_kernels
from deepinfer.ops.sampling import SamplerOutput
from deepinfer.scheduler.output import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model weights and the KV cache of one device."""

    def __init__(self, config: Config, model_dir: Path, args: ModelArgs) -> None:
        self.config = config
        self.args = args
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.max_model_len = config.model.max_model_len or args.max_position_embeddings
        self._init_threads()
        self._init_precision()
        self.kernels = select_kernels(config.kernel, self.device)
        self._init_model(model_dir)
        self.memory_profile: MemoryProfile | None = None  # set when sized on CUDA
        self._init_kv_cache()
        self._init_staging()
        self._init_graphs()
        self._warm_up_eager()
        self.cache_salt = self._cache_salt(model_dir)
        # The sampler draws unseeded rows from this generator on the logits' device.
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        # The host/disk tiers of the KV cache (set by the engine when configured).
        self.tiers: KVTiers | None = None
        # The last launch's sampled ids [R] on the device, and each request's row in them: what
        # the next launch's placeholders stand for.
        self._last_samples: tuple[torch.Tensor, dict[str, int]] | None = None

    def _init_threads(self) -> None:
        if self.config.kernel.num_threads > 0:
            torch.set_num_threads(self.config.kernel.num_threads)

    def _init_precision(self) -> None:
        """float32 on CUDA means IEEE float32: TF32 matmuls would move logits by ~1e-3."""
        if self.device.type == "cuda" and self.dtype == torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            logger.info("float32 on CUDA: TF32 off for matmuls and cuDNN (IEEE float32)")

    def _init_model(self, model_dir: Path) -> None:
        start = time.perf_counter()
        keep_fp8 = self.config.model.fp8_weights and self.device.type == "cuda"
        self.fp8_weights = keep_fp8  # other activations: part of the prefix cache's salt
        if self.config.model.fp8_weights and not keep_fp8:
            logger.warning("model.fp8_weights needs CUDA: dequantizing on %s", self.device)
        block = fp8_block(self.args)
        if self.config.model.random_weights:
            seed = self.config.model.tiny_model_seed
            logger.info("model: random weights (seed %d) in the shapes of %s", seed, model_dir)
            weights = random_weights(
                self.args, seed, self.device, self.dtype, fp8_block=block if keep_fp8 else None
            )
        else:
            weights = load_checkpoint(
                model_dir, self.args, device=self.device, dtype=self.dtype, keep_fp8=keep_fp8
            )
        with torch.device("meta"):
            model = DeepseekV4(self.args, self.kernels)
            num_fp8 = use_fp8_linears(model, weights, block, self.kernels.linear)
        if keep_fp8:
            logger.info("model: %d linear layers on FP8 weights (%dx%d blocks)", num_fp8, *block)
        model.load_state_dict(weights, strict=True, assign=True)
        model.init_rope(self.device)
        self.model = model.eval()
        num_params = sum(p.numel() for p in model.parameters())
        logger.info(
            "model: %s, %.1f M parameters, %s on %s, loaded in %.1f s",
            model_dir,
            num_params / 1e6,
            str(self.dtype).removeprefix("torch."),
            self.device,
            time.perf_counter() - start,
        )

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
        cache = self.config.cache
        return KVCache(
            self.args,
            num_blocks=num_blocks,
            num_slots=num_slots,
            num_snapshots=num_snapshots,
            block_size=cache.block_size,
            ring_margin=cache.ring_margin,
            dtype=self.dtype,
            device=self.device,
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
            )
            budget = self.memory_profile.kv_budget
            source = f"cache.gpu_memory_utilization={cache.gpu_memory_utilization}"
        else:
            budget = int(cache.memory_budget_gib * 2**30)
            source = f"cache.memory_budget_gib={cache.memory_budget_gib}"
        layout = scratch.layout
        fixed = num_slots * layout.bytes_per_slot(self.dtype)
        fixed += num_snapshots * scratch.bytes_per_snapshot
        max_useful = self.config.scheduler.max_num_seqs * self._blocks_per_request
        num_blocks = fit_num_blocks(
            budget,
            bytes_per_block=layout.bytes_per_block(self.dtype),
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
        return min(kernel.cuda_graph_max_batch, self.config.scheduler.max_num_seqs)

    def _init_graphs(self) -> None:
        """CUDA: decode-only steps replay graphs (cuda_graphs.py), all captured here, at start-up,
        so that no request waits for a capture."""
        self.graphs: DecodeGraphs | None = None
        if self._graph_batch > 0:
            self.graphs = DecodeGraphs(
                self.model, self.kv_cache, self._graph_batch, max_positions=self.max_model_len
            )
            self.graphs.capture_all()

    def _warm_up_eager(self) -> None:
        """CUDA: run the eager (prefill and mixed) step shapes once at start-up, on the cache's
        scratch slot and block, so that the kernels' first compilations (Triton JIT, a second
        or more each, per tile class and alignment) happen before the node reports ready rather
        than inside the first requests' steps."""
        if self.device.type != "cuda":
            return
        cache, budget = self.kv_cache, self.config.scheduler.max_num_batched_tokens
        started = time.perf_counter()
        # Each tile class of the kernels (by token count), aligned to 16 and not.
        sizes = sorted({n for n in (1, 3, 4, 7, 16, 24, 32, 48, 64, 100, 128, 200, 256, 512,
                                    1000, 1024, 2000, 2048) if n <= budget} | {budget})  # fmt: skip
        max_decodes = min(self.config.scheduler.max_num_seqs - 1, 63)
        shapes = [(n, 0) for n in sizes] + [
            (n, d) for n in sizes for d in (1, max_decodes) if d > 0 and n + d <= budget
        ]
        for num_tokens, num_decodes in tqdm(shapes, desc="warming up prefill steps", unit="step"):
            self._warm_up_step(cache, num_tokens, num_decodes)
        torch.cuda.synchronize(self.device)
        logger.info(
            "warmed up %d eager step shapes (a prefill chunk of %s tokens, alone and beside "
            "decodes) in %.1f s",
            len(shapes),
            sizes,
            time.perf_counter() - started,
        )

    def _warm_up_step(self, cache: KVCache, num_tokens: int, num_decodes: int) -> None:
        """A fresh prompt chunk of ``num_tokens`` and ``num_decodes`` one-token decodes at the
        end of a block, all on the scratch slot and block (their values do not matter)."""
        block = cache.block_size
        chunk = SeqSpan(0, num_tokens, 0, cache.scratch_slot, [cache.scratch_block] * -(
            -num_tokens // block))  # fmt: skip
        decodes = [
            SeqSpan(num_tokens + i, 1, block - 1, cache.scratch_slot, [cache.scratch_block])
            for i in range(num_decodes)
        ]
        positions = list(range(num_tokens)) + [block - 1] * num_decodes
        total = num_tokens + num_decodes
        batch = ForwardBatch(
            input_ids=torch.zeros(total, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            seqs=[chunk, *decodes],
            logits_indices=torch.tensor(
                [num_tokens - 1, *range(num_tokens, total)], device=self.device
            ),
        )
        with torch.inference_mode():
            self.model(batch, cache)

    def _cache_salt(self, model_dir: Path) -> bytes:
        """Model fingerprint + what changes the cached bytes (dtype, block layout)."""
        layout = f"kv-v1:{self.dtype}:{self.config.cache.block_size}:{self.kv_cache.ring_size}"
        if self.config.model.random_weights:
            layout += f":random-{self.config.model.tiny_model_seed}"
        if self.fp8_weights:
            layout += ":fp8-weights"
        return checkpoint_fingerprint(model_dir) + layout.encode()

    @property
    def replay_tokens(self) -> int:
        """Tokens to replay on a prefix hit with no snapshot: the sliding-window receptive field
        of the whole stack, num_layers * (window - 1)."""
        return self.args.num_layers * (self.args.sliding_window - 1)

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
        self._move_between_tiers(scheduler_output)
        scheduled = scheduler_output.scheduled
        one_by_one = self._deterministic_rows(scheduler_output)
        if not one_by_one and self.graphs is not None and self.graphs.can_run(scheduler_output):
            logits = self.graphs.run(
                scheduler_output, lambda ids: self._fill_placeholders(scheduled, ids)
            )
            sample_rows = [(i, i) for i in range(len(scheduled))]
            prompt_rows: list[tuple[int, int, int]] = []
        elif one_by_one:
            _, sample_rows, prompt_rows = _logits_layout(scheduled)
            logits = self._forward_split(scheduler_output, sample_rows, prompt_rows, one_by_one)
        else:
            batch, sample_rows, prompt_rows = self._prepare(scheduler_output)
            logits = self.model(batch, self.kv_cache)  # [N, V] fp32
        for sched in scheduled:
            if sched.save_snapshot is not None:
                self.kv_cache.save_snapshot(sched.state_slot, sched.save_snapshot)
        output = ModelRunnerOutput()
        self._prompt_logprobs(scheduler_output, logits, prompt_rows, output)
        if before_sampling is not None:
            before_sampling()
        samples = self._sample(scheduler_output, logits, sample_rows)
        if samples is None:
            self._last_samples = None
            return LaunchedStep(output)
        request_ids = [scheduled[i].request_id for i, _ in sample_rows]
        self._last_samples = (samples.token_ids, {rid: j for j, rid in enumerate(request_ids)})
        ready = None
        host = samples.to_host()
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return LaunchedStep(output, request_ids, host, ready)

    def _fill_placeholders(
        self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor
    ) -> None:
        """Write into ``input_ids`` (the flat batch of ``scheduled``) the tokens that stand in for
        the previous launch's samples (``PLACEHOLDER_TOKEN_ID``, always a chunk's last token)."""
        dst, request_ids, offset = [], [], 0
        for sched in scheduled:
            offset += sched.num_tokens
            if sched.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                dst.append(offset - 1)
                request_ids.append(sched.request_id)
        if dst:
            input_ids[to_device(torch.tensor(dst), self.device)] = self._last_sampled(request_ids)

    def _pending_outputs(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[list[int], torch.Tensor] | None:
        """The sampling rows whose newest output token is still on the device (fed in this step
        as a placeholder), and those tokens."""
        rows = [
            j
            for j, sched in enumerate(scheduled)
            if sched.start_pos + sched.num_tokens != sched.request.num_tokens
        ]
        if not rows:
            return None
        return rows, self._last_sampled([scheduled[j].request_id for j in rows])

    def _last_sampled(self, request_ids: list[str]) -> torch.Tensor:
        """[len(request_ids)] int64 on the device: each request's token sampled by the previous
        launch, gathered there (never read back)."""
        assert self._last_samples is not None, (
            f"requests {request_ids[:3]} wait for a token but no step sampled before"
        )
        tokens, row_of = self._last_samples
        rows = torch.tensor([row_of[rid] for rid in request_ids], dtype=torch.int64)
        return tokens[to_device(rows, self.device)]

    def _deterministic_rows(self, scheduler_output: SchedulerOutput) -> set[int]:
        """Scheduled requests whose tokens run one per forward: all in deterministic mode, else
        those that asked (SamplingParams.deterministic)."""
        scheduled = scheduler_output.scheduled
        if self.config.kernel.deterministic:
            return set(range(len(scheduled)))
        return {i for i, s in enumerate(scheduled) if s.request.sampling_params.deterministic}

    def _forward_split(
        self,
        scheduler_output: SchedulerOutput,
        sample_rows: list[tuple[int, int]],
        prompt_rows: list[tuple[int, int, int]],
        one_by_one: set[int],
    ) -> torch.Tensor:
        """The requests in ``one_by_one`` run one token per forward, so every matmul and
        reduction has the same shapes whatever else is batched and wherever chunks start: their
        results are bit-identical alone, batched, chunked or recomputed. The others run batched
        in one forward. Returns the logits rows in ``_prepare``'s layout, [N, V] fp32."""
        scheduled = scheduler_output.scheduled
        row_of: dict[tuple[int, int], int] = {}  # (scheduled index, token index) -> logits row
        for i, row, count in prompt_rows:
            for j in range(count):
                row_of[i, j] = row + j
        for i, row in sample_rows:
            row_of[i, scheduled[i].num_tokens - 1] = row
        rows: list[torch.Tensor | None] = [None] * len(row_of)
        batched = [i for i in range(len(scheduled)) if i not in one_by_one]
        if batched:
            part = SchedulerOutput(scheduled=[scheduled[i] for i in batched])
            batch, part_samples, part_prompts = self._prepare(part)
            logits = self.model(batch, self.kv_cache)
            for k, row in part_samples:
                i = batched[k]
                rows[row_of[i, scheduled[i].num_tokens - 1]] = logits[row]
            for k, row, count in part_prompts:
                for j in range(count):
                    rows[row_of[batched[k], j]] = logits[row + j]
        for i in sorted(one_by_one):
            sched = scheduled[i]
            for j, token_id in enumerate(sched.token_ids):
                one = dataclasses.replace(
                    sched,
                    token_ids=[token_id],
                    start_pos=sched.start_pos + j,
                    do_sample=(i, j) in row_of,  # asks _prepare for this token's logits
                    num_prompt_logprob_positions=0,
                )
                batch, _, _ = self._prepare(SchedulerOutput(scheduled=[one]))
                logits = self.model(batch, self.kv_cache)
                if (i, j) in row_of:
                    rows[row_of[i, j]] = logits[0]
        assert all(r is not None for r in rows), "a logits row was not computed"
        if not rows:  # a prefill chunk that neither samples nor scores prompt tokens
            return torch.empty(0, self.args.vocab_size, device=self.device)
        return torch.stack(rows)

    def _move_between_tiers(self, scheduler_output: SchedulerOutput) -> None:
        """Before the forward: evicted blocks/snapshots down to the lower tiers (before anything
        overwrites them), lower-tier hits up into their new blocks, snapshots into slots."""
        kv, tiers = self.kv_cache, self.tiers
        if tiers is not None:
            for block_id, key in scheduler_output.block_offloads:
                tiers.put("block", key, kv.block_payload(block_id))
            for snapshot_id, key in scheduler_output.snapshot_offloads:
                tiers.put("snapshot", key, kv.snapshot_payload(snapshot_id))
        for sched in scheduler_output.scheduled:
            for block_id, key in sched.block_loads:
                kv.write_block(block_id, self._take(key, "block"))
            if sched.restore_snapshot is not None:
                kv.restore_snapshot(sched.restore_snapshot, sched.state_slot)
            elif sched.restore_snapshot_key is not None:
                payload = self._take(sched.restore_snapshot_key, "snapshot")
                kv.restore_slot_from_payload(sched.state_slot, payload)
            elif sched.window_floor and sched.start_pos == sched.window_floor:
                kv.clear_slot(sched.state_slot)

    def _take(self, key: bytes, kind: str) -> list[torch.Tensor]:
        assert self.tiers is not None, f"a {kind} load was scheduled without lower tiers"
        payload = self.tiers.take(kind, key)
        assert payload is not None, f"staged {kind} {key.hex()[:16]} is gone"
        return [t.to(self.device, non_blocking=True) for t in payload]

    def _prepare(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[ForwardBatch, list[tuple[int, int]], list[tuple[int, int, int]]]:
        """Flatten the step and upload it in one copy. Returns the batch and ``_logits_layout``'s
        rows."""
        scheduled = scheduler_output.scheduled
        logits_indices, sample_rows, prompt_rows = _logits_layout(scheduled)
        seqs, token_ids, offset = [], [], 0
        for sched in scheduled:
            seqs.append(SeqSpan.of(offset, sched))
            token_ids.extend(sched.token_ids)
            offset += sched.num_tokens
        geometry = self.kv_cache.geometry
        host = step_arrays(seqs, token_ids, logits_indices, geometry)
        batch = batch_views(self._upload(flatten(host)), host, seqs, geometry)
        self._fill_placeholders(scheduled, batch.input_ids)
        return batch, sample_rows, prompt_rows

    def _upload(self, values: np.ndarray) -> torch.Tensor:
        """Host int64 [n] -> the same on the device (CUDA: through the pinned staging buffer, on
        the copy stream, the compute stream waiting for it)."""
        if self._staging is None:
            return torch.from_numpy(values).to(self.device)
        return self._staging.upload(values)

    def _prompt_logprobs(
        self,
        scheduler_output: SchedulerOutput,
        logits: torch.Tensor,
        prompt_rows: list[tuple[int, int, int]],
        output: ModelRunnerOutput,
    ) -> None:
        for i, row, count in prompt_rows:
            sched = scheduler_output.scheduled[i]
            request = sched.request
            start = sched.start_pos + 1
            next_ids = request.prompt_token_ids[start : start + count]
            targets = torch.tensor(next_ids, dtype=torch.int64, device=logits.device)
            num_top = request.sampling_params.prompt_logprobs or 0
            output.prompt_logprobs[request.request_id] = self.kernels.sampling.compute_logprobs(
                logits[row : row + count], targets, num_top
            )

    def _sample(
        self,
        scheduler_output: SchedulerOutput,
        logits: torch.Tensor,
        sample_rows: list[tuple[int, int]],
    ) -> SamplerOutput | None:
        """The step's samples, on the device (None when no request samples)."""
        if not sample_rows:
            return None
        scheduled = [scheduler_output.scheduled[i] for i, _ in sample_rows]
        requests = [s.request for s in scheduled]
        sampling = self.kernels.sampling
        metadata = sampling.SamplingMetadata.build(
            [r.sampling_params for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
            # The sampled token's position (the request's tokens still on the device included).
            positions=[s.start_pos + s.num_tokens for s in scheduled],
            eos_token_id=self.args.eos_token_id,
            device=logits.device,
            allowed_token_mask=allowed_token_mask(
                [r.matcher for r in requests], logits.shape[-1], logits.device
            ),
            pending=self._pending_outputs(scheduled),
        )
        rows = to_device(torch.tensor([row for _, row in sample_rows]), logits.device)
        return sampling.sample(logits[rows], metadata, self.generator)


@dataclass
class LaunchedStep:
    """A step queued on the device. Producer: ModelRunner.launch. Consumer: the engine, which
    calls ``result()`` (once) when it needs the samples on the host.

    ``samples`` (host tensors, filled by copies queued after the sampler) belong to
    ``request_ids`` in order; ``ready`` (CUDA) is recorded after those copies.
    """

    output: ModelRunnerOutput  # prompt logprobs already in it
    request_ids: list[str] = field(default_factory=list)
    samples: SamplerOutput | None = None
    ready: torch.cuda.Event | None = None

    def result(self) -> ModelRunnerOutput:
        if self.samples is None:
            return self.output
        if self.ready is not None:
            self.ready.synchronize()
        logprobs = self.samples.logprobs
        for rid, token_id, entry in zip(
            self.request_ids, self.samples.token_ids.tolist(), logprobs, strict=True
        ):
            self.output.sampled_token_ids[rid] = token_id
            if entry is not None:
                self.output.logprobs[rid] = entry
        self.samples = None
        return self.output


def _logits_layout(
    scheduled: list[ScheduledRequest],
) -> tuple[list[int], list[tuple[int, int]], list[tuple[int, int, int]]]:
    """Which batch rows get logits: (logits_indices, (scheduled index, logits row) per sampled
    request, (scheduled index, first logits row, count) per request with prompt logprobs)."""
    logits_indices: list[int] = []
    sample_rows: list[tuple[int, int]] = []
    prompt_rows: list[tuple[int, int, int]] = []
    offset = 0
    for i, sched in enumerate(scheduled):
        if sched.num_prompt_logprob_positions:
            count = sched.num_prompt_logprob_positions
            prompt_rows.append((i, len(logits_indices), count))
            logits_indices.extend(range(offset, offset + count))
        if sched.do_sample:
            sample_rows.append((i, len(logits_indices)))
            logits_indices.append(offset + sched.num_tokens - 1)
        offset += sched.num_tokens
    return logits_indices, sample_rows, prompt_rows
