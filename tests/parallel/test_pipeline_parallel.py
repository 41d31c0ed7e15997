"""Pipeline parallelism: stages holding contiguous layer ranges, a step's micro-batches flowing stage to stage,
give, greedy and float32, the output of one process token for token (chunked prefill, prefix caching, preemption,
n > 1, an untied LM head, uneven layer splits, 1 to 4 micro-batches); the stage split and each stage's checkpoint
slice; a stage that dies stops the engine."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.models.tiny import make_tiny_model
from tests.parallel.test_tensor_parallel import GREEDY, prompts, run
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import AddRequest
from tokenmill.engine.step_inputs import micro_batches
from tokenmill.errors import ConfigError, ParallelFailure
from tokenmill.model_config import ModelConfig
from tokenmill.parallel.layout import PPStage, StageCheckpoint
from tokenmill.sampling_params import SamplingParams


def core(model, pp: int, *, micro: int | None = None, chunk: int = 2048, num_blocks: int | None = None,
         headroom: float = 0.7, tp: int = 1) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model), dtype="float32", pipeline_parallel_size=pp, num_threads=1,
                                   tensor_parallel_size=tp,
                                   pipeline_micro_batches=micro,
                                   cache=CacheConfig(kv_cache_memory=4 << 20, block_size=4, num_blocks=num_blocks),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=chunk, new_token_ratio=headroom)))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("pp"), num_heads=4, num_kv_heads=2, vocab_size=256, num_layers=5,
                           tie_word_embeddings=False)


def same_as_one_process(model, pp: int, requests, **kw) -> EngineCore:
    ref = run(core(model, 1, **{k: v for k, v in kw.items() if k not in ("micro", "tp")}), requests)
    engine = core(model, pp, **kw)
    calls, seen = engine.runner.calls, []
    real = calls.forward
    calls.forward = lambda model, batches, caches: (seen.append(len(batches)), real(model, batches, caches))[1]
    try:
        assert run(engine, requests) == ref
    finally:
        engine.close()
    engine.micro_batches_seen = seen
    return engine


def test_stages_split_the_layers_later_ones_taking_the_remainder():
    cfg = ModelConfig("LlamaForCausalLM", 256, 64, 128, num_layers=30, num_heads=4, num_kv_heads=2, head_dim=16)
    assert [(s.start, s.end) for s in (PPStage.of(cfg, 4, i) for i in range(4))] == [(0, 7), (7, 14), (14, 22),
                                                                                      (22, 30)]
    weights = {f"model.layers.{i}.mlp.down_proj.weight": torch.full((1,), float(i)) for i in range(30)}
    weights |= {"model.embed_tokens.weight": torch.zeros(1), "model.norm.weight": torch.zeros(1)}
    second = StageCheckpoint(weights, PPStage.of(cfg, 4, 1))
    assert sorted(second) == sorted([f"model.layers.{i}.mlp.down_proj.weight" for i in range(7)]
                                    + ["model.norm.weight"])
    assert second["model.layers.0.mlp.down_proj.weight"].item() == 7.0  # renumbered from the stage's first
    assert "model.embed_tokens.weight" in StageCheckpoint(weights, PPStage.of(cfg, 4, 0))


def test_micro_batches_are_contiguous_runs_of_about_equal_tokens():
    class S:  # a scheduled request as micro_batches sees it
        def __init__(self, n):
            self.num_new_tokens = n
    steps = [S(n) for n in (1, 1, 1, 1, 100, 1, 1, 1)]
    whole = micro_batches(steps, 4, split_chunks=False)
    assert [s for run_ in whole for s, _, _ in run_] == steps and len(whole) <= 4
    assert all(offset == 0 and n == s.num_new_tokens for run_ in whole for s, offset, n in run_)
    cut = micro_batches(steps, 4, split_chunks=True)  # the 100-token chunk is cut: runs of ~27 tokens
    assert len(cut) == 3  # 107 tokens make at most 3 runs of >= 32
    assert [sum(n for _, _, n in r) for r in cut] == [36, 35, 36]
    pieces = [(offset, n) for r in cut for s, offset, n in r if s is steps[4]]
    assert pieces == [(0, 32), (32, 35), (67, 33)]  # in order, covering the chunk exactly
    assert [[(o, n) for _, o, n in r] for r in micro_batches(steps[4:5], 4, split_chunks=True)] == [
        [(0, 33)], [(33, 34)], [(67, 33)]]  # one 100-token chunk: 3 runs (of >= 32 tokens)
    assert [[(o, n) for _, o, n in r] for r in micro_batches([S(512)], 4, split_chunks=True)] == [
        [(0, 128)], [(128, 128)], [(256, 128)], [(384, 128)]]
    assert len(micro_batches(steps[:1], 4, split_chunks=True)) == 1


def test_too_many_stages_are_refused(model):
    with pytest.raises(ConfigError, match="exceeds the model's 5 layers"):
        core(model, 6)


@pytest.mark.parametrize("pp,micro,chunk", [(2, None, 16), (3, 1, 256), (3, 4, 256), (2, 4, 64)])
def test_stages_give_one_process_output_with_chunks_prefix_hits_and_samples(model, pp, micro, chunk):
    shared = prompts(1, (40,), seed=1)[0]
    requests = {f"g{i}": (p, GREEDY) for i, p in enumerate(prompts(4))}
    requests |= {f"s{i}": (shared + [7 + i], GREEDY) for i in range(2)}
    requests |= {f"n#{i}": (shared, SamplingParams(max_tokens=8, temperature=1.0, seed=3 + i, ignore_eos=True))
                 for i in range(2)}
    engine = same_as_one_process(model, pp, requests, micro=micro, chunk=chunk)
    most = max(engine.micro_batches_seen)
    assert most == (min(micro, chunk // 32) if micro else 1)  # prompts' chunks cut into that many runs


def test_tensor_parallel_stages_two_by_two(model, tmp_path):
    """Both at once: 2 stages of 2 tensor-parallel ranks (4 processes), tied and untied LM heads."""
    tied = make_tiny_model(tmp_path, num_heads=4, num_kv_heads=2, vocab_size=256, num_layers=5)
    for m in (model, tied):
        requests = {f"g{i}": (p, GREEDY) for i, p in enumerate(prompts(4))}
        engine = same_as_one_process(m, 2, requests, tp=2, micro=2, chunk=64)
        assert max(engine.micro_batches_seen) == 2
    engine = core(model, 2, tp=2)
    try:
        summary = engine.startup_summary()
        assert "tensor parallel: 2 ranks" in summary and "pipeline parallel: 2 stages, layers 0-1 | 2-4" in summary
        assert engine.cache_info.kv_bytes_per_token == 3 * 2 * 1 * 16 * 4  # 3 layers x K,V x 1 KV head x 16 x fp32
    finally:
        engine.close()


def test_stages_preempt_and_recompute_to_the_same_output(model):
    requests = {f"r{i}": (p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts(3, (30,), seed=2))}
    engine = same_as_one_process(model, 2, requests, num_blocks=40, headroom=0.0)
    assert engine.scheduler.num_preemptions > 0


def test_a_stage_that_dies_stops_the_engine(model):
    engine = core(model, 2, chunk=8)
    try:
        engine.add_request(AddRequest("r", prompts(1, (200,))[0], GREEDY, 12, frozenset(), time.monotonic()))
        engine.step()
        os.kill(engine.executor.ranks.procs[0].pid, signal.SIGKILL)
        engine.executor.ranks.procs[0].wait(10)
        with pytest.raises(ParallelFailure):
            engine.check_health()
        with pytest.raises(ParallelFailure, match="out of step"):
            for _ in range(100):
                engine.step()
    finally:
        engine.executor.ranks.kill()


@pytest.mark.slow
def test_smollm2_on_two_stages_gives_one_process_greedy_output():
    from tokenmill.model.loader import default_model_path
    from tokenmill.tokenizer import Tokenizer

    tok = Tokenizer.load(default_model_path())
    requests = {f"r{i}": (tok.encode(t), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
                for i, t in enumerate(["The capital of France is", "Write a haiku about the sea."])}

    def engine(pp: int) -> EngineCore:
        return EngineCore(EngineConfig(dtype="float32", quantization="none", pipeline_parallel_size=pp, num_threads=1,
                                       cache=CacheConfig(kv_cache_memory=64 << 20)))
    ref = run(engine(1), requests)
    pp2 = engine(2)
    try:
        assert "layers 0-14 | 15-29" in pp2.startup_summary()
        assert run(pp2, requests) == ref
    finally:
        pp2.close()


def test_smollm3_nope_layers_keep_their_place_across_stages(tmp_path):
    """SmolLM3's layer 3 of 4 has no rotary: on two stages (layers 0-1 and 2-3) the second stage's first layer is
    model layer 2, and its NoPE layer still the model's layer 3."""
    from tests.model.test_families import VARIANTS

    model = make_tiny_model(tmp_path, **{**VARIANTS["smollm3"], "vocab_size": 256})
    requests = {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts(3, lengths=(5, 37, 45)))}
    same_as_one_process(model, 2, requests, micro=2, chunk=16)


def test_gemma3_layer_types_keep_their_place_across_stages(tmp_path):
    """Gemma 3 with three local layers, then three global ones, on two stages of three layers: the second stage's
    layers are global (no window, the global rotary base), not the first three of the model's list. The prompt
    tokens' logprobs are compared: a tiny Gemma's greedy tokens hardly depend on its layers."""
    from tests.model.test_gemma3 import VARIANTS
    from tests.parallel.test_tensor_parallel import prompt_logprobs

    spec = {**VARIANTS["gemma3-layers"], "layer_types": ["sliding_attention"] * 3 + ["full_attention"] * 3}
    model = make_tiny_model(tmp_path, arch="gemma3", num_layers=6, rope_theta=1e6, vocab_size=256, **spec)
    batch = prompts(3, lengths=(5, 37, 45))
    ref = prompt_logprobs(core(model, 1, chunk=16), batch)
    engine = core(model, 2, micro=2, chunk=16)
    try:
        for ours, theirs in zip(prompt_logprobs(engine, batch), ref):
            assert ours == pytest.approx(theirs, abs=1e-5)
    finally:
        engine.close()
