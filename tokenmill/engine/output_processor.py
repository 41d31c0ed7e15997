"""The text side of a request, shared by the offline engine (llm_engine.py) and the server's client
(async_engine.py): checks before a request is queued, its n samples' state (incremental detokenizer, stop strings,
logprobs), and folding each core output into it. Plain Python: no torch, no model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.messages import EngineCoreOutput
from tokenmill.errors import ContextTooLong, InvalidRequest
from tokenmill.outputs import CompletionOutput, RequestMetrics
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer


@dataclass
class SampleState:
    """One of the n samples of a request, as the frontend tracks it."""

    index: int
    core_id: str
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None

    def output(self) -> CompletionOutput:
        text = self.detok.visible_text(self.finish_reason is not None)
        return CompletionOutput(self.index, text, list(self.token_ids), self.cumulative_logprob,
                                self.logprobs, self.finish_reason, self.stop_reason, self.error)


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState]
    metrics: RequestMetrics
    core_requests: list[Request]
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when the first sample was first scheduled

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


def validate_prompt(token_ids: list[int], vocab_size: int) -> None:
    if not token_ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt")


def validate_cache_salt(salt: object) -> str | None:
    """A cache salt is a non-empty string (or absent): requests with different salts never share cached KV."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequest("cache_salt must be a non-empty string", param="cache_salt")
    return salt


def resolve_max_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int, token_capacity: int) -> int:
    """params.max_tokens, or (None) up to the context window or what the whole KV pool can hold if that is less.
    Raises ContextTooLong when the prompt alone fills the context window."""
    if num_prompt_tokens >= max_model_len:
        raise ContextTooLong(f"the prompt has {num_prompt_tokens} tokens; the context window is {max_model_len}",
                             param="prompt")
    if params.max_tokens is not None:
        return params.max_tokens
    return min(max_model_len, token_capacity) - num_prompt_tokens


def new_parent(request_id: str, text: str | None, ids: list[int], params: SamplingParams, max_tokens: int,
               tokenizer: Tokenizer, eos_token_ids: frozenset[int], arrival_time: float | None = None,
               cache_salt: str | None = None) -> RequestState:
    """The frontend state of one request and its n core requests (ids `request_id`, or `request_id#i` for n > 1;
    seeded children get seed + i), each with its own incremental detokenizer. The n core requests share the
    prompt's KV blocks through the prefix cache."""
    now = time.monotonic() if arrival_time is None else arrival_time
    parent = RequestState(request_id, text, ids, params, [], RequestMetrics(arrival_time=now), [])
    for i in range(params.n):
        core_id = request_id if params.n == 1 else f"{request_id}#{i}"
        child_params = params
        if params.n > 1 and params.seed is not None:
            child_params = replace(params, seed=params.seed + i)
        req = Request(core_id, ids, child_params, max_tokens, eos_token_ids, arrival_time=now, cache_salt=cache_salt)
        detok = IncrementalDetokenizer(tokenizer, ids, params.stop_list, params.include_stop_str_in_output,
                                       params.skip_special_tokens)
        parent.samples.append(SampleState(i, core_id, detok, logprobs=[] if params.logprobs is not None else None,
                                      cumulative_logprob=0.0 if params.logprobs is not None else None))
        parent.core_requests.append(req)
    return parent


def apply_output(parent: RequestState, sample: SampleState, out: EngineCoreOutput) -> str | None:
    """Fold one core output into its sample. Returns a stop string that ended the sample while the core still
    runs it, so the caller tells the core to finish it (`EngineCore.finish`). Outputs for a sample already
    finished (a core in another process may run a step ahead of the frontend) are ignored."""
    if sample.finish_reason is not None:
        return None
    sample.token_ids.extend(out.new_token_ids)
    if sample.logprobs is not None and out.new_logprobs:
        for tok, lp in zip(out.new_token_ids, out.new_logprobs):
            sample.logprobs.append(lp)
            sample.cumulative_logprob += lp[tok]
    if parent.metrics.first_token_time is None and out.new_token_ids:
        parent.metrics.first_token_time = time.monotonic()
    text_ids = out.new_token_ids
    if out.finish_reason == "stop" and not parent.params.include_stop_str_in_output:
        text_ids = text_ids[:-1]  # the EOS / stop token ended it: its id is output, its text is not
    stop = sample.detok.append(text_ids)
    if stop is not None:  # a stop string wins, even over a length limit reached by the same token
        sample.finish_reason, sample.stop_reason = "stop", stop
        return stop if out.finish_reason is None else None
    if out.finish_reason is not None:
        sample.finish_reason, sample.stop_reason, sample.error = out.finish_reason, out.stop_reason, out.error
    return None
