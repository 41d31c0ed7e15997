"""Greedy parity with Hugging Face transformers `generate` on the same weights, token for token."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.greedy import assert_matches_reference, hf_greedy
from tests.models.tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import default_model_path

KV = 64 << 20  # bytes: small pools keep tests fast
# Block size 16: prompt lengths that end on a block boundary (16, 32) and off it (7, 23, 41).
PROMPT_LENGTHS = (7, 16, 23, 32, 41)

TINY_VARIANTS = {
    "llama-mha-untied": dict(arch="llama", num_heads=4, num_kv_heads=4, tie_word_embeddings=False),
    "llama-gqa-tied": dict(arch="llama", num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
    "qwen2-bias-gqa": dict(arch="qwen2", num_heads=4, num_kv_heads=1, tie_word_embeddings=False),
    "mistral-gqa": dict(arch="mistral", num_heads=8, num_kv_heads=2, hidden_size=128, tie_word_embeddings=False),
    "llama3-rope-scaling": dict(arch="llama", num_heads=4, num_kv_heads=2, rope_theta=500000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_tiny_model_greedy_matches_transformers(tmp_path, variant):
    path = make_tiny_model(tmp_path, vocab_size=512, **TINY_VARIANTS[variant])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", kv_cache_memory=KV)
    ps = prompts(512)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, out in zip(ps, outs):
        ref, logits = hf_greedy(hf, p, 24)
        assert len(out.outputs[0].token_ids) == 24
        assert_matches_reference(out.outputs[0].token_ids, ref, logits)
    llm.engine.core.check_idle_invariants()


@pytest.fixture(scope="module")
def smollm2_pair():
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory=KV)  # dequantized, as transformers
    return hf, llm


SMOL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Owls are birds that",
                "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.mark.slow
def test_smollm2_gguf_first_32_tokens_match_transformers(smollm2_pair):
    hf, llm = smollm2_pair
    outs = llm.generate(SMOL_PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    for out in outs:
        ref, logits = hf_greedy(hf, out.prompt_token_ids, 32)
        assert_matches_reference(out.outputs[0].token_ids, ref, logits)
    assert "Paris" in outs[0].outputs[0].text
    llm.engine.core.check_idle_invariants()
