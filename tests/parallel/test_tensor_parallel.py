"""Tensor parallelism end to end: N ranks over torch.distributed (gloo) give, greedy and float32, the output of one
process token for token, with chunked prefill, prefix caching, preemption and n > 1; KV heads split or
replicated; a vocabulary the ranks do not divide; SmolLM2 itself on 3 ranks (9 query heads, 3 KV heads). A rank
that dies stops the engine within seconds (ParallelFailure), never a hang."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from tests.models.tiny import make_tiny_model
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import AddRequest
from tokenmill.errors import ParallelFailure
from tokenmill.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def core(model, tp: int, *, chunk: int = 2048, num_blocks: int | None = None, prefix: bool = True,
         quantization: str | None = None, headroom: float = 0.7) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model), dtype="float32", tensor_parallel_size=tp, num_threads=1,
                                   quantization=quantization,
                                   cache=CacheConfig(kv_cache_memory=4 << 20, block_size=4, num_blocks=num_blocks,
                                                     enable_prefix_caching=prefix),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=chunk,
                                                             new_token_ratio=headroom)))


def run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(AddRequest(rid, prompt, params, params.max_tokens, frozenset(), time.monotonic()))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for o in engine.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.check_idle_invariants()
    return out


def prompts(n: int, lengths=(5, 37, 70), vocab: int = 256, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def same_as_one_process(model, tp: int, requests, **kw) -> None:
    ref_engine = core(model, 1, **kw)
    ref = run(ref_engine, requests)
    engine = core(model, tp, **kw)
    try:
        assert run(engine, requests) == ref
    finally:
        engine.close()
    return engine


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tp"), num_heads=4, num_kv_heads=2, vocab_size=256)


def test_two_ranks_give_one_process_output_with_chunks_prefix_hits_and_samples(gqa):
    shared = prompts(1, (40,), seed=1)[0]
    requests = {f"g{i}": (p, GREEDY) for i, p in enumerate(prompts(3))}
    requests |= {f"s{i}": (shared + [7 + i], GREEDY) for i in range(2)}  # the second hits the first's blocks
    requests |= {f"n#{i}": (shared, SamplingParams(max_tokens=8, temperature=1.0, seed=3 + i, ignore_eos=True))
                 for i in range(2)}
    same_as_one_process(gqa, 2, requests, chunk=16)


def test_two_ranks_preempt_and_recompute_to_the_same_output(gqa):
    requests = {f"r{i}": (p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts(3, (30,), seed=2))}
    engine = same_as_one_process(gqa, 2, requests, num_blocks=40, prefix=False, headroom=0.0)
    assert engine.scheduler.num_preemptions > 0


def test_two_ranks_over_gloo_alone_give_the_same_output(gqa, monkeypatch):
    """The collectives' other path: gloo for all (what ranks on several hosts use; here shared memory by default)."""
    monkeypatch.setenv("TOKENMILL_SHM_COLLECTIVES", "0")  # the worker ranks inherit it
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts(3))}
    ref = run(core(gqa, 1, chunk=16), requests)
    engine = core(gqa, 2, chunk=16)
    try:
        assert engine.executor.ranks.group.local is None
        assert run(engine, requests) == ref
    finally:
        engine.close()


def test_four_ranks_replicate_two_kv_heads(gqa):
    same_as_one_process(gqa, 4, {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts(2))})


def test_qwen2_biases_and_a_vocabulary_the_ranks_do_not_divide(tmp_path):
    model = make_tiny_model(tmp_path, arch="qwen2", num_heads=4, num_kv_heads=2, vocab_size=250,
                            tie_word_embeddings=False)
    same_as_one_process(model, 2, {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts(2, vocab=250))})


@pytest.mark.parametrize("family", ["qwen3", "phi4-mini", "smollm3"])
def test_the_model_families_shard_to_one_process_output(tmp_path, family):
    """Qwen3's per-head q/k norms, Phi-4-mini's fused checkpoint tensors with partial rotary and long-rope,
    SmolLM3's NoPE layers: each split over two ranks serves what one process serves."""
    from tests.model.test_families import VARIANTS

    model = make_tiny_model(tmp_path, **{**VARIANTS[family], "vocab_size": 256})
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts(3, lengths=(5, 37, 45)))}
    same_as_one_process(model, 2, requests, chunk=16)


def prompt_logprobs(engine: EngineCore, prompts_: list[list[int]]) -> list[list[float]]:
    """Each prompt token's logprob (after the first) as the engine scores it: a comparison finer than greedy tokens,
    for tiny models whose greedy output hardly depends on their layers (a tiny Gemma repeats its last token)."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    for i, p in enumerate(prompts_):
        engine.add_request(AddRequest(f"p{i}", p, params, 1, frozenset(), time.monotonic()))
    got: dict[str, list[float]] = {}
    while engine.has_unfinished:
        for o in engine.step().outputs:
            for lp in o.new_prompt_logprobs or []:
                got.setdefault(o.request_id, []).append(next(iter(lp.values())))  # the prompt token's own, first
    engine.check_idle_invariants()
    return [got[f"p{i}"] for i in range(len(prompts_))]


def test_gemma3_sliding_windows_shard_to_one_process_output(tmp_path):
    """Gemma 3's local layers (an 8-key window, prompts far longer) and its global layer, split over two ranks:
    the prompt tokens' logprobs as one process computes them (to float32 rounding of the split sums)."""
    from tests.model.test_gemma3 import VARIANTS

    model = make_tiny_model(tmp_path, arch="gemma3", num_layers=6, rope_theta=1e6, vocab_size=256,
                            **VARIANTS["gemma3"])
    batch = prompts(3, lengths=(5, 37, 45))
    ref = prompt_logprobs(core(model, 1, chunk=16), batch)
    engine = core(model, 2, chunk=16)
    try:
        for ours, theirs in zip(prompt_logprobs(engine, batch), ref):
            assert ours == pytest.approx(theirs, abs=1e-4)
    finally:
        engine.close()


def test_int8_weights_quantize_each_rank_shard(gqa):
    same_as_one_process(gqa, 2, {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts(2))}, quantization="int8")


def kill_process(rank) -> None:
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait(10)


def dying_rank_stops_the_engine(engine: EngineCore, kill=kill_process) -> None:
    """Mid-request, `kill` rank 1: the next steps fail with ParallelFailure within seconds, never a hang."""
    try:
        engine.add_request(AddRequest("r", prompts(1, (200,))[0], GREEDY, 12, frozenset(), time.monotonic()))
        engine.step()
        kill(engine.executor.ranks.procs[0])
        start = time.monotonic()
        with pytest.raises(ParallelFailure, match="out of step"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - start < 10
    finally:
        engine.executor.ranks.kill()


def test_a_rank_that_dies_mid_request_stops_the_engine_within_seconds(gqa):
    dying_rank_stops_the_engine(core(gqa, 2, chunk=8))


def test_layouts_are_checked_before_any_rank_starts(gqa):
    from tokenmill.errors import ConfigError

    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        core(gqa, 3)


def smollm2_requests() -> dict[str, tuple[list[int], SamplingParams]]:
    """Three prompts of the real model, 16 greedy tokens each."""
    from tokenmill.model.loader import default_model_path
    from tokenmill.tokenizer import Tokenizer

    tok = Tokenizer.load(default_model_path())
    texts = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"]
    return {f"r{i}": (tok.encode(t), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
            for i, t in enumerate(texts)}


def smollm2(**parallel) -> EngineCore:
    """SmolLM2 dequantized to float32 (where the ranks' partial sums give one process's tokens), one thread per
    rank."""
    return EngineCore(EngineConfig(dtype="float32", quantization="none", num_threads=1, cache=CacheConfig(kv_cache_memory=64 << 20),
                                   **parallel))


@pytest.mark.slow
def test_smollm2_on_three_ranks_gives_one_process_greedy_output():
    requests = smollm2_requests()
    ref = run(smollm2(), requests)
    tp3 = smollm2(tensor_parallel_size=3)
    try:
        assert "1 of 3 KV heads" in tp3.startup_summary()
        assert run(tp3, requests) == ref
        # `tokenmill plan --tp 3` and the engine agree per rank: KV bytes per token exactly, weights within the
        # norms every rank holds whole (the plan divides everything by 3)
        from tokenmill.cli import build_parser
        from tokenmill.plan import build_report

        plan = build_report(build_parser().parse_args(
            ["plan", "--gpu", "cpu", "--tp", "3", "--dtype", "fp32", "--kv-dtype", "fp32"])).plan
        assert tp3.cache_info.kv_bytes_per_token == plan.kv_bytes_per_token_per_gpu
        params = sum(p.numel() * p.element_size() for p in tp3.runner.model.parameters())
        assert abs(params - plan.weights_bytes_per_gpu) / plan.weights_bytes_per_gpu < 0.005
    finally:
        tp3.close()
