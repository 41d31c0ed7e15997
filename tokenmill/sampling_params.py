"""SamplingParams: vLLM's names and defaults, validated once when built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenmill.errors import InvalidRequest
from tokenmill.structured_params import StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_N = 64
MAX_PRIORITY = 1_000_000
MAX_LOGIT_BIAS = 1024  # token ids one request may bias (OpenAI's limit is 300)
POOLING_TYPES = (None, "last", "mean")
BAN = -100.0  # a logit_bias of -100 bans its token (its logit becomes -inf), as OpenAI describes it


@dataclass
class SamplingParams:
    """How to pick tokens for one request. temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context window
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0 = just the sampled one)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token after the first (0 = just that token)
    skip_special_tokens: bool = True
    speculate: bool = True  # with --speculative-config: False opts this request out of speculation
    # scheduling hints (vLLM keeps `priority` beside the sampling parameters; here they travel together):
    # lower priority runs first under --scheduling-policy priority; SLO targets override the server's defaults
    priority: int = 0
    slo_ttft_ms: float | None = None  # time to first token target
    slo_itl_ms: float | None = None  # inter-token latency target
    # the output follows a JSON schema, regex, choice or grammar (structured_params.py); a dict of its fields works
    structured_outputs: StructuredOutputsParams | dict | None = None
    # token id -> a bias in [-100, 100] added to its logit before sampling (OpenAI's logit_bias); -100 bans the token
    logit_bias: dict[int, float] | None = None
    # an embedding instead of tokens (/v1/embeddings, LLM.embed): the prompt's final hidden states pooled, the last
    # token's ("last") or their mean ("mean"), L2-normalized unless `normalize` is False; nothing is sampled, and
    # the request keeps no KV after it (none cached either)
    pooling: str | None = None
    normalize: bool = True
    stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                        name, "must be a finite number")
        self._check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
        self._check(self.temperature >= 0, "temperature", "must be >= 0 (0 means greedy)")
        self._check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        self._check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
                    "must be -1 or 0 (disabled) or a positive integer")
        self._check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        self._check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0 (1 = off)")
        self._check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        self._check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None:
            self._check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
                        "must be an integer >= 1")
        self._check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        if self.max_tokens is not None:
            self._check(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        if self.logprobs is not None:
            self._check(isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
                        f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None:
            self._check(isinstance(self.prompt_logprobs, int) and not isinstance(self.prompt_logprobs, bool)
                        and 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
                        f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.seed is not None:
            self._check(isinstance(self.seed, int) and 0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)")
        self._check(isinstance(self.priority, int) and not isinstance(self.priority, bool)
                    and abs(self.priority) <= MAX_PRIORITY, "priority",
                    f"must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}] (lower runs first)")
        for name in ("slo_ttft_ms", "slo_itl_ms"):
            value = getattr(self, name)
            if value is not None:
                self._check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                            and value > 0, name, "must be a positive number of milliseconds")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                    "structured_outputs", "must be StructuredOutputsParams or a dict of its fields")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self._check(all(isinstance(s, str) and s for s in stops), "stop", "must be non-empty strings")
        self.stop_list = stops
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                    "must be non-negative token ids")
        if self.top_k == -1:
            self.top_k = 0
        self._check(self.pooling in POOLING_TYPES, "pooling", f"must be one of {', '.join(map(str, POOLING_TYPES))}")
        if self.logit_bias is not None:
            self._check(isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
                        f"must map at most {MAX_LOGIT_BIAS} token ids to biases")
            self._check(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.logit_bias),
                        "logit_bias", "keys must be non-negative token ids")
            self._check(all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b)
                            and -100 <= b <= 100 for b in self.logit_bias.values()),
                        "logit_bias", "values must be numbers in [-100, 100]")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items() if b != 0} or None

    @staticmethod
    def _check(ok: bool, param: str, rule: str) -> None:
        if not ok:
            raise InvalidRequest(f"{param} {rule}", param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Anything that changes the raw logits before sampling: penalties or a logit bias."""
        return self.has_penalties or self.logit_bias is not None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
