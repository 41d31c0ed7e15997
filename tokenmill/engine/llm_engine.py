"""LLMEngine: the text side around an EngineCore (tokenize, n samples, detokenize, stop strings).

Used in-process by `LLM` and the CLI; the server's async engine does the same work over a process boundary.
"""

from __future__ import annotations

import itertools
import time

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import EngineCoreOutput
from tokenmill.engine.output_processor import (
    RequestState,
    SampleState,
    apply_output,
    new_parent,
    resolve_max_tokens,
    validate_cache_salt,
    validate_prompt,
)
from tokenmill.errors import InvalidRequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None):
        self.core = EngineCore(config)
        self.tokenizer = tokenizer or Tokenizer.load(self.core.model_path if config.tokenizer is None
                                                     else config.tokenizer)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.core.model_config.eos_token_ids)
        self._parents: dict[str, RequestState] = {}
        self._by_core_id: dict[str, tuple[RequestState, SampleState]] = {}
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    # ---- requests ----------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise InvalidRequest("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}",
                             param="prompt")

    def validate_prompt(self, token_ids: list[int]) -> None:
        validate_prompt(token_ids, self.core.model_config.vocab_size)

    def add_request(self, request_id: str, prompt: str | dict, params: SamplingParams) -> None:
        """Tokenize, validate and queue; raises InvalidRequest / ContextTooLong with nothing queued."""
        text, ids = self.tokenize_prompt(prompt)
        self.validate_prompt(ids)
        salt = validate_cache_salt(prompt.get("cache_salt") if isinstance(prompt, dict) else None)
        max_tokens = resolve_max_tokens(params, len(ids), self.max_model_len, self.core.cache_info.token_capacity)
        self.core.scheduler.check_admissible(len(ids), max_tokens)
        parent = new_parent(request_id, text, ids, params, max_tokens, self.tokenizer, self.eos_token_ids,
                            cache_salt=salt)
        for sample in parent.samples:
            self._by_core_id[sample.core_id] = (parent, sample)
        self._parents[request_id] = parent
        for req in parent.core_requests:
            self.core.add_request(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        self.core.abort([s.core_id for s in parent.samples if s.finish_reason is None])
        for s in parent.samples:
            s.finish_reason = s.finish_reason or "abort"
            self._by_core_id.pop(s.core_id, None)
        return self._output(parent)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    # ---- one step --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an updated RequestOutput for every request that changed."""
        touched: dict[str, RequestState] = {}
        for out in self.core.step():
            parent, sample = self._by_core_id[out.request_id]
            self._apply(parent, sample, out)
            touched[parent.request_id] = parent
        results = []
        for parent in touched.values():
            if parent.finished:
                parent.metrics.finished_time = time.monotonic()
                del self._parents[parent.request_id]
                for s in parent.samples:
                    self._by_core_id.pop(s.core_id, None)
            results.append(self._output(parent))
        return results

    def _apply(self, parent: RequestState, sample: SampleState, out: EngineCoreOutput) -> None:
        stop = apply_output(parent, sample, out)
        if stop is not None:
            self.core.finish(sample.core_id, stop)

    def _output(self, parent: RequestState) -> RequestOutput:
        req0 = parent.core_requests[0]
        parent.metrics.first_scheduled_time = req0.first_scheduled_time
        parent.metrics.num_preemptions = sum(r.num_preemptions for r in parent.core_requests)
        parent.num_cached_tokens = req0.num_cached_tokens or 0
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             [s.output() for s in parent.samples], parent.finished, parent.metrics,
                             parent.num_cached_tokens)
