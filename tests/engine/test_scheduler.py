"""Scheduler + KV cache manager without a model: token budgets, chunking, preemption, block accounting."""

import random

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache import BlockPool, KVCacheManager
from tokenmill.engine.scheduler import Scheduler
from tokenmill.errors import ContextTooLong
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int, eos: int | None = None) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(rid, list(range(1, prompt_len + 1)), params, max_tokens,
                   frozenset() if eos is None else frozenset({eos}))


def run_step(sched: Scheduler, token=7):
    out = sched.schedule()
    sampled = {s.request.request_id: (token, None) for s in out.scheduled if s.samples}
    finished = sched.update(out, sampled)
    return out, finished


def check_blocks_match_tokens(sched: Scheduler) -> None:
    """Each running request holds exactly the blocks its computed tokens need, no block is held twice."""
    held = [b for r in sched.running for b in r.block_ids]
    assert len(held) == len(set(held))
    assert len(held) + sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    for r in sched.waiting:
        assert r.block_ids == []


def test_block_pool_double_free_is_caught():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(blocks)


def test_free_is_idempotent():
    kv = KVCacheManager(8, 4)
    req = make_request("a", 10, 4)
    assert kv.allocate_slots(req, 10)
    assert len(req.block_ids) == 3
    kv.free(req)
    kv.free(req)
    kv.pool.check_whole()


def test_chunked_prefill_respects_budget_and_decodes_share_the_batch():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), kv, max_model_len=256)
    sched.add_request(make_request("short", 3, 5))
    sched.add_request(make_request("long", 30, 5))
    out, _ = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("short", 3), ("long", 5)]
    out, _ = run_step(sched)
    # "short" decodes (1 token) while "long" continues its prompt in the same step
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("short", 1), ("long", 7)]
    assert out.num_tokens <= 8
    check_blocks_match_tokens(sched)


def test_request_that_can_never_fit_is_refused_with_the_limit_named():
    kv = KVCacheManager(4, 4)  # 16 tokens in the whole pool
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=1000)
    with pytest.raises(ContextTooLong, match="KV cache capacity of 16 tokens"):
        sched.add_request(make_request("big", 10, 10))
    with pytest.raises(ContextTooLong, match="context window of 1000"):
        Scheduler(SchedulerConfig(), KVCacheManager(1000, 4), 1000).add_request(make_request("x", 990, 20))
    assert not sched.has_unfinished


def test_preemption_frees_blocks_and_resumes_by_recompute():
    kv = KVCacheManager(6, 4)  # 24 tokens
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, max_model_len=64)
    a, b = make_request("a", 8, 8), make_request("b", 8, 8)
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    while sched.has_unfinished:
        out, _ = run_step(sched)
        preempted += [r.request_id for r in out.preempted]
        check_blocks_match_tokens(sched)
    assert preempted and preempted[0] == "b"  # the later arrival gives way
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert b.num_preemptions >= 1
    kv.pool.check_whole()


def test_static_policy_admits_no_one_until_the_batch_ends():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, policy="static"), kv, max_model_len=256)
    for rid, n in (("a", 1), ("b", 6), ("c", 1)):
        sched.add_request(make_request(rid, 4, n))
    seen_c_while_b_runs = False
    while sched.has_unfinished:
        out, _ = run_step(sched)
        ids = {s.request.request_id for s in out.scheduled}
        if "c" in ids and b_running(sched):
            seen_c_while_b_runs = True
    assert not seen_c_while_b_runs
    kv.pool.check_whole()


def b_running(sched):
    return any(r.request_id == "b" for r in sched.running)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_aborts_and_preemptions_leaves_the_pool_whole(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(rng.randint(12, 40), rng.choice([1, 4, 16]))
    sched = Scheduler(SchedulerConfig(max_num_seqs=rng.randint(1, 8), max_num_batched_tokens=rng.randint(8, 64)),
                      kv, max_model_len=10_000)
    capacity = kv.pool.num_blocks * kv.block_size
    n_added, preemptions = 0, 0
    for step in range(400):
        if rng.random() < 0.3 and n_added < 60:
            total = rng.randint(2, capacity)
            prompt = rng.randint(1, total - 1)
            sched.add_request(make_request(f"r{n_added}", prompt, total - prompt, eos=3))
            n_added += 1
        if rng.random() < 0.05 and sched.requests:
            victim = rng.choice(list(sched.requests))
            assert sched.abort(victim).status is RequestStatus.FINISHED_ABORTED
            assert sched.abort(victim) is None  # second abort is a no-op
        out, _ = run_step(sched, token=3 if rng.random() < 0.05 else 7)
        preemptions += len(out.preempted)
        check_blocks_match_tokens(sched)
    while sched.has_unfinished:
        preemptions += len(run_step(sched)[0].preempted)
        check_blocks_match_tokens(sched)
    kv.pool.check_whole()
    assert preemptions > 0, "the workload is meant to exercise preemption"
