"""Speculative decoding through the whole engine, on a tiny random model (and one SmolLM2 check): lossless output
(greedy token for token, seeded sampling token for token, unseeded sampling in distribution), whatever the drafts
(prompt lookup, always right, always wrong, half right, random); the end of a request inside an accepted run (max
tokens, EOS, stop token ids, stop strings); logprobs; n samples, prefix caching, chunked prefill, preemption and
aborts, each ending with every KV block free."""

from __future__ import annotations

import math
import os
import random
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from tests.models.tiny import SMOLLM2_VOCAB, make_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.messages import AddRequest
from tokenmill.request import Request
from tokenmill.spec_stats import SpecDecodeStats

KV = 32 << 20
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PROMPTS = [
    "The capital of France is",
    "one two three four one two three four one two three four one two three",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return",
    "Hello world, this is a longer prompt",
]
MAX_TOKENS = 32


# ---- fixtures and helpers ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("spec"), arch="llama", num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module", autouse=True)
def restore_threads():
    """The engines here run one compute thread (tiny models gain nothing from more, and on a busy 2-core machine
    two threads can wait on each other far longer than they compute); the process's setting comes back after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def make_llm(path, spec: dict | None = SPEC, proposer=None, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", KV)
    kw.setdefault("num_threads", 1)
    if spec is not None:
        kw["speculative_config"] = spec
    llm = LLM(str(path), dtype="float32", **kw)
    if proposer is not None:
        llm.engine.core.speculator.proposer = proposer
        llm.engine.core.speculator.cost = None  # speculate whatever the measured step cost says: deterministic
    return llm


@pytest.fixture(scope="module")
def base(tiny_dir):
    """No speculation: the reference."""
    return make_llm(tiny_dir, spec=None)


def greedy_params(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def generate(llm: LLM, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def stats(llm: LLM) -> SpecDecodeStats:
    return llm.engine.core.scheduler.spec_stats


def sample_index(request: Request) -> int:
    return int(request.request_id.rsplit("#", 1)[1]) if "#" in request.request_id else 0


def refs_of(outputs) -> dict[tuple[tuple[int, ...], int], list[int]]:
    """(prompt token ids, sample index) -> that sample's tokens, for the proposers below."""
    return {(tuple(o.prompt_token_ids), c.index): list(c.token_ids) for o in outputs for c in o.outputs}


def wrong(token: int) -> int:
    return (token + 1) % SMOLLM2_VOCAB


class ReferenceProposer:
    """Drafts from a known continuation: the first `right` tokens of each proposal are the reference's, the rest
    are wrong (right None: all of them right). `extra` proposes that many more tokens than asked. Records every
    (request id, k) it was asked."""

    lookahead = 0
    draft_probs: dict = {}  # its drafts are point masses: never written

    def __init__(self, refs: dict, right: int | None = None, extra: int = 0):
        self.refs, self.right, self.extra = refs, right, extra
        self.asked: list[tuple[str, int]] = []
        self.overreach: list[tuple[str, int]] = []  # asked for drafts reaching max_tokens or past it
        self.forgotten: list[str] = []

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        out = []
        for r, k in zip(requests, ks):
            self.asked.append((r.request_id, k))
            if r.num_output_tokens + k + 1 > r.max_tokens:
                self.overreach.append((r.request_id, k))
            ref = self.refs[(tuple(r.prompt_token_ids), sample_index(r))]
            pos = r.num_output_tokens
            truth = ref[pos:pos + k + self.extra]
            right = len(truth) if self.right is None else min(self.right, len(truth))
            out.append(truth[:right] + [wrong(t) for t in truth[right:]])
        return out

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)

    def ks_of(self, request_id: str) -> list[int]:
        return [k for rid, k in self.asked if rid == request_id]


class RandomProposer:
    lookahead = 0
    draft_probs: dict = {}  # its drafts are point masses: never written

    def __init__(self, seed: int = 0, vocab: int = SMOLLM2_VOCAB):
        self.rng, self.vocab = random.Random(seed), vocab

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(k)] for k in ks]

    def forget(self, request_id: str) -> None:
        pass


class LikelyProposer:
    """Proposes the most frequent continuation seen in samples of the target (per output prefix): drafts the target
    often draws, so many are accepted."""

    lookahead = 0
    draft_probs: dict = {}  # its drafts are point masses: never written

    def __init__(self, samples: list[list[int]]):
        self.next: dict[tuple[int, ...], Counter] = {}
        for t in samples:
            for p in range(len(t)):
                self.next.setdefault(tuple(t[:p]), Counter())[t[p]] += 1

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        out = []
        for r, k in zip(requests, ks):
            seen, drafts = list(r.output_token_ids), []
            while len(drafts) < k and tuple(seen) in self.next:
                drafts.append(self.next[tuple(seen)].most_common(1)[0][0])
                seen.append(drafts[-1])
            out.append(drafts)
        return out

    def forget(self, request_id: str) -> None:
        pass


def idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    llm.engine.core.check_idle_invariants()


@pytest.fixture(scope="module")
def greedy_ref(base):
    return generate(base, PROMPTS, greedy_params())


# ---- greedy: token for token -------------------------------------------------------------------------------


def test_greedy_output_with_prompt_lookup_is_token_identical(tiny_dir, greedy_ref):
    llm = make_llm(tiny_dir)
    assert llm.engine.core.speculator is not None
    outs = generate(llm, PROMPTS, greedy_params())
    assert tokens(outs) == tokens(greedy_ref)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in greedy_ref]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    s = stats(llm)
    assert s.num_drafts > 0 and s.num_accepted_tokens > 0, s.describe()  # the repetitive prompts' drafts land
    assert s.mean_accepted_length > 1
    assert 0 < s.acceptance_rate <= 1
    idle(llm)


def test_no_speculation_means_no_speculator_and_no_stats(base):
    assert base.engine.core.speculator is None and base.engine.core.scheduler.spec_stats is None


@pytest.mark.parametrize("kind", ["right", "wrong", "half", "random"])
def test_greedy_output_is_the_same_whatever_the_drafts(tiny_dir, greedy_ref, kind):
    refs = refs_of(greedy_ref)
    proposer = {"right": lambda: ReferenceProposer(refs), "wrong": lambda: ReferenceProposer(refs, right=0),
                "half": lambda: ReferenceProposer(refs, right=2), "random": lambda: RandomProposer(1)}[kind]()
    llm = make_llm(tiny_dir, proposer=proposer)
    outs = generate(llm, PROMPTS, greedy_params())
    assert tokens(outs) == tokens(greedy_ref)
    s = stats(llm)
    assert s.num_drafts > 0 and s.num_draft_tokens > 0
    if kind == "random":
        idle(llm)
        return
    ks = [k for _, k in proposer.asked]
    assert s.num_draft_tokens == sum(ks)  # every proposal verified once, none cut
    assert s.num_drafts == len(ks)
    if kind == "right":
        assert s.acceptance_rate == 1.0 and s.num_accepted_tokens == s.num_draft_tokens
        assert s.acceptance_by_position() == [1.0] * 4
        assert s.mean_accepted_length > 4  # k = 4 nearly every time (the last proposals are capped)
    elif kind == "wrong":
        assert s.num_accepted_tokens == 0 and s.acceptance_rate == 0.0 and s.mean_accepted_length == 1.0
        for o in outs:  # adaptive k: halved on each rejection, down to one
            assert proposer.ks_of(o.request_id)[:4] == [4, 2, 1, 1]
    else:
        assert s.acceptance_by_position() == [1.0, 1.0, 0.0, 0.0]
        assert s.num_accepted_tokens == sum(min(k, 2) for k in ks)
        assert 0.4 < s.acceptance_rate < 0.6
    idle(llm)


def test_always_right_drafts_take_five_tokens_a_step(tiny_dir, greedy_ref):
    llm = make_llm(tiny_dir, proposer=ReferenceProposer(refs_of(greedy_ref)))
    engine = llm.engine
    for max_tokens in (1, 2, 5, 6, 20, 32):
        engine.add_request("one", PROMPTS[0], greedy_params(max_tokens))
        steps, final = 0, None
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                final = out
        assert final.outputs[0].token_ids == greedy_ref[0].outputs[0].token_ids[:max_tokens]
        # the prompt's step brings one token, then each verify pass 1 + k = min(5, tokens left)
        assert steps == 1 + math.ceil((max_tokens - 1) / 5), max_tokens
    idle(llm)


def test_a_request_that_opts_out_never_drafts(tiny_dir, greedy_ref):
    proposer = ReferenceProposer(refs_of(greedy_ref))
    llm = make_llm(tiny_dir, proposer=proposer)
    params = [greedy_params(speculate=(i % 2 == 0)) for i in range(len(PROMPTS))]
    outs = generate(llm, PROMPTS, params)
    assert tokens(outs) == tokens(greedy_ref)
    asked = {rid for rid, _ in proposer.asked}
    assert asked == {o.request_id for i, o in enumerate(outs) if i % 2 == 0}
    idle(llm)


def test_speculation_pauses_while_more_than_disable_by_batch_size_run(tiny_dir, base):
    prompts = [f"Item {i}: the quick brown fox" for i in range(9)]
    ref = generate(base, prompts, greedy_params(12))
    proposer = ReferenceProposer(refs_of(ref))
    llm = make_llm(tiny_dir, spec={**SPEC, "disable_by_batch_size": 8}, proposer=proposer)
    assert tokens(generate(llm, prompts, greedy_params(12))) == tokens(ref)
    assert proposer.asked == [] and stats(llm).num_drafts == 0  # nine ran together from start to end
    llm = make_llm(tiny_dir, spec={**SPEC, "disable_by_batch_size": 9}, proposer=ReferenceProposer(refs_of(ref)))
    assert tokens(generate(llm, prompts, greedy_params(12))) == tokens(ref)
    assert stats(llm).num_drafts > 0 and stats(llm).acceptance_rate == 1.0
    idle(llm)


# ---- sampling: the target's distribution, exactly ----------------------------------------------------------


def sampled_params(seed: int, max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def seeded_ref(base):
    return generate(base, PROMPTS, [sampled_params(100 + i) for i in range(len(PROMPTS))])


@pytest.mark.parametrize("kind", ["ngram", "right", "half", "random"])
def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(tiny_dir, seeded_ref, kind):
    refs = refs_of(seeded_ref)
    proposer = {"ngram": None, "right": ReferenceProposer(refs), "half": ReferenceProposer(refs, right=2),
                "random": RandomProposer(2)}[kind]
    llm = make_llm(tiny_dir, proposer=proposer)
    outs = generate(llm, PROMPTS, [sampled_params(100 + i) for i in range(len(PROMPTS))])
    assert tokens(outs) == tokens(seeded_ref)
    s = stats(llm)
    assert s.num_drafts > 0
    if kind == "right":  # each draft is the token the target draws at that position: all accepted
        assert s.acceptance_rate == 1.0
    if kind == "half":
        assert s.acceptance_by_position() == [1.0, 1.0, 0.0, 0.0]
    idle(llm)


def chi2_homogeneity(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Two-sample chi-square test that `a` and `b` come from one distribution: categories too rare for the test
    (expected count under `min_expected` on a side) are pooled into one. Returns (statistic, df, p-value)."""
    na, nb = sum(a.values()), sum(b.values())
    frac_a = na / (na + nb)
    keep = [c for c in set(a) | set(b) if min((a[c] + b[c]) * frac_a, (a[c] + b[c]) * (1 - frac_a)) >= min_expected]
    rows = [(a[c], b[c]) for c in keep]
    rest = (na - sum(x for x, _ in rows), nb - sum(y for _, y in rows))
    if sum(rest) > 0:
        rows.append(rest)
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, expected in ((x, total * frac_a), (y, total * (1 - frac_a))):
            stat += (observed - expected) ** 2 / expected
    df = len(rows) - 1
    if df < 1:
        return stat, df, 1.0
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p


def test_chi2_helper_tells_equal_from_different_distributions():
    rng = random.Random(0)
    same_a = Counter(rng.choices(range(6), weights=[5, 4, 3, 2, 1, 1], k=600))
    same_b = Counter(rng.choices(range(6), weights=[5, 4, 3, 2, 1, 1], k=600))
    other = Counter(rng.choices(range(6), weights=[1, 1, 2, 3, 4, 5], k=600))
    assert chi2_homogeneity(same_a, same_b)[2] > 0.01
    assert chi2_homogeneity(same_a, other)[2] < 1e-6


SAMPLES = 240  # per side
DIST_TOKENS = 4


def test_sampled_tokens_follow_the_target_distribution_whatever_the_drafts(tiny_dir, base):
    """Independent samples (different seeds) with and without speculation: each output position's token has the
    same distribution. Drafts are random (rejected: the target's own token is kept) or the continuation the target
    draws most often (often accepted)."""
    prompt = PROMPTS[1]

    def params(seeds):
        return [SamplingParams(temperature=1.0, top_k=8, seed=s, max_tokens=DIST_TOKENS, ignore_eos=True)
                for s in seeds]

    def positions(samples) -> list[Counter]:
        return [Counter(t[p] for t in samples) for p in range(DIST_TOKENS)]

    plain = tokens(generate(base, [prompt] * SAMPLES, params(range(SAMPLES))))
    spec = {**SPEC, "disable_by_batch_size": SAMPLES}
    for name, proposer, seed0 in (("random", RandomProposer(3), 10_000), ("likely", LikelyProposer(plain), 20_000)):
        llm = make_llm(tiny_dir, spec=spec, proposer=proposer)
        drafted = tokens(generate(llm, [prompt] * SAMPLES, params(range(seed0, seed0 + SAMPLES))))
        s = stats(llm)
        assert s.num_drafts >= SAMPLES, (name, s.describe())
        if name == "likely":
            assert s.num_accepted_tokens > SAMPLES // 2, s.describe()  # the accepting path is exercised
        for p, (a, b) in enumerate(zip(positions(plain), positions(drafted))):
            stat, df, pvalue = chi2_homogeneity(a, b)
            assert df >= 2, (name, p, a, b)
            assert pvalue > 0.01, f"{name} drafts, position {p}: chi2 {stat:.1f} on {df} df, p = {pvalue:.2g}"
        idle(llm)


# ---- the end of a request inside an accepted run -----------------------------------------------------------


def test_max_tokens_is_never_exceeded(tiny_dir, greedy_ref):
    ref = greedy_ref[0].outputs[0].token_ids
    spec = {**SPEC, "disable_by_batch_size": 16}
    for proposer in (ReferenceProposer(refs_of(greedy_ref)), None):
        llm = make_llm(tiny_dir, spec=spec, proposer=proposer)
        outs = generate(llm, [PROMPTS[0]] * 9, [greedy_params(m) for m in range(1, 10)])
        for m, o in zip(range(1, 10), outs):
            c = o.outputs[0]
            assert c.token_ids == ref[:m] and c.finish_reason == "length", m
        if proposer is not None:
            assert proposer.asked and proposer.overreach == []  # never asked for more than there is room for
            assert stats(llm).acceptance_rate == 1.0
        idle(llm)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_drafts_past_max_tokens_are_cut_at_max_tokens(tiny_dir, greedy_ref, prefix_caching):
    """A proposer that offers more than asked (here 5 more): the tokens past max_tokens are dropped in the
    scheduler's update (SampledTokens.truncate), never output, and every block comes back."""
    ref = greedy_ref[0].outputs[0].token_ids
    for m in range(1, 10):
        llm = make_llm(tiny_dir, proposer=ReferenceProposer(refs_of(greedy_ref), extra=5), block_size=4,
                       enable_prefix_caching=prefix_caching)
        c = generate(llm, PROMPTS[0], greedy_params(m))[0].outputs[0]
        assert c.token_ids == ref[:m] and c.finish_reason == "length", m
        idle(llm)


def inside_accepted_runs(ref: list[int], last: int) -> list[int]:
    """Output positions i <= last whose token first appears there and that always-right drafts bring inside a
    verify pass's accepted run (not its last token): the prompt's step brings token 0, each pass 5 tokens."""
    return [i for i in range(1, last + 1) if i % 5 != 0 and ref[i] not in ref[:i]]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_stop_token_id_inside_an_accepted_run_ends_the_output_there(tiny_dir, base, greedy_ref, prefix_caching):
    ref = greedy_ref[0].outputs[0].token_ids
    positions = inside_accepted_runs(ref, 18)
    assert len(positions) >= 5
    proposer = ReferenceProposer(refs_of(greedy_ref))
    llm = make_llm(tiny_dir, spec={**SPEC, "disable_by_batch_size": 64}, proposer=proposer, block_size=4,
                   enable_prefix_caching=prefix_caching)
    params = [greedy_params(stop_token_ids=[ref[i]], logprobs=1) for i in positions]
    outs = generate(llm, [PROMPTS[0]] * len(positions), params)
    plain = generate(base, [PROMPTS[0]] * len(positions), params)
    for i, o, p in zip(positions, outs, plain):
        c = o.outputs[0]
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (ref[:i + 1], "stop", ref[i]), i
        assert (c.text, c.token_ids) == (p.outputs[0].text, p.outputs[0].token_ids)
        assert_same_logprobs(c, p.outputs[0])  # the logprobs of the tokens past the stop token are dropped too
    assert stats(llm).acceptance_rate == 1.0
    idle(llm)


def test_a_stop_token_in_an_accepted_run_with_the_default_blocks(tiny_dir, base):
    """The same with the defaults (16-token blocks, prefix caching on): an 11-token prompt's first verify pass
    computes positions 11..15 (the last sampled token and 4 drafts), all accepted, so 16 tokens are computed, a
    whole block; a stop token at output position 1..3 ends the request with 13..15 tokens committed."""
    prompt = {"prompt_token_ids": [1000 + 97 * j for j in range(11)]}
    ref_out = generate(base, prompt, greedy_params())
    ref = ref_out[0].outputs[0].token_ids
    positions = [i for i in (1, 2, 3) if ref[i] not in ref[:i]]
    assert positions
    for i in positions:
        llm = make_llm(tiny_dir, proposer=ReferenceProposer(refs_of(ref_out)))
        c = generate(llm, prompt, greedy_params(stop_token_ids=[ref[i]]))[0].outputs[0]
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (ref[:i + 1], "stop", ref[i]), i
        idle(llm)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_eos_inside_an_accepted_run_ends_the_output_there(tiny_dir, base, greedy_ref, monkeypatch, prefix_caching):
    """The tiny model never draws SmolLM2's EOS, so the test makes a token of its greedy output the EOS id (the
    output processor hands the core its EOS ids with each request)."""
    ref = greedy_ref[0].outputs[0].token_ids
    for i in inside_accepted_runs(ref, 12):
        llm = make_llm(tiny_dir, proposer=ReferenceProposer(refs_of(greedy_ref)), block_size=4,
                       enable_prefix_caching=prefix_caching)
        for engine in (llm.engine, base.engine):
            monkeypatch.setattr(engine.processor, "eos_token_ids", frozenset({ref[i]}))
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        c = generate(llm, PROMPTS[0], params)[0].outputs[0]
        p = generate(base, PROMPTS[0], params)[0].outputs[0]
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (ref[:i + 1], "stop", None), i
        assert c.text == p.text  # the EOS token's text is not output
        idle(llm)


def token_texts(llm: LLM, prompt_ids: list[int], ids: list[int]) -> list[str]:
    """The output text after each token, as the engine's detokenizer builds it."""
    detok = IncrementalDetokenizer(llm.get_tokenizer(), prompt_ids, [])
    texts = [""]
    for t in ids:
        detok.append([t])
        texts.append(detok.text)
    return texts


def test_a_stop_string_completed_mid_step_cuts_the_text_and_tokens_there(tiny_dir, base, greedy_ref, monkeypatch):
    out = greedy_ref[0]
    ref = out.outputs[0].token_ids
    texts = token_texts(base, out.prompt_token_ids, ref)
    cases = []  # (i, stop): the text token i adds, found nowhere before it
    for i in range(1, 19):
        piece = texts[i + 1][len(texts[i]):]
        if i % 5 != 0 and piece.strip() and "\ufffd" not in piece and piece not in texts[i]:
            cases.append((i, piece))
    assert len(cases) >= 3, texts
    proposer = ReferenceProposer(refs_of(greedy_ref))
    llm = make_llm(tiny_dir, spec={**SPEC, "disable_by_batch_size": 64}, proposer=proposer)
    core = llm.engine.core
    emitted: dict[str, list[int]] = {}  # what the core sent for each request, all steps together
    step = core.step

    def recording_step():
        result = step()
        for o in result.outputs:
            emitted.setdefault(o.request_id, []).extend(o.new_token_ids)
        return result

    monkeypatch.setattr(core, "step", recording_step)
    params = [greedy_params(stop=[stop]) for _, stop in cases]
    outs = generate(llm, [PROMPTS[0]] * len(cases), params)
    plain = generate(base, [PROMPTS[0]] * len(cases), params)
    for (i, stop), o, p in zip(cases, outs, plain):
        c = o.outputs[0]
        assert (c.token_ids, c.finish_reason, c.stop_reason) == (ref[:i + 1], "stop", stop), (i, stop)
        assert c.text == texts[i + 1][:texts[i + 1].index(stop)] == p.outputs[0].text
        assert c.token_ids == p.outputs[0].token_ids
        assert len(emitted[o.request_id]) > i + 1  # the core's step brought tokens past the stop: they were cut
    idle(llm)


def test_stop_strings_with_include_and_logprobs_are_cut_consistently(tiny_dir, base, greedy_ref):
    out = greedy_ref[0]
    ref = out.outputs[0].token_ids
    texts = token_texts(base, out.prompt_token_ids, ref)
    i = next(i for i in range(2, 19) if i % 5 not in (0, 4) and texts[i + 1][len(texts[i]):].strip()
             and texts[i + 1][len(texts[i]):] not in texts[i] and "\ufffd" not in texts[i + 1])
    stop = texts[i + 1][len(texts[i]):]
    llm = make_llm(tiny_dir, proposer=ReferenceProposer(refs_of(greedy_ref)))
    params = greedy_params(stop=[stop], include_stop_str_in_output=True, logprobs=1)
    c = generate(llm, PROMPTS[0], params)[0].outputs[0]
    p = generate(base, PROMPTS[0], params)[0].outputs[0]
    assert c.token_ids == ref[:i + 1] == p.token_ids and c.text == p.text and c.text.endswith(stop)
    assert len(c.logprobs) == len(c.token_ids)
    assert c.cumulative_logprob == pytest.approx(sum(lp[t] for lp, t in zip(c.logprobs, c.token_ids)), abs=1e-5)
    assert c.cumulative_logprob == pytest.approx(p.cumulative_logprob, abs=1e-4)
    idle(llm)


# ---- logprobs ----------------------------------------------------------------------------------------------


def assert_same_logprobs(a, b, tol: float = 1e-4) -> None:
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
    for pos, (x, y, t) in enumerate(zip(a.logprobs, b.logprobs, a.token_ids)):
        assert next(iter(x)) == t == next(iter(y)), pos  # the sampled token first
        assert set(x) == set(y), pos
        for tok in x:
            assert abs(x[tok] - y[tok]) < tol, (pos, tok, x[tok], y[tok])
    assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=tol * len(a.token_ids))


@pytest.mark.parametrize("kind", ["ngram", "right", "half"])
def test_logprobs_with_speculation_equal_those_without(tiny_dir, base, kind):
    greedy = greedy_params(logprobs=2)
    sampled = [sampled_params(200 + i, logprobs=2) for i in range(len(PROMPTS))]
    plain_greedy = generate(base, PROMPTS, greedy)
    plain_sampled = generate(base, PROMPTS, sampled)
    for plain, params in ((plain_greedy, greedy), (plain_sampled, sampled)):
        proposer = None if kind == "ngram" else ReferenceProposer(refs_of(plain), right=None if kind == "right"
                                                                    else 2)
        llm = make_llm(tiny_dir, proposer=proposer)
        outs = generate(llm, PROMPTS, params)
        for o, p in zip(outs, plain):
            assert_same_logprobs(o.outputs[0], p.outputs[0])
        assert stats(llm).num_accepted_tokens > 0
        idle(llm)


# ---- n samples, prefix caching, chunked prefill, preemption, aborts ----------------------------------------


def test_n_samples_and_prefix_cache_hits_give_the_same_outputs(tiny_dir, base):
    prompts = [PROMPTS[1], PROMPTS[2]]
    params = [SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
              greedy_params(24, n=2)]
    plain = generate(base, prompts, params)
    for proposer in (None, ReferenceProposer(refs_of(plain))):
        llm = make_llm(tiny_dir, proposer=proposer, block_size=4)  # 4-token blocks: both prompts fill some
        first = generate(llm, prompts, params)
        assert tokens(first) == tokens(plain)
        again = generate(llm, prompts, params)  # the prompts' blocks are cached now
        assert all(o.num_cached_tokens > 0 for o in again)
        assert tokens(again) == tokens(plain)
        assert stats(llm).num_accepted_tokens > 0
        if proposer is not None:
            assert stats(llm).acceptance_rate == 1.0
        idle(llm)


def test_greedy_prefix_cache_sharing_between_speculating_requests(tiny_dir, base):
    """Requests that share a long prefix (cached blocks) and diverge after it, admitted while others decode with
    drafts: blocks written by drafts never end up in the cache under the wrong tokens."""
    shared = "Rename x to y everywhere: x = 1; x += 2; print(x); x = x * x; return x. "
    prompts = [shared + tail for tail in ("First.", "Second one.", "Third?", "x = 1; x += 2;")]
    ref = generate(base, prompts, greedy_params(40))
    llm = make_llm(tiny_dir, block_size=4)
    engine = llm.engine
    done = {}
    for i, p in enumerate(prompts):  # staggered: each arrives while the earlier ones are speculating
        engine.add_request(f"s{i}", p, greedy_params(40))
        for _ in range(3):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[f"s{i}"].outputs[0].token_ids for i in range(len(prompts))] == tokens(ref)
    assert any(done[f"s{i}"].num_cached_tokens > 0 for i in range(1, len(prompts)))
    again = generate(llm, prompts, greedy_params(40))  # now from cached blocks, including output blocks
    assert tokens(again) == tokens(ref)
    assert stats(llm).num_accepted_tokens > 0
    idle(llm)


@pytest.mark.parametrize("budget", [3, 8])
def test_chunked_prefill_and_a_small_budget_that_cuts_drafts(tiny_dir, base, budget):
    prompts = [{"prompt_token_ids": list(range(1000 + 37 * i, 1000 + 37 * i + n))} for i, n in
               enumerate((23, 9, 41))] + [PROMPTS[1]]
    ref = generate(base, prompts, greedy_params(24))
    proposer = ReferenceProposer(refs_of(ref))
    llm = make_llm(tiny_dir, proposer=proposer, max_num_batched_tokens=budget)
    outs = generate(llm, prompts, greedy_params(24))
    assert tokens(outs) == tokens(ref)
    s = stats(llm)
    assert s.acceptance_rate == 1.0
    assert s.num_draft_tokens < sum(k for _, k in proposer.asked)  # the budget cut some drafts off
    ngram = make_llm(tiny_dir, max_num_batched_tokens=budget)
    assert tokens(generate(ngram, prompts, greedy_params(24))) == tokens(ref)
    idle(llm)
    idle(ngram)


@pytest.mark.parametrize("kind", ["ngram", "right", "half"])
def test_preemption_while_speculating(tiny_dir, base, kind):
    prompts = PROMPTS + [PROMPTS[1] + " five", PROMPTS[2] + " a * b"]
    ref = generate(base, prompts, greedy_params(48))
    per_token = base.engine.core.cache_info.kv_bytes_per_token
    proposer = None if kind == "ngram" else ReferenceProposer(refs_of(ref), right=None if kind == "right" else 2)
    # 16 blocks of 8 tokens: each request fits alone (at most ~80 tokens), the six together do not
    llm = make_llm(tiny_dir, proposer=proposer, block_size=8, kv_cache_memory=16 * 8 * per_token,
                   new_token_ratio=0)  # no headroom for decode growth: admitted together, then preempted
    assert llm.engine.core.cache_info.num_blocks == 16
    outs = generate(llm, prompts, greedy_params(48))
    assert tokens(outs) == tokens(ref)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert stats(llm).num_drafts > 0
    idle(llm)


def test_preemption_with_seeded_sampling_and_prefix_caching_off(tiny_dir, base):
    prompts = PROMPTS + [PROMPTS[1] + " five"]
    params = [sampled_params(300 + i, max_tokens=48) for i in range(len(prompts))]
    ref = generate(base, prompts, params)
    per_token = base.engine.core.cache_info.kv_bytes_per_token
    llm = make_llm(tiny_dir, proposer=ReferenceProposer(refs_of(ref)), block_size=8,
                   kv_cache_memory=16 * 8 * per_token, enable_prefix_caching=False, new_token_ratio=0)
    assert tokens(generate(llm, prompts, params)) == tokens(ref)
    assert llm.engine.core.scheduler.num_preemptions > 0 and stats(llm).acceptance_rate == 1.0
    idle(llm)


def test_abort_mid_generation_with_drafts_pending(tiny_dir, greedy_ref):
    llm = make_llm(tiny_dir, proposer=ReferenceProposer(refs_of(greedy_ref)))
    engine, core = llm.engine, llm.engine.core
    ids = [f"a{i}" for i in range(len(PROMPTS))]
    for rid, p in zip(ids, PROMPTS):
        engine.add_request(rid, p, greedy_params())
    engine.step()
    engine.step()
    pending = {r.request_id for r in core.scheduler.running if r.spec_token_ids}
    assert {"a1", "a3"} <= pending  # drafted, not verified yet
    for rid in ("a1", "a3"):
        c = engine.abort_request(rid).outputs[0]
        assert c.finish_reason == "abort" and 0 < len(c.token_ids) < MAX_TOKENS
        assert c.token_ids == greedy_ref[int(rid[1])].outputs[0].token_ids[:len(c.token_ids)]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id in ("a0", "a2")
            if out.finished:
                final[out.request_id] = out
    assert final["a0"].outputs[0].token_ids == greedy_ref[0].outputs[0].token_ids
    assert final["a2"].outputs[0].token_ids == greedy_ref[2].outputs[0].token_ids
    idle(llm)


def test_abort_through_the_core_while_requests_speculate(tiny_dir, greedy_ref):
    proposer = ReferenceProposer(refs_of(greedy_ref))
    llm = make_llm(tiny_dir, proposer=proposer, max_num_batched_tokens=16)
    core = llm.engine.core
    prompt_ids = [o.prompt_token_ids for o in greedy_ref]
    for i, ids in enumerate(prompt_ids):
        core.add_request(AddRequest(f"c{i}", ids, greedy_params(), MAX_TOKENS, frozenset(), 0.0))
    got: dict[str, list[int]] = {f"c{i}": [] for i in range(len(prompt_ids))}
    aborted, with_drafts = set(), set()
    for o in core.step().outputs:  # c0 and part of c1's prompt (16 tokens a step)
        got[o.request_id].extend(o.new_token_ids)
    core.abort(["c3"])  # never scheduled yet
    aborted.add("c3")
    for _ in range(200):
        if not core.has_unfinished:
            break
        for o in core.step().outputs:
            got[o.request_id].extend(o.new_token_ids)
        drafted = [r.request_id for r in core.scheduler.running if r.spec_token_ids]
        if drafted and len(with_drafts) < 2:
            core.abort([drafted[0]])  # with drafts pending, not verified yet
            aborted.add(drafted[0])
            with_drafts.add(drafted[0])
    assert len(with_drafts) == 2
    core.abort(["c3", "never-added"])  # ended or unknown: nothing happens
    assert not core.has_unfinished
    core.check_idle_invariants()
    for i in range(len(prompt_ids)):
        rid = f"c{i}"
        ref = greedy_ref[i].outputs[0].token_ids
        assert got[rid] == ref[:len(got[rid])]
        if rid not in aborted:
            assert got[rid] == ref


def test_no_speculation_state_outlives_its_request(tiny_dir, greedy_ref, base):
    """The Speculator's per-request adaptive k (and the proposer's state) goes when the request goes, however it
    ends: a server runs for days, one entry per request would grow without bound."""
    proposer = ReferenceProposer(refs_of(greedy_ref))
    llm = make_llm(tiny_dir, proposer=proposer, enable_prefix_caching=False)
    core = llm.engine.core
    generate(llm, PROMPTS, greedy_params(21))  # 1 token, then 4 verify passes of 5: ends by length in one
    ref = greedy_ref[0].outputs[0].token_ids
    generate(llm, PROMPTS[0], greedy_params(stop_token_ids=[ref[7]]))  # a stop token in an accepted run
    engine = llm.engine
    engine.add_request("ab", PROMPTS[1], greedy_params())
    for _ in range(3):
        engine.step()
    engine.abort_request("ab")
    idle(llm)
    assert core.speculator.k == {}, f"per-request state left behind: {core.speculator.k}"
    assert core.runner.base_seeds == {}
    assert len(set(proposer.forgotten)) == len(PROMPTS) + 2  # every request told to the proposer when it ended


# ---- the real model ----------------------------------------------------------------------------------------


CODE = ("def order_total(items, tax_rate):\n    total = 0\n    for item in items:\n"
        "        total += item.price * item.quantity\n    total = total * (1 + tax_rate)\n    return total\n")
CODE_EDIT = ("<|im_start|>user\nAdd type hints to this function.\n\n```python\n" + CODE
             + "```<|im_end|>\n<|im_start|>assistant\n```python\n")


@pytest.mark.slow
def test_smollm2_code_edit_is_identical_and_prompt_lookup_pays():
    """The real model editing code it was shown: the output (which repeats much of the prompt) is token for token
    the same, and prompt lookup's drafts are accepted often enough to pay."""
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(dtype="float32", kv_cache_memory=64 << 20, num_threads=1)
    ref = generate(plain, CODE_EDIT, params)[0].outputs[0]
    del plain
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, num_threads=1, speculative_config=SPEC)
    out = generate(llm, CODE_EDIT, params)[0].outputs[0]
    assert out.token_ids == ref.token_ids and out.text == ref.text
    assert out.text.startswith("def order_total(items")  # it did copy from the prompt
    s = stats(llm)
    assert s.acceptance_rate > 0.3, s.describe()
    assert s.mean_accepted_length > 1.5, s.describe()
    idle(llm)
