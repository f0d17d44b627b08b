"""LLMEngine: the scheduler, the model runner and the tokenizer of one process.

    add_request -> [ schedule -> execute -> update ] per step -> RequestOutputDelta

Asynchronous scheduling (``scheduler.async_scheduling``, an executor with ``launch``) overlaps
the host's work with the device's: each ``step()`` schedules and launches step N+1 while step N
is still on the device, then waits for step N's samples and applies them::

    host    schedule N+1 | launch N+1 | wait N, update N | schedule N+2 | launch N+2 | wait N+1 ...
    device  ... step N ......................| step N+1 ..................................| ...

A request whose step-N token is still on the device feeds a placeholder in step N+1 (the
executor gathers the real id on the device). Penalties and min_tokens count that token on the
device. A grammar needs it on the host before step N+1 samples (its matcher must accept it
before the next mask exists): then step N is applied between N+1's forward and its sampler,
while the device runs the forward. When the schedule itself needs those tokens
(``Scheduler.needs_sampled_tokens``: a prefix-cache block boundary) the step first waits for
step N, as a synchronous engine always does.

Lock-step ranks (config [parallel], deepinfer/parallel/): after scheduling, every rank's step
agrees with the others' (``LockStep.agree``) before anything runs; a rank with nothing
scheduled runs a placeholder step while others run theirs, and ``group_unfinished`` says
whether any rank still has requests (a rank's loop goes on until none has).

One file of ~430 lines: the step (sync and async), its agreement with other ranks and the
requests' ways in and out (add, abort, finish, hand-off export and import) share the scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import torch

from deepinfer.config import Config
from deepinfer.constraints import ConstraintError
from deepinfer.constraints.compiler import GrammarCompiler
from deepinfer.device import resolve_device
from deepinfer.engine.handoff import RequestState, export_request, import_request
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.weights_loading import model_folder
from deepinfer.images import ImageInput, PromptImage, decode_images
from deepinfer.kv_cache.events import CacheEventLog, CacheLayout
from deepinfer.kv_cache.tiered import KVTiers
from deepinfer.model.families import load_args, with_serving_options
from deepinfer.parallel.group import RankGroup, with_rendezvous_port
from deepinfer.parallel.lockstep import LockStep, RankStep
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.drafts import ConfidenceSchedule, Drafter, ExecutorDrafter, NgramDrafter
from deepinfer.scheduler.output import (
    PLACEHOLDER_TOKEN_ID,
    ModelRunnerOutput,
    RequestOutputDelta,
    SchedulerOutput,
)
from deepinfer.scheduler.prefix_reuse import PrefixCachingOptions
from deepinfer.scheduler.request import Request, RequestStatus
from deepinfer.scheduler.scheduler import Scheduler
from deepinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Executor(Protocol):
    """What the engine needs of whatever runs the model (ModelRunner, or a test double).

    ``execute`` must return a token for every scheduled request with ``do_sample`` and
    ``num_prompt_logprob_positions`` prompt-logprob dicts where asked.
    """

    num_blocks: int
    num_slots: int
    num_snapshots: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    # Prefix caching: the hash chain's salt (model, weights fingerprint, cache format) and the
    # replay bound num_layers * (window - 1).
    cache_salt: bytes
    replay_tokens: int
    # The prompt tokens a hit leaves to compute (the family's recompute_tokens: 1, or the kept
    # tokens of a YoCo-truncating DeepSeek-V4.1).
    recompute_tokens: int

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class PlaceholderExecutor(Executor, Protocol):
    """An executor of one lock-step rank: it also runs steps with no tokens of its own."""

    def run_placeholder(self) -> None: ...


class StepInFlight(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class LaunchingExecutor(Executor, Protocol):
    """An executor that queues a step and returns before it ran (ModelRunner): what
    asynchronous scheduling needs. A scheduled placeholder token stands for the request's
    token sampled by the previous launch."""

    def launch(
        self,
        scheduler_output: SchedulerOutput,
        before_sampling: Callable[[], None] | None = None,
    ) -> StepInFlight: ...


class LLMEngine:
    """``executor`` None: load the configured checkpoint (or the built-in one) into a
    ModelRunner, joining the rank group first when config [parallel] asks for one (this
    process is then rank ``parallel.data_parallel_rank``). Tests and the serving layer may pass
    any Executor instead (with ``group``: a PlaceholderExecutor of that rank)."""

    def __init__(
        self, config: Config, executor: Executor | None = None, group: RankGroup | None = None
    ) -> None:
        self.config = config
        if executor is None and group is None and config.parallel.needs_group:
            parallel = with_rendezvous_port(config.parallel)
            group = RankGroup.join(parallel, resolve_device(config.model.device).type)
        self.group = group
        if executor is None:
            self.model_dir: Path | None = model_folder(config.model)
            args = with_serving_options(
                load_args(self.model_dir),
                yoco_truncation=config.model.yoco_truncation,
                yoco_keep_tokens=config.model.yoco_keep_tokens,
                mtp_layers=int(_model_drafts(config) == "mtp"),
                dspark=_model_drafts(config) == "dspark",
            )
            self.tokenizer: Tokenizer | None = Tokenizer.from_folder(
                self.model_dir, config.model.tokenizer
            )
            executor = ModelRunner(config, self.model_dir, args, group)
        else:
            self.model_dir, self.tokenizer = None, None
        self.executor = executor
        self.lockstep = None if group is None else LockStep(group.control, group.world_size)
        self.leaving = False  # a served rank that is stopping says so in each agreement
        launch = getattr(executor, "launch", None)
        self._launch = launch if config.scheduler.async_scheduling else None
        # The step launched by the previous step() call, its samples not yet applied.
        self._in_flight: tuple[SchedulerOutput, StepInFlight] | None = None
        self.num_scheduled_tokens = 0  # tokens the last step() scheduled (for metrics)
        self.num_preemptions = 0  # requests preempted so far
        self.max_model_len = executor.max_model_len
        self.tiers = self._init_tiers()
        self.grammar_compiler = self._init_grammar_compiler()
        self.scheduler = Scheduler(
            config.scheduler,
            block_size=config.cache.block_size,
            num_blocks=executor.num_blocks,
            num_state_slots=executor.num_slots,
            max_model_len=self.max_model_len,
            prefix_caching=self._prefix_caching_options(),
            tiers=self.tiers,
            # Deterministic steps run one token per forward: no drafts to verify in one.
            max_draft_tokens=0 if config.kernel.deterministic else config.cache.max_draft_tokens,
        )
        self._init_drafter()

    def _init_drafter(self) -> None:
        """The drafter that [speculative] names (none: no drafts)."""
        spec = self.config.speculative
        if not spec.enabled:
            return
        if self.config.kernel.deterministic:
            logger.warning("speculative.method=%s: off in deterministic mode", spec.method)
            return
        if spec.method in ("mtp", "dspark"):
            if getattr(self.executor, "step_drafts", None) is None:
                raise ValueError(
                    f"speculative.method={spec.method!r} needs the model runner's drafter layers"
                )
            self.set_drafter(ExecutorDrafter())
            if spec.verify_schedule == "confidence":
                graphs = getattr(self.executor, "graphs", None)  # steps cost their graph's rows
                self.scheduler.verify_schedule = ConfidenceSchedule(
                    spec.verify_cost_tokens,
                    spec.max_verify_tokens,
                    tuple(graphs.buckets) if graphs is not None else (),
                    tuple(graphs.row_buckets) if graphs is not None else (),
                    spec.cost_curve,
                )
            logger.info(
                "speculative decoding: %s, %d drafts a step from the model's drafter layers "
                "(steps run synchronously: each step's drafts come with its results)",
                spec.method,
                self.scheduler.max_draft_tokens,
            )
            return
        self.set_drafter(
            NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max, self.executor.vocab_size)
        )
        logger.info(
            "speculative decoding: %s, up to %d drafts a step (n-grams of %d..%d tokens)",
            spec.method,
            self.scheduler.max_draft_tokens,
            spec.prompt_lookup_min,
            spec.prompt_lookup_max,
        )

    def spec_stats(self) -> dict:
        """Verification steps so far (scheduler/drafts.py SpecDecodeStats); read by the node's
        metrics."""
        return self.scheduler.spec_stats.as_dict()

    def set_drafter(self, drafter: Drafter | None) -> None:
        """Speculative decoding: ``drafter`` proposes tokens that the next steps verify, up to
        cache.max_draft_tokens per request (scheduler/drafts.py); None stops drafting."""
        if drafter is not None and self.scheduler.max_draft_tokens == 0:
            raise ValueError("a drafter needs cache.max_draft_tokens > 0 (and not deterministic)")
        self.scheduler.drafter = drafter

    def _init_tiers(self) -> KVTiers | None:
        """Host/disk tiers for a real model runner with prefix caching on."""
        if not self.config.cache.enable_prefix_caching or not isinstance(
            self.executor, ModelRunner
        ):
            return None
        tiers = KVTiers.from_config(
            self.config.cache, self.executor.cache_salt, self.executor.device
        )
        self.executor.tiers = tiers
        return tiers

    def _init_grammar_compiler(self) -> GrammarCompiler | None:
        """Structured output needs the tokenizer (and EOS): none for a test-double executor.
        Cheap here: xgrammar loads the vocabulary on the first compile."""
        if self.tokenizer is None or self.executor.eos_token_id is None:
            return None
        # Every family of deepinfer/model/families.py speaks DeepSeek's DSML tool-call format.
        return GrammarCompiler(
            self.tokenizer.path,
            vocab_size=self.executor.vocab_size,
            eos_token_id=self.executor.eos_token_id,
        )

    def publish_cache_events(self, events: CacheEventLog) -> CacheLayout | None:
        """Record every change to what the prefix cache's tiers hold in ``events`` (for the
        coordinator's router), and say how the blocks are named; None without prefix caching
        (nothing to publish). Call before the engine steps."""
        prefix = self.scheduler.prefix
        if prefix is None:
            return None
        prefix.cache.events = events
        disk_tier_id = ""
        if self.tiers is not None and self.tiers.host is not None:
            self.tiers.host.events = events
        if self.tiers is not None and self.tiers.disk is not None:
            self.tiers.disk.publish_to(events)
            disk_tier_id = self.tiers.disk.tier_id()
        return CacheLayout(prefix.options.salt, self.scheduler.block_size, disk_tier_id)

    def _prefix_caching_options(self) -> PrefixCachingOptions | None:
        cache = self.config.cache
        if not cache.enable_prefix_caching:
            return None
        replay = self.executor.replay_tokens
        if cache.replay_tokens_override is not None:
            replay = cache.replay_tokens_override
        return PrefixCachingOptions(
            salt=self.executor.cache_salt,
            num_snapshots=self.executor.num_snapshots,
            snapshot_interval_blocks=cache.snapshot_interval_blocks,
            replay_tokens=replay,
            recompute_tokens=self.executor.recompute_tokens,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        compiled_grammar: Any = None,
        hand_off: bool = False,
        images: Sequence[ImageInput] = (),
    ) -> Request:
        """Admit a request. A constrained request's grammar is ``compiled_grammar`` (compiled off
        the engine thread, as AsyncEngine does) or compiled here, synchronously. ``hand_off``:
        the prefill side of a prefill/decode hand-off (handoff.py): the request is held after
        its first token, for ``export_request``. ``images``: one per image placeholder of the
        prompt, in order (the model family grows each placeholder to the image's positions).
        Raises ValueError (ConstraintError for a bad constraint) before anything is
        admitted."""
        sampling_params.check_limits(max_logprobs=self.config.model.max_logprobs)
        if (
            sampling_params.prompt_logprobs is not None
            and self.config.model.yoco_truncation != "off"
        ):
            raise ValueError(
                "prompt_logprobs are not available while model.yoco_truncation="
                f"{self.config.model.yoco_truncation!r}: the consumer layers compute only each "
                "prompt's last model.yoco_keep_tokens"
            )
        vocab = self.executor.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"request {request_id!r}: token ids {bad[:5]} are outside [0, {vocab})"
            )
        prompt, spans = self.expand_images(request_id, prompt_token_ids, decode_images(images))
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=sampling_params,
            eos_token_id=self.executor.eos_token_id,
            cache_salt=cache_salt,
            hand_off=hand_off,
            images=tuple(spans),
        )
        if sampling_params.constraint is not None:
            if compiled_grammar is None:
                compiled_grammar = self.compile_grammar(sampling_params)
            assert self.grammar_compiler is not None
            request.matcher = self.grammar_compiler.matcher(
                compiled_grammar, request.prompt_token_ids
            )
        self.scheduler.add_request(request)
        return request

    def expand_images(
        self, request_id: str, prompt_token_ids: list[int], images: Sequence[ImageInput]
    ) -> tuple[list[int], list[PromptImage]]:
        """The prompt with each image placeholder grown to its image's positions, and the
        images' spans (the model family's); ValueError naming the request and the problem."""
        if not images:
            return list(prompt_token_ids), []
        expand = getattr(self.executor, "expand_images", None)
        if expand is None:
            raise ValueError(f"request {request_id!r}: this engine's executor takes no images")
        try:
            prompt, spans = expand(list(prompt_token_ids), list(images))
        except ValueError as e:
            raise ValueError(f"request {request_id!r}: {e}") from None
        for i, span in enumerate(spans):
            embeds = span.image.embeds
            if embeds is not None and tuple(embeds.shape[:1]) != (span.num_tokens,):
                raise ValueError(
                    f"request {request_id!r}: image {i}'s embeddings are {tuple(embeds.shape)}: "
                    f"its {span.num_tokens} positions need one row each"
                )
        return prompt, spans

    def compile_grammar(self, sampling_params: SamplingParams) -> Any:
        """The compiled constraint (blocking, with the compile timeout)."""
        kind, schema = self._constraint_of(sampling_params)
        return self.grammar_compiler.compile(kind, schema)

    def compile_grammar_async(self, sampling_params: SamplingParams) -> Future:
        """Same, as a concurrent Future (the compile runs in the compiler's thread pool)."""
        kind, schema = self._constraint_of(sampling_params)
        return self.grammar_compiler.compile_async(kind, schema)

    def _constraint_of(self, sampling_params: SamplingParams) -> tuple[str, str]:
        assert sampling_params.constraint is not None
        if self.grammar_compiler is None:
            raise ConstraintError("output constraints need a model with a tokenizer and an EOS")
        return sampling_params.constraint

    def export_request(self, request_id: str, on_device: bool = False) -> RequestState:
        """A held hand-off's state (handoff.py; ``on_device``: its tensors stay on the device);
        it stays held until ``release_hand_off``."""
        runner = self._model_runner()
        cache, salt = runner.kv_cache, runner.cache_salt
        return export_request(self.scheduler, cache, salt, request_id, on_device)

    @property
    def device(self) -> torch.device:
        """Where the engine's KV cache is (the CPU for an executor without one)."""
        return getattr(self.executor, "device", torch.device("cpu"))

    def release_hand_off(self, request_id: str) -> None:
        """Free a held hand-off's blocks and slot (exported, or not collected)."""
        self.scheduler.release_held(request_id)

    def reserve_hand_off(self, request_id: str, num_prompt_tokens: int) -> None:
        """Keep blocks and a slot for a hand-off on its way (decode side); ``import_request``
        takes them, an abort gives them back. Raises ValueError (too long, id in use, no room)."""
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {num_prompt_tokens} tokens but "
                f"max_model_len is {self.max_model_len}"
            )
        self.scheduler.reserve_hand_off(request_id, num_prompt_tokens)

    def import_request(
        self,
        state: RequestState,
        sampling_params: SamplingParams,
        compiled_grammar: Any = None,
        images: Sequence[PromptImage] = (),
    ) -> Request:
        """Continue a request another engine computed the prompt of (handoff.py), in its
        reservation if it has one. A constrained request's matcher is rebuilt here and fed the
        tokens the other engine sampled (its grammar ``compiled_grammar``, or compiled now).
        ``images``: the prompt's (``expand_images`` of the request as sent). Raises ValueError
        (ConstraintError) with nothing taken."""
        sampling_params.check_limits(max_logprobs=self.config.model.max_logprobs)
        matcher = None
        if sampling_params.constraint is not None:
            if compiled_grammar is None:
                compiled_grammar = self.compile_grammar(sampling_params)
            assert self.grammar_compiler is not None
            matcher = self.grammar_compiler.matcher(compiled_grammar, state.prompt_token_ids)
            if not all(matcher.accept(t) for t in state.output_token_ids):
                raise ValueError(
                    f"request {state.request_id!r}: its sampled tokens break its constraint"
                )
        runner = self._model_runner()
        request = import_request(
            self.scheduler,
            runner.kv_cache,
            runner.cache_salt,
            state,
            sampling_params,
            self.executor.eos_token_id,
            images,
        )
        request.matcher = matcher
        return request

    def _model_runner(self) -> ModelRunner:
        if not isinstance(self.executor, ModelRunner):
            raise TypeError("hand-offs need the engine's own ModelRunner (a KV cache)")
        return self.executor

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def finish_requests(self, request_ids: list[str], stop_reason: int | str | None) -> None:
        """End requests the text side decided are done (a stop string matched)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED, stop_reason)

    def cache_stats(self) -> dict:
        """Prefix-cache counters for metrics (empty when prefix caching is off)."""
        prefix = self.scheduler.prefix
        if prefix is None:
            return {}
        cache, snapshots = prefix.cache.stats, prefix.snapshots.stats
        return {
            "prefix_query_tokens": cache.num_query_tokens,
            "evicted_blocks": cache.num_evicted_blocks,
            "replayed_tokens": prefix.stats.num_replayed_tokens,
            "cached_tokens_by_tier": dict(prefix.stats.cached_tokens_by_tier),
            "snapshots_stored": snapshots.num_stored,
            "snapshots_restored": snapshots.num_restored,
            "snapshots_evicted": snapshots.num_evicted,
            "tiers": self.tiers.stats() if self.tiers is not None else {},
        }

    def rank_stats(self) -> dict:
        """A rank's lock-step counters (empty alone): its rank, the LockStepStats fields
        (steps by kind, agreement time, tokens by rank), preemptions, the MoE exchanges' host
        time, and the pairs its experts computed (``expert_tokens``: global expert id -> count).
        Read by the node's metrics, the offline ranks' per-call stats and benchmarks."""
        if self.lockstep is None or self.group is None:
            return {}
        moe = getattr(getattr(self.executor, "kernels", None), "moe", None)
        return {
            "rank": self.group.rank,
            **self.lockstep.stats.as_dict(),
            "num_preemptions": self.num_preemptions,
            "exchange_seconds": getattr(moe, "exchange_seconds", 0.0),
            "expert_tokens": getattr(moe, "expert_tokens", dict)(),
        }

    @staticmethod
    def stats_since(before: dict, after: dict) -> dict:
        """``rank_stats`` growth between two reads (one generate call's share): counters
        subtracted, lists element by element; the rank and the expert counts as ``after``."""
        out = {}
        for key, value in after.items():
            if key in ("rank", "expert_tokens"):
                out[key] = value
            elif isinstance(value, list):
                out[key] = [a - b for a, b in zip(value, before[key], strict=True)]
            else:
                out[key] = value - before[key]
        return out

    def graph_stats(self) -> dict[str, int]:
        """Decode CUDA graphs captured at start-up and while serving (empty without graphs)."""
        graphs = getattr(self.executor, "graphs", None)
        if graphs is None or not graphs.capture:
            return {}
        serving = graphs.num_captures_while_serving
        return {"startup": graphs.num_graphs - serving, "serving": serving}

    def image_stats(self) -> dict[str, float]:
        """The vision tower's counters since start (empty without a tower)."""
        images = getattr(self.executor, "images", None)
        if images is None:
            return {}
        return dataclasses.asdict(images.stats)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a launched step whose results are not applied yet."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    @property
    def group_unfinished(self) -> bool:
        """Some rank of the group had requests left at the last step (alone: this engine)."""
        if self.lockstep is None:
            return self.has_unfinished_requests()
        return self.lockstep.last.unfinished

    @property
    def group_has_left(self) -> bool:
        """Every rank of the group is leaving and none has requests left (the last step)."""
        return self.lockstep is not None and self.lockstep.last.has_left

    def _agree(self, scheduler_output: SchedulerOutput) -> None:
        """Lock-step: agree on the step with the other ranks; run a placeholder step when they
        run one and this rank has nothing scheduled."""
        if self.lockstep is None:
            return
        mine = RankStep(
            num_tokens=scheduler_output.num_scheduled_tokens,
            decode_only=all(s.num_tokens == 1 for s in scheduler_output.scheduled),
            unfinished=self.has_unfinished_requests(),
            leaving=self.leaving,
        )
        if self.lockstep.agree(mine).runs and scheduler_output.is_empty:
            executor: PlaceholderExecutor = self.executor  # type: ignore[assignment]
            executor.run_placeholder()

    def step(self) -> list[RequestOutputDelta]:
        """One scheduling iteration; returns the deltas of the step it completed (asynchronous:
        the previous one). If it raises, the step in flight is dropped: the caller aborts the
        running requests (their pending tokens are lost with it); in a rank group, the group
        has ended (a collective failed)."""
        if self._launch is None:
            scheduler_output = self.scheduler.schedule()
            self.num_scheduled_tokens = scheduler_output.num_scheduled_tokens
            self.num_preemptions += len(scheduler_output.preempted_request_ids)
            self._agree(scheduler_output)
            runner_output = self.executor.execute(scheduler_output)
            return self.scheduler.update(scheduler_output, runner_output)
        try:
            return self._step_async(self._launch)
        except BaseException:
            self._in_flight = None
            raise

    def _step_async(self, launch: Callable[..., StepInFlight]) -> list[RequestOutputDelta]:
        deltas = []
        if self._in_flight is not None and self.scheduler.needs_sampled_tokens():
            deltas = self._complete_in_flight()
        scheduler_output = self.scheduler.schedule()
        self.num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        self.num_preemptions += len(scheduler_output.preempted_request_ids)
        self._agree(scheduler_output)
        launched = None
        if not scheduler_output.is_empty:
            before_sampling = None
            if self._in_flight is not None and _masks_need_pending_tokens(scheduler_output):
                # The grammar masks of this step need the previous step's tokens: apply it while
                # this step's forward runs on the device.
                def before_sampling() -> None:
                    deltas.extend(self._complete_in_flight())

            launched = launch(scheduler_output, before_sampling)
        deltas += self._complete_in_flight()
        if launched is not None:
            self._in_flight = (scheduler_output, launched)
        return deltas

    def complete_in_flight(self) -> list[RequestOutputDelta]:
        """Wait for the launched step (if any) and apply it, scheduling nothing new: what a
        caller does when the requests it waits for are done but one step still runs (it
        computed the token after a stop, which is dropped)."""
        return self._complete_in_flight()

    def _complete_in_flight(self) -> list[RequestOutputDelta]:
        if self._in_flight is None:
            return []
        (scheduler_output, launched), self._in_flight = self._in_flight, None
        return self.scheduler.update(scheduler_output, launched.result())


def _model_drafts(config: Config) -> str | None:
    """The drafter layers of the model that [speculative] method runs ("mtp", "dspark"), when
    drafting is on (deterministic mode turns it off); None: no drafter layers."""
    method = config.speculative.method
    if method in ("mtp", "dspark") and not config.kernel.deterministic:
        return method
    return None


def _masks_need_pending_tokens(scheduler_output: SchedulerOutput) -> bool:
    """Some request with a grammar samples this step on a token still on the device."""
    return any(
        s.do_sample and s.request.matcher is not None and s.token_ids[-1] == PLACEHOLDER_TOKEN_ID
        for s in scheduler_output.scheduled
    )
