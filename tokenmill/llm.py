"""LLM: offline batch inference with vLLM's entry-point names, so scripts written for vLLM run."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine_args import EngineArgs
from tokenmill.errors import InvalidRequest
from tokenmill.lora.request import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

log = logging.getLogger("tokenmill")

# vLLM arguments that mean nothing on this engine; accepted so vLLM scripts run, with a warning.
_IGNORED_VLLM_ARGS = {"gpu_memory_utilization", "enforce_eager", "trust_remote_code",
                      "swap_space", "disable_log_stats", "max_seq_len_to_capture", "download_dir"}

Prompt = str | dict[str, Any]
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, *, engine_args: EngineArgs | None = None, **kwargs: Any):
        """`LLM(model, dtype=..., kv_cache_memory=..., ...)`: every keyword is an EngineArgs field (the same
        options as the command line's flags); or pass a whole `engine_args`."""
        ignored = {k: kwargs.pop(k) for k in list(kwargs) if k in _IGNORED_VLLM_ARGS}
        for name in ignored:
            log.warning("LLM(%s=...) has no effect in tokenmill and is ignored", name)
        if engine_args is None:
            known = {f.name for f in dataclasses.fields(EngineArgs)}
            unknown = set(kwargs) - known
            if unknown:
                raise TypeError(f"LLM() got unexpected arguments: {', '.join(sorted(unknown))}")
            engine_args = EngineArgs(model=model, **kwargs)
        elif kwargs or model is not None:
            raise TypeError("LLM(): pass either engine_args or model and keyword arguments, not both")
        config = engine_args.create_engine_config()
        self.engine = LLMEngine(config)
        log.info(self.engine.core.cache_info.describe())

    def shutdown(self) -> None:
        """Stop the engine now: its parallel ranks end and its process groups go, so another parallel LLM can
        start in this process. Idempotent; `with LLM(...) as llm:` calls it on leaving, and an LLM never shut down
        is, when garbage collected or at interpreter exit."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[
            SamplingParams] | None = None, use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts. `priority` (one per
        prompt, as vLLM's) matters under scheduling_policy="priority": lower runs first. `lora_request`: the
        adapter every prompt runs through, or one per prompt (None: the base model); needs enable_lora=True."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        if priority is not None:
            if len(priority) != len(prompts):
                raise InvalidRequest(f"{len(priority)} priorities for {len(prompts)} prompts", param="priority")
            params = [dataclasses.replace(p, priority=q) for p, q in zip(params, priority)]
        loras = (list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise InvalidRequest(f"{len(loras)} LoRA requests for {len(prompts)} prompts", param="lora_request")
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                rid = self.engine.new_request_id()
                self.engine.add_request(rid, prompt, p, lora)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str = "last", normalize: bool = True,
              use_tqdm: bool = True) -> list[list[float]]:
        """One embedding per prompt (vLLM's `LLM.embed`, the vectors themselves): the final hidden states of its
        tokens pooled, the last token's ("last") or their mean ("mean"), L2-normalized unless `normalize` is
        False. Each prompt is computed whole, in batches with the others, and keeps no KV after."""
        params = SamplingParams(max_tokens=1, pooling=pooling, normalize=normalize)
        return [out.embedding for out in self.generate(prompts, params, use_tqdm)]

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
