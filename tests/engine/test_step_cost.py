"""The step cost model (engine/step_cost.py): fit, tokens within a latency target, predicted TTFT."""

import dataclasses
import random

import pytest

from tokenmill.engine.step_cost import (
    DECODE_STEP_FLOOR_S,
    StepCost,
    StepCostModel,
    attention_pairs,
    predict_ttft,
    stretched_step_seconds,
)


def fitted(fixed: float, per_token: float) -> StepCostModel:
    model = StepCostModel()
    for n in [1, 8, 64, 5, 300, 16, 2, 40, 128, 3] * 3:
        model.observe(n, fixed + per_token * n)
    return model


def test_the_step_cost_fit_recovers_fixed_and_per_token_time():
    assert StepCostModel().fitted is None
    cost = fitted(0.010, 0.001).fitted
    assert cost.fixed == pytest.approx(0.010, rel=1e-6) and cost.per_token == pytest.approx(0.001, rel=1e-6)
    assert cost.per_pair == 0.0  # no pairs observed: the two-term fit
    model = StepCostModel()
    for _ in range(20):
        model.observe(8, 0.02)  # one token count only: nothing to fit a slope from
    assert model.fitted is None and model.break_even_acceptance(8) == 0.0


def test_forget_drops_every_step_seen():
    model = fitted(5.0, 0.001)  # steps that timed a kernel build: a fixed cost of seconds
    model.forget()
    assert model.fitted is None
    for n in [1, 8, 64, 5, 300, 16, 2, 40]:
        model.observe(n, 0.010 + 0.001 * n)
    assert model.fitted.fixed == pytest.approx(0.010, rel=1e-6)  # nothing of the forgotten steps left in the fit


def test_attention_pairs_count_the_causal_square_after_the_context():
    assert attention_pairs(1, 0) == 1 and attention_pairs(1, 99) == 100  # a decode reads its context and itself
    assert attention_pairs(4, 0) == 10 and attention_pairs(4, 10) == 50
    assert attention_pairs(3, 5) + attention_pairs(2, 8) == attention_pairs(5, 5)  # chunks add up


def test_the_fit_separates_attention_pairs_from_tokens():
    rng = random.Random(0)
    model = StepCostModel()
    for _ in range(60):  # decodes at growing contexts and prompt chunks at various depths
        n, ctx = rng.choice([(rng.randint(1, 64), rng.randint(0, 4000)), (rng.randint(100, 500), 0)])
        pairs = attention_pairs(n, ctx)
        model.observe(n, 0.008 + 2e-4 * n + 3e-8 * pairs, pairs)
    cost = model.fitted
    assert cost.fixed == pytest.approx(0.008, rel=1e-3)
    assert cost.per_token == pytest.approx(2e-4, rel=1e-3) and cost.per_pair == pytest.approx(3e-8, rel=1e-3)


def test_pairs_that_only_follow_tokens_fall_back_to_the_token_fit():
    model = StepCostModel()
    for n in [1, 8, 64, 5, 300, 16, 2, 40, 128, 3] * 3:  # pairs exactly proportional to tokens: not separable
        model.observe(n, 0.010 + 0.001 * n, pairs=100 * n)
    cost = model.fitted
    assert cost.per_pair == 0.0 and cost.per_token == pytest.approx(0.001, rel=1e-6)


def test_tokens_within_a_target_follow_the_fit():
    cost = fitted(0.010, 0.001).fitted
    assert cost.max_chunk_within(0.050 - cost.fixed, 0) == 40
    assert cost.max_chunk_within(0.005 - cost.fixed, 0) == 0  # below the fixed cost: nothing besides what must run


def test_a_chunk_deep_into_its_context_fits_fewer_tokens():
    cost = StepCost(0.0, 1e-4, 1e-7)
    shallow, deep = cost.max_chunk_within(0.05, 0), cost.max_chunk_within(0.05, 3000)
    assert deep < shallow
    for n, ctx in ((shallow, 0), (deep, 3000)):  # the largest that fits: one more would not
        assert cost.chunk_seconds(n, ctx) <= 0.05 < cost.chunk_seconds(n + 1, ctx)
    assert cost.max_chunk_within(0.0, 0) == 0 and StepCost(0.0, 1e-3).max_chunk_within(0.05, 10**6) == 50


def test_predicted_ttft_packs_the_prompts_ahead_into_steps_beside_the_decodes():
    cost = StepCost(0.01, 0.001)
    assert predict_ttft(100, [], 0, 0, None, None, 512) is None
    assert predict_ttft(100, [], 0, 0, cost, None, 512) == pytest.approx(0.110)  # one step of 100 tokens
    # 1,000 tokens ahead + 24 own at 256 prompt tokens a step (512 - 256 decodes): 4 full steps
    assert predict_ttft(24, [1000], 256, 0, cost, None, 512) == pytest.approx(4 * (0.01 + 0.512))
    # three prompts of 30 ahead share one step with ours
    assert predict_ttft(10, [30, 30, 30], 0, 0, cost, None, 512) == pytest.approx(0.01 + 0.100)
    # an ITL target's 40 ms: 30 prompt tokens a step after the fixed cost
    assert predict_ttft(60, [], 0, 0, cost, 0.040, 512) == pytest.approx(2 * 0.040)
    # decodes' context makes each step dearer
    assert predict_ttft(10, [], 4, 4000, StepCost(0.01, 0.001, 1e-6), None, 512) == pytest.approx(
        0.01 + 0.004 + 0.004 + 0.010 + 55e-6)


def fitted_with_pairs(fixed: float, per_token: float, per_pair: float) -> StepCostModel:
    """A model that has seen steps costing exactly fixed + per_token tokens + per_pair pairs."""
    rng = random.Random(1)
    model = StepCostModel()
    for _ in range(40):
        n, ctx = rng.randint(1, 400), rng.randint(0, 4000)
        model.observe(n, fixed + per_token * n + per_pair * attention_pairs(n, ctx), attention_pairs(n, ctx))
    return model


def test_the_overrun_is_how_much_longer_than_the_fit_recent_sized_steps_took():
    model = fitted(0.010, 0.001)
    assert model.fitted.overrun == 1.0  # steps took exactly what the fit says
    rng = random.Random(2)
    for _ in range(200):  # a quarter of the sized steps take 1.5x their cost, the rest 0.95x: the fit follows the bulk
        n = rng.randint(20, 300)
        model.observe(n, (0.010 + 0.001 * n) * (1.5 if rng.random() < 0.25 else 0.95))
    assert 1.2 < model.fitted.overrun <= 1.6
    for _ in range(200):
        model.observe(1, 0.0101)  # steps of the fixed cost alone do not count
    assert model.fitted.overrun > 1.2


def test_stretched_step_is_a_multiple_of_the_decodes_own_with_a_floor():
    cost = StepCost(fixed=0.020, per_token=0.001, per_pair=1e-6)
    own = cost.seconds(16, 16_000)  # 16 decodes over 1,000 keys each: 52 ms
    assert stretched_step_seconds(cost, 3.0, 16, 16_000) == pytest.approx(3 * own)
    # steps that recently ran 1.25x their prediction are sized to 3 / 1.25 of it: 3x in what they take
    overrunning = dataclasses.replace(cost, overrun=1.25)
    assert stretched_step_seconds(overrunning, 3.0, 16, 16_000) == pytest.approx(3 * own / 1.25)
    assert stretched_step_seconds(cost, 1.5, 1, 100) == DECODE_STEP_FLOOR_S  # 1.5 x 21 ms is under the floor
    assert stretched_step_seconds(cost, 0.0, 16, 16_000) is None  # off
    assert stretched_step_seconds(cost, None, 16, 16_000) is None
    assert stretched_step_seconds(cost, 3.0, 0, 0) is None  # nothing decodes: no limit
    assert stretched_step_seconds(None, 3.0, 16, 16_000) is None  # no fit yet
