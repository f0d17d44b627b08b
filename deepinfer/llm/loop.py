"""The offline engine loop: requests in, RequestOutputs out, on one engine (one rank).

    (request id, prompt, params) per request --add--> LLMEngine
    step() until every request finished (a rank of a group: until no rank has requests left)
      -> deltas -> _Track (detokenizer, stop strings) -> RequestOutput per request

Used by ``LLM`` in one process and by each rank process of ``llm/ranks.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tqdm import tqdm

from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.outputs import CompletionOutput, FinishReason, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.output import RequestOutputDelta
from deepinfer.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

Prompt = str | list[int]
Work = tuple[str, Prompt, SamplingParams]  # request id, prompt, sampling params


class EngineLoop:
    """Runs batches of requests on ``engine`` to completion."""

    def __init__(self, engine: LLMEngine) -> None:
        assert engine.tokenizer is not None
        self.engine = engine
        self.tokenizer: Tokenizer = engine.tokenizer

    def generate(
        self,
        work: Sequence[Work],
        use_tqdm: bool = False,
        on_finished: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in ``work``'s order. If anything raises, every request of ``work`` still in
        the engine is aborted. In a rank group, returns once no rank has requests left."""
        tracks: dict[str, _Track] = {}
        try:
            for request_id, prompt, params in work:
                tracks[request_id] = self._add(request_id, prompt, params)
            self._run(tracks, use_tqdm, on_finished)
        except BaseException:
            self.engine.abort_requests(list(tracks))
            raise
        return [t.output for t in tracks.values()]

    def _add(self, request_id: str, prompt: Prompt, params: SamplingParams) -> _Track:
        tokenizer = self.tokenizer
        text = prompt if isinstance(prompt, str) else None
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.engine.add_request(request_id, ids, params)
        return _Track(tokenizer, request_id, text, ids, params)

    def _run(
        self,
        tracks: dict[str, _Track],
        use_tqdm: bool,
        on_finished: Callable[[RequestOutput], None] | None,
    ) -> None:
        bar = tqdm(total=len(tracks), desc="generate", unit="req", disable=not use_tqdm)
        pending = set(tracks)
        grouped = self.engine.lockstep is not None
        # A rank of a group steps while any rank has requests, its own done or not (at least
        # once: only the agreement tells it whether the others have any).
        while pending or grouped:
            for delta in self.engine.step():
                track = tracks.get(delta.request_id)
                if track is None or delta.request_id not in pending:
                    continue
                stop = track.push(delta)
                if stop is not None and not delta.is_finished:
                    self.engine.finish_requests([delta.request_id], stop)
                if track.output.finished:
                    pending.discard(delta.request_id)
                    bar.update(1)
                    if on_finished is not None:
                        on_finished(track.output)
            if grouped and not pending and not self.engine.group_unfinished:
                break
        self.engine.complete_in_flight()  # only finished requests' dropped tokens are left
        bar.close()


class _Track:
    """One request's accumulating output, detokenizer and stop-string matcher."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.matcher = (
            StopStringMatcher(params.stop, params.include_stop_str_in_output)
            if params.stop
            else None
        )
        prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self.output = RequestOutput(request_id, prompt, prompt_ids, prompt_logprobs)
        self.completion = CompletionOutput(
            index=0, text="", token_ids=[], logprobs=[] if params.logprobs is not None else None
        )
        self.output.outputs.append(self.completion)
        self.stopped = False

    def push(self, delta: RequestOutputDelta) -> str | None:
        """Add a delta; returns the stop string when one matched in this delta's text."""
        out, done = self.completion, self.stopped
        self.output.num_cached_tokens = delta.num_cached_tokens
        if delta.new_prompt_logprobs and self.output.prompt_logprobs is not None:
            self.output.prompt_logprobs.extend(delta.new_prompt_logprobs)
        if done:
            return None
        out.token_ids.extend(delta.new_token_ids)
        if out.logprobs is not None and delta.new_logprobs:
            out.logprobs.extend(delta.new_logprobs)
        matched = None
        if delta.new_token_ids:
            new_text = self.detokenizer.push(delta.new_token_ids)
            text = self.detokenizer.text
            if self.matcher is not None:
                check = self.matcher.check(text, len(new_text))
                if check.is_stopped:
                    matched, text = check.stop_str, check.text
            out.text = text
        if matched is not None:
            self.stopped = True
            out.finish_reason, out.stop_reason = FinishReason.STOP, matched
        elif delta.is_finished:
            out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
        return matched
