"""With a real (tiny) model: output with the prefix cache equals output without it, for shared system prompts,
multi-turn chats, n > 1 and prompts ending on and off block boundaries; eviction under memory pressure; salts."""

import pytest
import torch

from tests.greedy import assert_same_greedy
from tests.models.tiny import make_tiny_model
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
VOCAB = 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("prefix"), arch="llama", num_heads=4, num_kv_heads=2,
                           num_layers=3, vocab_size=VOCAB)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model_dir, cache: bool, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float32", enable_prefix_caching=cache, **({"kv_cache_memory": 16 << 20} | kw))


def generate(llm: LLM, prompts, params=GREEDY):
    return llm.generate([p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts], params,
                        use_tqdm=False)


def shared_prompt_workload() -> list[list[int]]:
    """Three system prompts (32 tokens: on a block boundary; 37 and 50: off), each with questions whose full
    prompts end on and off block boundaries (block size 16)."""
    systems = [tokens(32, 1), tokens(37, 2), tokens(50, 3)]
    prompts = []
    for i, system in enumerate(systems):
        for j, q in enumerate([1, 5, 16, 27]):
            prompts.append(system + tokens(q, 100 + 10 * i + j))
    return prompts


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = engine(model_dir, cache=False)
    outs = [o.outputs[0] for o in generate(llm, shared_prompt_workload())]
    assert llm.engine.core.kv.prefix_cache_stats().queries == 0
    return outs


@pytest.mark.parametrize("chunk", [16, 512])
def test_shared_system_prompts_same_output_less_prefill(model_dir, reference, chunk):
    llm = engine(model_dir, cache=True, max_num_batched_tokens=chunk)
    outs = [o.outputs[0] for o in generate(llm, shared_prompt_workload())]
    for ref, out in zip(reference, outs):
        assert_same_greedy(ref, out)
    core = llm.engine.core
    stats = core.kv.prefix_cache_stats()
    prompt_tokens = sum(map(len, shared_prompt_workload()))
    assert stats.hits >= 3 * (32 + 32 + 48)  # the other three questions of each system prompt hit its blocks
    assert core.scheduler.num_prefill_tokens_computed <= prompt_tokens - stats.hits
    core.check_idle_invariants()
    # a second round finds everything but the last partial block of each prompt in the cache
    again = [o.outputs[0] for o in generate(llm, shared_prompt_workload())]
    for ref, out in zip(reference, again):
        assert_same_greedy(ref, out)
    core.check_idle_invariants()


def test_multi_turn_chat_reuses_the_conversation(model_dir):
    convo = tokens(21, 7)
    runs = {}
    for cache in (False, True):
        llm = engine(model_dir, cache=cache)
        history, outs, hits = list(convo), [], []
        for turn in range(3):
            out = generate(llm, [history])[0]
            outs.append(out.outputs[0])
            hits.append(llm.engine.core.kv.prefix_cache_stats().hits)
            history = history + out.outputs[0].token_ids + tokens(9 + turn, 50 + turn)
        runs[cache] = outs, hits
        llm.engine.core.check_idle_invariants()
    for ref, out in zip(runs[False][0], runs[True][0]):
        assert_same_greedy(ref, out)
    hits = runs[True][1]
    # turn 2's prompt is turn 1's prompt + 24 outputs (+9): 44 computed tokens before it -> 2 whole blocks;
    # turn 3 adds turn 2's 54-token prompt + 24 outputs: 77 computed -> 4 whole blocks
    assert hits == [0, 32, 32 + 64]


def test_n_samples_share_the_prompt_blocks(model_dir):
    prompt = tokens(40, 11)
    params = SamplingParams(n=4, temperature=0.9, seed=5, max_tokens=16, ignore_eos=True)
    results = {}
    for cache in (False, True):
        llm = engine(model_dir, cache=cache)
        results[cache] = [o.token_ids for o in generate(llm, [prompt], params)[0].outputs]
        core = llm.engine.core
        if cache:
            assert core.kv.prefix_cache_stats().hits == 3 * 32  # samples 2-4 take the first's two whole blocks
            assert core.scheduler.num_prefill_tokens_computed == 40 + 3 * 8
        core.check_idle_invariants()
    assert results[True] == results[False]
    assert len({tuple(t) for t in results[True]}) > 1  # really n different samples


def test_eviction_under_memory_pressure_stays_correct(model_dir, reference):
    # 768 bytes per token (3 layers x 2 heads x 16 dims x K,V x 4 bytes): 20 blocks of 16 = 320 tokens, less
    # than the workload's prompts hold together, so cached blocks are evicted (and requests preempted).
    llm = engine(model_dir, cache=True, kv_cache_memory=20 * 16 * 768, max_num_seqs=4, max_num_batched_tokens=64)
    outs = [o.outputs[0] for o in generate(llm, shared_prompt_workload() * 2)]
    for ref, out in zip(reference * 2, outs):
        assert_same_greedy(ref, out)
    stats = llm.engine.core.kv.prefix_cache_stats()
    assert stats.evicted_blocks > 0 and stats.hits > 0
    llm.engine.core.check_idle_invariants()


def test_different_cache_salts_never_share(model_dir):
    llm = engine(model_dir, cache=True)
    prompt = tokens(48, 21)
    generate(llm, [{"prompt_token_ids": prompt, "cache_salt": "alice"}])
    generate(llm, [{"prompt_token_ids": prompt, "cache_salt": "bob"}, {"prompt_token_ids": prompt}])
    assert llm.engine.core.kv.prefix_cache_stats().hits == 0
    out = generate(llm, [{"prompt_token_ids": prompt, "cache_salt": "alice"}])[0]
    assert llm.engine.core.kv.prefix_cache_stats().hits == 32 and out.num_cached_tokens == 32
    with pytest.raises(Exception, match="cache_salt"):
        generate(llm, [{"prompt_token_ids": prompt, "cache_salt": ""}])
    llm.engine.core.check_idle_invariants()
