"""Speculative decoding without a model: prompt lookup (`propose_ngram`), --speculative-config parsing, and the
Speculator's rules (who drafts, how many, adaptive k), on plain Request objects and a fake proposer."""

from __future__ import annotations

import argparse
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.test_step_cost import fitted
from tokenmill.config import SpeculativeConfig
from tokenmill.engine_args import EngineArgs
from tokenmill.errors import ConfigError
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec.ngram import propose_ngram
from tokenmill.spec.speculator import PROBE_EVERY, NgramProposer, Speculator, build_speculator

# ---- propose_ngram -----------------------------------------------------------------------------------------


def reference_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule, spelled out on token lists: longest n first, most recent earlier occurrence (one that ends before
    the last token, so not the suffix itself), the up to k tokens after it."""
    if k < 1:
        return []
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        for start in range(size - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_the_longest_matching_n_wins_over_a_more_recent_shorter_match():
    # last 3 tokens [1, 2, 3] occur at 0 (followed by 10, 11); last 2 [2, 3] occur more recently at 6 (-> 20, 21)
    tokens = [1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 1, 2, 3]
    assert propose_ngram(tokens, 2, 2, 3) == [10, 11]
    assert propose_ngram(tokens, 2, 2, 2) == [20, 21]  # with n capped at 2 the recent 2-gram is the match
    assert propose_ngram(tokens, 2, 3, 4) == [10, 11]  # n = 4 does not occur; n = 3 does


def test_the_most_recent_earlier_occurrence_is_used():
    tokens = [5, 6, 7, 9, 5, 6, 8, 4, 5, 6]
    assert propose_ngram(tokens, 2, 2, 2) == [8, 4]  # [5, 6] at 4, not at 0
    assert propose_ngram(tokens, 1, 1, 1) == [8]  # [6] at 5 is the most recent


def test_no_match_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4, 5, 6], 4, 2, 4) == []
    assert propose_ngram([1, 2, 3, 4, 5, 6], 4, 1, 4) == []  # not even one token repeats
    assert propose_ngram([], 4, 1, 4) == []
    assert propose_ngram([7], 4, 1, 4) == []
    assert propose_ngram([3, 1, 2], 4, 2, 2) == []  # the suffix itself is not an earlier occurrence
    assert propose_ngram([1, 2], 4, 2, 4) == []  # too short for a 2-gram to occur twice


def test_the_continuation_near_the_end_is_shorter_than_k():
    assert propose_ngram([1, 2, 3, 1, 2], 4, 2, 4) == [3, 1, 2]
    assert propose_ngram([7, 7, 7], 4, 2, 2) == [7]  # overlapping occurrence: just the last token follows it
    assert propose_ngram([4, 9, 4], 5, 1, 3) == [9, 4]


def test_k_caps_the_proposal():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert propose_ngram(tokens, 1, 2, 4) == [3]
    assert propose_ngram(tokens, 3, 2, 4) == [3, 4, 5]
    assert propose_ngram(tokens, 16, 2, 4) == [3, 4, 5, 6, 7, 8, 1, 2]
    assert propose_ngram(tokens, 0, 2, 4) == []


def test_token_ids_past_one_byte_match_as_whole_tokens():
    assert propose_ngram([300, 70000, 5, 300, 70000], 3, 2, 2) == [5, 300, 70000]
    assert propose_ngram([49151, 256, 1, 49151, 256], 2, 1, 2) == [1, 49151]
    # 300 and 44 share their low byte (44 = 300 - 256): no match between them
    assert propose_ngram([44, 1, 9, 300], 2, 1, 1) == []
    assert propose_ngram([300, 1, 9, 44], 2, 1, 1) == []


def test_a_byte_match_across_two_tokens_never_counts():
    # little-endian int32: 65543 = 07 00 01 00 and 1280 = 00 05 00 00, so their bytes 1..4 read 00 01 00 00, which
    # is token 256: a misaligned match of the last token
    assert propose_ngram([65543, 1280, 99, 256], 4, 1, 1) == []
    # an aligned occurrence before the misaligned one is still found
    assert propose_ngram([256, 42, 65543, 1280, 99, 256], 4, 1, 1) == [42, 65543, 1280, 99]
    # the two-token suffix [256, 512] (00 01 00 00 00 02 00 00) hidden at byte 1 of [65543, 131072, 0]
    # (07 00 01 00, 00 00 02 00, 00 00 00 00)
    tokens = [65543, 131072, 0, 5, 256, 512]
    assert array("i", tokens).tobytes().find(array("i", [256, 512]).tobytes()) == 1
    assert reference_ngram(tokens, 3, 2, 2) == []
    assert propose_ngram(tokens, 3, 2, 2) == []


# token values whose little-endian bytes collide a lot when misaligned
_COLLIDING = [0, 1, 2, 256, 257, 512, 65536, 65537, 65792, 16777216, 16777217, 16843009, 49151]


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.sampled_from(_COLLIDING), max_size=40), k=st.integers(0, 6),
       min_n=st.integers(1, 4), extra=st.integers(0, 3))
def test_matches_the_token_level_rule_on_byte_colliding_tokens(tokens, k, min_n, extra):
    assert propose_ngram(tokens, k, min_n, min_n + extra) == reference_ngram(tokens, k, min_n, min_n + extra)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), max_size=60), k=st.integers(1, 8))
def test_matches_the_token_level_rule_on_repetitive_sequences(tokens, k):
    assert propose_ngram(tokens, k, 2, 4) == reference_ngram(tokens, k, 2, 4)


# ---- --speculative-config ----------------------------------------------------------------------------------


def test_parse_accepts_json_text_dicts_configs_and_none():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
                                '"prompt_lookup_min": 1, "disable_by_batch_size": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min,
            c.disable_by_batch_size) == ("ngram", 3, 5, 1, 4)
    d = SpeculativeConfig.parse({"method": "ngram"})
    assert (d.num_speculative_tokens, d.prompt_lookup_max, d.prompt_lookup_min, d.disable_by_batch_size) == (
        4, 4, 2, None)
    assert SpeculativeConfig.parse(d) is d
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse({}).method == "ngram"  # no method and no model: prompt lookup
    assert SpeculativeConfig.parse({"model": "/some/draft"}).method == "draft_model"
    assert SpeculativeConfig.parse({"num_speculative_tokens": 16}).num_speculative_tokens == 16
    assert SpeculativeConfig.parse({"num_speculative_tokens": 1}).num_speculative_tokens == 1


@pytest.mark.parametrize("value,words", [
    ('{"method": "ngram", ', ["not valid JSON"]),
    ("ngram", ["not valid JSON"]),
    ('[1, 2]', ["JSON object"]),
    ('"ngram"', ["JSON object"]),
    (42, ["JSON object"]),
    ({"method": "ngram", "lookahead": 3}, ["unknown key", "lookahead"]),
    ({"method": "ngram", "num_spec_tokens": 3, "zzz": 1}, ["unknown key", "num_spec_tokens", "zzz"]),
    ({"method": "medusa"}, ["unknown method", "medusa"]),
    ({"method": "eagle", "num_speculative_tokens": 2}, ["unknown method", "eagle"]),
    ({"num_speculative_tokens": 0}, ["num_speculative_tokens", "0"]),
    ({"num_speculative_tokens": -1}, ["num_speculative_tokens"]),
    ({"num_speculative_tokens": 17}, ["num_speculative_tokens", "17"]),
    ({"num_speculative_tokens": "4"}, ["num_speculative_tokens"]),
    ({"num_speculative_tokens": 2.5}, ["num_speculative_tokens"]),
    ({"num_speculative_tokens": True}, ["num_speculative_tokens"]),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, ["prompt_lookup_min", "prompt_lookup_max", "5", "3"]),
    ({"prompt_lookup_min": 0, "prompt_lookup_max": 3}, ["prompt_lookup_min"]),
    ({"prompt_lookup_min": 2, "prompt_lookup_max": "4"}, ["prompt_lookup_max"]),
    ({"method": "draft_model"}, ["draft_model", '"model"']),
    ({"method": "draft_model", "num_speculative_tokens": 3}, ["draft_model", '"model"']),
    ({"disable_by_batch_size": 0}, ["disable_by_batch_size"]),
    ({"disable_by_batch_size": "8"}, ["disable_by_batch_size"]),
    ({"quantization": "int3"}, ["quantization"]),
])
def test_a_bad_speculative_config_is_one_clear_config_error(value, words):
    with pytest.raises(ConfigError) as info:
        SpeculativeConfig.parse(value)
    message = str(info.value)
    assert "speculative-config" in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_the_flag_reaches_the_engine_config_and_a_bad_one_fails_before_any_model_loads():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative.method == "ngram" and config.speculative.num_speculative_tokens == 3
    assert EngineArgs().create_engine_config().speculative is None
    assert EngineArgs(speculative_config={"num_speculative_tokens": 2}).create_engine_config(
    ).speculative.num_speculative_tokens == 2
    bad = parser.parse_args(["--speculative-config", '{"method": "ngram", "k": 3}'])
    with pytest.raises(ConfigError, match="unknown key"):
        EngineArgs.from_cli_args(bad).create_engine_config()


# ---- the Speculator's rules --------------------------------------------------------------------------------


class FakeProposer:
    """Proposes k tokens 1000, 1001, ... for each request, and records what it was asked."""

    lookahead = 0
    draft_probs: dict = {}  # its drafts are point masses: never written

    def __init__(self):
        self.calls: list[list[tuple[str, int]]] = []
        self.forgotten: list[str] = []

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        self.calls.append([(r.request_id, k) for r, k in zip(requests, ks)])
        return [list(range(1000, 1000 + k)) for k in ks]

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)

    @property
    def last(self) -> dict[str, int]:
        return dict(self.calls[-1]) if self.calls else {}


def speculator(k: int = 4, **kw) -> tuple[Speculator, FakeProposer]:
    proposer = FakeProposer()
    return Speculator(SpeculativeConfig(num_speculative_tokens=k, **kw), proposer), proposer


def decoding(rid: str, num_output: int = 1, max_tokens: int = 32, prompt_len: int = 6, **params) -> Request:
    """A running request whose prompt is done: one token (the last sampled) left to compute."""
    req = Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(**params), max_tokens,
                  output_token_ids=[5] * num_output, status=RequestStatus.RUNNING)
    req.num_computed_tokens = req.num_tokens - 1
    return req


def prefilling(rid: str, computed: int = 0, prompt_len: int = 20) -> Request:
    req = Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(), 32, status=RequestStatus.RUNNING)
    req.num_computed_tokens = computed
    return req


def test_only_decoding_requests_get_drafts():
    spec, proposer = speculator()
    fresh, chunked, dec = prefilling("fresh"), prefilling("chunked", computed=12), decoding("dec")
    recompute = decoding("recompute", num_output=3)
    recompute.num_computed_tokens = 0  # preempted and re-admitted: prompt and outputs to compute again
    spec.propose([fresh, chunked, dec, recompute])
    assert proposer.calls == [[("dec", 4)]]
    assert dec.spec_token_ids == [1000, 1001, 1002, 1003]
    assert fresh.spec_token_ids == chunked.spec_token_ids == recompute.spec_token_ids == []


def test_drafts_never_reach_past_max_tokens_minus_one():
    spec, proposer = speculator(k=4)
    reqs = [decoding(f"left-{left}", num_output=10, max_tokens=10 + left) for left in (1, 2, 3, 4, 5, 6, 20)]
    spec.propose(reqs)
    # left = max_tokens - num_output tokens still to come: the verify pass samples 1 + k of them, so k <= left - 1
    assert proposer.last == {"left-2": 1, "left-3": 2, "left-4": 3, "left-5": 4, "left-6": 4, "left-20": 4}
    assert reqs[0].spec_token_ids == []
    for r in reqs:
        assert r.num_output_tokens + len(r.spec_token_ids) + 1 <= r.max_tokens


def test_a_request_with_one_token_left_is_not_even_offered_to_the_proposer():
    spec, proposer = speculator()
    spec.propose([decoding("last", num_output=4, max_tokens=5)])
    assert proposer.calls == []


def test_speculation_pauses_while_more_requests_than_the_threshold_run():
    spec, proposer = speculator()  # no cap (and no cost model): everyone speculates
    spec.propose([decoding(f"r{i}") for i in range(64)])
    assert len(proposer.last) == 64

    spec, proposer = speculator(disable_by_batch_size=2)
    spec.propose([decoding("a"), decoding("b")])
    assert set(proposer.last) == {"a", "b"}
    three = [decoding("a"), decoding("b"), prefilling("c")]  # the count is of running requests, drafting or not
    spec.propose(three)
    assert len(proposer.calls) == 1 and all(r.spec_token_ids == [] for r in three)

    spec, proposer = speculator(disable_by_batch_size=20)
    spec.propose([decoding(f"t{i}") for i in range(20)])
    assert len(proposer.last) == 20


def test_a_request_that_opted_out_or_finished_gets_no_drafts():
    spec, proposer = speculator()
    out = decoding("out", speculate=False)
    done = decoding("done")
    done.status = RequestStatus.FINISHED_ABORTED
    inn = decoding("in")
    spec.propose([out, done, inn])
    assert proposer.last == {"in": 4}
    assert out.spec_token_ids == [] and done.spec_token_ids == []
    spec.propose([out])
    assert len(proposer.calls) == 1  # nobody to ask: the proposer is not called


def test_k_halves_on_zero_acceptance_and_grows_back_one_at_a_time():
    spec, proposer = speculator(k=4)
    req = decoding("a")

    def k_now() -> int:
        spec.propose([req])
        return proposer.last["a"]

    assert k_now() == 4
    spec.observe("a", 4, 0)
    assert k_now() == 2
    spec.observe("a", 2, 0)
    assert k_now() == 1
    spec.observe("a", 1, 0)
    assert k_now() == 1  # never below one: it can recover
    spec.observe("a", 1, 1)
    assert k_now() == 2
    spec.observe("a", 2, 1)  # partly accepted: k stays
    assert k_now() == 2
    spec.observe("a", 2, 2)
    assert k_now() == 3
    spec.observe("a", 3, 3)
    assert k_now() == 4
    spec.observe("a", 4, 4)
    assert k_now() == 4  # never above the configured k
    spec.observe("a", 0, 0)  # no drafts verified: nothing learned
    assert k_now() == 4


def test_adaptive_k_is_per_request_and_still_capped_by_max_tokens():
    spec, proposer = speculator(k=6)
    a, b = decoding("a", num_output=1, max_tokens=40), decoding("b", num_output=1, max_tokens=40)
    spec.observe("a", 6, 0)
    spec.propose([a, b])
    assert proposer.last == {"a": 3, "b": 6}
    near_end = decoding("b", num_output=37, max_tokens=40)
    spec.propose([near_end])
    assert proposer.last == {"b": 2}


def test_forget_resets_k_and_tells_the_proposer():
    spec, proposer = speculator(k=4)
    spec.observe("a", 4, 0)
    spec.forget("a")
    assert "a" not in spec.k and proposer.forgotten == ["a"]
    spec.propose([decoding("a")])
    assert proposer.last == {"a": 4}
    spec.forget("never-seen")  # harmless
    assert proposer.forgotten == ["a", "never-seen"]


def test_the_ngram_proposer_looks_up_prompt_and_output_together():
    config = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    spec = build_speculator(config)
    assert isinstance(spec.proposer, NgramProposer) and spec.lookahead == 0
    req = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(), 32, output_token_ids=[9, 1, 2],
                  status=RequestStatus.RUNNING)
    req.num_computed_tokens = req.num_tokens - 1
    other = Request("b", [7, 8, 9], SamplingParams(), 32, output_token_ids=[10], status=RequestStatus.RUNNING)
    other.num_computed_tokens = other.num_tokens - 1
    spec.propose([req, other])
    assert req.spec_token_ids == [3, 4, 5]  # [1, 2] from the output matched in the prompt
    assert other.spec_token_ids == []
    assert spec.proposer.propose([req], [1]) == [[3]]


# ---- the cost model: speculate where it pays ----------------------------------------------------------------


def test_break_even_acceptance_is_the_share_of_the_step_that_grows_with_tokens():
    model = fitted(0.010, 0.001)
    assert model.break_even_acceptance(2) == pytest.approx(0.002 / 0.012)
    assert model.break_even_acceptance(64) == pytest.approx(0.064 / 0.074)
    assert model.break_even_acceptance(2, proposer_seconds=0.006) == pytest.approx(0.008 / 0.012)


def test_a_request_speculates_only_where_its_acceptance_pays_and_probes_now_and_then():
    proposer = FakeProposer()
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), proposer, fitted(0.010, 0.001))
    good, poor = decoding("good"), decoding("poor")
    spec.observe("good", 4, 3)
    spec.observe("poor", 4, 0)
    spec.observe("poor", 2, 0)
    small = [good, poor]  # break-even 0.17: the good one (0.6) speculates, the poor one (0.25) does too
    spec.propose(small)
    assert set(proposer.last) == {"good", "poor"}
    crowd = [good, poor] + [decoding(f"x{i}") for i in range(62)]  # 64 running: break-even 0.86
    spec.acceptance.update({f"x{i}": 0.95 for i in range(62)})
    spec.propose(crowd)
    assert "good" not in proposer.last and "poor" not in proposer.last and len(proposer.last) == 62
    for _ in range(PROBE_EVERY - 2):
        spec.propose(crowd)
        assert "good" not in proposer.last
    spec.propose(crowd)  # passed over PROBE_EVERY times: it speculates once to measure again
    assert "good" in proposer.last and "poor" in proposer.last


def test_a_slow_proposer_raises_the_bar():
    proposer = FakeProposer()
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), proposer, fitted(0.010, 0.001))
    req = decoding("a")
    spec.observe("a", 4, 2)  # acceptance 0.5 x 0.3 + 0.5 x 0.7 = 0.5
    spec.proposer_seconds = 0.008  # a draft forward pass per draft position, nearly a target step
    spec.propose([req])  # break-even (0.001 + 0.008) / 0.011 = 0.82
    assert proposer.calls == []


def test_a_failing_proposer_costs_the_drafts_not_the_step():
    class Broken(FakeProposer):
        def propose(self, requests, ks):
            raise RuntimeError("draft forward failed")

    proposer = Broken()
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), proposer)
    req = decoding("a")
    spec.propose([req])  # does not raise
    assert req.spec_token_ids == [] and proposer.forgotten == ["a"]
