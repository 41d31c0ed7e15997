"""One request's greedy output does not depend on what else runs: alone, in a batch of 16 mixed-length
requests, under chunk sizes 16/64/512, after preemption; the pool ends whole every time.

With --batch-invariant (the default): bit for bit, tokens and logprobs, in float32 and in bfloat16 (where the CPU has
AMX or AVX512-BF16, what `--dtype auto` picks there), since one matmul kernel serves every row count and every
token reads its context through the paged kernel. Without it: the same up to float32 near-ties (a decode of <= 4
rows and a batch run different matmul kernels; a prompt's first chunk runs SDPA, its later ones the paged kernel)."""

import pytest
import torch

from tests.greedy import assert_same_greedy
from tests.models.tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.model.cpu_kernels import _extension

_ops = _extension()
needs_bf16_kernel = pytest.mark.skipif(_ops is None or not _ops.bf16_kernel(),
                                       reason="this CPU has neither AMX nor AVX512-BF16: auto picks float32 here")
DTYPES = ["float32", pytest.param("bfloat16", marks=needs_bf16_kernel)]

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 32: bfloat16 attention then runs on AMX tiles where the CPU has them (csrc/amx_attention.cpp)
    return make_tiny_model(tmp_path_factory.mktemp("inv"), arch="llama", hidden_size=128, num_heads=4,
                           num_kv_heads=2, num_layers=3, vocab_size=1024)


def batch_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    lengths = [90, 3, 17, 64, 150, 1, 33, 48, 120, 5, 16, 81, 29, 200, 9, 57]
    return [torch.randint(3, 1024, (n,), generator=g).tolist() for n in lengths]


def run(model_dir, prompts, dtype, **engine_kw):
    llm = LLM(str(model_dir), dtype=dtype, **({"kv_cache_memory": 32 << 20} | engine_kw))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    llm.engine.core.check_idle_invariants()
    return llm, [o.outputs[0] for o in outs]


_alone: dict[tuple, list] = {}


def alone(model_dir, dtype, batch_invariant=True):
    """Each request run by itself with a large chunk size: the reference (computed once per setting)."""
    key = (dtype, batch_invariant)
    if key not in _alone:
        llm = LLM(str(model_dir), dtype=dtype, kv_cache_memory=32 << 20, max_num_batched_tokens=512,
                  batch_invariant=batch_invariant)
        _alone[key] = [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0]
                       for p in batch_prompts()]
    return _alone[key]


def assert_bitwise(refs, outs):
    for i, (ref, out) in enumerate(zip(refs, outs)):
        assert len(out.token_ids) == 40
        assert out.token_ids == ref.token_ids, f"request {i}"
        assert out.logprobs == ref.logprobs, f"request {i}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [16, 64, 512])
def test_batched_and_chunked_output_is_bitwise_alone(model_dir, dtype, chunk):
    llm, outs = run(model_dir, batch_prompts(), dtype, max_num_batched_tokens=chunk)
    assert llm.engine.core.runner.batch_invariant  # the default
    assert_bitwise(alone(model_dir, dtype), outs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_preempted_and_resumed_output_is_bitwise_alone(model_dir, dtype):
    # 3 layers x 2 KV heads x 16 dims x 2 (K, V) x 4 bytes = 768 bytes/token in float32 (384 in bfloat16); 40 blocks
    # of 16 = 640 tokens, far below the ~1,500 the batch needs at once, so requests are preempted and recomputed.
    per_token = 768 if dtype == "float32" else 384
    llm, outs = run(model_dir, batch_prompts(), dtype, kv_cache_memory=40 * 16 * per_token, max_num_batched_tokens=64,
                    new_token_ratio=0)  # no headroom for decode growth: admitted together, then preempted
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_bitwise(alone(model_dir, dtype), outs)


@pytest.mark.parametrize("chunk", [16, 512])
def test_without_batch_invariance_float32_agrees_up_to_near_ties(model_dir, chunk):
    """--no-batch-invariant runs the skinny GEMV / oneDNN pair and SDPA first chunks: still the same greedy
    tokens unless the top two were within float32 noise."""
    llm, outs = run(model_dir, batch_prompts(), "float32", max_num_batched_tokens=chunk, batch_invariant=False)
    assert not llm.engine.core.runner.batch_invariant
    assert llm.engine.core.runner.prepacked == torch.backends.mkldnn.is_available()
    for ref, out in zip(alone(model_dir, "float32", batch_invariant=False), outs):
        assert len(out.token_ids) == 40
        assert_same_greedy(ref, out)


@pytest.mark.slow
@needs_bf16_kernel
def test_real_model_bf16_greedy_is_the_same_among_32_concurrent_streams():
    """The case that failed before (issue 12): SmolLM2 in bfloat16, 32 concurrent copies of one prompt mixed
    with other prompts gave 1-6 of 32 different continuations from the same prompt run alone."""
    llm = LLM(dtype="bfloat16", kv_cache_memory=128 << 20)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    prompt = "Monday, Tuesday, Wednesday,"
    alone_out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    others = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 5, 8,"]
    batch = [prompt if i % 2 == 0 else others[i % len(others)] for i in range(64)]
    outs = [o.outputs[0] for o, p in zip(llm.generate(batch, params, use_tqdm=False), batch) if p == prompt]
    assert len(outs) == 32
    assert sum(o.token_ids != alone_out.token_ids for o in outs) == 0
    # bit for bit: the logprobs too, not only the argmax (which a small numeric difference rarely flips)
    assert sum(o.logprobs != alone_out.logprobs for o in outs) == 0
