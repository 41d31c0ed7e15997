"""In float32 one request's greedy output does not depend on what else runs: alone, in a batch of 16
mixed-length requests, under chunk sizes 16/64/512, after preemption; the pool ends whole every time."""

import pytest
import torch

from tests.greedy import assert_same_greedy
from tests.models.tiny import make_tiny_model
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("inv"), arch="llama", num_heads=4, num_kv_heads=2,
                           num_layers=3, vocab_size=1024)


def batch_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = [90, 3, 17, 64, 150, 1, 33, 48, 120, 5, 16, 81, 29, 200, 9, 57]
    return [torch.randint(3, 1024, (n,), generator=g).tolist() for n in lengths]


def run(model_dir, prompts, **engine_kw):
    llm = LLM(str(model_dir), dtype="float32", **({"kv_cache_memory": 32 << 20} | engine_kw))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    llm.engine.core.check_idle_invariants()
    return llm, [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def alone(model_dir):
    """Each request run by itself with a large chunk size: the reference."""
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=32 << 20, max_num_batched_tokens=512)
    return [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0] for p in batch_prompts()]


@pytest.mark.parametrize("chunk", [16, 64, 512])
def test_batched_and_chunked_output_equals_alone(model_dir, alone, chunk):
    llm, outs = run(model_dir, batch_prompts(), max_num_batched_tokens=chunk)
    # batches of 16 decodes run the oneDNN prepacked matmuls, the reference's single rows the skinny GEMV
    assert llm.engine.core.runner.prepacked == torch.backends.mkldnn.is_available()
    for ref, out in zip(alone, outs):
        assert len(out.token_ids) == 40
        assert_same_greedy(ref, out)


def test_preempted_and_resumed_output_equals_alone(model_dir, alone):
    # 3 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes = 768 bytes/token; 40 blocks of 16 = 640 tokens,
    # far below the ~1,500 the batch needs at once, so requests are preempted and recomputed.
    llm, outs = run(model_dir, batch_prompts(), kv_cache_memory=40 * 16 * 768, max_num_batched_tokens=64)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for ref, out in zip(alone, outs):
        assert_same_greedy(ref, out)
