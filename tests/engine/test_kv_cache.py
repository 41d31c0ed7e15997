"""KVCacheManager with prefix caching, driven through the Scheduler without a model: hits, sharing, ref counts,
eviction, salts, longest-prefix-first admission and its starvation bound."""

import random
from collections import Counter

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.policy import LPM_MAX_SKIPS
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.step_types import SampledTokens
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


def request(rid: str, prompt: list[int], max_tokens: int = 4, salt: str | None = None, eos: int = 3) -> Request:
    return Request(rid, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens), max_tokens,
                   frozenset({eos}), cache_salt=salt)


def scheduler(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    return Scheduler(SchedulerConfig(**cfg), kv)


def step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sampled = {s.request.request_id: SampledTokens([token]) for s in out.scheduled if s.samples_next_token}
    sched.update(out, sampled)
    check_accounting(sched)
    return out


def run_all(sched: Scheduler, token: int = 7) -> None:
    while sched.has_unfinished:
        step(sched, token)


def check_accounting(sched: Scheduler) -> None:
    """Every block's ref count is the number of requests holding it; free, idle-cached and held blocks
    partition the pool; waiting requests hold nothing."""
    kv = sched.kv
    holders = Counter(b for r in sched.running for b in r.block_ids)
    for b in range(kv.pool.num_blocks):
        assert kv.pool.ref_counts[b] == holders[b], f"block {b}: ref {kv.pool.ref_counts[b]} held by {holders[b]}"
    for r in sched.running:
        assert len(set(r.block_ids)) == len(r.block_ids)
    for r in sched.waiting:
        assert r.block_ids == [] and r.cache_node is None
    kv.tree.check()
    idle_cached = [b for b in kv.tree.block_ids() if not holders[b]]
    assert len(idle_cached) == kv.tree.evictable_blocks
    assert kv.pool.num_free_blocks + len(idle_cached) + len(holders) == kv.pool.num_blocks


def test_a_second_request_takes_the_cached_prefix_and_shares_its_blocks():
    sched = scheduler()
    system = list(range(100, 110))  # 10 tokens: two full blocks of 4 and a partial one
    a = request("a", system + [1, 2], max_tokens=20)
    sched.add_request(a)
    step(sched)  # a's prompt computed: blocks 0-2 full and cached
    b = request("b", system + [5, 6, 7])
    sched.add_request(b)
    out = step(sched)
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert [s.num_new_tokens for s in out.scheduled if s.request is b] == [13 - 8]
    assert sched.kv.pool.ref_counts[a.block_ids[0]] == 2
    stats = sched.kv.prefix_cache_stats()
    assert stats.queries == 12 + 13 and stats.hits == 8
    run_all(sched)
    sched.kv.check_idle()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched = scheduler()
    prompt = list(range(100, 108))  # exactly two blocks
    sched.add_request(request("a", prompt))
    run_all(sched)
    b = request("b", prompt)
    sched.add_request(b)
    out = step(sched)
    assert b.num_cached_tokens == 4  # the last block is recomputed, never written while shared
    assert [s.num_new_tokens for s in out.scheduled] == [4]
    run_all(sched)
    sched.kv.check_idle()


def test_generated_tokens_are_cached_too_for_the_next_turn():
    sched = scheduler()
    a = request("a", list(range(100, 106)), max_tokens=10)
    sched.add_request(a)
    run_all(sched)
    turn2 = a.prompt_token_ids + a.output_token_ids + [50, 51, 52]
    b = request("b", turn2)
    sched.add_request(b)
    step(sched)
    assert b.num_cached_tokens == 12  # prompt 6 + 9 computed outputs = 15 -> 3 whole blocks
    run_all(sched)
    sched.kv.check_idle()


def test_identical_prompts_arriving_together_compute_the_prefix_once():
    sched = scheduler(max_num_batched_tokens=8)
    prompt = list(range(100, 130))  # 30 tokens: chunked over several steps
    reqs = [request(f"r{i}", prompt) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    computed = 0
    while sched.has_unfinished:
        out = step(sched)
        computed += sum(s.num_new_tokens for s in out.scheduled if s.request.num_output_tokens == 0
                        or s.num_new_tokens > 1)
    assert [r.num_cached_tokens for r in reqs] == [0, 28, 28, 28]
    assert computed == 30 + 3 * 2  # the others only compute what follows the last whole block
    sched.kv.check_idle()


def test_duplicate_blocks_computed_concurrently_collapse_onto_the_cached_one():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    a, b = request("a", list(range(100, 109))), request("b", list(range(100, 109)))
    for r in (a, b):
        assert kv.admit(r, kv.match(r), 9)
        r.num_computed_tokens = 9
    kv.cache_blocks(a)
    own = b.block_ids[:2]
    kv.cache_blocks(b)
    assert b.block_ids[:2] == a.block_ids[:2] and kv.pool.ref_counts[a.block_ids[0]] == 2
    assert all(kv.pool.ref_counts[x] == 0 and not kv.pool.cached[x] for x in own)
    kv.free(a)
    kv.free(b)
    kv.free(b)
    kv.check_idle()


def test_different_salts_never_share():
    sched = scheduler()
    prompt = list(range(100, 120))
    a, b, c = request("a", prompt, salt="tenant-1"), request("b", prompt, salt="tenant-2"), request("c", prompt)
    for r in (a, b, c):
        sched.add_request(r)
        run_all(sched)
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 0, 0)
    d = request("d", prompt, salt="tenant-1")
    sched.add_request(d)
    step(sched)
    assert d.num_cached_tokens == 16
    run_all(sched)
    sched.kv.check_idle()


def test_eviction_under_memory_pressure_keeps_requests_running():
    sched = scheduler(num_blocks=12, block_size=4, max_num_seqs=2)
    rng = random.Random(0)
    for i in range(30):
        sched.add_request(request(f"r{i}", [rng.randint(10, 99) for _ in range(rng.randint(5, 20))], max_tokens=6))
    run_all(sched)
    stats = sched.kv.prefix_cache_stats()
    assert stats.evicted_blocks > 0 and stats.cached_blocks <= 12
    sched.kv.check_idle()


def test_waiting_requests_with_the_longest_cached_prefix_go_first():
    sched = scheduler(max_num_seqs=1)
    shared = list(range(100, 116))
    sched.add_request(request("warm", shared + [1]))
    run_all(sched)
    sched.add_request(request("cold", list(range(200, 217))))
    sched.add_request(request("hot", shared + [2]))
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["hot"]
    run_all(sched)
    sched.kv.check_idle()


def test_a_request_passed_over_too_often_is_served_next():
    sched = scheduler(max_num_seqs=1)
    shared = list(range(100, 116))
    sched.add_request(request("warm", shared + [1], max_tokens=1))
    run_all(sched)
    cold = request("cold", list(range(200, 217)), max_tokens=1)
    sched.add_request(cold)
    served = []
    for i in range(LPM_MAX_SKIPS + 3):
        sched.add_request(request(f"hot{i}", shared + [10 + i], max_tokens=1))
        out = step(sched)
        served += [s.request.request_id for s in out.scheduled]
        if cold.status is not RequestStatus.WAITING:
            break
    assert served[:LPM_MAX_SKIPS] == [f"hot{i}" for i in range(LPM_MAX_SKIPS)]
    assert "cold" in served and cold.num_skips == LPM_MAX_SKIPS
    run_all(sched)
    sched.kv.check_idle()


@pytest.mark.parametrize("seed", range(8))
def test_random_shared_prefix_workload_with_aborts_and_preemptions_ends_whole(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    sched = scheduler(num_blocks=rng.randint(16, 48), block_size=bs, max_num_seqs=rng.randint(1, 8),
                      max_num_batched_tokens=rng.randint(8, 64))
    capacity = sched.kv.pool.num_blocks * bs
    prefixes = [[rng.randint(10, 99) for _ in range(rng.randint(1, capacity // 3))] for _ in range(3)]
    added = 0
    for _ in range(400):
        if rng.random() < 0.3 and added < 60:
            prefix = rng.choice(prefixes)[:rng.randint(0, capacity // 3)]
            total = rng.randint(len(prefix) + 2, max(len(prefix) + 2, capacity))
            prompt = prefix + [rng.randint(10, 99) for _ in range(rng.randint(1, total - len(prefix) - 1))]
            sched.add_request(request(f"r{added}", prompt, max_tokens=total - len(prompt),
                                      salt=rng.choice([None, None, "s"])))
            added += 1
        if rng.random() < 0.05 and sched.requests:
            sched.abort(rng.choice(list(sched.requests)))
        step(sched, token=3 if rng.random() < 0.05 else 7)
    run_all(sched)
    sched.kv.check_idle()
    assert sched.kv.prefix_cache_stats().hits > 0
