"""ScriptedExecutor: an Executor (deepinfer/engine/llm_engine.py) with no model, for server tests.

Each request's output is a script of token ids, chosen from its prompt; after the script the
executor emits EOS. The real scheduler runs around it, so blocks, slots, chunked prefill,
preemption, finish reasons and draft verification behave as in production.

    executor = ScriptedExecutor({7: [10, 11, 12]})   # prompts containing token 7 -> 10, 11, 12
    engine = LLMEngine(Config(), executor=executor)    # then EOS (finish_reason "stop")

A prompt's script is the one keyed by the prompt's last token that is a key (so a marker can sit
anywhere, e.g. inside a chat-templated prompt); unmatched prompts get ``default_script``. A
callable ``prompt_token_ids -> script`` may be given instead of the dict.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from deepinfer.scheduler.drafts import accepted
from deepinfer.scheduler.output import ModelRunnerOutput, SchedulerOutput

Script = list[int]


class ScriptedStepError(RuntimeError):
    """Raised by execute() while ``num_failing_steps`` > 0 (to test step failures)."""


class ScriptedExecutor:
    """Producer of ModelRunnerOutput for Scheduler.update(); runs on the CPU, in the step thread.

    ``step_delay_s`` sleeps in every execute() (to test disconnects, drains and timeouts).
    Set ``num_failing_steps`` to make the next that many steps raise ScriptedStepError.
    Logprobs are fake but well formed: the sampled (or actual prompt) token at -0.25 (sampled) or
    -1.0 (prompt), then the asked-for number of alternatives ``(token + i) % vocab_size`` at
    ``-1.0 - i``.
    """

    def __init__(
        self,
        scripts: Mapping[int, Script] | Callable[[list[int]], Script] | None = None,
        *,
        default_script: Script | None = None,
        num_blocks: int = 64,
        num_slots: int = 16,
        max_model_len: int = 4096,
        vocab_size: int = 129280,
        eos_token_id: int | None = 1,
        step_delay_s: float = 0.0,
    ) -> None:
        self.scripts = scripts if scripts is not None else {}
        self.default_script = list(default_script or [])
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.step_delay_s = step_delay_s
        # Prefix caching: there is no state to rebuild, so a hit needs no replay.
        self.num_snapshots = 2 * num_slots
        self.cache_salt = b"scripted-executor"
        self.replay_tokens = 0
        self.recompute_tokens = 1
        self.num_failing_steps = 0
        self.num_steps = 0
        self._scripts_by_request: dict[str, Script] = {}

    def script_for(self, prompt_token_ids: list[int]) -> Script:
        if callable(self.scripts):
            return list(self.scripts(prompt_token_ids))
        for token_id in reversed(prompt_token_ids):
            if token_id in self.scripts:
                return list(self.scripts[token_id])
        return list(self.default_script)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        if self.num_failing_steps > 0:
            self.num_failing_steps -= 1
            raise ScriptedStepError(f"scripted failure in step {self.num_steps}")
        for request_id in scheduler_output.freed_request_ids:
            if request_id not in scheduler_output.preempted_request_ids:
                self._scripts_by_request.pop(request_id, None)
        output = ModelRunnerOutput()
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            params = request.sampling_params
            if scheduled.num_prompt_logprob_positions:
                num_top = params.prompt_logprobs or 0
                output.prompt_logprobs[request.request_id] = [
                    self._logprobs(request.prompt_token_ids[pos + 1], -1.0, num_top)
                    for pos in range(
                        scheduled.start_pos,
                        scheduled.start_pos + scheduled.num_prompt_logprob_positions,
                    )
                ]
            if not scheduled.do_sample:
                continue
            script = self._scripts_by_request.get(request.request_id)
            if script is None:
                script = self._scripts_by_request[request.request_id] = self.script_for(
                    request.prompt_token_ids
                )
            # Indexed by the output position, so a recompute after preemption replays the script.
            # Drafts (the chunk's last num_draft_tokens ids) are verified as a model would: the
            # token at each drafted position is the script's, kept while the drafts match it.
            index = request.num_output_tokens
            samples = [
                script[i] if i < len(script) else self._end_token()
                for i in range(index, index + scheduled.num_draft_tokens + 1)
            ]
            drafts = scheduled.token_ids[len(scheduled.token_ids) - scheduled.num_draft_tokens :]
            token_ids = accepted(drafts, samples)
            output.sampled_token_ids[request.request_id] = token_ids
            if params.logprobs is not None:
                output.logprobs[request.request_id] = [
                    self._logprobs(token_id, -0.25, params.logprobs) for token_id in token_ids
                ]
        return output

    def _end_token(self) -> int:
        return self.eos_token_id if self.eos_token_id is not None else 0

    def _logprobs(self, token_id: int, logprob: float, num_top: int) -> dict[int, float]:
        out = {token_id: logprob}
        for i in range(1, min(num_top, self.vocab_size - 1) + 1):
            out[(token_id + i) % self.vocab_size] = -1.0 - i
        return out
