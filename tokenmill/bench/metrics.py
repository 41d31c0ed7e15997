"""Serving metrics from per-request client timings, computed as vLLM's serving benchmark computes them.

Keeping vLLM's definitions (vllm/benchmarks/serve.py, `calculate_metrics`) makes our numbers comparable with
results published for vLLM and with runs of its own benchmark against the same servers:

- TTFT: first content chunk received - request sent. A content chunk carries text for choice 0; chunks with
  none (a chat stream's opening role delta, a bare finish_reason, the usage chunk) carry no token and are not
  timed. (vLLM times any chunk with choices, which makes a chat stream's role delta its "first token".)
- TPOT (per request, only when it produced more than one token): (e2e latency - TTFT) / (output tokens - 1).
- ITL: every gap between consecutive content chunks, pooled over all requests.
- E2E latency: last content chunk received - request sent.
- Output tokens: the server's usage count when it sent one, else the tokenizer's count of the text.
- Throughputs: totals over successful requests divided by the whole benchmark's duration.
- Goodput: successful requests meeting every SLO given (a TPOT of 0 for one-token requests), per second.
- Failed requests count only in `failed`: no latency, no tokens.
- Per request class (`--request-class`): the same definitions over that class's requests, divided by the whole
  benchmark's duration (so class goodputs add up to a mixed load's total), each class against its own SLOs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What the client measured for one request (seconds, perf_counter based)."""

    success: bool
    prompt_len: int
    start_time: float = 0.0  # when the request was sent, relative to the benchmark start
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int | None = None  # the server's usage count; None when it sent none
    generated_text: str = ""
    error: str = ""


@dataclass
class LatencyStats:
    """Summary of one latency metric in milliseconds; None everywhere when there were no samples."""

    mean: float | None
    median: float | None
    std: float | None
    percentiles: dict[int, float | None]

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[int] = PERCENTILES) -> LatencyStats:
        if len(seconds) == 0:
            return cls(None, None, None, {p: None for p in percentiles})
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()),
                   {p: float(np.percentile(ms, p)) for p in percentiles})


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None  # None when no SLO was given
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats

    def flat(self) -> dict:
        """vLLM's result-file key names: mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms, ..."""
        out = {k: v for k, v in asdict(self).items() if not k.endswith("_ms")}
        out["duration"] = out.pop("duration_s")
        for name in ("ttft", "tpot", "itl", "e2el"):
            stats: LatencyStats = getattr(self, f"{name}_ms")
            out[f"mean_{name}_ms"], out[f"median_{name}_ms"] = stats.mean, stats.median
            out[f"std_{name}_ms"] = stats.std
            for p, value in stats.percentiles.items():
                out[f"p{p}_{name}_ms"] = value
        return out


def output_lengths(results: Sequence[RequestResult],
                   count_tokens: Callable[[str], int] | None = None) -> list[int]:
    """Output tokens per request: usage count, else tokenizer count of the text, else 1 (vLLM's fallback);
    0 for failed requests."""
    lens = []
    for r in results:
        if not r.success:
            lens.append(0)
        elif r.output_tokens:
            lens.append(int(r.output_tokens))
        elif count_tokens is not None:
            lens.append(count_tokens(r.generated_text))
        else:
            lens.append(1)
    return lens


def tpot(result: RequestResult, output_len: int) -> float | None:
    """Time per output token after the first; None when the request made at most one token."""
    if output_len <= 1:
        return None
    return (result.latency - result.ttft) / (output_len - 1)


def calculate_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    count_tokens: Callable[[str], int] | None = None,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    percentiles: Sequence[int] = PERCENTILES,
) -> tuple[BenchmarkMetrics, list[int]]:
    """Aggregate per-request results; returns the metrics and each request's output length."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    lens = output_lengths(results, count_tokens)
    ok = [(r, n) for r, n in zip(results, lens) if r.success]
    tpots = [t for r, n in ok if (t := tpot(r, n)) is not None]
    itls = [gap for r, _ in ok for gap in r.itl]
    total_input = sum(r.prompt_len for r, _ in ok)
    total_output = sum(n for _, n in ok)
    goodput = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(1 for r, n in ok if _meets_slo(r, n, slo_ttft_ms, slo_tpot_ms))
        goodput = good / duration_s
    metrics = BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        request_goodput=goodput,
        ttft_ms=LatencyStats.of([r.ttft for r, _ in ok], percentiles),
        tpot_ms=LatencyStats.of(tpots, percentiles),
        itl_ms=LatencyStats.of(itls, percentiles),
        e2el_ms=LatencyStats.of([r.latency for r, _ in ok], percentiles),
    )
    return metrics, lens


@dataclass
class RequestClass:
    """One kind of request in a mixed load: its share of the requests, and what it asks the server for.

    `priority` and the SLOs travel in the request body (slo_tpot_ms as the server's `slo_itl_ms`); the SLOs also
    decide the class's goodput. None means: not sent, and for goodput the run's global SLO applies.
    """

    name: str
    share: float = 1.0
    priority: int | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


@dataclass
class ClassMetrics:
    """The numbers of one request class; goodput uses `slo_ttft_ms`/`slo_tpot_ms`, the targets it was held to."""

    name: str
    share: float  # normalised
    priority: int | None
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    requests: int
    completed: int
    failed: int
    output_throughput: float
    request_throughput: float
    request_goodput: float | None  # None when neither the class nor the run gave an SLO
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats

    def flat(self) -> dict:
        """JSON-ready, with the vLLM-style latency keys of the run's own record (median_ttft_ms, p99_tpot_ms)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("name", "ttft_ms", "tpot_ms")}
        for name in ("ttft", "tpot"):
            stats: LatencyStats = getattr(self, f"{name}_ms")
            out[f"mean_{name}_ms"], out[f"median_{name}_ms"] = stats.mean, stats.median
            for p, value in stats.percentiles.items():
                out[f"p{p}_{name}_ms"] = value
        return out


def class_metrics(
    results: Sequence[RequestResult],
    output_lens: Sequence[int],
    assignment: Sequence[str],
    classes: Sequence[RequestClass],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    percentiles: Sequence[int] = PERCENTILES,
) -> list[ClassMetrics]:
    """Per-class metrics, in the order of `classes`; `assignment[i]` names request i's class.

    A class's own SLO wins, metric by metric; where it gives none, the run's global one (if any) applies.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    if not len(results) == len(output_lens) == len(assignment):
        raise ValueError(f"{len(results)} results, {len(output_lens)} lengths, {len(assignment)} class labels")
    unknown = set(assignment) - {c.name for c in classes}
    if unknown:
        raise ValueError(f"requests of unknown classes: {', '.join(sorted(unknown))}")
    total_share = sum(c.share for c in classes)
    out = []
    for c in classes:
        mine = [(r, n) for r, n, name in zip(results, output_lens, assignment) if name == c.name]
        ok = [(r, n) for r, n in mine if r.success]
        ttft_slo = c.slo_ttft_ms if c.slo_ttft_ms is not None else slo_ttft_ms
        tpot_slo = c.slo_tpot_ms if c.slo_tpot_ms is not None else slo_tpot_ms
        goodput = None
        if ttft_slo is not None or tpot_slo is not None:
            goodput = sum(1 for r, n in ok if _meets_slo(r, n, ttft_slo, tpot_slo)) / duration_s
        out.append(ClassMetrics(
            name=c.name, share=c.share / total_share, priority=c.priority, slo_ttft_ms=ttft_slo,
            slo_tpot_ms=tpot_slo, requests=len(mine), completed=len(ok), failed=len(mine) - len(ok),
            output_throughput=sum(n for _, n in ok) / duration_s, request_throughput=len(ok) / duration_s,
            request_goodput=goodput, ttft_ms=LatencyStats.of([r.ttft for r, _ in ok], percentiles),
            tpot_ms=LatencyStats.of([t for r, n in ok if (t := tpot(r, n)) is not None], percentiles)))
    return out


def _meets_slo(r: RequestResult, output_len: int, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if slo_ttft_ms is not None and r.ttft * 1000.0 > slo_ttft_ms:
        return False
    return slo_tpot_ms is None or (tpot(r, output_len) or 0.0) * 1000.0 <= slo_tpot_ms
