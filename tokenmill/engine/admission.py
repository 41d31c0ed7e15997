"""The one admission check, run at the edge (the offline engine's add_request, the server client's add_requests)
before anything is queued: a prompt must be token ids of the vocabulary, and prompt + max_tokens must fit both the
context window and the whole KV pool. The engine core trusts what passes (docs/architecture.md: validation happens once, at the edge)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.errors import ContextTooLong, InvalidRequest

if TYPE_CHECKING:
    from tokenmill.sampling_params import SamplingParams


@dataclass(frozen=True)
class ContextLimits:
    """What the engine can hold, as the engine core reports it."""

    max_model_len: int  # the context window, in tokens
    vocab_size: int
    token_capacity: int  # tokens the whole KV pool holds


def admit(prompt_token_ids: list[int], max_tokens: int | None, limits: ContextLimits) -> int:
    """Check one prompt and return its resolved max_tokens: the given one, or (None) as many as the context window
    and the KV pool leave. Raises InvalidRequest (empty prompt, id outside the vocabulary) or ContextTooLong, with
    the limit named, so nothing that can never run reaches the scheduler."""
    if not prompt_token_ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    check_token_ids(prompt_token_ids, limits.vocab_size, "prompt")
    num_prompt, window = len(prompt_token_ids), limits.max_model_len
    if num_prompt >= window:
        raise ContextTooLong(f"the prompt has {num_prompt} tokens; the context window is {window}", param="prompt")
    param = "max_tokens"
    if max_tokens is None:  # at least one token: a prompt that fills the KV pool is refused below, naming it
        max_tokens = max(min(window, limits.token_capacity) - num_prompt, 1)
        param = "prompt"
    total = num_prompt + max_tokens
    if total > window:
        raise ContextTooLong(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} exceeds the context "
                             f"window of {window} tokens", param=param)
    if total > limits.token_capacity:
        raise ContextTooLong(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} exceeds the KV cache "
                             f"capacity of {limits.token_capacity} tokens; raise --kv-cache-memory (or spread the KV over "
                             "ranks: --context-parallel-size)", param=param)
    return max_tokens


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """Every id a token of the vocabulary: the one rule for any field of token ids (a prompt, stop_token_ids,
    /detokenize's tokens)."""
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)


def validate_cache_salt(salt: object) -> str | None:
    """A cache salt is a non-empty string (or absent): requests with different salts never share cached KV."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequest("cache_salt must be a non-empty string", param="cache_salt")
    return salt


def check_generates(generates: bool, params: SamplingParams, model: str = "this model") -> None:
    """A base model (ModelConfig.headless: no language-model head of its own) gives embeddings only."""
    if not generates and params.pooling is None:
        raise InvalidRequest(f"{model} is a base model without a language-model head: it gives embeddings "
                             "(/v1/embeddings, LLM.embed), not text", param="model")


def check_pooling(context_parallel_size: int, params: SamplingParams) -> None:
    """Embeddings pool every prompt row in one process; under context parallelism each rank holds a share of them."""
    if params.pooling is not None and context_parallel_size > 1:
        raise InvalidRequest("embeddings are not served with context parallelism (--context-parallel-size > 1): "
                             "each rank computes only part of a prompt", param="input")

