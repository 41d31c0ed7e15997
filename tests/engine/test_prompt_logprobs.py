"""prompt_logprobs (as vLLM has it): each prompt token's logprob given the ones before it, checked against a
full-prompt forward of Hugging Face transformers on the same tiny random model; the same however the prompt is
chunked, preempted, cached or sampled n times, and no KV block left behind."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.models.tiny import make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.messages import EngineCoreOutput, EngineOutputs
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.errors import InvalidRequest

KV = 64 << 20
VOCAB = 512
TOP = 5
PROMPT_LENGTHS = (2, 7, 16, 23, 41, 300)  # 300 > the runner's 256-row chunk of logits


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("plp"), vocab_size=VOCAB, num_kv_heads=2)


@pytest.fixture(scope="module")
def reference(model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        """[len - 1, vocab]: row i is the distribution of prompt token i + 1."""
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0].float()
        return logits.log_softmax(-1)[:-1]

    return logprobs


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 3, "ignore_eos": True, "prompt_logprobs": TOP, **kw})


def run(llm: LLM, ps: list[list[int]], p: SamplingParams):
    return llm.generate([{"prompt_token_ids": x} for x in ps], p, use_tqdm=False)


def assert_matches(plp, prompt: list[int], ref: torch.Tensor, top: int = TOP) -> None:
    assert plp[0] is None and len(plp) == len(prompt)
    for i, entry in enumerate(plp[1:]):
        token = prompt[i + 1]
        assert next(iter(entry)) == token  # the prompt token first
        assert entry[token] == pytest.approx(float(ref[i, token]), abs=1e-4)
        vals, ids = ref[i].topk(top)
        for t, v in zip(ids.tolist(), vals.tolist()):
            assert entry[t] == pytest.approx(v, abs=1e-4)
        assert len(entry) in (top, top + 1)


@pytest.mark.parametrize("batch_invariant", [True, False])  # False: a first chunk runs SDPA, rows reordered
def test_matches_transformers_full_forward(model_dir, reference, batch_invariant):
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=KV, batch_invariant=batch_invariant)
    ps = prompts()
    outs = run(llm, ps, params())
    for p, out in zip(ps, outs):
        assert_matches(out.prompt_logprobs, p, reference(p))
        assert len(out.outputs[0].token_ids) == 3
    zero = run(llm, ps[2:3], params(prompt_logprobs=0))[0].prompt_logprobs
    assert [list(e) for e in zero[1:]] == [[t] for t in ps[2][1:]]  # N = 0: just the prompt token
    plain = run(llm, ps[2:3], params(prompt_logprobs=None))[0]
    assert plain.prompt_logprobs is None
    llm.engine.core.check_idle_invariants()


def test_chunked_prefill_gives_the_same(model_dir, reference):
    ps = prompts(1)
    whole = run(LLM(str(model_dir), dtype="float32", kv_cache_memory=KV), ps, params())
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=KV, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    chunked = run(llm, ps, params())
    for p, a, b in zip(ps, whole, chunked):
        assert len(b.prompt_logprobs) == len(p)
        for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert ea.keys() == eb.keys()
            assert all(abs(ea[t] - eb[t]) < 1e-5 for t in ea)
        assert_matches(b.prompt_logprobs, p, reference(p))
    llm.engine.core.check_idle_invariants()


def test_prefix_cache_hit_is_skipped_for_prompt_logprobs(model_dir, reference):
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=KV, enable_prefix_caching=True)
    p = prompts(2)[4]  # 41 tokens: two whole blocks could come from the cache
    first = run(llm, [p], params(prompt_logprobs=None))[0]
    assert first.prompt_logprobs is None
    again = run(llm, [p], params())[0]  # the cache holds its prefix now, but it must compute every position
    assert again.num_cached_tokens == 0
    assert_matches(again.prompt_logprobs, p, reference(p))
    hit = run(llm, [p], params(prompt_logprobs=None))[0]  # its blocks joined the cache all the same
    assert hit.num_cached_tokens == 32
    llm.engine.core.check_idle_invariants()


def test_n_samples_share_one_list(model_dir, reference):
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=KV)
    p = prompts(3)[3]
    out = run(llm, [p], params(n=3, temperature=1.0, seed=7))[0]
    assert len(out.outputs) == 3
    assert_matches(out.prompt_logprobs, p, reference(p))
    llm.engine.core.check_idle_invariants()


@pytest.mark.parametrize("after_tokens", [False, True])
def test_preemption_recompute_reports_each_position_once(model_dir, reference, after_tokens):
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=KV, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    engine, core = llm.engine, llm.engine.core
    p = prompts(4)[4]
    engine.add_request("r", {"prompt_token_ids": p}, params(max_tokens=5))
    steps = 5 if after_tokens else 2  # 41 tokens in chunks of 16: three steps to the first token
    for _ in range(steps):
        engine.step()
    req = core.scheduler.requests["r"]
    assert req.num_prompt_logprobs == (40 if after_tokens else 32)
    core.scheduler._preempt(req)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    assert out.finished and len(out.outputs[0].token_ids) == 5
    assert_matches(out.prompt_logprobs, p, reference(p))
    core.check_idle_invariants()


def test_one_token_prompt_has_just_none(model_dir):
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=KV)
    out = run(llm, [[5]], params())[0]
    assert out.prompt_logprobs == [None]
    llm.engine.core.check_idle_invariants()


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_bad_values_are_refused(bad):
    with pytest.raises(InvalidRequest, match=r"prompt_logprobs must be an integer in \[0, 20\]") as e:
        SamplingParams(prompt_logprobs=bad)
    assert e.value.param == "prompt_logprobs"


class _Chars:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def test_output_processor_accumulates_the_first_sample_only():
    proc = OutputProcessor(_Chars(), frozenset())
    state, msgs = proc.add_request("r", "abc", [97, 98, 99], SamplingParams(n=2, prompt_logprobs=1), 2)
    assert [m.params.prompt_logprobs for m in msgs] == [1, None]  # computed once, by the first sample
    proc.process(EngineOutputs([EngineCoreOutput("r#0", [], new_prompt_logprobs=[{98: -1.0, 5: -0.5}])]))
    proc.process(EngineOutputs([EngineCoreOutput("r#0", [100], new_prompt_logprobs=[{99: -2.0, 5: -0.1}]),
                                EngineCoreOutput("r#1", [101], new_prompt_logprobs=[{99: -9.0}])]))
    out = state.output()
    assert out.prompt_logprobs == [None, {98: -1.0, 5: -0.5}, {99: -2.0, 5: -0.1}]
    assert [o.token_ids for o in out.outputs] == [[100], [101]]
