"""LLM: offline batch inference with vLLM's entry-point names, so scripts written for vLLM run."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import InvalidRequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

log = logging.getLogger("tokenmill")

# vLLM arguments that mean nothing on this engine; accepted so vLLM scripts run, with a warning.
_IGNORED_VLLM_ARGS = {"gpu_memory_utilization", "enforce_eager", "trust_remote_code", "tensor_parallel_size",
                      "swap_space", "disable_log_stats", "max_seq_len_to_capture", "download_dir"}

Prompt = str | dict[str, Any]
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, *, tokenizer: str | None = None, dtype: str = "auto",
                 device: str = "cpu", seed: int = 0, block_size: int = 16, kv_cache_memory: int | None = None,
                 max_num_seqs: int = 128, max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                 scheduling_policy: str = "continuous", enable_prefix_caching: bool = True,
                 num_threads: int | None = None, **kwargs: Any):
        unknown = set(kwargs) - _IGNORED_VLLM_ARGS
        if unknown:
            raise TypeError(f"LLM() got unexpected arguments: {', '.join(sorted(unknown))}")
        for name in kwargs:
            log.warning("LLM(%s=...) has no effect in tokenmill and is ignored", name)
        config = EngineConfig(
            model=model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed, num_threads=num_threads,
            cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      policy=scheduling_policy, max_model_len=max_model_len),
        )
        self.engine = LLMEngine(config)
        log.info(self.engine.core.cache_info.describe())

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[
            SamplingParams] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = self.engine.new_request_id()
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params: SamplingParams | Sequence[
            SamplingParams] | None = None, use_tqdm: bool = True, add_generation_prompt: bool = True
             ) -> list[RequestOutput]:
        """One conversation or a list of them, rendered through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            if not conv:
                raise InvalidRequest("a conversation needs at least one message", param="messages")
            prompts.append({"prompt_token_ids": self.engine.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[rid] for rid in ids]


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise InvalidRequest(f"{len(params)} sampling params for {n} prompts", param="sampling_params")
    return list(params)
