"""The step cost model (engine/step_cost.py): fit, tokens within a latency target, predicted TTFT."""

import pytest

from tokenmill.engine.step_cost import StepCostModel, predict_ttft


def test_tokens_within_a_target_follow_the_fit():
    model = StepCostModel()
    assert model.max_tokens_within(0.05) is None
    for n in [1, 64, 8, 300, 2, 128, 16, 40] * 2:
        model.observe(n, 0.010 + 0.001 * n)
    assert model.max_tokens_within(0.050) == 40
    assert model.max_tokens_within(0.005) == 0  # below the fixed cost: nothing besides what must run


def test_predicted_ttft_counts_steps_of_the_budget_less_the_running_decodes():
    assert predict_ttft(100, 0, 0, None, 512) is None
    assert predict_ttft(100, 0, 0, (0.01, 0.001), 512) == pytest.approx(0.110)  # one step of 100 tokens
    # 1,000 tokens ahead + 24 own at 256 prompt tokens a step (512 - 256 decodes): 4 full steps
    assert predict_ttft(24, 1000, 256, (0.01, 0.001), 512) == pytest.approx(4 * (0.01 + 0.512))
