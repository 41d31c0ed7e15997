"""What every family's GGUF test checks once its file is written: the file served dense gives the reference's greedy
tokens, and served with its blocks kept (a quantized file) gives prompt logprobs close to the dense model's."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.engine.drive import run
from tests.greedy import assert_matches_reference
from tokenmill import LLM
from tokenmill.sampling_params import SamplingParams


def prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The logprob `llm` gives each prompt token after the first."""
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([lp[t] for lp, t in zip(out.prompt_logprobs[1:], prompt[1:])])


def assert_gguf_serves(file: Path, tokenizer: Path, prompts: dict[str, list[int]], ref: dict, tokens: int,
                       quantized: bool, memory: int = 8 << 20) -> None:
    """`ref`: per prompt, the reference's greedy tokens and logits (transformers on the weights the file holds).
    With `quantized`, the file's blocks kept too: every prompt token's logprob within 2% of the dequantized model's
    (int8 activations: close, not equal)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    dense = LLM(str(file), dtype="float32", kv_cache_memory=memory, block_size=4, tokenizer=str(tokenizer))
    done = run(dense.engine, prompts, params)
    for rid, (want, logits) in ref.items():
        assert_matches_reference(done[rid].token_ids, want, logits)
    if quantized:
        kept = LLM(str(file), dtype="float32", kv_cache_memory=memory, block_size=4, tokenizer=str(tokenizer),
                   quantization="gguf")
        assert kept.engine.core.runner.weight_format().startswith("gguf")
        a = torch.cat([prompt_logprobs(kept, p) for p in prompts.values()])
        b = torch.cat([prompt_logprobs(dense, p) for p in prompts.values()])
        assert 0 < (a - b).abs().mean() < 0.02 * b.abs().mean()
