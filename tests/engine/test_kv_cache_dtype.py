"""--kv-cache-dtype fp8: an e4m3 cache of half the bytes per token (twice the blocks in the same memory), read by
the same kernels as the reference reads it, batch-invariant like the bfloat16 cache, and close to it."""

from __future__ import annotations

import pytest
import torch

from tests.models.reference import make_llm
from tests.models.tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ConfigError

KV = 4 << 20
BATCH = [{"prompt_token_ids": list(range(5 + i, 25 + 7 * i))} for i in range(4)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("kv8"), num_heads=4, num_kv_heads=2))


def generate(llm: LLM, batch=BATCH, tokens: int = 12):
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=1)
    return [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_cache_halves_bytes_and_serves_every_path(tiny, dtype, monkeypatch):
    full = LLM(tiny, dtype=dtype, kv_cache_memory=KV)
    fp8 = LLM(tiny, dtype=dtype, kv_cache_memory=KV, kv_cache_dtype="fp8")
    a, b = full.engine.core.cache_info, fp8.engine.core.cache_info
    assert b.kv_bytes_per_token * (4 if dtype == "float32" else 2) == a.kv_bytes_per_token
    assert b.num_blocks >= 2 * a.num_blocks - 1 and b.dtype == "float8_e4m3fn"
    assert fp8.engine.core.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    outs = generate(fp8)
    # the reference runner (plain torch, no C++) reads and writes the same codes: the same tokens
    ref = make_llm(tiny, "reference", monkeypatch, dtype="float32", kv_cache_memory=KV, kv_cache_dtype="fp8")
    if dtype == "float32":
        assert [o.token_ids for o in generate(ref)] == [o.token_ids for o in outs]
    # close to the full-precision cache: each prompt token's logprob (every position reads the cache) moves little
    a, b = prompt_logprobs(full), prompt_logprobs(fp8)
    assert 0 < (a - b).abs().mean() < 0.05 * a.abs().mean()
    fp8.engine.core.check_idle_invariants()


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    """The logprob of each prompt token after the first, over BATCH."""
    outs = llm.generate(BATCH, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([lp[t] for o, r in zip(outs, BATCH)
                         for lp, t in zip(o.prompt_logprobs[1:], r["prompt_token_ids"][1:])])


def test_fp8_cache_is_batch_invariant(tiny):
    llm = LLM(tiny, dtype="bfloat16", kv_cache_memory=KV, kv_cache_dtype="fp8", max_num_batched_tokens=16)
    together = generate(llm)
    alone = [generate(llm, [r])[0] for r in BATCH]
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_unknown_kv_cache_dtype_names_the_choices(tiny):
    with pytest.raises(ConfigError, match="auto, fp8, fp8_e4m3"):
        LLM(tiny, kv_cache_dtype="int4", kv_cache_memory=KV)
