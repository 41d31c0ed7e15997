"""Sampler: seeded reproducibility, top-k/top-p/min-p never leave the allowed set, penalties as defined."""

import pytest
import torch

from tokenmill.engine.sampler import (
    Sampler,
    SamplingError,
    SamplingRow,
    apply_penalties,
    draw,
    nucleus,
    weights_of,
)
from tokenmill.errors import InvalidRequest
from tokenmill.sampling_params import SamplingParams

VOCAB = 12
# A fixed distribution with distinct probabilities, largest first after sorting by id order below.
LOGITS = torch.log(torch.tensor([0.30, 0.20, 0.15, 0.10, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01, 0.007, 0.003]))


def row(params: SamplingParams, seed: int | None = None, prompt=(), output=()) -> SamplingRow:
    gen = None
    if not params.greedy:
        gen = torch.Generator().manual_seed(params.seed if params.seed is not None else (seed or 0))
    return SamplingRow(params, list(prompt), list(output), gen)


def draw_many(params: SamplingParams, n: int = 3000) -> torch.Tensor:
    sampler = Sampler()
    r = row(params, seed=1)
    logits = LOGITS.unsqueeze(0).repeat(n, 1)
    rows = [SamplingRow(params, [], [], r.generator) for _ in range(n)]
    return torch.tensor([t for t, _ in sampler(logits, rows)])


def test_greedy_is_argmax():
    logits = torch.randn(5, VOCAB)
    out = Sampler()(logits, [row(SamplingParams(temperature=0)) for _ in range(5)])
    assert [t for t, _ in out] == logits.argmax(1).tolist()


def test_seeded_sampling_is_reproducible_whatever_else_is_in_the_batch():
    sampler = Sampler()
    p = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(1, VOCAB)
    alone = [sampler(logits, [row(p)])[0][0] for _ in range(1)]
    seq_alone, seq_batched = [], []
    ra, rb = row(p), row(p)
    others = torch.randn(7, VOCAB)
    for _ in range(20):
        seq_alone.append(sampler(logits, [ra])[0][0])
        batch = torch.cat([others[:3], logits, others[3:]])
        rows = [row(SamplingParams(temperature=0.8), seed=i) for i in range(3)] + [rb] + \
               [row(SamplingParams(temperature=1.3), seed=9 + i) for i in range(4)]
        seq_batched.append(sampler(batch, rows)[3][0])
    assert seq_alone == seq_batched
    assert alone[0] == seq_alone[0]
    assert len(set(seq_alone)) > 1  # it really samples


def test_top_k_never_picks_outside_the_k_most_likely():
    tokens = draw_many(SamplingParams(temperature=1.0, top_k=3))
    assert set(tokens.tolist()) == {0, 1, 2}


def test_top_p_never_picks_outside_the_nucleus():
    # cumulative: 0.30, 0.50, 0.65, 0.75 -> top_p=0.6 keeps tokens 0, 1, 2 (the token crossing 0.6 is kept)
    tokens = draw_many(SamplingParams(temperature=1.0, top_p=0.6))
    assert set(tokens.tolist()) == {0, 1, 2}


def test_min_p_never_picks_below_the_floor():
    # floor = 0.5 * 0.30 = 0.15 -> tokens 0, 1, 2 (0.15 is not below)
    tokens = draw_many(SamplingParams(temperature=1.0, min_p=0.5))
    assert set(tokens.tolist()) <= {0, 1, 2} and 0 in tokens.tolist()


def test_sampling_frequencies_follow_the_distribution():
    tokens = draw_many(SamplingParams(temperature=1.0, top_k=2), n=4000)
    frac0 = (tokens == 0).float().mean().item()
    assert abs(frac0 - 0.6) < 0.04  # 0.30 / (0.30 + 0.20)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    apply_penalties(logits, [row(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0], output=[1])])
    assert logits.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def test_presence_and_frequency_penalties_subtract_as_defined():
    logits = torch.zeros(1, 4)
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(logits, [row(p, prompt=[3], output=[1, 1, 2])])
    # token 1: 2 x 0.25 + 0.5; token 2: 0.25 + 0.5; the prompt's token 3 is not penalised
    assert logits.tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_blocked_tokens_are_never_sampled_below_min_tokens():
    logits = torch.tensor([[0.0, 10.0, 0.0]])
    r = row(SamplingParams(temperature=0, min_tokens=3))
    r.blocked_token_ids = [1]
    assert Sampler()(logits, [r])[0][0] != 1


def test_logprobs_are_the_raw_distribution_with_the_sampled_token_first():
    logits = torch.randn(1, VOCAB)
    (token, lps), = Sampler()(logits, [row(SamplingParams(temperature=0, logprobs=3))])
    ref = logits.log_softmax(1)[0]
    assert list(lps)[0] == token
    top3 = ref.topk(3).indices.tolist()
    assert set(top3) <= set(lps)
    for t, v in lps.items():
        assert v == pytest.approx(ref[t].item(), abs=1e-6)


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
                                         ("min_p", 1.5), ("max_tokens", 0), ("n", 0), ("logprobs", 21),
                                         ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("stop", [""]),
                                         ("temperature", float("inf")), ("temperature", float("nan")),
                                         ("top_p", float("nan")), ("min_p", float("nan")),
                                         ("repetition_penalty", float("inf")), ("frequency_penalty", float("nan"))])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and field in str(e.value)


# ---- the sampler is total: any valid parameters give a token (issue 11: these crashed the engine) ----------


@pytest.mark.parametrize("kw", [dict(top_p=1e-46), dict(top_p=5e-324), dict(min_p=1.0), dict(top_k=1, top_p=1e-9),
                                dict(temperature=1e-30), dict(temperature=1e-30, top_p=1e-46, min_p=1.0),
                                dict(temperature=1e-30, repetition_penalty=1e-38, frequency_penalty=-2),
                                dict(temperature=1e-30, repetition_penalty=1e30)])
def test_extreme_but_valid_parameters_give_the_top_token(kw):
    """A nucleus or floor that rounds to nothing keeps the most likely token; a tiny temperature is greedy."""
    logits = torch.randn(4, VOCAB) * 5
    params = SamplingParams(temperature=kw.pop("temperature", 1.0), seed=3, **kw)
    rows = [row(params, prompt=[1, 2], output=[2]) for _ in range(4)]
    ref = logits.clone()
    apply_penalties(ref, rows)
    out = Sampler()(logits, rows)
    assert [t for t, _ in out] == ref.clamp(max=torch.finfo(torch.float32).max).argmax(1).tolist()


@pytest.mark.parametrize("penalty", [1e-38, 1e-30, 1e30, 3e38])
def test_extreme_repetition_penalties_still_sample_a_token(penalty):
    logits = torch.randn(64, VOCAB) * 5
    rows = [row(SamplingParams(temperature=1.0, seed=i, repetition_penalty=penalty), prompt=[1, 2]) for i in range(64)]
    assert all(0 <= t < VOCAB for t, _ in Sampler()(logits, rows))


def test_a_mask_covering_the_whole_vocabulary_is_not_applied():
    """min_tokens with stop ids covering every token: the request still gets a token (it used to be NaN)."""
    logits = torch.randn(3, VOCAB)
    everything = list(range(VOCAB))
    rows = [SamplingRow(SamplingParams(temperature=0), [], [], None, everything),
            SamplingRow(SamplingParams(temperature=1.0, seed=1), [], [], torch.Generator().manual_seed(1), everything),
            SamplingRow(SamplingParams(temperature=0), [], [], None, everything[1:])]
    out = [t for t, _ in Sampler()(logits, rows)]
    assert out[0] == int(logits[0].argmax()) and 0 <= out[1] < VOCAB
    assert out[2] == 0  # a partial mask still applies: only token 0 is left


def test_non_finite_logits_raise_a_sampling_error_not_a_crash_in_multinomial():
    logits = torch.randn(2, VOCAB)
    logits[1, 3] = float("nan")
    rows = [row(SamplingParams(temperature=1.0, seed=1)) for _ in range(2)]
    with pytest.raises(SamplingError):
        Sampler()(logits, rows)
    assert 0 <= Sampler()(logits[:1], rows[:1])[0][0] < VOCAB


def test_draw_follows_the_distribution_across_blocks_and_never_picks_a_zero_weight():
    """The two-level inverse CDF: a vocabulary that is not a whole number of blocks (the last token sits in the
    padded block), mass spread over many tiny tokens, zero-weight and -inf tokens never drawn."""
    vocab, n = 1000, 24_000
    probs = torch.full((vocab,), 0.05 / 995)
    probs[0], probs[500], probs[999] = 0.25, 0.45, 0.25
    probs[998] = probs[3] = probs[997] = 0.0
    logits = probs.log()  # -inf where the probability is 0
    logits -= logits.max()
    gens = [torch.Generator().manual_seed(i) for i in range(2000)]
    drawn = torch.cat([draw(weights_of(logits.repeat(len(gens), 1)), gens) for _ in range(n // len(gens))])
    counts = torch.bincount(drawn, minlength=vocab).double() / n
    assert counts[[3, 997, 998]].sum() == 0
    for token, p in ((0, 0.25), (500, 0.45), (999, 0.25)):
        assert abs(counts[token] - p) < 0.015, (token, counts[token])
    assert abs(counts.sum() - counts[[0, 500, 999]].sum() - 0.05) < 0.01


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat rows reach past the candidates, peaked ones do not
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.995])
def test_nucleus_is_what_a_full_sort_gives(scale, top_p):
    torch.manual_seed(int(scale * 10) + int(top_p * 1000))
    logits = torch.randn(6, 5000) * scale
    p = torch.full((6,), top_p)
    probs = logits.softmax(dim=1)
    sorted_probs, order = probs.sort(dim=1, descending=True)
    keep_sorted = (sorted_probs.cumsum(dim=1) - sorted_probs) < top_p
    keep_sorted[:, 0] = True
    expected = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    assert torch.equal(nucleus(logits, p), expected)


@pytest.mark.parametrize("vocab", [1000, 4096])
def test_seeded_draws_do_not_depend_on_the_batch_for_any_vocabulary_size(vocab):
    logits = torch.randn(8, vocab) * 2
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    alone_row, batched_row = row(p), row(p)
    others = [row(SamplingParams(temperature=1.1, top_k=40), seed=i) for i in range(7)]
    alone = [Sampler()(logits[3:4], [alone_row])[0][0] for _ in range(30)]
    batched = [Sampler()(logits, others[:3] + [batched_row] + others[3:])[3][0] for _ in range(30)]
    assert alone == batched and len(set(alone)) > 1


def test_top_k_applies_to_its_own_rows_in_a_mixed_batch():
    """Rows without top-k keep their whole distribution; rows with it never leave their k most likely."""
    logits = LOGITS.unsqueeze(0).repeat(400, 1)
    with_k, without = SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0)
    rows = [row(with_k if i % 2 else without, seed=i) for i in range(400)]
    tokens = [t for t, _ in Sampler()(logits, rows)]
    assert set(tokens[1::2]) == {0, 1}
    assert len(set(tokens[0::2])) > 4  # the unfiltered rows still reach past the top two


def cpu_backend():
    from tokenmill.model.backends.cpu import CpuBackend
    from tokenmill.model.cpu_kernels import _extension

    ops = _extension()
    assert ops is not None  # the kernels build on every machine the tests run on (tests/model/test_attention.py)
    return CpuBackend(ops)


@pytest.mark.parametrize("vocab", [49_152, 1_003])  # SmolLM2's; and one with vector tails
def test_fused_weights_are_the_torch_ops_weights(vocab):
    """The CPU backend's fused kernel (max, shift, temperature, exp, the LOWEST_LOGIT cut in two passes) gives the
    torch ops' weights to float32 rounding, leaves the logits as they were, and seeded rows draw the same tokens."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(24, vocab, generator=g) * 4
    logits[3, :500] = float("-inf")  # filtered tokens weigh nothing
    temps = [0.3, 1.0, 1.7] * 8
    params = [SamplingParams(temperature=t, max_tokens=4) for t in temps]
    fused = Sampler(cpu_backend())
    before = logits.clone()
    ours = fused._weights(logits, params)
    assert torch.equal(logits, before)
    reference = Sampler()._weights(logits, params)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-30)  # an exponent near -80 carries its rounding
    assert (ours[3, :500] == 0).all()
    for seed in range(3):
        rows = [SamplingRow(p, [], [], torch.Generator().manual_seed(seed * 100 + i)) for i, p in enumerate(params)]
        twin = [SamplingRow(p, [], [], torch.Generator().manual_seed(seed * 100 + i)) for i, p in enumerate(params)]
        assert [t for t, _ in fused(logits, rows)] == [t for t, _ in Sampler()(logits, twin)]


def test_fused_weights_refuse_non_finite_logits_and_reuse_their_buffer():
    fused = Sampler(cpu_backend())
    params = [SamplingParams(temperature=1.0, max_tokens=4)] * 2
    bad = torch.zeros(2, 40)
    bad[1, 7] = float("nan")
    with pytest.raises(SamplingError):
        fused(bad, [row(p, seed=i) for i, p in enumerate(params)])
    small = fused._weights(torch.zeros(2, 40), params)
    assert torch.equal(small, torch.ones(2, 40))  # every logit at the max: weight exp(0)
    big = fused._weights(torch.zeros(3, 100), params + params[:1])
    assert big.shape == (3, 100) and fused._buffer.numel() >= 300


@pytest.mark.parametrize("vocab", [49_152, 1_003, 7])  # SmolLM2's; vector tails; shorter than one vector
def test_backend_first_argmax_is_torch_max_indices(vocab):
    """Greedy rows' token through the CPU kernel: the first index of the maximum (ties to the lowest index, in one
    lane or across lanes, in the tail), a NaN anywhere taking its first one, -inf rows giving 0, as torch's
    max(dim=1).indices: Hugging Face's argmax, so greedy parity holds."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(12, vocab, generator=g)
    top = float(logits.max()) + 1
    logits[1, [vocab - 1, vocab // 2]] = top  # the same maximum twice: the first wins
    logits[2, [min(17, vocab - 1), min(33, vocab - 1)]] = top  # in one lane, two vectors apart
    logits[3, vocab - 1] = top  # only in the tail
    logits[4, [vocab // 3, vocab - 2]] = float("nan")  # NaNs: the first one
    logits[5] = float("-inf")
    logits[6, :] = 2.0  # all equal: index 0
    logits[7, 0] = float("nan")
    logits[8, [vocab - 1]] = float("inf")
    logits[8, [max(0, vocab - 3)]] = float("inf")
    backend = cpu_backend()
    ours = backend.first_argmax(logits)
    assert ours.dtype == torch.long and torch.equal(ours, logits.max(dim=1).indices)
    assert int(ours[1]) == min(vocab - 1, vocab // 2) and int(ours[5]) == 0 and int(ours[6]) == 0
    rows = [row(SamplingParams(temperature=0.0, max_tokens=4), seed=i) for i in range(12)]
    assert [t for t, _ in Sampler(backend)(logits[[0, 1, 2, 3, 6, 8]], rows[:6])] == \
        logits[[0, 1, 2, 3, 6, 8]].max(dim=1).indices.tolist()
    assert backend.first_argmax(logits.t()) is None  # not contiguous: torch's max instead


def test_logit_bias_bans_and_shifts_tokens():
    """-100 bans a token: never drawn, nor picked greedily, with any other row in the batch untouched; other biases
    add to the logit (+5 on the 4th most likely token makes it the argmax); logprobs stay the raw model's."""
    greedy = Sampler()(LOGITS.unsqueeze(0), [row(SamplingParams(temperature=0, logit_bias={0: -100, 1: -100}))])
    assert greedy[0][0] == 2
    shifted = Sampler()(LOGITS.unsqueeze(0), [row(SamplingParams(temperature=0, logit_bias={3: 5.0}))])
    assert shifted[0][0] == 3
    drawn = draw_many(SamplingParams(temperature=1.0, logit_bias={0: -100, 2: -100.0}))
    assert not bool(((drawn == 0) | (drawn == 2)).any()) and bool((drawn == 1).any())
    mixed = Sampler()(LOGITS.unsqueeze(0).repeat(2, 1), [row(SamplingParams(temperature=0, logit_bias={0: -100})),
                                                          row(SamplingParams(temperature=0, logprobs=1))])
    assert [t for t, _ in mixed] == [1, 0]
    (token, lp), = Sampler()(LOGITS.unsqueeze(0), [row(SamplingParams(temperature=0, logit_bias={0: -100},
                                                                      logprobs=1))])
    assert token == 1 and lp[1] == pytest.approx(float(torch.log_softmax(LOGITS, 0)[1]))


def test_bans_give_way_when_nothing_else_is_left():
    """A constraint allowing only banned tokens (here: every other logit -inf already) still gets a token."""
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, 4] = 0.0
    out = Sampler()(logits, [row(SamplingParams(temperature=0, logit_bias={4: -100, 5: 3.0}))])
    assert out[0][0] == 4


@pytest.mark.parametrize("bias", [{1: 101}, {1: float("nan")}, {-1: 1.0}, {"1": 1.0}, {1: True}])
def test_logit_bias_values_are_checked(bias):
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias=bias)
