"""The step cost model (engine/step_cost.py): fit, tokens within a latency target, predicted TTFT."""

import pytest

from tokenmill.engine.step_cost import StepCostModel, predict_ttft


def fitted(fixed: float, per_token: float) -> StepCostModel:
    model = StepCostModel()
    for n in [1, 8, 64, 5, 300, 16, 2, 40, 128, 3] * 3:
        model.observe(n, fixed + per_token * n)
    return model


def test_the_step_cost_fit_recovers_fixed_and_per_token_time():
    assert StepCostModel().fit is None
    fixed, per_token = fitted(0.010, 0.001).fit
    assert fixed == pytest.approx(0.010, rel=1e-6) and per_token == pytest.approx(0.001, rel=1e-6)
    model = StepCostModel()
    for _ in range(20):
        model.observe(8, 0.02)  # one token count only: nothing to fit a slope from
    assert model.fit is None and model.break_even_acceptance(8) == 0.0


def test_tokens_within_a_target_follow_the_fit():
    assert StepCostModel().max_tokens_within(0.05) is None
    model = fitted(0.010, 0.001)
    assert model.max_tokens_within(0.050) == 40
    assert model.max_tokens_within(0.005) == 0  # below the fixed cost: nothing besides what must run


def test_predicted_ttft_counts_steps_of_the_budget_less_the_running_decodes():
    assert predict_ttft(100, 0, 0, None, 512) is None
    assert predict_ttft(100, 0, 0, (0.01, 0.001), 512) == pytest.approx(0.110)  # one step of 100 tokens
    # 1,000 tokens ahead + 24 own at 256 prompt tokens a step (512 - 256 decodes): 4 full steps
    assert predict_ttft(24, 1000, 256, (0.01, 0.001), 512) == pytest.approx(4 * (0.01 + 0.512))
