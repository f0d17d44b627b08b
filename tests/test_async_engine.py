"""AsyncEngine on the real scheduler with a ScriptedExecutor: exact token streams and finish
reasons, concurrency, aborts (explicit and by a consumer leaving) freeing every block, text-side
finishes, validation before the first delta, step failures, drain and stop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from scripted_executor import ScriptedExecutor

from deepinfer.config import CacheConfig, Config, SchedulerConfig
from deepinfer.engine.async_engine import AsyncEngine, EngineClosedError, EngineStepError
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.output import RequestOutputDelta

pytestmark = pytest.mark.asyncio

EOS = 1
SCRIPTS = {7: [10, 11, 12, 13], 8: [20, 21], 9: list(range(100, 400))}


def make_engine(executor: ScriptedExecutor | None = None, max_num_seqs: int = 8) -> AsyncEngine:
    config = Config(
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
    )
    executor = executor or ScriptedExecutor(SCRIPTS, eos_token_id=EOS)
    return AsyncEngine(LLMEngine(config, executor=executor))


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    engine = make_engine()
    await engine.start()
    yield engine
    await engine.stop()


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], **kw: object):
    return [d async for d in engine.generate(request_id, prompt, greedy(**kw))]


def stream_shape(deltas: list[RequestOutputDelta]) -> list[tuple[list[int], str | None]]:
    return [(d.new_token_ids, d.finish_reason) for d in deltas]


async def wait_until_idle(engine: AsyncEngine) -> None:
    """Aborts apply between steps; wait (bounded) until the scheduler has nothing left."""
    for _ in range(500):
        if not engine.engine.has_unfinished_requests():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the engine still has unfinished requests after 1 s")


def assert_all_freed(engine: AsyncEngine) -> None:
    scheduler = engine.engine.scheduler
    assert scheduler.block_manager.num_used_blocks == 0
    assert scheduler.state_slots.num_used_slots == 0
    scheduler.check_integrity()
    assert engine.load().num_running == 0 and engine.load().num_waiting == 0


async def test_generate_streams_the_script_then_eos(engine: AsyncEngine) -> None:
    deltas = await collect(engine, "a", [3, 7, 5], max_tokens=16)
    assert stream_shape(deltas) == [
        ([10], None),
        ([11], None),
        ([12], None),
        ([13], None),
        ([EOS], "stop"),
    ]
    assert deltas[-1].stop_reason is None
    assert engine.get_request("a") is None  # the stream is gone once its consumer finished
    assert_all_freed(engine)


async def test_max_tokens_and_stop_token_ids(engine: AsyncEngine) -> None:
    length = await collect(engine, "a", [7], max_tokens=2)
    assert stream_shape(length) == [([10], None), ([11], "length")]
    stopped = await collect(engine, "b", [7], stop_token_ids=[12])
    assert stream_shape(stopped)[-1] == ([12], "stop") and stopped[-1].stop_reason == 12
    assert_all_freed(engine)


async def test_concurrent_requests_get_their_own_scripts() -> None:
    executor = ScriptedExecutor(SCRIPTS, eos_token_id=EOS, step_delay_s=0.002)
    engine = make_engine(executor)
    await engine.start()
    prompts = {"a": [7], "b": [8], "c": [2, 7, 3], "d": [8, 8], "e": [4]}
    results = await asyncio.gather(*(collect(engine, rid, p) for rid, p in prompts.items()))
    tokens = {
        rid: [t for d in ds for t in d.new_token_ids]
        for rid, ds in zip(prompts, results, strict=True)
    }
    assert tokens == {
        "a": [10, 11, 12, 13, EOS],
        "b": [20, 21, EOS],
        "c": [10, 11, 12, 13, EOS],
        "d": [20, 21, EOS],
        "e": [EOS],  # no marker: the empty default script
    }
    # Batched: 17 tokens in fewer steps than one per token.
    assert executor.num_steps < 17, executor.num_steps
    assert_all_freed(engine)
    await engine.stop()


async def test_consumer_leaving_aborts_and_frees_every_block(engine: AsyncEngine) -> None:
    async with contextlib.aclosing(engine.generate("a", [9] * 40, greedy(max_tokens=300))) as gen:
        first = [await anext(gen) for _ in range(3)]
    assert [d.new_token_ids for d in first] == [[100], [101], [102]]
    await wait_until_idle(engine)
    assert_all_freed(engine)


async def test_cancelled_consumer_task_aborts(engine: AsyncEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("a", [9] * 40, greedy(max_tokens=300)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    assert engine.engine.scheduler.block_manager.num_used_blocks >= 3  # 41+ positions / 16
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until_idle(engine)
    assert_all_freed(engine)


async def test_abort_and_finish_end_the_streams(engine: AsyncEngine) -> None:
    async def run(request_id: str, end: str) -> list[RequestOutputDelta]:
        deltas = []
        async for delta in engine.generate(request_id, [9], greedy(max_tokens=300)):
            deltas.append(delta)
            if len(deltas) == 2:
                engine.abort(request_id) if end == "abort" else engine.finish(request_id, "\n\n")
        return deltas

    aborted, finished = await asyncio.gather(run("a", "abort"), run("b", "finish"))
    for deltas, reason, stop_reason in ((aborted, "abort", None), (finished, "stop", "\n\n")):
        *streamed, last = deltas
        assert (last.finish_reason, last.stop_reason, last.new_token_ids) == (
            reason,
            stop_reason,
            [],
        )
        # Steps already done when the end was applied were delivered, whole and in order.
        tokens = [t for d in streamed for t in d.new_token_ids]
        assert len(tokens) >= 2 and tokens == list(range(100, 100 + len(tokens)))
        assert all(d.finish_reason is None for d in streamed)
    engine.abort("a")  # unknown / finished ids are ignored
    assert_all_freed(engine)


async def test_validation_errors_raise_before_the_first_delta(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match=r"token ids \[129280\] are outside \[0, 129280\)"):
        await collect(engine, "a", [129280])
    with pytest.raises(ValueError, match="the prompt must not be empty"):
        await collect(engine, "b", [])
    with pytest.raises(ValueError, match="max_model_len is 4096"):
        await collect(engine, "c", [5] * 4096)
    gen = engine.generate("d", [9], greedy(max_tokens=300))
    await anext(gen)
    with pytest.raises(ValueError, match="'d' is already in use"):
        await collect(engine, "d", [7])
    await gen.aclose()
    await wait_until_idle(engine)
    # Ids of failed adds are free again.
    assert len(await collect(engine, "a", [7])) == 5
    assert_all_freed(engine)


async def test_logprobs_and_prompt_logprobs(engine: AsyncEngine) -> None:
    prompt = [3, 4, 5, 6, 8]
    deltas = await collect(engine, "a", prompt, logprobs=2, prompt_logprobs=1)
    assert [d.new_logprobs for d in deltas] == [
        [{20: -0.25, 21: -2.0, 22: -3.0}],
        [{21: -0.25, 22: -2.0, 23: -3.0}],
        [{EOS: -0.25, 2: -2.0, 3: -3.0}],
    ]
    prompt_logprobs = [p for d in deltas for p in d.new_prompt_logprobs or []]
    assert prompt_logprobs == [{t: -1.0, t + 1: -2.0} for t in prompt[1:]]


async def test_failed_step_fails_its_requests_and_the_engine_keeps_serving() -> None:
    executor = ScriptedExecutor(SCRIPTS, eos_token_id=EOS, step_delay_s=0.002)
    engine = make_engine(executor, max_num_seqs=1)  # "b" waits while "a" runs
    await engine.start()
    first = asyncio.Event()

    async def run_a() -> list[RequestOutputDelta]:
        deltas = []
        async for delta in engine.generate("a", [9], greedy(max_tokens=300)):
            deltas.append(delta)
            if len(deltas) == 1:
                executor.num_failing_steps = 1
                first.set()
        return deltas

    task_a = asyncio.create_task(run_a())
    await first.wait()
    b = asyncio.create_task(collect(engine, "b", [8]))
    with pytest.raises(EngineStepError, match="ScriptedStepError: scripted failure in step"):
        await task_a
    assert stream_shape(await b) == [([20], None), ([21], None), ([EOS], "stop")]
    assert engine.is_turning
    assert len(await collect(engine, "c", [7])) == 5
    assert_all_freed(engine)
    await engine.stop()


async def test_a_crashed_loop_fails_its_streams_and_refuses_new_requests() -> None:
    class CrashingObserver:
        def on_scheduled(self, request: object, queue_time_s: float) -> None:
            pass

        def on_step(self, step_time_s: float, deltas: object, num_scheduled: int) -> None:
            raise RuntimeError("observer bug")

        def on_finished(self, request: object, finish_reason: str) -> None:
            pass

    engine = make_engine()
    engine.observer = CrashingObserver()
    await engine.start()
    with pytest.raises(EngineStepError, match="engine loop crashed: RuntimeError: observer bug"):
        await collect(engine, "a", [7])
    assert not engine.is_turning
    with pytest.raises(EngineClosedError, match="the engine failed"):
        await collect(engine, "b", [7])
    await engine.stop()


async def test_drain_refuses_new_requests_and_stop_aborts_the_rest() -> None:
    engine = make_engine(ScriptedExecutor(SCRIPTS, eos_token_id=EOS, step_delay_s=0.002))
    await engine.start()
    gen = engine.generate("long", [9], greedy(max_tokens=300))
    assert (await anext(gen)).new_token_ids == [100]
    await engine.drain(0.02)  # "long" needs 300 steps: the drain times out
    assert engine.is_draining and engine.load().is_draining
    with pytest.raises(EngineClosedError):
        await collect(engine, "new", [7])
    await engine.stop()
    rest = [d async for d in gen]
    assert rest[-1].finish_reason == "abort" and not engine.is_turning
    assert_all_freed(engine)


async def test_drain_returns_when_the_streams_finish() -> None:
    engine = make_engine(ScriptedExecutor(SCRIPTS, eos_token_id=EOS, step_delay_s=0.002))
    await engine.start()
    task = asyncio.create_task(collect(engine, "a", [7]))
    await asyncio.sleep(0)
    await asyncio.wait_for(engine.drain(5.0), 1.0)
    assert stream_shape(await task)[-1] == ([EOS], "stop")
    await engine.stop()


class _CancellingEngine(AsyncEngine):
    """Cancels a consumer in the window that killed the loop: its add is queued behind a step,
    the consumer's task is cancelled (its ``added`` future with it), and the add is applied
    before the task has run its cleanup."""

    victim: asyncio.Task | None = None

    def _apply_commands(self) -> None:
        if self.victim is not None and self._commands:
            self.victim.cancel()
            self.victim = None
        super()._apply_commands()


async def test_a_consumer_cancelled_while_its_add_is_queued_leaves_the_loop_alive() -> None:
    config = Config(
        cache=CacheConfig(block_size=16),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
    )
    executor = ScriptedExecutor(SCRIPTS, eos_token_id=EOS, step_delay_s=0.005)
    engine = _CancellingEngine(LLMEngine(config, executor=executor))
    await engine.start()
    long = engine.generate("long", [9], greedy(max_tokens=300))
    await anext(long)  # steps are running: the next add is queued
    for request_id in ("a", "b"):  # a plain add, then one whose add fails (empty prompt)
        prompt = [7] if request_id == "a" else []
        task = asyncio.create_task(collect(engine, request_id, prompt))
        while not engine._commands:
            await asyncio.sleep(0)
        engine.victim = task
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5.0)
    await long.aclose()
    await wait_until_idle(engine)
    assert engine.is_turning
    assert stream_shape(await collect(engine, "c", [8])) == [
        ([20], None),
        ([21], None),
        ([EOS], "stop"),
    ]
    assert_all_freed(engine)
    await engine.stop()
