"""Serving metrics on synthetic timings: the arithmetic vLLM's benchmark does, failures left out."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokenmill.bench.metrics import (
    LatencyStats,
    RequestClass,
    RequestResult,
    calculate_metrics,
    class_metrics,
    output_lengths,
    tpot,
)


def ok(ttft: float, itl: list[float], tokens: int | None, prompt_len: int = 10, text: str = "") -> RequestResult:
    """A successful request whose last chunk came at ttft + sum(itl)."""
    return RequestResult(success=True, prompt_len=prompt_len, ttft=ttft, itl=list(itl),
                         latency=ttft + sum(itl), output_tokens=tokens, generated_text=text)


def failed(prompt_len: int = 99) -> RequestResult:
    return RequestResult(success=False, prompt_len=prompt_len, ttft=123.0, itl=[50.0], latency=500.0,
                         output_tokens=1000, error="HTTP 500: boom")


def test_percentiles_match_numpy_linear_interpolation():
    stats = LatencyStats.of([0.001 * i for i in range(1, 101)])  # 1..100 ms
    assert stats.mean == pytest.approx(50.5)
    assert stats.median == pytest.approx(50.5)
    assert stats.percentiles[90] == pytest.approx(90.1)
    assert stats.percentiles[99] == pytest.approx(99.01)
    assert stats.std == pytest.approx(float(np.std(np.arange(1, 101))))


def test_empty_samples_are_none_not_zero():
    stats = LatencyStats.of([])
    assert stats.mean is None and stats.median is None and stats.percentiles == {50: None, 90: None, 99: None}


def test_tpot_excludes_the_first_token():
    r = ok(ttft=1.0, itl=[0.1, 0.2, 0.3], tokens=4)  # latency 1.6
    assert tpot(r, 4) == pytest.approx(0.6 / 3)
    assert tpot(r, 1) is None


def test_throughputs_latencies_and_itl_pooling():
    results = [ok(0.5, [0.1, 0.1, 0.1], tokens=4, prompt_len=20),
               ok(1.0, [0.2, 0.4], tokens=3, prompt_len=30),
               ok(2.0, [], tokens=1, prompt_len=40)]  # one token: no TPOT, no ITL
    m, lens = calculate_metrics(results, duration_s=10.0)
    assert lens == [4, 3, 1]
    assert (m.completed, m.failed) == (3, 0)
    assert (m.total_input_tokens, m.total_output_tokens) == (90, 8)
    assert m.request_throughput == pytest.approx(0.3)
    assert m.output_throughput == pytest.approx(0.8)
    assert m.total_token_throughput == pytest.approx(9.8)
    assert m.ttft_ms.mean == pytest.approx(1000 * 3.5 / 3)
    assert m.ttft_ms.median == pytest.approx(1000.0)
    # ITL: every gap of every request, pooled
    assert m.itl_ms.mean == pytest.approx(1000 * 0.9 / 5)
    assert m.itl_ms.median == pytest.approx(100.0)
    # TPOT: per request, only requests with more than one token
    assert m.tpot_ms.mean == pytest.approx(1000 * (0.3 / 3 + 0.6 / 2) / 2)
    assert m.e2el_ms.percentiles[99] == pytest.approx(1000 * float(np.percentile([0.8, 1.6, 2.0], 99)))
    assert m.request_goodput is None


def test_failed_requests_are_counted_but_excluded_from_everything_else():
    good = [ok(0.5, [0.1], tokens=2, prompt_len=10), ok(0.7, [0.3], tokens=2, prompt_len=10)]
    with_failures, lens = calculate_metrics([failed(), *good, failed()], duration_s=2.0)
    alone, _ = calculate_metrics(good, duration_s=2.0)
    assert (with_failures.completed, with_failures.failed) == (2, 2)
    assert lens == [0, 2, 2, 0]
    assert with_failures.total_input_tokens == alone.total_input_tokens == 20
    assert with_failures.total_output_tokens == 4
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert getattr(with_failures, name) == getattr(alone, name)


def test_goodput_needs_every_given_slo():
    results = [ok(0.1, [0.01] * 9, tokens=10),   # ttft 100 ms, tpot 10 ms: good
               ok(0.3, [0.01] * 9, tokens=10),   # ttft too slow
               ok(0.1, [0.05] * 9, tokens=10),   # tpot too slow
               ok(0.1, [], tokens=1),            # one token: tpot counts as 0
               failed()]
    both, _ = calculate_metrics(results, 2.0, slo_ttft_ms=200, slo_tpot_ms=20)
    ttft_only, _ = calculate_metrics(results, 2.0, slo_ttft_ms=200)
    tpot_only, _ = calculate_metrics(results, 2.0, slo_tpot_ms=20)
    assert both.request_goodput == pytest.approx(2 / 2.0)
    assert ttft_only.request_goodput == pytest.approx(3 / 2.0)
    assert tpot_only.request_goodput == pytest.approx(3 / 2.0)


def test_output_tokens_from_usage_else_tokenizer_else_one():
    results = [ok(0.1, [0.1], tokens=7, text="a b"), ok(0.1, [0.1], tokens=None, text="a b c"),
               failed()]
    assert output_lengths(results, lambda text: len(text.split())) == [7, 3, 0]
    assert output_lengths(results) == [7, 1, 0]


def test_flat_keys_follow_vllm_names():
    m, _ = calculate_metrics([ok(0.5, [0.1, 0.2], tokens=3)], duration_s=1.0, slo_ttft_ms=1000)
    flat = m.flat()
    for key in ("completed", "failed", "duration", "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
                "p90_tpot_ms", "mean_itl_ms", "p99_e2el_ms"):
        assert key in flat, key
    assert flat["median_itl_ms"] == pytest.approx(150.0)
    assert not any(isinstance(v, float) and math.isnan(v) for v in flat.values())


def test_duration_must_be_positive():
    with pytest.raises(ValueError, match="duration"):
        calculate_metrics([], 0.0)


# ------------------------------------------------------------------------------------------ per class


def test_each_class_is_held_to_its_own_slos():
    slow_start = ok(0.5, [0.01] * 9, tokens=10)  # ttft 500 ms, tpot 10 ms
    results = [slow_start, slow_start, ok(0.1, [0.01] * 9, tokens=10), slow_start, failed(),
               ok(0.1, [0.05] * 9, tokens=10)]  # the last: tpot 50 ms
    labels = ["tight", "loose", "tight", "global", "loose", "global"]
    classes = [RequestClass("tight", share=3, slo_ttft_ms=200),
               RequestClass("loose", share=1, priority=1, slo_ttft_ms=1000),
               RequestClass("global", share=1, slo_ttft_ms=1000)]  # no TPOT target of its own
    lens = output_lengths(results)
    tight, loose, glob = class_metrics(results, lens, labels, classes, 2.0, slo_tpot_ms=20)
    # the same 500 ms TTFT fails "tight" (200 ms) and passes "loose" (1000 ms)
    assert tight.request_goodput == pytest.approx(1 / 2.0) and loose.request_goodput == pytest.approx(1 / 2.0)
    assert (tight.requests, tight.completed, tight.failed) == (2, 2, 0)
    assert (loose.requests, loose.completed, loose.failed) == (2, 1, 1)  # a failed request is never good
    # a class without a TPOT target takes the run's (20 ms): the 50 ms TPOT request misses it
    assert glob.request_goodput == pytest.approx(1 / 2.0)
    assert (glob.slo_ttft_ms, glob.slo_tpot_ms) == (1000, 20) and (tight.slo_ttft_ms, tight.slo_tpot_ms) == (200, 20)
    assert [c.share for c in (tight, loose, glob)] == pytest.approx([0.6, 0.2, 0.2])
    assert loose.priority == 1 and tight.priority is None


def test_class_latencies_and_throughput_cover_only_that_class():
    results = [ok(0.1, [0.02] * 3, tokens=4), ok(0.3, [0.04] * 3, tokens=4), ok(0.9, [0.1], tokens=2),
               ok(0.2, [], tokens=1)]
    labels = ["a", "a", "b", "a"]
    a, b = class_metrics(results, output_lengths(results), labels, [RequestClass("a"), RequestClass("b")], 4.0)
    assert a.ttft_ms.median == pytest.approx(200.0) and a.ttft_ms.percentiles[99] == pytest.approx(298.0)
    assert a.tpot_ms.median == pytest.approx(30.0)  # the one-token request has no TPOT
    assert b.ttft_ms.median == pytest.approx(900.0) and b.tpot_ms.median == pytest.approx(100.0)
    assert a.output_throughput == pytest.approx(9 / 4.0) and b.output_throughput == pytest.approx(2 / 4.0)
    assert a.request_throughput == pytest.approx(3 / 4.0)
    assert a.request_goodput is None and b.request_goodput is None  # no SLO anywhere
    flat = a.flat()
    assert flat["median_ttft_ms"] == pytest.approx(200.0) and flat["p99_tpot_ms"] == pytest.approx(39.8)
    assert "name" not in flat and flat["completed"] == 3


def test_a_class_with_no_requests_has_no_latencies():
    (empty,) = class_metrics([], [], [], [RequestClass("idle", slo_ttft_ms=100)], 1.0)
    assert (empty.requests, empty.completed, empty.request_goodput) == (0, 0, 0.0)
    assert empty.ttft_ms.median is None and empty.flat()["p99_ttft_ms"] is None


def test_class_metrics_refuses_mismatched_inputs():
    r = [ok(0.1, [0.1], tokens=2)]
    with pytest.raises(ValueError, match="unknown classes: b"):
        class_metrics(r, [2], ["b"], [RequestClass("a")], 1.0)
    with pytest.raises(ValueError, match="class labels"):
        class_metrics(r, [2], [], [RequestClass("a")], 1.0)
