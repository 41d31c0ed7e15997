"""A tiny Gemma 3 on the hybrid KV layout (engine/kv_layout.py: window layers give back the pages that left their
5-key window) against the same model keeping every block (--disable-hybrid-kv-cache-manager): the same tokens and
logprobs, through chunked prefill, shared prefixes, a small pool that reuses released pages at once (and preempts),
multi-step decode and n-gram speculation; no page left held at the end."""

from __future__ import annotations

import random

import pytest

from tests.model.test_families import BACKENDS, make_llm
from tests.model.test_gemma3 import GLOBAL_EVERY_3
from tests.models.tiny import make_tiny_model
from tokenmill import SamplingParams

SPEC = dict(arch="gemma3", num_layers=6, rope_theta=1e6, num_heads=4, num_kv_heads=1, head_dim=32, sliding_window=5,
            query_pre_attn_scalar=24, vocab_size=512, layer_types=GLOBAL_EVERY_3)
ARGS = dict(block_size=4, max_num_batched_tokens=16, long_prefill_token_threshold=16)
# 40 pages of 2 layers x 4 tokens (2 KiB): the longest request (94 tokens: 24 full pages, and window pages for at
# most 6 blocks in 2 tables) fits alone; 16 at once do not (the uniform layout would need 144 KiB for it alone)
SMALL_POOL = 80 * 1024


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gemma3-window"), **SPEC)


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    system = [rng.randrange(10, 500) for _ in range(20)]
    out = []
    for i in range(16):
        own = [rng.randrange(10, 500) for _ in range(rng.randrange(3, 50))]
        out.append((system if i % 2 else []) + own)
    return out


def generate(model, backend, monkeypatch, hybrid: bool, num_prompts: int = 16, **kwargs):
    llm = make_llm(model, backend, monkeypatch, **ARGS, disable_hybrid_kv_cache_manager=not hybrid, **kwargs)
    assert llm.engine.core.kv.layout.hybrid is hybrid
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()[:num_prompts]], params, use_tqdm=False)
    llm.engine.core.check_idle_invariants()
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def assert_same(got, want, tol=1e-5):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        for mine, theirs in zip(logprobs, want_logprobs):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t] - theirs[t]) < tol for t in mine)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hybrid_layout_computes_what_the_uniform_one_does(gemma, backend, monkeypatch):
    _, want = generate(gemma, backend, monkeypatch, hybrid=False)
    llm, got = generate(gemma, backend, monkeypatch, hybrid=True)
    assert_same(got, want)
    layout = llm.engine.core.kv.layout
    assert (layout.num_slots, layout.num_window_tables) == (2, 2)
    assert len({t.data_ptr() for t, _ in llm.engine.core.runner.kv_caches}) == 2  # one cache per slot


def test_a_small_pool_reuses_released_pages_at_once(gemma, monkeypatch):
    """Pages that leave a window are taken by other requests the next step: a layer still reading one (a release
    too early) would read someone else's keys."""
    _, want = generate(gemma, "reference", monkeypatch, hybrid=False)
    llm, got = generate(gemma, "reference", monkeypatch, hybrid=True, kv_cache_memory=SMALL_POOL)
    # a preempted request recomputes in other batches, where the reference's float32 matmuls round otherwise
    assert_same(got, want, tol=1e-4)
    assert llm.engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("extra", [dict(num_scheduler_steps=4, num_prompts=4),  # a few decodes: runs of 4
                                   dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')])
def test_multi_step_and_speculation(gemma, monkeypatch, extra):
    _, want = generate(gemma, "reference", monkeypatch, hybrid=False, **extra)
    _, got = generate(gemma, "reference", monkeypatch, hybrid=True, **extra)
    assert_same(got, want)
