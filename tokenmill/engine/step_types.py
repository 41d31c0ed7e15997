"""The data one engine step passes along, plain Python (no tensors): what the scheduler schedules (SchedulerOutput),
what the runner samples (StepResult) and what the scheduler reports (SchedulerStats). A module of their own, so the
scheduler, the runner, the hooks and the API process each name them without importing one another. The one tensor
payload, a draft model's distributions, passes from the speculator to the runner untouched (`draft_probs`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.kv_cache import PrefixCacheStats
from tokenmill.engine.step_cost import StepCost, attention_pairs
from tokenmill.request import Request
from tokenmill.spec_stats import SpecDecodeStats


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def num_left(self) -> int:
        """Committed tokens of the request still to compute after this chunk."""
        return max(0, self.request.num_tokens - self.request.num_computed_tokens - self.num_new_tokens)

    @property
    def num_spec_tokens(self) -> int:
        """Draft tokens this chunk verifies: what it computes past the committed tokens."""
        return max(0, self.request.num_computed_tokens + self.num_new_tokens - self.request.num_tokens)

    @property
    def samples_next_token(self) -> bool:
        """True when this chunk reaches the end of the request's known tokens, so its last logits are used (never
        for an embedding request: it pools hidden states instead)."""
        return self.num_left == 0 and not self.request.pools


@dataclass
class SampledTokens:
    """What a step sampled for one request: one token, or with speculation the accepted drafts and one more, with
    their logprobs ({token: logprob}, that token first) when asked for."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None

    def truncate(self, n: int) -> None:
        """Keep the first n (the request ended at the n-th)."""
        del self.token_ids[n:]
        if self.logprobs is not None:
            del self.logprobs[n:]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # > 1: every scheduled request is one decode token, and the runner decodes this many tokens in a row for each
    # (each sampled token fed back as the next input), its KV slots already allocated (multi-step decode)
    num_steps: int = 1
    # a draft model's distributions q [drafts, V] of the drafts a request verifies this step, for the rejection
    # sampler (set by the speculator before the step runs: spec/speculator.py)
    draft_probs: dict[str, Any] = field(default_factory=dict)
    # constrained requests' matchers (structured/manager.py StructuredOutputs), set by their hook before the step
    # runs: the runner masks those rows' logits with them; None: no constrained request this step
    grammar: Any = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled

    @property
    def num_attention_pairs(self) -> int:
        """(query, key) pairs the step's attention covers (before `update` advances the requests)."""
        return sum(attention_pairs(s.num_new_tokens, s.request.num_computed_tokens) for s in self.scheduled)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    kv_usage: float
    num_preemptions_total: int
    num_prefill_tokens_computed_total: int = 0
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding on
    preemptions_by_cause: dict[str, int] = field(default_factory=dict)  # "blocks" (pool short), "priority"
    step_cost: StepCost | None = None  # what a step costs, as measured (step_cost.py)
    running_context_tokens: int = 0  # computed tokens of the running requests: their decodes' attention
    # prompt tokens still to compute of running requests (chunked prefills under way), by priority level now
    prefill_tokens_by_level: dict[int, int] = field(default_factory=dict)
    new_token_ratio: float = 0.0  # the KV headroom kept for decode growth now
    leaked_blocks: int = 0  # blocks still held the last time no request was in flight (each a bug)
    # of the waiting, those that ran before (preempted, waiting to be recomputed): the requests the API process
    # cannot count itself, since it saw them start (engine/async_engine.py num_waiting)
    num_requeued: int = 0
    num_requeued_tokens: int = 0


@dataclass
class StepResult:
    sampled: dict[str, SampledTokens] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it could not be run or sampled
    # request id -> the next prompt tokens' logprobs this step computed, in prompt order, each {token: logprob}
    # with that prompt token first; they continue from the request's `num_prompt_logprobs`
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    # embedding requests: their Request.pooled after this step's chunk
    pooled: dict[str, list[float]] = field(default_factory=dict)

    def merge(self, other: StepResult) -> None:
        self.sampled.update(other.sampled)
        self.failed.update(other.failed)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.pooled.update(other.pooled)
