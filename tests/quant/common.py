"""What the quantized-model tests share: a tiny model, a small batch of prompts, and the dense model's outputs."""

from __future__ import annotations

import torch

from tests.greedy import first_divergence
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


# Where kept blocks run on VNNI or AVX2 (csrc/gguf_vnni.cpp, gguf_avx2.cpp), x is rounded in two int8 blocks and
# the products summed in another order than the dense matmul's: a logit moves by about one bfloat16 step (1/8-1/4 at
# SmolLM2's logit sizes) at most, so greedy may swap a pair of tokens that close, no more.
CLOSE_LOGPROB = 0.3
SWAP_GAP = 0.5


def assert_kept_tracks_dense(dense: list, kept: list, exact: bool, close: float = CLOSE_LOGPROB) -> None:
    """Kept blocks against the dequantized model, request by request (outputs with logprobs >= 2). `exact` (the
    AMX tiles widen to the very bfloat16 weights): the same tokens and logprobs. Else the same tokens up to a
    step where the kept model chose a token the dense model rated within SWAP_GAP of its best (among its top
    logprobs), and every logprob up to there within `close`: a wrong block decode moves logits by nats."""
    for a, b in zip(dense, kept, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        if exact:
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
            continue
        i = first_divergence(a.token_ids, b.token_ids)
        upto = len(a.token_ids) if i is None else i
        for j in range(upto):
            token = a.token_ids[j]
            assert abs(a.logprobs[j][token] - b.logprobs[j][token]) < close, f"step {j}"
        if i is not None:  # the kept model's choice was a near-tie in the dense model too
            chosen = a.logprobs[i].get(b.token_ids[i])
            assert chosen is not None, f"step {i}: the kept model chose a token outside the dense model's top logprobs"
            gap = max(a.logprobs[i].values()) - chosen
            assert gap <= SWAP_GAP, f"diverged at step {i} with a gap of {gap:.3f}"
