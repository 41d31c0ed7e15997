"""The offline API (`LLM.generate`, `LLM.chat`, the engine's add/abort/step) on a tiny random model, plus a
few checks on the real SmolLM2 model where a trained model matters (EOS, chat)."""

from __future__ import annotations

import logging
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests.models.tiny import EOS_ID, make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.runner import DTYPES
from tokenmill.errors import ContextTooLong, InvalidRequest
from tokenmill.model.backends import auto_dtype

KV = 32 << 20
PROMPTS = ["The capital of France is", "Once upon a time", "def f(x):",
           "Hello world, this is a longer prompt"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # SmolLM2's full vocabulary, so text prompts and stop strings work; random weights with spread logits,
    # so sampling has entropy.
    return make_tiny_model(tmp_path_factory.mktemp("llm"), arch="llama", num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", kv_cache_memory=KV)


@pytest.fixture(scope="module")
def smol():
    return LLM(dtype="float32", kv_cache_memory=64 << 20)


def greedy(llm: LLM, prompt, max_tokens: int = 24, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def assert_idle_and_serving(llm: LLM) -> None:
    """Nothing in flight, every block free, and a plain request still runs."""
    assert not llm.engine.has_unfinished_requests()
    llm.engine.core.check_idle_invariants()
    out = greedy(llm, "Hello", max_tokens=3)
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    llm.engine.core.check_idle_invariants()


# ---- prompt forms, ordering, finish reasons ----------------------------------------------------------------


def test_generate_accepts_string_list_and_token_id_dicts(tiny):
    tok = tiny.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    single = tiny.generate(PROMPTS[0], params, use_tqdm=False)
    assert len(single) == 1
    assert single[0].prompt == PROMPTS[0]
    assert single[0].prompt_token_ids == tok.encode(PROMPTS[0])
    assert single[0].finished

    many = tiny.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt for o in many] == PROMPTS
    assert len({o.request_id for o in many}) == len(PROMPTS)
    assert many[0].outputs[0].token_ids == single[0].outputs[0].token_ids

    ids = [tok.encode(p) for p in PROMPTS]
    by_ids = tiny.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in by_ids] == ids
    assert [o.outputs[0].token_ids for o in by_ids] == [o.outputs[0].token_ids for o in many]

    by_text_dict = tiny.generate({"prompt": PROMPTS[1]}, params, use_tqdm=False)
    assert by_text_dict[0].prompt == PROMPTS[1]
    assert by_text_dict[0].outputs[0].token_ids == many[1].outputs[0].token_ids
    tiny.engine.core.check_idle_invariants()


def test_outputs_come_in_prompt_order_with_per_prompt_params(tiny):
    # The first prompt runs longest, so it finishes last: the results must still come back in prompt order.
    lengths = [9, 2, 6, 4]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = tiny.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    for prompt, n, out in zip(PROMPTS, lengths, outs):
        c = out.outputs[0]
        assert len(c.token_ids) == n
        assert c.finish_reason == "length" and c.stop_reason is None
        assert c.token_ids == greedy(tiny, prompt, max_tokens=n).token_ids
    tiny.engine.core.check_idle_invariants()


def test_wrong_number_of_sampling_params_is_refused(tiny):
    with pytest.raises(InvalidRequest, match="2 sampling params for 4 prompts"):
        tiny.generate(PROMPTS, [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert_idle_and_serving(tiny)


def test_text_equals_decode_of_token_ids(tiny):
    tok = tiny.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = tiny.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.text and c.text == tok.decode(c.token_ids)


def first_new_token(ids: list[int], start: int) -> int:
    """The first index >= start whose token did not occur earlier in `ids`."""
    return next(i for i in range(start, len(ids)) if ids[i] not in ids[:i])


def test_stop_token_ids_end_the_output_with_stop_reason(tiny):
    ref = greedy(tiny, PROMPTS[1], max_tokens=24).token_ids
    i = first_new_token(ref, 2)
    out = greedy(tiny, PROMPTS[1], max_tokens=24, stop_token_ids=[ref[i]])
    assert out.token_ids == ref[: i + 1]  # the stop token is the last one kept
    assert out.finish_reason == "stop"
    assert out.stop_reason == ref[i]
    tiny.engine.core.check_idle_invariants()


def test_stop_token_text_is_not_in_the_output(tiny):
    """vLLM drops a stop token's text from `text` (unless include_stop_str_in_output), as it does for EOS."""
    tok = tiny.get_tokenizer()
    ref = greedy(tiny, PROMPTS[1], max_tokens=24).token_ids
    i = first_new_token(ref, 2)
    assert tok.decode(ref[i: i + 1]).strip()  # the stop token has visible text
    out = greedy(tiny, PROMPTS[1], max_tokens=24, stop_token_ids=[ref[i]])
    assert out.text == tok.decode(ref[:i])
    kept = greedy(tiny, PROMPTS[1], max_tokens=24, stop_token_ids=[ref[i]], include_stop_str_in_output=True)
    assert kept.text == tok.decode(ref[: i + 1])


def test_min_tokens_delays_stop_token_ids(tiny):
    ref = greedy(tiny, PROMPTS[2], max_tokens=24).token_ids
    i = first_new_token(ref, 2)
    min_tokens = i + 3
    out = greedy(tiny, PROMPTS[2], max_tokens=24, stop_token_ids=[ref[i]], min_tokens=min_tokens)
    assert out.token_ids[:i] == ref[:i]
    assert len(out.token_ids) >= min_tokens
    assert ref[i] not in out.token_ids[:min_tokens]  # blocked while below min_tokens
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == ref[i] and out.stop_reason == ref[i]
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 24
    tiny.engine.core.check_idle_invariants()


# ---- stop strings ------------------------------------------------------------------------------------------


def token_offsets(tok, ids: list[int]) -> list[int]:
    """offsets[i] = length of the text of the first i tokens."""
    return [len(tok.decode(ids[:i])) for i in range(len(ids) + 1)]


def boundary_stop(tiny, prompt: str, near: int):
    """A stop string of 4 characters straddling the boundary between two tokens around index `near`, whose
    first occurrence in the greedy text is right there. Returns (ref output, token index completing it,
    char index where it starts, the stop string)."""
    tok = tiny.get_tokenizer()
    ref = greedy(tiny, prompt, max_tokens=32)
    off = token_offsets(tok, ref.token_ids)
    assert ref.text == tok.decode(ref.token_ids)
    for k in list(range(near, len(ref.token_ids) - 1)) + list(range(near - 1, 2, -1)):
        if off[k] - off[k - 1] >= 2 and off[k + 1] - off[k] >= 2:
            stop = ref.text[off[k] - 2: off[k] + 2]
            if ref.text.find(stop) == off[k] - 2 and "\ufffd" not in stop:
                return ref, k, off[k] - 2, stop
    raise AssertionError("no usable stop string in the greedy text")


def test_stop_string_ends_the_text_before_it(tiny):
    tok = tiny.get_tokenizer()
    ref, k, at, stop = boundary_stop(tiny, PROMPTS[0], near=12)
    out = greedy(tiny, PROMPTS[0], max_tokens=32, stop=stop)
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == ref.text[:at]
    assert stop not in out.text
    # Generation ended on the token that completed the stop string.
    assert out.token_ids == ref.token_ids[: k + 1]
    assert tok.decode(out.token_ids).startswith(out.text + stop)
    assert stop not in tok.decode(out.token_ids[:-1])
    tiny.engine.core.check_idle_invariants()


def test_stop_string_included_when_asked(tiny):
    ref, _, at, stop = boundary_stop(tiny, PROMPTS[0], near=12)
    out = greedy(tiny, PROMPTS[0], max_tokens=32, stop=stop, include_stop_str_in_output=True)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == ref.text[: at + len(stop)]
    assert out.text.endswith(stop)


def test_earliest_of_several_stop_strings_wins(tiny):
    ref, _, at, early = boundary_stop(tiny, PROMPTS[3], near=8)
    _, _, at2, late = boundary_stop(tiny, PROMPTS[3], near=20)
    assert at2 > at + len(early)
    out = greedy(tiny, PROMPTS[3], max_tokens=32, stop=[late, early])
    assert out.stop_reason == early
    assert out.text == ref.text[:at]


def test_streamed_text_never_shows_what_a_stop_string_removes(tiny):
    """Through the engine, every intermediate text is a prefix of the final one (the tail that may start a
    stop string is held back), and the final output is the one generate() gives."""
    ref, _, at, stop = boundary_stop(tiny, PROMPTS[0], near=12)
    engine = tiny.engine
    engine.add_request("stream-1", PROMPTS[0], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                                                 stop=stop))
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
    assert len(texts) > 3
    assert texts[-1] == ref.text[:at]
    for t in texts:
        assert texts[-1].startswith(t)
    engine.core.check_idle_invariants()


def test_stop_string_completed_by_the_last_allowed_token_reports_stop(tiny):
    """When the token that completes a stop string is also the max_tokens-th one, the text is cut at the stop
    string, so the finish reason must say so (vLLM: "stop", stop_reason = the string), not "length"."""
    ref, k, at, stop = boundary_stop(tiny, PROMPTS[0], near=12)
    out = greedy(tiny, PROMPTS[0], max_tokens=k + 1, stop=stop)
    assert out.text == ref.text[:at]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


# ---- n > 1, seeds ------------------------------------------------------------------------------------------


def test_n_samples_are_seeded_distinct_and_reproducible(tiny):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8)
    first = tiny.generate(PROMPTS[3], params, use_tqdm=False)[0]
    second = tiny.generate(PROMPTS[3], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert [c.text for c in first.outputs] == [c.text for c in second.outputs]
    samples = {tuple(c.token_ids) for c in first.outputs}
    assert len(samples) == 3
    assert all(len(c.token_ids) == 8 for c in first.outputs)
    other_seed = tiny.generate(PROMPTS[3], SamplingParams(n=3, temperature=1.0, seed=6, max_tokens=8),
                               use_tqdm=False)[0]
    assert [c.token_ids for c in other_seed.outputs] != [c.token_ids for c in first.outputs]
    tiny.engine.core.check_idle_invariants()


def test_n_greedy_samples_are_identical(tiny):
    out = tiny.generate(PROMPTS[0], SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    ref = greedy(tiny, PROMPTS[0], max_tokens=10)
    for c in out.outputs:
        assert c.token_ids == ref.token_ids and c.text == ref.text


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny):
    target = SamplingParams(temperature=1.0, seed=123, max_tokens=16, ignore_eos=True)
    alone = tiny.generate(PROMPTS[1], target, use_tqdm=False)[0].outputs[0].token_ids
    others = [
        ("A much longer prompt that takes more than one block of sixteen tokens in the cache, surely", None),
        ("x", 7), ("def g(y): return y", None), ("Lorem ipsum", 9), ("Owls", None), ("1 2 3 4 5", 123),
        ("Zebra", 0),
    ]
    prompts, params = [], []
    for i, (p, seed) in enumerate(others):
        if i == 3:
            prompts.append(PROMPTS[1])
            params.append(target)
        prompts.append(p)
        temperature = 0.8 if seed is None else 1.0
        params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=5 + 3 * i))
    outs = tiny.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 8
    assert outs[3].prompt == PROMPTS[1]
    assert outs[3].outputs[0].token_ids == alone
    # And seeded sampling really samples (the seed matters).
    reseeded = SamplingParams(temperature=1.0, seed=124, max_tokens=16, ignore_eos=True)
    other = tiny.generate(PROMPTS[1], reseeded, use_tqdm=False)[0].outputs[0].token_ids
    assert other != alone
    tiny.engine.core.check_idle_invariants()


# ---- logprobs ----------------------------------------------------------------------------------------------


def test_logprobs_hold_the_sampled_token_and_sum_to_the_cumulative(tiny):
    out = tiny.generate(PROMPTS[2], SamplingParams(temperature=1.0, seed=3, max_tokens=12, logprobs=3,
                                                   ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 12
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp
        assert 3 <= len(lp) <= 4
        assert all(v <= 0 for v in lp.values())
        assert sum(math.exp(v) for v in lp.values()) <= 1 + 1e-5
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)),
                                                   abs=1e-4)
    assert out.cumulative_logprob < 0


def test_greedy_logprobs_rank_the_chosen_token_first(tiny):
    out = greedy(tiny, PROMPTS[0], max_tokens=8, logprobs=3)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert len(lp) == 3
        assert lp[tok] == max(lp.values())
    none = greedy(tiny, PROMPTS[0], max_tokens=8, logprobs=0)
    assert all(list(lp) == [t] for t, lp in zip(none.token_ids, none.logprobs))
    assert none.cumulative_logprob == pytest.approx(out.cumulative_logprob, abs=1e-4)
    plain = greedy(tiny, PROMPTS[0], max_tokens=8)
    assert plain.logprobs is None and plain.cumulative_logprob is None


# ---- errors ------------------------------------------------------------------------------------------------


def test_token_id_outside_the_vocabulary_is_refused(tiny):
    vocab = tiny.engine.core.model_config.vocab_size
    with pytest.raises(InvalidRequest, match=str(vocab + 5)):
        tiny.generate({"prompt_token_ids": [5, 6, vocab + 5]}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert_idle_and_serving(tiny)
    with pytest.raises(InvalidRequest, match="-1"):
        tiny.generate({"prompt_token_ids": [5, -1]}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert_idle_and_serving(tiny)


def test_empty_prompt_is_refused(tiny):
    with pytest.raises(InvalidRequest, match="empty"):
        tiny.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(InvalidRequest, match="empty"):
        tiny.generate("", SamplingParams(max_tokens=4), use_tqdm=False)
    assert_idle_and_serving(tiny)


def test_prompt_plus_max_tokens_over_the_context_window_is_refused(tiny):
    limit = tiny.engine.max_model_len
    assert limit == 2048
    prompt = {"prompt_token_ids": list(range(10, 50))}
    with pytest.raises(ContextTooLong, match=str(limit)):
        tiny.generate(prompt, SamplingParams(max_tokens=limit - 39), use_tqdm=False)
    assert_idle_and_serving(tiny)
    # Exactly at the limit is fine.
    out = tiny.generate(prompt, SamplingParams(max_tokens=limit - 40, temperature=0, stop_token_ids=[
        greedy(tiny, prompt, max_tokens=1).token_ids[0]]), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "stop"
    with pytest.raises(ContextTooLong, match=str(limit)):
        tiny.generate({"prompt_token_ids": [7] * limit}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert_idle_and_serving(tiny)


def test_a_bad_prompt_in_a_batch_queues_none_of_the_batch(tiny):
    bad = {"prompt_token_ids": [10 ** 9]}
    with pytest.raises(InvalidRequest):
        tiny.generate([PROMPTS[0], PROMPTS[1], bad], SamplingParams(max_tokens=4), use_tqdm=False)
    assert_idle_and_serving(tiny)


def test_unknown_llm_argument_is_a_type_error():
    with pytest.raises(TypeError, match="foo"):
        LLM(foo=1)


def test_ignored_vllm_argument_is_accepted_with_a_warning(tiny_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=KV, gpu_memory_utilization=0.9)
    assert any("gpu_memory_utilization" in r.getMessage() and r.levelno == logging.WARNING
               for r in caplog.records)
    assert len(greedy(llm, "Hi", max_tokens=2).token_ids) == 2


# ---- abort -------------------------------------------------------------------------------------------------


def test_abort_mid_generation_frees_everything(tiny):
    engine = tiny.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ids = [f"abort-{i}" for i in range(4)]
    for rid, p in zip(ids, PROMPTS):
        engine.add_request(rid, p, params)
    for _ in range(4):
        engine.step()
    aborted = {ids[1], ids[3]}
    for rid in sorted(aborted):
        out = engine.abort_request(rid)
        assert out is not None and out.finished
        assert out.outputs[0].finish_reason == "abort"
        assert 0 < len(out.outputs[0].token_ids) < 20
    assert engine.abort_request(ids[1]) is None  # already gone
    assert engine.abort_request("never-added") is None
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in aborted
            if out.finished:
                final[out.request_id] = out
    assert set(final) == {ids[0], ids[2]}
    for rid in final:
        c = final[rid].outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 20
    assert final[ids[0]].outputs[0].token_ids == greedy(tiny, PROMPTS[0], max_tokens=20).token_ids
    engine.core.check_idle_invariants()


def test_abort_while_waiting_or_mid_prefill_frees_everything(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=KV, max_num_batched_tokens=16)
    engine = llm.engine
    long_prompt = {"prompt_token_ids": list(range(100, 160))}  # 60 tokens: four steps of prefill at 16 a step
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"w-{i}", long_prompt, params)
    engine.step()  # w-0 part-prefilled, the rest waiting
    assert engine.core.kv.num_free_blocks < engine.core.kv.pool.num_blocks
    assert engine.abort_request("w-0").outputs[0].finish_reason == "abort"  # mid-prefill
    assert engine.abort_request("w-3").outputs[0].token_ids == []  # never scheduled
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"w-1", "w-2"}
    assert all(len(o.outputs[0].token_ids) == 6 for o in done.values())
    engine.core.check_idle_invariants()


def test_abort_of_an_n_request_ends_every_sample(tiny):
    engine = tiny.engine
    engine.add_request("nabort", PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=30,
                                                            ignore_eos=True))
    engine.step()
    engine.step()
    out = engine.abort_request("nabort")
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests()
    engine.core.check_idle_invariants()


# ---- lifecycle ---------------------------------------------------------------------------------------------
def test_with_statement_shuts_down_and_later_work_is_refused_by_name(tiny_dir):
    """Leaving the block is shutdown(); a shut-down LLM says so rather than failing somewhere in its ranks."""
    with LLM(str(tiny_dir), dtype="float32", kv_cache_memory=KV) as llm:
        assert len(greedy(llm, PROMPTS[0], max_tokens=3).token_ids) == 3
        assert not llm.engine.is_shut_down
    assert llm.engine.is_shut_down
    with pytest.raises(RuntimeError, match="shut down; create a new LLM"):
        greedy(llm, PROMPTS[0], max_tokens=3)
    llm.shutdown()  # again: nothing to do


# ---- dtype -------------------------------------------------------------------------------------------------


def test_auto_dtype_is_one_whose_greedy_output_does_not_depend_on_the_batch(tiny_dir):
    """What `auto` promises on this CPU, checked rather than restated: the engine runs in the dtype it names,
    and in it a request's greedy tokens and logprobs are bit for bit the same alone and in a batch of 8
    (bfloat16 where our bfloat16 kernels run; float32, where they do not, is exact here too at these sizes)."""
    on_cpu = auto_dtype("cpu")
    assert on_cpu in ("bfloat16", "float32")
    llm = LLM(str(tiny_dir), dtype="auto", kv_cache_memory=KV)
    assert llm.engine.core.cache_info.dtype == on_cpu
    assert {p.dtype for p in llm.engine.core.runner.model.parameters()} == {DTYPES[on_cpu]}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = PROMPTS * 2
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    batched = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(alone, batched):
        assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)


def test_num_threads_sets_the_compute_threads(tiny_dir):
    before = torch.get_num_threads()
    try:
        llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory=KV, num_threads=1)
        assert torch.get_num_threads() == 1
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        torch.set_num_threads(before)


# ---- the real model ----------------------------------------------------------------------------------------


HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.slow
def test_chat_renders_the_template_and_replies(smol):
    out = smol.chat(HI, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert len(out) == 1
    hf = smol.get_tokenizer().hf_tokenizer
    expected = hf.apply_chat_template(HI, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert out[0].prompt_token_ids == list(expected)
    rendered = hf.decode(out[0].prompt_token_ids)
    assert rendered.startswith("<|im_start|>")
    assert "<|im_start|>user\nHi<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    assert out[0].outputs[0].text.strip()
    # A list of conversations gives one output each, in order.
    two = smol.chat([HI, [{"role": "user", "content": "Name a color."}]],
                    SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(two) == 2 and two[0].prompt_token_ids == out[0].prompt_token_ids
    assert two[1].prompt_token_ids != two[0].prompt_token_ids
    smol.engine.core.check_idle_invariants()


@pytest.mark.slow
def test_eos_ends_with_stop_and_min_tokens_delays_it(smol):
    free = smol.chat(HI, SamplingParams(max_tokens=48, temperature=0), use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "stop" and free.stop_reason is None
    assert free.token_ids[-1] == EOS_ID
    assert "<|im_end|>" not in free.text and free.text.strip()
    n = len(free.token_ids)
    held = smol.chat(HI, SamplingParams(max_tokens=n + 6, min_tokens=n + 3, temperature=0),
                     use_tqdm=False)[0].outputs[0]
    assert held.token_ids[: n - 1] == free.token_ids[: n - 1]
    assert EOS_ID not in held.token_ids[: n + 3]
    assert len(held.token_ids) >= n + 3
    smol.engine.core.check_idle_invariants()
