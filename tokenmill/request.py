"""Request: the engine-side state of one sequence (plain Python, no tensors)."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # running or sampling it raised: it ends alone, the engine goes on

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)


@dataclass(eq=False)  # identity: the scheduler's `in` and `remove` must not compare field tuples
class Request:
    """One sequence. `num_computed_tokens` catches up with `num_tokens` step by step: that one rule covers
    chunked prefill, decode and recompute after preemption."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what the context window leaves
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # a hybrid KV layout's window pages per block (engine/window_pages.py): None once released, as are the first
    # `num_window_released` blocks'
    window_pages: list[list[int] | None] = field(default_factory=list)
    num_window_released: int = 0
    # a hybrid model's recurrent/convolution state (engine/state_slots.py): its slot while admitted, else None
    state_slot: int | None = None
    # prefix caching on such a model (engine/state_snapshots.py): the snapshot row its slot starts from at its next
    # step (a hit), and the row its state is copied to after this step with the tokens it then reaches (a block
    # boundary)
    state_load: int | None = None
    state_save: tuple[int, int] | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    stop_reason: int | str | None = None
    cache_salt: str | None = None  # requests with different salts never share cached KV blocks
    # prefix-cache state, kept by the KV cache manager: the deepest radix-tree node this request holds locked,
    # how many of its leading blocks that path covers, and the tokens found cached when it was first admitted
    cache_node: Any = None
    num_cached_blocks: int = 0
    num_cached_tokens: int | None = None
    num_skips: int = 0  # times a later arrival was admitted before it (the scheduler's starvation bound)
    # prompt positions whose next-token logprob was already reported (params.prompt_logprobs): a recompute after
    # preemption runs them again but must not report them twice
    num_prompt_logprobs: int = 0
    # speculative decoding: tokens a proposer guessed to follow the output, verified by the next step (tokens to
    # compute = tokens known, drafts included); never part of `num_tokens`, which counts committed tokens only
    spec_token_ids: list[int] = field(default_factory=list)
    # disaggregated prefill/decode (tokenmill/disagg/): prompt tokens whose KV arrived from a producer, loaded instead
    # of computed when the request is admitted; `pending_load` is the token range admission gave it to load
    # [start, end) before its first step (the engine core writes it)
    num_external_tokens: int = 0
    pending_load: tuple[int, int] | None = None
    # scheduling: lower priority first (policy priority); latency targets in seconds (None: none)
    priority: int = 0
    ttft_target: float | None = None
    itl_target: float | None = None
    # an embedding request (params.pooling): the float64 sum of its prompt's hidden rows so far ("mean"), or the
    # last prompt token's row ("last"), as the runner hands them back chunk by chunk
    pooled: list[float] | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs through (None: the base model)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position must run through the model (its logits are reported, or its hidden state pooled),
        so no cached prefix."""
        return self.params.prompt_logprobs is not None or self.pools

    @property
    def pools(self) -> bool:
        """An embedding request: its prompt's hidden states pooled (params.pooling), nothing sampled."""
        return self.params.pooling is not None

    @property
    def cache_namespace(self) -> Hashable:
        """What besides tokens must be equal for two requests to share cached blocks."""
        if self.lora_request is not None:  # an adapter's KV is its own: other values for the same tokens
            return (self.cache_salt, self.lora_request.lora_name)
        return (self.cache_salt,) if self.cache_salt is not None else None

    @property
    def lora_name(self) -> str | None:
        return self.lora_request.lora_name if self.lora_request is not None else None

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def tokens_with_spec(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the committed tokens followed by the drafts (start <= num_tokens)."""
        n = self.num_tokens
        if end <= n:
            return self.tokens_slice(start, end)
        return self.tokens_slice(start, n) + self.spec_token_ids[:end - n]

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def check_stop(self) -> bool:
        """After a token is appended: set a finished status if it ends the request (EOS, stop id, length)."""
        end = self._end(self.output_token_ids[-1], len(self.output_token_ids))
        if end is not None:
            self.status, self.stop_reason = end
        return end is not None

    def would_stop(self, token: int, num_output: int) -> bool:
        """Whether `token` as the request's `num_output`-th output token would end it: check_stop asked ahead
        (multi-step decode ends early once every request of its batch has ended)."""
        return self._end(token, num_output) is not None

    def _end(self, token: int, num_output: int) -> tuple[RequestStatus, int | None] | None:
        if num_output >= self.params.min_tokens:
            if not self.params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token in self.params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if num_output >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        return None
