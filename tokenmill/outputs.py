"""Results handed to users, with vLLM's names and fields."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per generated token: {token_id: logprob}, sampled token first
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    error: str | None = None  # finish_reason "error": why the engine could not run this sample

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # params.prompt_logprobs: per prompt token, {token_id: logprob} given the tokens before it (that token first,
    # then the top-N); None for the first token, which has nothing before it (as vLLM)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: list[float] | None = None  # an embedding request's (SamplingParams.pooling; LLM.embed) result
