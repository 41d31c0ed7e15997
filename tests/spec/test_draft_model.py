"""Draft-model speculation (spec/draft_model.py) on tiny models: greedy output identical to no speculation,
sampled output distributed as without it (a deliberately bad draft included), the KV pool whole afterwards, and
a draft the target cannot verify refused at start-up."""

import pytest
import torch

from tests.models.tiny import make_tiny_model
from tests.spec.test_rejection import chi2_pvalue
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import ConfigError
from tokenmill.sampling_params import SamplingParams

VOCAB = 256


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model(root, vocab_size=VOCAB, num_layers=2, seed=0)
    bad = make_tiny_model(root, vocab_size=VOCAB, num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
                          num_kv_heads=2, seed=7)  # unrelated random weights: a poor draft
    # the target's first layer and embedding (same seed, drawn in the same order), not its second layer: a draft
    # that often agrees, so both the acceptance and the residual paths run often
    near = make_tiny_model(root, vocab_size=VOCAB, num_layers=1, seed=0)
    other_vocab = make_tiny_model(root, vocab_size=VOCAB * 2, num_layers=1, seed=3)
    return {"target": str(target), "bad": str(bad), "near": str(near), "other_vocab": str(other_vocab)}


def engine(models, draft: str | None, k: int = 3, seed: int = 0, **sched) -> LLMEngine:
    spec = None if draft is None else {"model": models[draft], "num_speculative_tokens": k,
                                       "disable_by_batch_size": 1024}
    eng = LLMEngine(EngineConfig(model=models["target"], dtype="float32", speculative=spec, seed=seed,
                                 cache=CacheConfig(kv_cache_memory=8 << 20), scheduler=SchedulerConfig(**sched)))
    if eng.core.speculator is not None:
        eng.core.speculator.cost = None  # speculate whatever the measured step cost says: deterministic
    return eng


def run(eng: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    for i, (ids, p) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), {"prompt_token_ids": ids}, p)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    eng.core.check_idle_invariants()
    return [done[str(i)] for i in range(len(prompts))]


PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), [3] * 12, [100, 90, 80, 70]]


@pytest.mark.parametrize("draft", ["target", "bad"])
def test_greedy_output_is_the_targets_token_for_token(models, draft):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (24, 17, 30, 1)]
    reference = run(engine(models, None), PROMPTS, params)
    eng = engine(models, draft)
    assert run(eng, PROMPTS, params) == reference
    stats = eng.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    if draft == "target":  # a self-draft with the same weights agrees with every token
        assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_chunked_prefill_and_preemption_keep_greedy_output(models):
    params = [SamplingParams(temperature=0, max_tokens=40) for _ in PROMPTS]
    reference = run(engine(models, None), PROMPTS, params)
    # 8 tokens a step: prompts are chunked; 16 blocks of 16 tokens for 4 requests growing to ~80 tokens: preemption
    eng = LLMEngine(EngineConfig(model=models["target"], dtype="float32",
                                 speculative={"model": models["bad"], "num_speculative_tokens": 3,
                                              "disable_by_batch_size": 1024},
                                 cache=CacheConfig(num_blocks=16, block_size=8),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=8, new_token_ratio=0)))
    assert run(eng, PROMPTS, params) == reference
    assert eng.core.scheduler.num_preemptions > 0


def second_tokens(eng: LLMEngine, num: int) -> torch.Tensor:
    """The second sampled token over many unseeded requests (the first one the draft's proposals decide; unseeded
    requests are the ones verified by rejection sampling)."""
    params = [SamplingParams(temperature=1.5, top_k=20, max_tokens=3, ignore_eos=True) for _ in range(num)]
    outs = run(eng, [[5, 6, 7, 8]] * len(params), params)
    return torch.bincount(torch.tensor([o[1] for o in outs]), minlength=VOCAB).double()


def test_a_sampled_self_draft_is_always_accepted(models):
    """Draft = target: q equals p row for row (same positions, same temperature, top-k/p, min-p, penalties and
    min_tokens applied the same way), so min(1, p/q) = 1 for every draft: any misalignment would reject some."""
    eng = engine(models, "target", k=4)
    params = [SamplingParams(temperature=1.3, top_p=0.9, top_k=30, min_p=0.02, repetition_penalty=1.2,
                             presence_penalty=0.5, min_tokens=6, max_tokens=25) for _ in PROMPTS]
    run(eng, PROMPTS, params)
    stats = eng.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 40 and stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize("draft", ["near", "bad"])
def test_sampled_output_is_distributed_as_without_speculation(models, draft):
    plain = second_tokens(engine(models, None, max_num_seqs=256), 3000)
    spec_eng = engine(models, draft, seed=1, max_num_seqs=256)  # other engine seed: independent draws
    spec = second_tokens(spec_eng, 3000)
    stats = spec_eng.core.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both paths ran
    expected = (plain + spec) / 2  # two samples of one distribution: each against the pooled frequencies
    assert chi2_pvalue(spec, expected) > 0.01


def test_seeded_requests_sample_the_tokens_they_sample_without_speculation(models):
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20, seed=11 + i) for i in range(len(PROMPTS))]
    reference = run(engine(models, None), PROMPTS, params)
    eng = engine(models, "near")
    assert run(eng, PROMPTS, params) == reference
    assert eng.core.scheduler.spec_stats.num_accepted_tokens > 0


def test_unseeded_requests_are_reproducible_for_one_engine_seed(models):
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=20) for _ in PROMPTS]
    assert run(engine(models, "bad"), PROMPTS, params) == run(engine(models, "bad"), PROMPTS, params)


def test_a_draft_with_another_vocabulary_is_refused_at_start_up(models):
    with pytest.raises(ConfigError, match="vocabulary"):
        engine(models, "other_vocab")
