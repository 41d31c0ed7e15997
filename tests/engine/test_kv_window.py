"""The hybrid KV layout (engine/kv_layout.py, engine/window_pages.py): which layer reads which page through which
table; a request holds only its window's window pages while the scheduler runs it; prefix hits take the window
pages they need (and are shortened where those were reclaimed); every page back in the pool at the end. Driven
through the Scheduler without a model; tests/model/test_kv_window_model.py runs a real (tiny) Gemma 3 on it."""

import random
from collections import Counter

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.kv_layout import KVLayout
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.step_types import SampledTokens
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

WINDOW, BS = 8, 4
# three layers: two window layers (one page slot, tables 1 and 2) and one full-attention layer (table 0)
LAYOUT = KVLayout.for_model(3, [0, 1], WINDOW, BS, max_model_len=1000)


def gemma3_sliding(num_layers: int) -> list[int]:
    return [i for i in range(num_layers) if (i + 1) % 6]


def test_gemma3_270m_layout():
    layout = KVLayout.for_model(18, gemma3_sliding(18), 512, 16, max_model_len=32768)
    assert layout.hybrid and (layout.num_slots, layout.num_window_tables, layout.pages_per_block) == (3, 5, 6)
    assert [(layout.layer_slots[i], layout.layer_tables[i]) for i in (5, 11, 17)] == [(0, 0), (1, 0), (2, 0)]
    # no two layers share a cache tensor through the same table: each writes its own slots
    assert len(set(zip(layout.layer_slots, layout.layer_tables))) == 18
    # a 600-token window of Gemma 3 1B's 26 layers (4 global): slots of 4, 22 window layers in 6 tables
    layout = KVLayout.for_model(26, gemma3_sliding(26), 512, 16, max_model_len=32768)
    assert (layout.num_slots, layout.num_window_tables) == (4, 6)
    assert len(set(zip(layout.layer_slots, layout.layer_tables))) == 26


def test_uniform_where_a_hybrid_layout_saves_nothing():
    assert not KVLayout.for_model(18, gemma3_sliding(18), 512, 16, max_model_len=512).hybrid  # window >= longest
    assert not KVLayout.for_model(4, [0], 8, 4, max_model_len=100).hybrid  # fewer window layers than full ones
    assert not KVLayout.for_model(4, [], None, 4, max_model_len=100).hybrid
    assert not KVLayout.for_model(4, [0, 1, 2, 3], 8, 4, max_model_len=100).hybrid  # no full layer to page by


def test_first_window_block_and_capacity():
    # a token at position p sees keys p - 7 .. p: from position 11 on, block 0 (tokens 0-3) is never read again
    assert [LAYOUT.first_window_block(n) for n in (0, 10, 11, 14, 15)] == [0, 0, 1, 1, 2]
    # a request of one block's window pages per window block and chunk, and its full pages, fits the pool
    span = LAYOUT.window_span_blocks(max_chunk=4)  # keys 7 back, plus 4 new tokens: 3 blocks, straddling: 4
    assert span == 4
    assert LAYOUT.token_capacity(100, max_chunk=4) == (100 - 2 * 4) * BS
    assert LAYOUT.token_capacity(9, max_chunk=64) == 9 // 3 * BS  # a chunk wider than the pool: all blocks at once


def request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens), max_tokens,
                   frozenset({3}))


def scheduler(num_pages=120, prefix_caching=True, **cfg) -> Scheduler:
    cfg.setdefault("max_num_batched_tokens", 8)
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_pages, BS, prefix_caching, LAYOUT))


def check_pages(sched: Scheduler) -> None:
    """Each page's ref count is the number of requests holding it (full pages and window pages alike); a running
    request holds window pages exactly for its blocks from its first unreleased one, never for one a later token
    no longer reads; free, idle-cached and held pages partition the pool."""
    kv = sched.kv
    holders = Counter()
    for r in sched.running:
        assert len(r.window_pages) == len(r.block_ids)
        first = LAYOUT.first_window_block(r.num_computed_tokens)
        assert r.num_window_released == min(first, len(r.block_ids)) or r.num_computed_tokens == 0
        for b, pages in enumerate(r.window_pages):
            assert (pages is None) == (b < r.num_window_released), (r.request_id, b)
        holders.update(r.block_ids)
        holders.update(p for pages in r.window_pages if pages is not None for p in pages)
    for p in range(kv.pool.num_blocks):
        assert kv.pool.ref_counts[p] == holders[p], f"page {p}: ref {kv.pool.ref_counts[p]}, held by {holders[p]}"
    idle = sum(1 for p in range(kv.pool.num_blocks) if kv.pool.cached[p] and not holders[p])
    assert kv.pool.num_free_blocks + idle + len(holders) == kv.pool.num_blocks
    if kv.tree is not None:
        kv.tree.check()
        assert idle == kv.tree.evictable_blocks + kv.window.num_idle_pages


def step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sched.update(out, {s.request.request_id: SampledTokens([token]) for s in out.scheduled if s.samples_next_token})
    check_pages(sched)
    return out


def run_all(sched: Scheduler) -> None:
    while sched.has_unfinished:
        step(sched)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_long_request_holds_only_its_window(prefix_caching):
    sched = scheduler(prefix_caching=prefix_caching)
    a = request("a", list(range(100, 140)), max_tokens=30)  # 40 prompt tokens in chunks of 8, then 30 decodes
    sched.add_request(a)
    most = 0
    while sched.has_unfinished:
        step(sched)
        held = sum(1 for pages in a.window_pages if pages is not None)
        assert held <= LAYOUT.window_span_blocks(8)
        most = max(most, held)
    assert most >= 3  # it did hold a window's worth
    # the uniform layout would have held 18 blocks of 3 layers at the end: 54 pages
    sched.kv.check_idle()


def test_held_pages_are_the_window_and_the_full_pages():
    sched = scheduler(prefix_caching=False)
    a = request("a", list(range(100, 132)), max_tokens=20)
    sched.add_request(a)
    for _ in range(10):  # 32 prompt tokens in 4 chunks of 8, then 6 decodes: 38 computed
        step(sched)
    assert a.num_computed_tokens == 38
    # 10 blocks of full pages; window pages for blocks 7 (tokens 28-31: position 38 reads from 31) to 9
    assert [b for b, pages in enumerate(a.window_pages) if pages is not None] == [7, 8, 9]
    assert sched.kv.pool.num_blocks - sched.kv.pool.num_free_blocks == 10 + 3 * 2
    run_all(sched)
    sched.kv.check_idle()


def test_a_prefix_hit_takes_the_window_pages_at_its_end():
    sched = scheduler()
    prompt = list(range(100, 130))  # 30 tokens
    a = request("a", prompt, max_tokens=2)
    sched.add_request(a)
    run_all(sched)  # its blocks cached, each with its window pages (idle now)
    b = request("b", prompt + [1, 2, 3])
    sched.add_request(b)
    out = sched.schedule()  # admitted: the hit, before its first step
    # 31 tokens computed by a (30 + 1 fed back; its last block partial): 7 whole blocks = 28 tokens hit
    assert b.num_cached_tokens == b.num_computed_tokens == 28
    assert b.num_window_released == LAYOUT.first_window_block(28) == 5
    assert b.window_pages[:5] == [None] * 5 and all(p is not None for p in b.window_pages[5:])
    cached = sched.kv.window._cached
    assert b.window_pages[5:7] == [cached[b.block_ids[5]], cached[b.block_ids[6]]]  # a's, shared
    sched.update(out, {"b": SampledTokens([7])})
    check_pages(sched)
    run_all(sched)
    sched.kv.check_idle()


def test_a_hit_whose_window_pages_were_reclaimed_is_shortened():
    sched = scheduler()
    prompt = list(range(100, 140))
    sched.add_request(request("a", prompt, max_tokens=2))
    run_all(sched)
    kv = sched.kv
    # reclaim the window pages of blocks 1, 4 and 5: a hit ending at 24 or 20 tokens cannot take its window
    tree_blocks = kv.tree.match(prompt).blocks
    for full in (tree_blocks[5], tree_blocks[4], tree_blocks[1]):
        kv.window._idle.move_to_end(full, last=False)
    assert kv.window.reclaim(6) == 6
    b = request("b", prompt[:24] + [1, 2, 3, 4, 5])  # would hit 24 tokens (6 blocks) if the window were there
    assert kv.cached_prefix_len(b) == 16  # 4 blocks: the window at their end (blocks 2, 3) still cached
    sched.add_request(b)
    step(sched)
    assert b.num_cached_tokens == 16
    run_all(sched)
    kv.check_idle()


def test_random_traffic_on_a_small_pool_never_leaks():
    """Shared prefixes, preemptions (the pool is small) and reclaiming, with the page accounting checked after
    every step."""
    rng = random.Random(0)
    sched = scheduler(num_pages=60, max_num_batched_tokens=12)
    system = list(range(200, 216))
    for i in range(40):
        prompt = (system if rng.random() < 0.6 else []) + [rng.randrange(10, 90) for _ in range(rng.randrange(1, 30))]
        sched.add_request(request(f"r{i}", prompt, max_tokens=rng.randrange(1, 25)))
        for _ in range(rng.randrange(0, 4)):
            step(sched, token=rng.randrange(10, 90))
    run_all(sched)
    assert sched.num_preemptions > 0 and sched.kv.prefix_stats.evicted_blocks > 0
    sched.kv.check_idle()
