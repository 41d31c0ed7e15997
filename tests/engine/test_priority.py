"""Priorities and latency targets in the scheduler (no model): rank order, preemption by priority, aging, the
step budget within an ITL target, TTFT slack ordering; and their validation at the edge."""

import time

import pytest

from tests.engine.test_step_cost import fitted, fitted_with_pairs
from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.policy import ITL_STEP_SHARE
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.step_types import SampledTokens
from tokenmill.errors import ConfigError, InvalidRequest
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams


def request(rid: str, prompt_len: int = 8, max_tokens: int = 8, priority: int = 0, waited: float = 0.0,
            ttft: float | None = None, itl: float | None = None) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(temperature=0, max_tokens=max_tokens),
                   max_tokens, arrival_time=time.monotonic() - waited, priority=priority, ttft_target=ttft,
                   itl_target=itl)


def scheduler(num_blocks: int = 64, block_size: int = 4, step_cost=None, **cfg) -> Scheduler:
    cfg.setdefault("policy", "priority")
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, block_size), step_cost=step_cost)


def step(sched: Scheduler):
    out = sched.schedule()
    sched.update(out, {s.request.request_id: SampledTokens([7]) for s in out.scheduled if s.samples_next_token})
    return out


def test_a_high_priority_request_is_admitted_before_an_earlier_queue():
    sched = scheduler(max_num_seqs=1)
    for i in range(3):
        sched.add_request(request(f"low-{i}", priority=1))
    step(sched)  # low-0 runs
    sched.add_request(request("high", priority=0))
    out = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["high"]
    assert [r.request_id for r in out.preempted] == ["low-0"]  # a seat was needed: the worse one gave it up
    assert sched.preemptions_by_cause == {"blocks": 0, "priority": 1}
    while sched.has_unfinished:
        step(sched)
    sched.kv.check_idle()


def test_fcfs_does_not_reorder_by_priority():
    sched = scheduler(max_num_seqs=1, policy="continuous")
    sched.add_request(request("low", priority=5))
    sched.add_request(request("high", priority=0))
    assert [s.request.request_id for s in step(sched).scheduled] == ["low"]


def test_short_of_blocks_the_worst_ranked_request_is_preempted_not_the_latest():
    sched = scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, new_token_ratio=0)
    sched.add_request(request("high-late", prompt_len=8, max_tokens=16, priority=0))
    sched.add_request(request("low-early", prompt_len=8, max_tokens=16, priority=3, waited=0.0))
    preempted = []
    while sched.has_unfinished:
        preempted += [r.request_id for r in step(sched).preempted]
    assert preempted and set(preempted) == {"low-early"}
    sched.kv.check_idle()


def test_aging_lets_a_long_waiting_low_priority_request_overtake_fresh_high_priority_ones():
    sched = scheduler(max_num_seqs=1, priority_aging_s=1.0)
    sched.add_request(request("fresh-high", priority=0))
    sched.add_request(request("old-low", priority=3, waited=10.0))  # ranks 3 - 10 = -7
    assert [s.request.request_id for s in step(sched).scheduled] == ["old-low"]


def test_two_requests_never_preempt_each_other_back_and_forth():
    sched = scheduler(max_num_seqs=1, priority_aging_s=0.5)
    sched.add_request(request("a", priority=1, waited=2.0, max_tokens=30))  # rank 1 - 4 = -3
    sched.add_request(request("b", priority=0, waited=0.0, max_tokens=30))  # rank 0
    preemptions = 0
    while sched.has_unfinished:
        preemptions += len(step(sched).preempted)
    assert preemptions == 0


def test_an_itl_target_caps_the_step_to_what_the_measured_cost_fits():
    sched = scheduler(num_blocks=256, max_num_batched_tokens=512, policy="continuous", step_cost=fitted(0.010, 0.001))  # 10 ms + 1 ms per token: 40 tokens fit in 0.8 x 62.5 ms
    for i in range(4):
        sched.add_request(request(f"d{i}", prompt_len=4, max_tokens=50, itl=0.0625))
    step(sched)  # their prompts
    sched.add_request(request("long", prompt_len=400, max_tokens=2))
    sizes = []
    while any(r.request_id == "long" and r.num_computed_tokens < 400 for r in sched.running + list(sched.waiting)):
        out = step(sched)
        sizes.append(out.num_tokens)
    assert max(sizes) <= 40 and len(sizes) >= 400 // 36
    plain = scheduler(num_blocks=256, max_num_batched_tokens=512, policy="continuous")
    for i in range(4):
        plain.add_request(request(f"d{i}", prompt_len=4, max_tokens=50))
    step(plain)
    plain.add_request(request("long", prompt_len=400, max_tokens=2))
    assert step(plain).num_tokens > 100  # no target: the long prompt takes its share of a large step


def test_an_itl_target_never_starves_the_decodes_themselves():
    sched = scheduler(policy="continuous", step_cost=fitted(0.030, 0.001))  # the fixed cost alone is over the 20 ms target
    for i in range(5):
        sched.add_request(request(f"d{i}", prompt_len=4, max_tokens=6, itl=0.020))
    step(sched)
    assert step(sched).num_tokens == 5


def test_admission_among_equal_priorities_goes_by_ttft_slack():
    sched = scheduler(max_num_seqs=1)
    sched.add_request(request("relaxed", ttft=10.0))
    sched.add_request(request("none"))
    sched.add_request(request("urgent", ttft=0.2))
    assert [s.request.request_id for s in step(sched).scheduled] == ["urgent"]


@pytest.mark.parametrize("kw,param", [({"priority": 1.5}, "priority"), ({"priority": 10**7}, "priority"),
                                      ({"slo_ttft_ms": 0}, "slo_ttft_ms"), ({"slo_itl_ms": -5}, "slo_itl_ms"),
                                      ({"slo_itl_ms": float("nan")}, "slo_itl_ms")])
def test_bad_priority_or_targets_name_the_field(kw, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kw)
    assert e.value.param == param


@pytest.mark.parametrize("kw,flag", [({"policy": "lottery"}, "--scheduling-policy"),
                                     ({"slo_itl_ms": 0}, "--slo-itl-ms"),
                                     ({"priority_aging_s": -1}, "--priority-aging-s")])
def test_bad_scheduler_flags_name_the_flag(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        SchedulerConfig(**kw)


def test_a_finished_request_is_not_ranked():
    sched = scheduler()
    r = request("x")
    sched.add_request(r)
    sched.abort("x")
    assert r.status is RequestStatus.FINISHED_ABORTED and not sched.has_unfinished


def test_by_rank_an_itl_target_protects_its_decodes_before_lower_priority_ones():
    sched = scheduler(num_blocks=1024, step_cost=fitted(0.010, 0.001))  # 40 tokens fit in 0.8 x 62.5 ms
    for i in range(30):
        sched.add_request(request(f"batch-{i}", prompt_len=4, max_tokens=50, priority=1))
    for i in range(20):
        sched.add_request(request(f"chat-{i}", prompt_len=4, max_tokens=50, priority=0, itl=0.0625))
    step(sched)
    step(sched)  # all 50 decode now
    out = step(sched)
    served = [s.request.request_id for s in out.scheduled]
    assert out.num_tokens == 40 and all(f"chat-{i}" in served for i in range(20))  # the rest: 20 batch decodes
    fcfs = scheduler(num_blocks=1024, policy="continuous")
    fcfs.step_cost = sched.step_cost
    for i in range(30):
        fcfs.add_request(request(f"batch-{i}", prompt_len=4, max_tokens=50, priority=1))
    for i in range(20):
        fcfs.add_request(request(f"chat-{i}", prompt_len=4, max_tokens=50, itl=0.050))
    step(fcfs)
    step(fcfs)
    assert step(fcfs).num_tokens == 50  # first come first served protects every decode


def test_under_an_itl_target_chunks_deep_into_a_long_prompt_shrink_and_every_step_fits_the_target():
    sched = scheduler(num_blocks=2048, block_size=16, max_num_batched_tokens=512, policy="continuous", step_cost=fitted_with_pairs(0.010, 2e-4, 1e-7))
    cost, target = sched.step_cost.fitted, 0.100
    for i in range(4):
        sched.add_request(request(f"d{i}", prompt_len=4, max_tokens=400, itl=target))
    step(sched)
    sched.add_request(request("long", prompt_len=4000, max_tokens=2))
    long_chunks = []
    while any(r.request_id == "long" and r.num_computed_tokens < 4000 for r in sched.running + list(sched.waiting)):
        out = sched.schedule()
        assert cost.seconds(out.num_tokens, out.num_attention_pairs) <= target * ITL_STEP_SHARE + 1e-9
        long_chunks += [s.num_new_tokens for s in out.scheduled if s.request.request_id == "long"]
        assert sum(1 for s in out.scheduled if s.request.request_id.startswith("d")) == 4  # no decode waits
        sched.update(out, {s.request.request_id: SampledTokens([7]) for s in out.scheduled if s.samples_next_token})
    assert sum(long_chunks) == 4000 and long_chunks[-2] < long_chunks[0]  # deeper chunks cost more per token


def test_an_earlier_arrival_at_the_same_level_does_not_preempt():
    sched = scheduler(max_num_seqs=1, priority_aging_s=10.0)
    sched.add_request(request("running", priority=0, max_tokens=20))
    step(sched)
    sched.add_request(request("aged", priority=1, waited=15.0))  # level 0 now, and earlier: ranks better
    out = step(sched)
    assert out.preempted == [] and [s.request.request_id for s in out.scheduled] == ["running"]
    sched.add_request(request("older", priority=1, waited=25.0))  # level -1: a better level displaces
    out = step(sched)
    assert [r.request_id for r in out.preempted] == ["running"]


def test_admission_serves_targets_it_can_still_meet_then_lost_ones_then_none():
    sched = scheduler(max_num_seqs=1)
    sched.add_request(request("none"))
    sched.add_request(request("lost", ttft=0.5, waited=2.0))  # its target passed 1.5 s ago
    sched.add_request(request("relaxed", ttft=20.0))
    sched.add_request(request("tight", ttft=1.0))
    order = [s.request.request_id for _ in range(4) for s in run_to_end_of_one(sched)]
    assert order == ["tight", "relaxed", "lost", "none"]


def run_to_end_of_one(sched: Scheduler):
    """Steps until the running request ends; returns the first step's scheduled chunks."""
    first = step(sched).scheduled
    while sched.running:
        step(sched)
    return first


def test_kv_headroom_holds_back_admission_until_decode_growth_fits():
    sched = scheduler(num_blocks=32, block_size=4, policy="continuous")  # 128 tokens
    sched.add_request(request("a", prompt_len=8, max_tokens=100))  # may write 100 more tokens: 70 expected
    step(sched)
    sched.add_request(request("b", prompt_len=8, max_tokens=40))  # 8 + 28 expected; 128 - 8 - 70 = 50 free
    assert [s.request.request_id for s in step(sched).scheduled] == ["a", "b"]
    sched.add_request(request("c", prompt_len=8, max_tokens=40))  # would leave the pool short of a's and b's growth
    assert [s.request.request_id for s in step(sched).scheduled] == ["a", "b"]
    no_headroom = scheduler(num_blocks=32, block_size=4, policy="continuous", new_token_ratio=0)
    for rid, max_tokens in (("a", 100), ("b", 40), ("c", 40)):
        no_headroom.add_request(request(rid, prompt_len=8, max_tokens=max_tokens))
    assert len(step(no_headroom).scheduled) == 3  # admitted now, to be preempted later


def test_the_new_token_ratio_decays_while_nothing_is_preempted_and_rises_when_blocks_run_out():
    sched = scheduler(num_blocks=256, block_size=16, policy="continuous", new_token_ratio=0.7)
    assert sched.new_token_ratio == 0.7
    sched.add_request(request("a", prompt_len=4, max_tokens=4000))  # does not end here
    for _ in range(700):
        step(sched)
    assert sched.new_token_ratio == pytest.approx(0.1)  # the floor: a seventh
    sched.new_token_ratio = 0.1
    sched._preempt(sched.running[0], "blocks")
    assert sched.new_token_ratio == pytest.approx(0.7)


def test_fewer_preemptions_with_headroom_on_a_load_that_outgrows_the_pool():
    counts = {}
    for ratio in (0.0, 0.7):
        sched = scheduler(num_blocks=64, block_size=4, policy="continuous", new_token_ratio=ratio)
        for i in range(12):
            sched.add_request(request(f"r{i}", prompt_len=8, max_tokens=60))
        while sched.has_unfinished:
            step(sched)
        sched.kv.check_idle()
        counts[ratio] = sched.num_preemptions
    assert counts[0.7] < counts[0.0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("priority"), num_heads=4, num_kv_heads=2)


def test_requests_preempted_for_priority_resume_with_unchanged_output(tiny_dir):
    """Engine level: high-priority requests arriving while low ones run take their seats (preempted by priority),
    and every request's greedy output is what it is alone."""
    from tokenmill.config import CacheConfig, EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    prompts = {f"low-{i}": {"prompt_token_ids": list(range(10 + i, 30 + i))} for i in range(3)}
    prompts |= {f"high-{i}": {"prompt_token_ids": list(range(50 + i, 62 + i))} for i in range(2)}

    def engine(policy: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(tiny_dir), dtype="float32", num_threads=1,
                                      cache=CacheConfig(num_blocks=64, block_size=4),
                                      scheduler=SchedulerConfig(policy=policy, max_num_seqs=2)))

    def run(eng: LLMEngine, names: list[str], later: list[str] = ()) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for name in names:
            eng.add_request(name, prompts[name], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                priority=1 if name.startswith("low") else 0))
        steps = 0
        while eng.has_unfinished_requests():
            if steps == 4:
                for name in later:
                    eng.add_request(name, prompts[name], SamplingParams(temperature=0, max_tokens=12,
                                                                        ignore_eos=True, priority=0))
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
            steps += 1
        eng.core.check_idle_invariants()
        return out

    alone = {name: run(engine("continuous"), [name])[name] for name in prompts}
    eng = engine("priority")
    mixed = run(eng, [n for n in prompts if n.startswith("low")], [n for n in prompts if n.startswith("high")])
    assert eng.core.scheduler.preemptions_by_cause["priority"] > 0
    assert mixed == alone


def test_prompts_still_move_when_an_itl_target_leaves_them_no_time():
    sched = scheduler(num_blocks=256, policy="continuous", step_cost=fitted(0.030, 0.001))  # the fixed cost alone is over the 20 ms target
    for i in range(3):
        sched.add_request(request(f"d{i}", prompt_len=4, max_tokens=200, itl=0.020))
    step(sched)
    sched.add_request(request("late", prompt_len=100, max_tokens=2))
    late = sched.requests["late"]
    for _ in range(10):
        out = step(sched)
        assert sum(s.num_new_tokens for s in out.scheduled if s.request.request_id != "late") == 3  # decodes run
    assert late.num_computed_tokens >= 100 or late.output_token_ids  # crawled through at least 16 a step
