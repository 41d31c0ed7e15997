"""LLMEngine: an EngineCore driven in-process, with the same client side as the server (admission, then the
OutputProcessor: n samples, detokenize, stop strings, logprobs, metrics). Used by `LLM` and the CLI."""

from __future__ import annotations

import itertools
import os
import weakref

from tokenmill.config import EngineConfig
from tokenmill.engine.admission import ContextLimits, admit, check_generates, check_pooling, validate_cache_salt
from tokenmill.engine.core import EngineCore
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.errors import InvalidRequest
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.backend import GrammarCache
from tokenmill.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None):
        self.core = EngineCore(config)
        # the core's parallel ranks and process groups end with this engine: on shutdown(), when it is garbage
        # collected, or at interpreter exit, whichever comes first (a script need not call anything)
        self._closer = weakref.finalize(self, _close_in, os.getpid(), self.core)
        try:
            self.tokenizer = tokenizer or Tokenizer.load(self.core.model_path if config.tokenizer is None
                                                         else config.tokenizer)
        except BaseException:
            self.shutdown()
            raise
        eos = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.core.model_config.eos_token_ids)
        self.processor = OutputProcessor(self.tokenizer, eos)
        self.limits = ContextLimits(self.core.max_model_len, self.core.model_config.vocab_size,
                                    self.core.cache_info.token_capacity)
        self._ids = itertools.count()
        self.grammars = GrammarCache()  # structured output's constraints, checked once each

    def shutdown(self) -> None:
        """Stop the parallel ranks and leave their process groups now, so another parallel engine can start in
        this process. Idempotent."""
        self._closer()

    @property
    def is_shut_down(self) -> bool:
        return not self._closer.alive

    def _check_open(self) -> None:
        if self.is_shut_down:
            raise RuntimeError("this engine was shut down; create a new LLM to generate again")

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

    def add_request(self, request_id: str, prompt: str | dict, params: SamplingParams,
                    lora_request: LoRARequest | None = None) -> None:
        """Tokenize, admit and queue; raises InvalidRequest / ContextTooLong with nothing queued."""
        self._check_open()
        cfg = self.core.model_config
        check_generates(not cfg.headless, params, f"this {cfg.architecture.replace('ForCausalLM', 'Model')} checkpoint")
        check_pooling(self.core.config.context_parallel_size, params)
        text, ids = self.tokenize_prompt(prompt)
        salt = validate_cache_salt(prompt.get("cache_salt") if isinstance(prompt, dict) else None)
        max_tokens = admit(ids, params.max_tokens, self.limits)
        grammar = self.grammars.check(params.structured_outputs) if params.structured_outputs is not None else None
        _, sequences = self.processor.add_request(request_id, text, ids, params, max_tokens, cache_salt=salt,
                                                  grammar=grammar, lora_request=lora_request)
        try:
            for msg in sequences:
                self.core.add_request(msg)
        except BaseException:  # the request ends whole: samples already queued must not run on
            self.core.abort([m.request_id for m in sequences])
            self.processor.pop(request_id)
            raise

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; returns its output (samples still running end with "abort"), or None if unknown."""
        state = self.processor.requests.get(request_id)
        if state is None:
            return None
        self.core.abort(self.processor.abort_request(request_id))
        return state.output()

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished

    # ---- one step --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return an updated RequestOutput for every request that changed."""
        self._check_open()
        processed = self.processor.process(self.core.step())
        for stop in processed.stops:
            self.core.finish(stop.request_id, stop.stop_reason)
        return [state.output() for state in processed.requests]


def _close_in(pid: int, core: EngineCore) -> None:
    """Close the core in the process that made it only: a forked child exiting must not stop its parent's ranks."""
    if os.getpid() == pid:
        core.close()
