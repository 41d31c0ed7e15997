"""What the quantized-model tests share: a tiny model, a small batch of prompts, and the dense model's outputs."""

from __future__ import annotations

import torch

from tests.models.tiny import make_tiny_model
from tokenmill import LLM, SamplingParams

KV = 64 << 20


def tiny_batch_and_dense(tmp_path, dtype: str, max_tokens: int) -> tuple[str, list[dict], SamplingParams, list]:
    """(model path, 3 prompts of 6-40 tokens, greedy params with logprobs, the dense model's outputs for them)."""
    path = make_tiny_model(tmp_path, vocab_size=512, hidden_size=128, intermediate_size=256, num_heads=4,
                           num_kv_heads=2)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    g = torch.Generator().manual_seed(0)
    batch = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (6, 21, 40)]
    dense = LLM(str(path), dtype=dtype, kv_cache_memory=KV).generate(batch, params, use_tqdm=False)
    return str(path), batch, params, dense
