"""Multi-step decode (`num_scheduler_steps`): several decode steps in one engine step give the tokens one step at a
time gives, sampling parameters and all, and lose no block or request."""

import pytest

from tests.engine.drive import run
from tests.models.tiny import make_tiny_model
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

STEPS = 8


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("multi_step"), vocab_size=256))


def make_engine(path: str, steps: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, dtype="float32", cache=CacheConfig(kv_cache_memory=8 << 20),
                                  scheduler=SchedulerConfig(num_scheduler_steps=steps)))


@pytest.fixture(scope="module")
def engines(model_path):
    """One step at a time, and multi-step; the latter counts the runs of several steps it made."""
    single, multi = make_engine(model_path, 1), make_engine(model_path, STEPS)
    runner = multi.core.runner
    execute = runner.execute
    multi.runs = []

    def counting(out):
        multi.runs.append(out.num_steps)
        return execute(out)

    runner.execute = counting
    return single, multi


PROMPTS = {f"p{i}": [3 + i, 40 + 7 * i, 90, 17 + i][:2 + i % 3] for i in range(5)}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=40),  # EOS may end a request inside a run
    SamplingParams(temperature=0.9, seed=11, max_tokens=30, logprobs=3),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=30),  # unseeded: a seed per request
    SamplingParams(temperature=0.8, seed=5, max_tokens=30, repetition_penalty=1.4, frequency_penalty=0.5,
                   min_tokens=20, stop_token_ids=[9, 12]),  # penalties over the run's own tokens, stops held back
    SamplingParams(temperature=0, max_tokens=25, stop_token_ids=[7, 30, 31, 60, 61, 99, 100, 101, 200]),
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={77: 4.0, 5: -100, 6: -100}),
], ids=["greedy", "greedy-eos", "seeded-logprobs", "unseeded-filters", "penalties-min-tokens", "stop-ids",
        "greedy-logit-bias"])
def test_several_steps_at_once_give_the_tokens_of_one_at_a_time(engines, params):
    single, multi = engines
    multi.runs.clear()
    for prompts in ({"one": [5, 6, 7]}, PROMPTS):
        if params.seed is None and not params.greedy:  # the engines draw each request's seed from their own rng
            single.core.runner._seed_rng.seed(0)
            multi.core.runner._seed_rng.seed(0)
        want, got = run(single, prompts, params), run(multi, prompts, params)
        for rid in prompts:
            assert got[rid].token_ids == want[rid].token_ids, rid
            assert got[rid].finish_reason == want[rid].finish_reason
            assert got[rid].logprobs == want[rid].logprobs
    assert any(n > 1 for n in multi.runs), "no run of several steps happened"


def test_runs_through_the_modules_give_the_same_tokens(engines, monkeypatch):
    """Without the backend's whole-model paths (another device, a split model) a run steps the modules."""
    single, multi = engines
    model = multi.core.runner.model
    monkeypatch.setattr(model, "decode_greedy", lambda *args: None)
    monkeypatch.setattr(model, "decode_logits", lambda *args: None)
    multi.runs.clear()
    for params in (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                   SamplingParams(temperature=0.9, seed=3, max_tokens=30, logprobs=1)):
        want, got = run(single, PROMPTS, params), run(multi, PROMPTS, params)
        assert {k: (o.token_ids, o.logprobs) for k, o in got.items()} == {
            k: (o.token_ids, o.logprobs) for k, o in want.items()}
    assert any(n > 1 for n in multi.runs)


def test_a_batch_larger_than_a_run_takes_steps_one_at_a_time(engines):
    single, multi = engines
    multi.runs.clear()
    prompts = {f"r{i}": [i + 1, 2 * i + 3] for i in range(9)}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert {k: o.token_ids for k, o in run(multi, prompts, params).items()} == {
        k: o.token_ids for k, o in run(single, prompts, params).items()}
    assert set(multi.runs) == {1}


def test_an_abort_between_runs_frees_the_request(engines):
    _, multi = engines
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    multi.add_request("keep", {"prompt_token_ids": [4, 5]}, params)
    multi.add_request("drop", {"prompt_token_ids": [6, 7]}, params)
    for _ in range(3):
        multi.step()
    assert multi.abort_request("drop") is not None
    done = {}
    while multi.has_unfinished_requests():
        for out in multi.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    assert len(done["keep"].token_ids) == 100
    multi.core.check_idle_invariants()


@pytest.mark.parametrize("whole_model", [True, False])  # the logits from one C++ call a step, or the modules'
def test_non_finite_logits_inside_a_run_fail_that_request_alone(engines, monkeypatch, whole_model):
    _, multi = engines
    model = multi.core.runner.model
    calls = []

    def poisoned(logits):
        calls.append(logits.shape[0])
        if len(calls) == 6 and logits.shape[0] == 2:  # inside the first run of both requests' decodes
            logits[1] = float("nan")
        return logits

    compute_logits, decode_logits = model.compute_logits, model.decode_logits
    monkeypatch.setattr(model, "compute_logits", lambda hidden: poisoned(compute_logits(hidden)))
    monkeypatch.setattr(model, "decode_logits", lambda *args: (
        None if not whole_model or (out := decode_logits(*args)) is None else poisoned(out)))
    multi.runs.clear()
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=20, ignore_eos=True)
    done = run(multi, {"a": [1, 2, 3], "b": [4, 5, 6]}, params)
    assert multi.runs[:2] == [1, STEPS]
    assert done["a"].finish_reason == "length" and len(done["a"].token_ids) == 20
    assert done["b"].finish_reason == "error" and "non-finite logits" in done["b"].error


def count_native_steps(engine: LLMEngine) -> list[int]:
    """Wraps the model's whole-model decode paths: the list gets the steps each call served (a greedy run's,
    or 1 for a step's logits), not the calls they declined."""
    model, served = engine.core.runner.model, []
    decode_greedy, decode_logits = model.decode_greedy, model.decode_logits

    def greedy(*args, **kwargs):
        tokens = decode_greedy(*args, **kwargs)
        if tokens is not None:
            served.append(tokens.shape[0])
        return tokens

    def logits(*args, **kwargs):
        out = decode_logits(*args, **kwargs)
        if out is not None:
            served.append(1)
        return out

    model.decode_greedy, model.decode_logits = greedy, logits
    return served


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("bfloat16", "int8"),
                                                ("bfloat16", "fp8"), ("bfloat16", "int4")])
@pytest.mark.parametrize("tied", [True, False])
def test_runs_through_the_whole_model_calls_give_the_same_tokens(tmp_path, dtype, quantization, tied):
    path = str(make_tiny_model(tmp_path, vocab_size=256, tie_word_embeddings=tied, num_kv_heads=2))
    single, multi = (LLMEngine(EngineConfig(
        model=path, dtype=dtype, quantization=quantization, cache=CacheConfig(kv_cache_memory=8 << 20),
        scheduler=SchedulerConfig(num_scheduler_steps=steps))) for steps in (1, STEPS))
    served = count_native_steps(multi)
    prompts = {f"p{i}": [3 + i, 40 + 7 * i, 90] for i in range(3)}
    for params in (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[5, 6]),  # runs in one call
                   SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=30, logprobs=2)):  # a call a step
        served.clear()
        want, got = run(single, prompts, params), run(multi, prompts, params)
        assert {k: (o.token_ids, o.finish_reason, o.logprobs) for k, o in got.items()} == {
            k: (o.token_ids, o.finish_reason, o.logprobs) for k, o in want.items()}
        model = multi.core.runner.model
        # int8 and FP8 weights have their packed copy where the bfloat16 tiles run (AMX, AVX512-BF16); elsewhere
        # (an AVX2 CPU) they take the Python path, whose steps are checked above all the same; so do steps whose
        # tied 4-bit head sits in AMX's regrouped tiles (no C++ row lookup: backends/cpu_rows.py)
        packed = all(getattr(m, "qweight", None) is None or m.packed_weight is not None for m in model.linear_layers())
        rows = model.embed_tokens.rows
        if multi.core.runner.backend.name == "cpu" and packed and (rows is None or rows.native is not None):
            assert served and (params.greedy or set(served) == {1})


def test_the_embedded_gguf_decodes_the_same_tokens_in_runs():
    """SmolLM2's GGUF as served by default (Q4_1 layers and a Q8_0 tied head kept in their blocks, where this CPU
    has their kernel), prompts through its tokenizer: runs of greedy steps give the step-by-step tokens."""
    from tokenmill import LLM

    single, multi = LLM(), LLM(num_scheduler_steps=STEPS)
    served = count_native_steps(multi.engine)
    prompts = ["Once upon a time", "The three primary colors are", "def fibonacci(n):"]
    for params in (SamplingParams(temperature=0, max_tokens=48),
                   SamplingParams(temperature=0, max_tokens=48, stop=[" the", ":"])):  # stop strings inside a run
        want = [o.outputs[0] for o in single.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0] for o in multi.generate(prompts, params, use_tqdm=False)]
        assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
            (o.token_ids, o.text, o.finish_reason) for o in want]
        assert not params.stop or any(o.finish_reason == "stop" for o in got)
    if multi.engine.core.runner.backend.name == "cpu":
        assert served
    single.engine.core.check_idle_invariants()
    multi.engine.core.check_idle_invariants()
