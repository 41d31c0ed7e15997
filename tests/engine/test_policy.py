"""Scheduling policies on their own (no scheduler, no model): aging, rank, FCFS and LPM admission, priority order,
preemption choice, TTFT slack ordering, and the step budget under ITL targets and prefill caps."""

import pytest

from tokenmill.engine.policy import (
    ITL_STEP_SHARE,
    LPM_MAX_QUEUE,
    LPM_MAX_SKIPS,
    MIN_PROGRESS_TOKENS,
    FcfsPolicy,
    PriorityPolicy,
    StaticPolicy,
    StepBudget,
    aged_level,
    make_policy,
    prefill_finish_key,
    prefill_seconds,
    rank,
    step_budget,
    ttft_slack,
)
from tokenmill.engine.step_cost import StepCost
from tokenmill.request import Request
from tokenmill.sampling_params import SamplingParams

NOW = 1000.0
AGING = 10.0


def req(rid: str, arrival: float = NOW, priority: int = 0, prompt: int = 8, computed: int = 0,
        ttft: float | None = None, itl: float | None = None, skips: int = 0) -> Request:
    r = Request(rid, list(range(1, prompt + 1)), SamplingParams(temperature=0, max_tokens=8), 8,
                arrival_time=arrival, priority=priority, ttft_target=ttft, itl_target=itl, num_computed_tokens=computed)
    r.num_skips = skips
    return r


def decoding(rid: str, itl: float | None = None, computed: int = 8) -> Request:
    """A request with one token left to compute: a decode."""
    return req(rid, prompt=computed + 1, computed=computed, itl=itl)


def ids(entries) -> list[str]:
    return [(e[1] if isinstance(e, tuple) else e).request_id for e in entries]


@pytest.mark.parametrize("priority,waited,level", [(3, 0.0, 3), (3, 9.99, 3), (3, 10.0, 2), (3, 25.0, 1),
                                                   (0, 35.0, -3), (2, -50.0, 2)])
def test_aged_level_gains_one_level_per_aging_period(priority, waited, level):
    """A whole level per aging_s waited, none for a part of one, and none for an arrival in the future."""
    assert aged_level(priority, NOW - waited, NOW, AGING) == level


def test_rank_breaks_equal_levels_by_arrival():
    """Same level now (one aged into the other's): the earlier arrival ranks first."""
    old, new = req("old", arrival=NOW - 12, priority=1), req("new", arrival=NOW - 1, priority=0)
    assert rank(old, NOW, AGING) == (0, NOW - 12) and rank(old, NOW, AGING) < rank(new, NOW, AGING)


def test_make_policy_maps_names_to_policies():
    """priority ranks with its aging; static admits no one while a batch runs; anything else is continuous FCFS."""
    p = make_policy("priority", 7.0)
    assert type(p) is PriorityPolicy and p.aging_s == 7.0 and p.ranked
    assert type(make_policy("static", 7.0)) is StaticPolicy and not StaticPolicy.admits_while_running
    fcfs = make_policy("continuous", 7.0)
    assert type(fcfs) is FcfsPolicy and fcfs.admits_while_running and not fcfs.ranked


def test_fcfs_ignores_priority_everywhere():
    """FCFS: running order kept, the latest arrival preempted, no waiting request displaces a running one."""
    p = FcfsPolicy()
    running = [req("a", priority=5), req("b", priority=0), req("c", priority=2)]
    assert ids(p.order_running(running, NOW)) == ["a", "b", "c"]
    assert p.victim(running, NOW) == 2
    assert not p.displaces(req("urgent", priority=-10), running[0], NOW)
    assert p.level(running[0], NOW) == 0 and p.protects(running[0])


def test_fcfs_admission_keeps_queue_order_without_prefix_caching():
    """No cached_prefix_len: queue order, with each request's queue position."""
    waiting = [req("a"), req("b"), req("c")]
    order = FcfsPolicy().admission_order(waiting, NOW, None, None)
    assert [(pos, r.request_id) for pos, r in order] == [(0, "a"), (1, "b"), (2, "c")]


def test_fcfs_admission_goes_longest_cached_prefix_first_and_a_skipped_request_first_of_all():
    """LPM: most cached tokens first, ties by queue position; a request passed over LPM_MAX_SKIPS times leads."""
    waiting = [req("none"), req("long"), req("short"), req("long-2"), req("starved", skips=LPM_MAX_SKIPS)]
    cached = {"none": 0, "long": 64, "short": 16, "long-2": 64, "starved": 0}
    order = FcfsPolicy().admission_order(waiting, NOW, lambda r: cached[r.request_id], None)
    assert ids(order) == ["starved", "long", "long-2", "short", "none"]
    assert [pos for pos, _ in order] == [4, 1, 3, 2, 0]


def test_fcfs_admission_does_not_rank_a_long_queue():
    """Past LPM_MAX_QUEUE waiting requests, ranking costs more than it saves: queue order."""
    waiting = [req(f"r{i}") for i in range(LPM_MAX_QUEUE + 1)]
    order = FcfsPolicy().admission_order(waiting, NOW, lambda r: int(r.request_id[1:]), None)
    assert ids(order) == ids(waiting)


def test_priority_orders_running_by_aged_level_then_arrival():
    """Lower aged level first; aging lifts an old low-priority request to the level of a new high one."""
    p = PriorityPolicy(AGING)
    running = [req("new-low", arrival=NOW, priority=2), req("old-low", arrival=NOW - 25, priority=2),
               req("high", arrival=NOW - 1, priority=0), req("mid", arrival=NOW - 2, priority=1)]
    assert ids(p.order_running(running, NOW)) == ["old-low", "high", "mid", "new-low"]
    assert p.level(running[1], NOW) == 0


def test_priority_preempts_the_worst_ranked_request():
    """The victim is the worst level, the latest arrival among equals; not simply the last in the list."""
    p = PriorityPolicy(AGING)
    candidates = [req("low-late", arrival=NOW - 1, priority=3), req("low-early", arrival=NOW - 2, priority=3),
                  req("high", arrival=NOW, priority=0)]
    assert p.victim(candidates, NOW) == 0


def test_priority_displaces_only_from_a_strictly_better_level():
    """Arrival order alone never preempts; an aged running request is not displaced by its new equal."""
    p = PriorityPolicy(AGING)
    running = req("running", arrival=NOW - 5, priority=1)
    assert p.displaces(req("better", priority=0), running, NOW)
    assert not p.displaces(req("equal", arrival=NOW - 100, priority=1), running, NOW - 99)
    assert not p.displaces(req("equal-now", priority=1), running, NOW)
    aged = req("aged", arrival=NOW - 30, priority=3)
    assert not p.displaces(req("new-zero", priority=0), aged, NOW)
    assert p.displaces(req("new-neg", priority=-1), aged, NOW)


def test_priority_protects_only_decodes_with_an_itl_target():
    """Only requests with an ITL target have their decode tokens reserved; FCFS reserves all."""
    assert PriorityPolicy(AGING).protects(decoding("t", itl=0.05))
    assert not PriorityPolicy(AGING).protects(decoding("no-target"))


def test_ttft_slack_is_time_to_the_target_after_the_predicted_prefill():
    """Slack = arrival + target - now - predicted prefill (fixed + chunk cost); inf without a target."""
    cost = StepCost(fixed=0.01, per_token=0.001)
    r = req("r", arrival=NOW - 0.5, prompt=100, computed=40, ttft=2.0)
    assert prefill_seconds(r, None) == 0.0
    assert prefill_seconds(r, cost) == pytest.approx(0.01 + 0.060)
    assert ttft_slack(r, NOW, cost) == pytest.approx(1.5 - 0.07)
    assert ttft_slack(r, NOW, None) == pytest.approx(1.5)
    assert ttft_slack(req("none"), NOW, cost) == float("inf")


def test_priority_admission_meets_targets_least_slack_first_then_lost_ones_then_untargeted():
    """Within a level: targets still reachable by slack, then those already lost, then no target (queue order);
    a better level goes before all of them."""
    p = PriorityPolicy(AGING)
    waiting = [req("none-1"), req("relaxed", ttft=10.0), req("lost", arrival=NOW - 5, ttft=1.0), req("none-2"),
               req("urgent", ttft=0.5), req("lost-2", arrival=NOW - 9, ttft=1.0), req("vip", priority=-1)]
    order = p.admission_order(waiting, NOW, None, None)
    assert ids(order) == ["vip", "urgent", "relaxed", "lost", "lost-2", "none-1", "none-2"]


def test_priority_admission_slack_counts_the_predicted_prefill():
    """With a cost, a long prompt with a looser target can have less slack than a short one with a tighter one."""
    cost = StepCost(fixed=0.0, per_token=0.001)
    long_prompt, short = req("long", prompt=900, ttft=1.0), req("short", prompt=10, ttft=0.5)
    assert ids(PriorityPolicy(AGING).admission_order([short, long_prompt], NOW, None, None)) == ["short", "long"]
    assert ids(PriorityPolicy(AGING).admission_order([short, long_prompt], NOW, None, cost)) == ["long", "short"]


def test_prefill_finish_key_is_tokens_left_until_the_cost_is_known_then_virtual_finish():
    """Fewest tokens first among simultaneous arrivals; an early long prompt still beats a much later short one."""
    assert prefill_finish_key(req("r"), 300, 0, None) == 300.0
    cost = StepCost(fixed=0.0, per_token=0.001)
    early_long = prefill_finish_key(req("a", arrival=NOW), 500, 0, cost)
    late_short = prefill_finish_key(req("b", arrival=NOW + 1), 10, 0, cost)
    same_time_short = prefill_finish_key(req("c", arrival=NOW), 10, 0, cost)
    assert early_long == pytest.approx(NOW + 0.5)
    assert same_time_short < early_long < late_short


def test_step_budget_without_decodes_is_just_the_token_budget():
    """No decoding request: no ITL cap and no prefill cap apply."""
    budget = step_budget([req("prefill", prompt=100)], 512, FcfsPolicy(), prefill_cap=8,
                         cost=StepCost(0.01, 0.001), slowdown=2.0)
    assert budget.tokens == 512 and budget.seconds is None


def test_step_budget_caps_prompt_tokens_beside_decodes():
    """--max-prefill-tokens-while-decoding: the decodes' tokens plus the cap."""
    running = [decoding("d0"), decoding("d1"), req("p", prompt=200)]
    assert step_budget(running, 512, FcfsPolicy(), prefill_cap=32, cost=None).tokens == 34


def test_step_budget_under_an_itl_target_reserves_the_protected_decodes():
    """Seconds: the target's step share less the fixed cost and each protected decode; a reserved decode's chunk
    fits whole and costs nothing more when taken, while an unprotected decode pays like any chunk."""
    cost = StepCost(fixed=0.01, per_token=0.001)
    d0, d1 = decoding("d0", itl=0.05), decoding("d1")
    budget = step_budget([d0, d1, req("p", prompt=200)], 512, PriorityPolicy(AGING), None, cost)
    assert budget.seconds == pytest.approx(0.05 * ITL_STEP_SHARE - 0.01 - 0.001)
    assert budget.tokens_that_fit(d0, 1, d0.num_computed_tokens) == 1
    budget.take(d0, 1, d0.num_computed_tokens)
    assert budget.seconds == pytest.approx(0.029) and budget.tokens == 511
    assert budget.tokens_that_fit(req("p", prompt=200), 200, 0) == 29
    budget.take(d1, 1, d1.num_computed_tokens)
    assert budget.seconds == pytest.approx(0.028)


def test_step_budget_overrun_shrinks_the_time_allowed():
    """A cost whose steps overran by 2x gets half the target's share."""
    cost = StepCost(fixed=0.0, per_token=0.001, overrun=2.0)
    budget = step_budget([decoding("d", itl=0.1)], 512, FcfsPolicy(), None, cost)
    assert budget.seconds == pytest.approx(0.1 * ITL_STEP_SHARE / 2 - 0.001)


def test_a_budget_with_no_time_left_still_gives_prompts_minimal_progress_once():
    """When the decodes alone overrun the target, the first other chunk still gets MIN_PROGRESS_TOKENS; once one
    has moved, none is given more."""
    cost = StepCost(fixed=0.05, per_token=0.001)
    d = decoding("d", itl=0.02)
    budget = StepBudget(100, seconds=0.02, cost=cost, reserved=[d])
    p = req("p", prompt=200)
    assert budget.tokens_that_fit(p, 200, 0) == MIN_PROGRESS_TOKENS
    assert budget.tokens_that_fit(p, 5, 0) == 5
    budget.take(p, MIN_PROGRESS_TOKENS, 0)
    assert budget.tokens_that_fit(req("q", prompt=200), 200, 0) == 0
    assert budget.tokens_that_fit(d, 1, d.num_computed_tokens) == 1


def test_step_budget_with_a_slowdown_grows_with_the_prompts_per_decode():
    """--max-decode-slowdown: more prompts waiting per decode allow a longer step; every decode is reserved."""
    cost = StepCost(fixed=0.01, per_token=0.001)
    running = [decoding("d0"), decoding("d1")]
    few = step_budget(running, 4096, FcfsPolicy(), None, cost, slowdown=2.0, num_waiting=0)
    many = step_budget(running, 4096, FcfsPolicy(), None, cost, slowdown=2.0, num_waiting=6)
    assert few.seconds is not None and many.seconds > few.seconds
    assert few.tokens_that_fit(running[0], 1, running[0].num_computed_tokens) == 1


def test_a_budget_without_a_cost_counts_tokens_only():
    """Before the step cost is fitted seconds are ignored: fit is the tokens left, never more than asked."""
    budget = StepBudget(10, seconds=0.001, cost=None)
    assert budget.seconds is None and budget.left
    assert budget.tokens_that_fit(req("p"), 25, 0) == 10 and budget.tokens_that_fit(req("p"), 3, 0) == 3
    budget.take(req("p"), 10, 0)
    assert not budget.left and budget.tokens_that_fit(req("p"), 3, 0) == 0
