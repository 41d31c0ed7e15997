"""EngineCore: a request whose step raises fails alone, with a clear error; the engine and the others go on."""

import pytest

from tests.engine.drive import run
from tests.models.tiny import make_tiny_model
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

POISON = 77  # a prompt holding this token id makes the patched model fail


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("core"), vocab_size=256)
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", cache=CacheConfig(kv_cache_memory=8 << 20)))


PROMPTS = {"ok-1": [5, 6, 7, 8], "bad": [5, POISON, 9], "ok-2": list(range(10, 40))}


def test_a_forward_pass_that_raises_fails_only_the_request_at_fault(engine, monkeypatch):
    model = engine.core.runner.model
    forward = model.forward

    def faulty(input_ids, *args, **kwargs):
        if bool((input_ids == POISON).any()):
            raise RuntimeError("kernel fault")
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", faulty)
    done = run(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert done["bad"].finish_reason == "error" and "kernel fault" in done["bad"].error
    assert done["bad"].token_ids == []
    for rid in ("ok-1", "ok-2"):
        assert done[rid].finish_reason == "length" and len(done[rid].token_ids) == 4 and done[rid].error is None


def test_non_finite_logits_fail_only_that_request(engine, monkeypatch):
    model = engine.core.runner.model
    compute_logits = model.compute_logits
    poisoned_rows = []

    def nan_for_first_row(hidden):
        logits = compute_logits(hidden)
        if poisoned_rows == [] and logits.shape[0] == 3:  # the first step with all three: poison the middle row
            poisoned_rows.append(1)
            logits[1] = float("nan")
        return logits

    monkeypatch.setattr(model, "compute_logits", nan_for_first_row)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=3, ignore_eos=True)
    done = run(engine, {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9]}, params)
    assert poisoned_rows == [1]
    assert sorted(o.finish_reason for o in done.values()) == ["error", "length", "length"]
    failed = next(o for o in done.values() if o.finish_reason == "error")
    assert "non-finite logits" in failed.error


def test_the_engine_serves_normally_after_a_failure(engine):
    done = run(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 2 for o in done.values())
