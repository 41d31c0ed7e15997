"""Scheduler + KV cache manager without a model: token budgets, chunking, preemption, block accounting."""

import random
from types import SimpleNamespace

import pytest

from tokenmill.config import SchedulerConfig
from tokenmill.engine.block_pool import BlockPool
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.step_cost import DECODE_STEP_FLOOR_S, StepCost
from tokenmill.engine.step_types import SampledTokens
from tokenmill.errors import ConfigError
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int, eos: int | None = None) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(rid, list(range(1, prompt_len + 1)), params, max_tokens,
                   frozenset() if eos is None else frozenset({eos}))


def run_step(sched: Scheduler, token=7):
    """One step whose sampler draws `token` (as many as a multi-step run's steps)."""
    out = sched.schedule()
    assert all(s.num_new_tokens > 0 for s in out.scheduled)
    sampled = {s.request.request_id: SampledTokens([token] * out.num_steps) for s in out.scheduled if s.samples_next_token}
    finished = sched.update(out, sampled)
    return out, finished


def check_blocks_match_tokens(sched: Scheduler) -> None:
    """Each running request holds exactly the blocks its computed tokens need, no block is held twice."""
    held = [b for r in sched.running for b in r.block_ids]
    assert len(held) == len(set(held))
    assert len(held) + sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    for r in sched.running:
        assert len(r.block_ids) == sched.kv.blocks_needed(r.num_computed_tokens), r.request_id
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
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), kv)
    sched.add_request(make_request("short", 3, 5))
    sched.add_request(make_request("long", 30, 5))
    out, _ = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("short", 3), ("long", 5)]
    out, _ = run_step(sched)
    # "short" decodes (1 token) while "long" continues its prompt in the same step
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("short", 1), ("long", 7)]
    assert out.num_tokens <= 8
    check_blocks_match_tokens(sched)


def test_prompt_tokens_beside_decodes_are_capped_when_asked():
    """--max-prefill-tokens-while-decoding: while requests decode, a step carries at most that many prompt tokens
    besides them; with nothing decoding (the first burst) the whole budget still goes to prompts."""
    kv = KVCacheManager(256, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_prefill_tokens_while_decoding=10), kv)
    for i in range(3):
        sched.add_request(make_request(f"d{i}", 4, 20))
    out, _ = run_step(sched)
    assert out.num_tokens == 12  # no one decodes yet: no cap
    sched.add_request(make_request("p", 40, 5))
    for _ in range(3):
        out, _ = run_step(sched)
        decodes = [s for s in out.scheduled if s.request.request_id.startswith("d")]
        assert [s.num_new_tokens for s in decodes] == [1, 1, 1]  # every decode still runs
        assert out.num_tokens - 3 <= 10
    check_blocks_match_tokens(sched)


class FixedCost:
    """A step cost model whose fit never changes (the engine's is fitted from measured steps)."""

    def __init__(self, cost: StepCost):
        self.fitted = cost


def drain_and_check_pool(sched: Scheduler) -> None:
    """Run every request to its end: the pool is whole again (no block leaked)."""
    while sched.has_unfinished:
        run_step(sched)
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks


def three_decodes_and_a_prompt(config: SchedulerConfig, cost: StepCost) -> Scheduler:
    """A scheduler whose step cost is `cost`, with three requests decoding and a 200-token prompt just queued."""
    sched = Scheduler(config, KVCacheManager(256, 4), step_cost=FixedCost(cost))
    for i in range(3):
        sched.add_request(make_request(f"d{i}", 4, 30))
    run_step(sched)
    sched.add_request(make_request("p", 200, 5))
    return sched


@pytest.mark.parametrize("slowdown", [3.0, 0.0])
def test_steps_beside_decodes_stay_within_the_slowdown(slowdown):
    """--max-decode-slowdown (default 3): while requests decode, a step with prompt tokens beside them is predicted
    to take at most that many times the decodes alone, times 1 + the prompts per decode (here one prompt beside
    three decodes: 4 x 28 ms, 14 prompt tokens at 6 ms each); every decode still runs and the prompt keeps moving.
    0 turns it off: the prompt's chunk is cut by tokens only."""
    cost = StepCost(fixed=0.010, per_token=0.006)
    sched = three_decodes_and_a_prompt(SchedulerConfig(max_num_batched_tokens=64, max_decode_slowdown=slowdown), cost)
    for _ in range(4):
        out, _ = run_step(sched)
        decodes = [s.num_new_tokens for s in out.scheduled if s.request.request_id.startswith("d")]
        assert decodes == [1, 1, 1]
        prompt = out.num_tokens - 3
        if slowdown:
            assert prompt == 14
            assert cost.seconds(out.num_tokens) <= slowdown * (1 + 1 / 3) * cost.seconds(3) + 1e-9
        else:
            assert prompt >= 16  # the long-prefill share (a quarter of the budget), not cut by step time
    check_blocks_match_tokens(sched)
    drain_and_check_pool(sched)


def test_a_wave_of_prompts_stretches_the_steps_beside_few_decodes():
    """The slowdown grows with the prompts per decode: one decode beside four waiting prompts may take 3 x (1 + 4)
    its own time, so a wave of arrivals is prefilled in long steps (a fixed 3x held 64 ShareGPT streams' TTFT p50
    at 10-13 s); as the prompts start decoding, the steps shrink back towards 3x."""
    cost = StepCost(fixed=0.010, per_token=0.002)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_decode_slowdown=3.0), KVCacheManager(512, 4),
                      step_cost=FixedCost(cost))
    sched.add_request(make_request("d", 4, 60))
    run_step(sched)
    for i in range(4):
        sched.add_request(make_request(f"p{i}", 30, 40))
    out, _ = run_step(sched)
    decode_alone = cost.seconds(1)
    assert 3 * decode_alone < cost.seconds(out.num_tokens) <= 15 * decode_alone + 1e-9
    assert out.num_tokens - 1 == int((15 * decode_alone - decode_alone) / cost.per_token + 1e-9)
    while any(r.num_tokens - r.num_computed_tokens > 1 for r in [*sched.running, *sched.waiting]):
        run_step(sched)  # every prompt is in: five decodes, nothing waiting
    out, _ = run_step(sched)
    assert out.num_tokens == 5 and len(sched.waiting) == 0
    sched.add_request(make_request("late", 100, 5))
    out, _ = run_step(sched)  # one prompt beside five decodes: 3 x 6/5 of the decodes' own step
    assert cost.seconds(out.num_tokens) <= 3 * (1 + 1 / 5) * cost.seconds(5) + 1e-9
    assert out.num_tokens - 5 == int((3.6 * cost.seconds(5) - cost.seconds(5)) / cost.per_token + 1e-9)
    drain_and_check_pool(sched)


def test_fast_decodes_still_leave_a_prompt_the_floor():
    """Decodes alone taking 13 ms would allow a 43 ms step at 2.5 x 4/3 (one prompt beside three decodes): the 50
    ms floor (DECODE_STEP_FLOOR_S) gives the prompt 37 ms, so one or two quick streams do not starve a newcomer's
    prefill."""
    cost = StepCost(fixed=0.010, per_token=0.001)
    sched = three_decodes_and_a_prompt(SchedulerConfig(max_num_batched_tokens=64, max_decode_slowdown=2.5), cost)
    out, _ = run_step(sched)
    assert out.num_tokens - 3 == round((DECODE_STEP_FLOOR_S - cost.seconds(3)) / cost.per_token)
    drain_and_check_pool(sched)


def test_preemption_frees_blocks_and_resumes_by_recompute():
    kv = KVCacheManager(6, 4)  # 24 tokens
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, new_token_ratio=0), kv)  # no headroom kept
    a, b = make_request("a", 8, 8), make_request("b", 8, 8)
    sched.add_request(a)
    sched.add_request(b)
    preempted, requeued = [], []
    while sched.has_unfinished:
        out, _ = run_step(sched)
        preempted += [r.request_id for r in out.preempted]
        check_blocks_match_tokens(sched)
        stats = sched.stats()  # the waiting that ran before: what only the engine can count (num_waiting)
        again = [r for r in sched.waiting if r.num_preemptions]
        assert (stats.num_requeued, stats.num_requeued_tokens) == (len(again), sum(r.num_tokens for r in again))
        requeued.append(stats.num_requeued)
    assert preempted and preempted[0] == "b"  # the later arrival gives way
    assert max(requeued) == 1 and requeued[-1] == 0
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert b.num_preemptions >= 1
    kv.pool.check_whole()


def test_static_policy_admits_no_one_until_the_batch_ends():
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, policy="static"), kv)
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


@pytest.mark.parametrize("steps", [1, 4])  # one decode a step; multi-step decode
@pytest.mark.parametrize("ratio", [0.0, 0.7])  # no headroom for decode growth (preempts more), the default
@pytest.mark.parametrize("threshold", [None, 1, 10_000])  # default, everything long, no sharing
@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_aborts_and_preemptions_leaves_the_pool_whole(seed, threshold, ratio, steps):
    rng = random.Random(seed)
    kv = KVCacheManager(rng.randint(12, 40), rng.choice([1, 4, 16]))
    sched = Scheduler(SchedulerConfig(max_num_seqs=rng.randint(1, 8), max_num_batched_tokens=rng.randint(8, 64),
                                      long_prefill_token_threshold=threshold, new_token_ratio=ratio), kv)
    sched.limit_runs(steps)
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
    assert preemptions > 0 or ratio, "the workload is meant to exercise preemption"


# ---- long prefills share the step ---------------------------------------------------------------------------------
def long_prefill_scheduler(threshold=None, num_blocks=1024, step_cost=None) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=512, long_prefill_token_threshold=threshold),
                     KVCacheManager(num_blocks, 16), step_cost=step_cost)


def chunks(out) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_a_short_request_behind_a_long_prefill_starts_in_the_next_step():
    sched = long_prefill_scheduler()  # threshold: a quarter of the 512-token budget
    long, short = make_request("long", 8000, 2), make_request("short", 5, 2)
    sched.add_request(long)
    assert chunks(run_step(sched)[0]) == [("long", 512)]
    sched.add_request(short)
    out, _ = run_step(sched)
    assert chunks(out) == [("long", 507), ("short", 5)]  # its whole prompt, and the rest of the step to "long"
    assert short.num_output_tokens == 1  # first token within one step
    out, finished = run_step(sched)
    assert chunks(out) == [("long", 511), ("short", 1)] and finished == [short]
    while sched.has_unfinished:
        run_step(sched)
        check_blocks_match_tokens(sched)
    sched.kv.check_idle()
    # a threshold of the whole budget is the unshared schedule: "short" waits for all 16 steps of "long"
    sched = long_prefill_scheduler(threshold=512)
    short = make_request("short", 5, 2)
    sched.add_request(make_request("long", 8000, 2))
    run_step(sched)
    sched.add_request(short)
    for _ in range(14):
        assert chunks(run_step(sched)[0]) == [("long", 512)]
    assert chunks(run_step(sched)[0]) == [("long", 320), ("short", 5)]


def test_a_mid_sized_prompt_behind_a_long_prefill_finishes_its_prompt_first():
    sched = long_prefill_scheduler()
    long, mid = make_request("long", 8000, 2), make_request("mid", 1200, 2)
    sched.add_request(long)
    run_step(sched)
    sched.add_request(mid)
    out, _ = run_step(sched)
    # "long" keeps its 128-token share, "mid" (shorter than what "long" has left) gets the rest: fewest left first
    assert chunks(out) == [("long", 128), ("mid", 384)]
    steps = 1
    while mid.num_output_tokens == 0:
        out, _ = run_step(sched)
        steps += 1
        assert out.num_tokens == 512 and dict(chunks(out))["long"] >= 128  # the oldest long prefill never starves
    assert steps == 4 and long.num_output_tokens == 0  # ceil(1200 / 384)
    while sched.has_unfinished:
        run_step(sched)
        check_blocks_match_tokens(sched)
    sched.kv.check_idle()


def test_a_long_prefill_goes_before_prompts_that_arrive_after_its_virtual_finish():
    """With a fitted step cost, long prefills go in order of arrival + their predicted prefill time: a mid-sized
    prompt arriving soon after a long one still goes first, one arriving after the long one would have finished
    alone waits its turn (fewest tokens left first would let a stream of such arrivals starve the long one)."""
    for delay, expected in ((1.0, [("long", 128), ("mid", 384)]), (9.0, [("long", 512)])):
        # "long" alone: 8 s
        sched = long_prefill_scheduler(step_cost=SimpleNamespace(fitted=StepCost(fixed=0.0, per_token=1e-3)))
        long, mid = make_request("long", 8000, 2), make_request("mid", 1200, 2)
        sched.add_request(long)
        run_step(sched)
        mid.arrival_time = long.arrival_time + delay  # its virtual finish: delay + 1.2 s, long's 8 s
        sched.add_request(mid)
        assert chunks(run_step(sched)[0]) == expected, delay
        while sched.has_unfinished:
            run_step(sched)
        sched.kv.check_idle()


def test_a_long_prompt_waiting_ahead_of_short_ones_does_not_take_the_whole_budget():
    sched = long_prefill_scheduler()
    for rid, n in (("long1", 8000), ("long2", 8000), ("long3", 8000), ("short1", 20), ("short2", 30)):
        sched.add_request(make_request(rid, n, 2))
    out, _ = run_step(sched)
    # one long prefill at a time takes the 128-token share, the short ones go in, the rest goes back to "long1"
    assert chunks(out) == [("long1", 462), ("short1", 20), ("short2", 30)]
    assert [r.request_id for r in sched.waiting] == ["long2", "long3"]
    check_blocks_match_tokens(sched)
    run_step(sched)  # no one admitted: no one overtaken
    assert [r.num_skips for r in sched.waiting] == [1, 1]
    # a long prompt passed over still gets what the others leave: two 300-token prompts (both over the 128-token
    # threshold) use the whole budget, as without sharing
    sched = long_prefill_scheduler()
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, 300, 2))
    assert chunks(run_step(sched)[0]) == [("a", 300), ("b", 212)]


def test_when_no_one_else_needs_it_a_long_prefill_gets_the_whole_budget():
    for threshold in (None, 16, 512):
        sched = long_prefill_scheduler(threshold)
        long = make_request("long", 8000, 2)
        sched.add_request(long)
        steps = 0
        while long.num_output_tokens == 0:
            out, _ = run_step(sched)
            steps += 1
            assert out.num_tokens == min(512, 8000 - 512 * (steps - 1))
        assert steps == 16  # ceil(8000 / 512), whatever the threshold
    # and with a short request beside it, no step leaves budget unused: it costs "long" only the tokens it took
    sched = long_prefill_scheduler()
    long, short = make_request("long", 8000, 2), make_request("short", 20, 3)
    sched.add_request(long)
    sched.add_request(short)
    steps = 0
    while long.num_output_tokens == 0:
        out, _ = run_step(sched)
        steps += 1
        assert out.num_tokens == 512 or long.num_output_tokens == 1
    assert short.status is RequestStatus.FINISHED_LENGTH and steps == 16  # ceil((8000 + 20 + 2) / 512)


def test_a_chunk_the_pool_cannot_grow_stays_capped_and_preempts_no_one():
    kv = KVCacheManager(8, 4)  # 32 tokens
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=8, new_token_ratio=0),
                      kv)  # no headroom kept: "long" is admitted though the pool cannot hold it and short's growth
    short, long = make_request("short", 8, 10), make_request("long", 28, 1)
    sched.add_request(short)
    run_step(sched)
    sched.add_request(long)
    out, _ = run_step(sched)
    # "long" gets its 8-token share (2 blocks); growing it to 28 tokens would need 5 more blocks, 3 are free
    assert chunks(out) == [("short", 1), ("long", 8)] and out.preempted == []
    check_blocks_match_tokens(sched)
    while sched.has_unfinished:
        run_step(sched)
        check_blocks_match_tokens(sched)
    assert short.num_output_tokens == 10 and long.num_output_tokens == 1
    kv.pool.check_whole()


def test_long_prefill_token_threshold_is_validated():
    with pytest.raises(ConfigError, match="--long-prefill-token-threshold must be >= 1"):
        SchedulerConfig(long_prefill_token_threshold=0)


# ---- multi-step decode ----------------------------------------------------------------------------------------------
def multi_step_scheduler(steps=4, num_blocks=64, block_size=4) -> Scheduler:
    sched = Scheduler(SchedulerConfig(), KVCacheManager(num_blocks, block_size))
    sched.limit_runs(steps)
    return sched


def test_plain_decodes_run_several_steps_with_their_slots_allocated():
    sched = multi_step_scheduler(steps=4)
    a, b = make_request("a", 5, 10), make_request("b", 3, 10)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = run_step(sched)  # the prompts: one step
    assert out.num_steps == 1
    out = sched.schedule()  # the first decodes: 4 steps, slots for 4 tokens each
    assert out.num_steps == 4 and [s.num_new_tokens for s in out.scheduled] == [1, 1]
    assert len(a.block_ids) == sched.kv.blocks_needed(5 + 4) and len(b.block_ids) == sched.kv.blocks_needed(3 + 4)
    sched.update(out, {"a": SampledTokens([7, 8, 9, 10]), "b": SampledTokens([7, 8, 9, 10])})
    # each token but the last was fed back: computed up to the last token, which the next step feeds
    assert a.output_token_ids == [7, 7, 8, 9, 10] and a.num_computed_tokens == a.num_tokens - 1 == 9
    check_blocks_match_tokens(sched)
    out, _ = run_step(sched)
    assert out.num_steps == 4 and a.num_output_tokens == 9
    out, _ = run_step(sched)  # one token left to write: one step
    assert out.num_steps == 1 and not sched.has_unfinished
    sched.kv.pool.check_whole()


def test_a_run_ends_at_the_token_that_stops_the_request():
    sched = multi_step_scheduler(steps=4)
    req = make_request("a", 5, 20, eos=2)
    sched.add_request(req)
    run_step(sched)
    out = sched.schedule()
    got = SampledTokens([7, 2, 8, 9])
    assert sched.update(out, {"a": got}) == [req]
    assert req.output_token_ids == [7, 7, 2] and got.token_ids == [7, 2]  # what came after the EOS is dropped
    assert req.status is RequestStatus.FINISHED_STOPPED
    sched.kv.pool.check_whole()


def test_a_run_cut_short_gives_back_the_slots_it_did_not_use():
    sched = multi_step_scheduler(steps=8, block_size=2)
    req = make_request("a", 4, 20)
    sched.add_request(req)
    run_step(sched)
    out = sched.schedule()
    assert out.num_steps == 8 and len(req.block_ids) == 6  # 4 + 8 tokens
    sched.update(out, {"a": SampledTokens([7, 8])})  # the runner stopped after 2 (its sampling failed)
    assert req.num_computed_tokens == 6 and req.num_tokens == 7
    assert len(req.block_ids) == sched.kv.blocks_needed(req.num_computed_tokens + 1) == 4


@pytest.mark.parametrize("case", ["waiting", "itl target", "prompt chunk", "too many", "pool short", "first token"])
def test_one_step_at_a_time_unless_a_run_is_safe(case):
    sched = multi_step_scheduler(steps=8 if case == "pool short" else 4, num_blocks=4 if case == "pool short" else 256)
    reqs = [make_request(f"r{i}", 4, 10) for i in range(9 if case == "too many" else 1)]
    if case == "itl target":
        reqs[0].itl_target = 0.05
    for r in reqs:
        sched.add_request(r)
    out, _ = run_step(sched)
    assert out.num_steps == 1
    if case == "first token":  # the step after the prompt has a token: the next runs
        assert run_step(sched)[0].num_steps == 4
        return
    if case == "waiting":  # a newcomer would wait for the whole run
        sched.add_request(make_request("late", 4, 10))
        sched.config.max_num_seqs = 1
    if case == "prompt chunk":
        sched.add_request(make_request("long", 40, 10))
    if case == "pool short":  # 4 blocks of 4: the prompt's 1 and another's 2 held; a run of 8 needs 3
        other = make_request("other", 7, 10)
        assert sched.kv.allocate_slots(other, 8)
    out, _ = run_step(sched)
    assert out.num_steps == 1
    assert [s.request.request_id for s in out.scheduled][:1] == ["r0"] and (case != "waiting" or sched.waiting)
    for r in reqs:  # nothing allocated for a run that did not happen
        assert len(r.block_ids) == sched.kv.blocks_needed(r.num_computed_tokens)


def test_the_number_of_scheduler_steps_is_validated():
    with pytest.raises(ConfigError, match="--num-scheduler-steps must be >= 1"):
        SchedulerConfig(num_scheduler_steps=0)


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_running_adapters_stay_within_max_loras(policy):
    """A request whose adapter would be one more than the model's slots waits; the base and adapters already
    running still join; it runs once a slot's requests end."""
    from tokenmill.lora import LoRARequest

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_loras=2, policy=policy), KVCacheManager(512, 4))
    adapters = [LoRARequest(f"a{i}", i + 1, "/adapters/a{i}") for i in range(3)]
    reqs = [make_request(f"r{i}", 8, 2) for i in range(5)]
    for req, lora in zip(reqs, [adapters[0], adapters[1], adapters[2], None, adapters[0]]):
        req.lora_request = lora
        sched.add_request(req)
    out, _ = run_step(sched)
    # r2's a2 would be a third: continuous batching goes past it, a static batch ends there (first come, first in)
    want = ["r0", "r1", "r3", "r4"] if policy == "continuous" else ["r0", "r1"]
    assert [s.request.request_id for s in out.scheduled] == want
    while sched.has_unfinished:
        out, _ = run_step(sched)
        assert len({s.request.lora_name for s in out.scheduled} - {None}) <= 2
    assert reqs[2].status is RequestStatus.FINISHED_LENGTH
