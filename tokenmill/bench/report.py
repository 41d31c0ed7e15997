"""Result files and the printed summary of a benchmark run.

A result is one flat JSON object: the run's configuration (label, base_url, model, dataset, request_rate, ...),
the metrics under vLLM's key names (request_throughput, mean_ttft_ms, p99_itl_ms, ...), and the per-request
samples (ttfts, itls, e2els, input_lens, output_lens, errors) so plots and later analyses need no re-run.
A mixed load (`--request-class`) adds "classes" (name -> that class's metrics) and "request_classes" (each
request's class name).
Infinite request rates are written as the string "inf" (JSON has no infinity).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenmill.bench.metrics import PERCENTILES, BenchmarkMetrics, ClassMetrics, RequestResult

WIDTH = 50


def rate_to_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def rate_from_json(value: Any) -> float:
    return math.inf if value in ("inf", "Infinity", None) else float(value)


def serve_result(config: dict[str, Any], metrics: BenchmarkMetrics, results: Sequence[RequestResult],
                 output_lens: Sequence[int], expected_lens: Sequence[int] | None = None,
                 class_stats: Sequence[ClassMetrics] | None = None,
                 request_classes: Sequence[str] | None = None) -> dict[str, Any]:
    """The JSON-ready record of one `bench serve` run (failed requests keep their slot, with nulls).

    `short_outputs` counts successful requests that made fewer tokens than their `max_tokens`: with
    `ignore_eos` there should be none, and a server that stops early (or drops the field) shows up here.
    """
    out = {"kind": "serve", **config, **metrics.flat()}
    out["request_rate"] = rate_to_json(float(config.get("request_rate", math.inf)))
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = list(output_lens)
    if expected_lens is not None:
        out["expected_output_lens"] = list(expected_lens)
        out["short_outputs"] = sum(1 for r, n, want in zip(results, output_lens, expected_lens)
                                   if r.success and n < want)
    out["ttfts"] = [r.ttft if r.success else None for r in results]
    out["itls"] = [list(r.itl) if r.success else None for r in results]
    out["e2els"] = [r.latency if r.success else None for r in results]
    out["start_times"] = [r.start_time for r in results]
    out["errors"] = [r.error for r in results]
    if class_stats:
        out["classes"] = {c.name: c.flat() for c in class_stats}
    if request_classes is not None:
        out["request_classes"] = list(request_classes)
    return out


def save_result(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return path


def load_result(path: str | Path) -> dict[str, Any]:
    """Read a result file; raises ValueError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read result file {path}: {e}") from None
    if not isinstance(data, dict) or data.get("kind") not in ("serve", "offline"):
        raise ValueError(f"{path} is not a tokenmill bench result (no 'kind': serve or offline)")
    return data


# -------------------------------------------------------------------------------------------- the table


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.{digits}f}"
    return str(value)


def _line(name: str, value: Any, digits: int = 2) -> str:
    return f"{name:<40} {_fmt(value, digits)}"


def format_serve(result: dict[str, Any], percentiles: Sequence[int] = PERCENTILES) -> str:
    """The summary vLLM's benchmark prints, plus p90s and the failures' first error."""
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    lines.append(_line("Label:", result.get("label")))
    lines.append(_line("Successful requests:", result["completed"]))
    lines.append(_line("Failed requests:", result["failed"]))
    lines.append(_line("Request rate configured (RPS):", rate_from_json(result.get("request_rate"))))
    if result.get("burstiness", 1.0) != 1.0:
        lines.append(_line("Burstiness:", result["burstiness"]))
    if result.get("max_concurrency"):
        lines.append(_line("Maximum request concurrency:", result["max_concurrency"]))
    lines.append(_line("Benchmark duration (s):", result["duration"]))
    lines.append(_line("Total input tokens:", result["total_input_tokens"]))
    lines.append(_line("Total generated tokens:", result["total_output_tokens"]))
    if result.get("short_outputs"):
        lines.append(_line("Requests cut short (< max_tokens):", result["short_outputs"]))
    lines.append(_line("Request throughput (req/s):", result["request_throughput"]))
    if result.get("request_goodput") is not None:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in (result.get("slo_ms") or {}).items() if v is not None)
        lines.append(_line(f"Request goodput (req/s){' [' + slo + ']' if slo else ''}:",
                           result["request_goodput"]))
    lines.append(_line("Input token throughput (tok/s):", result["total_input_tokens"] / result["duration"]))
    lines.append(_line("Output token throughput (tok/s):", result["output_throughput"]))
    lines.append(_line("Total token throughput (tok/s):", result["total_token_throughput"]))
    for key, title, short in (("ttft", "Time to First Token", "TTFT"),
                              ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl", "Inter-token Latency", "ITL"),
                              ("e2el", "End-to-end Latency", "E2EL")):
        lines.append(title.center(WIDTH, "-"))
        lines.append(_line(f"Mean {short} (ms):", result.get(f"mean_{key}_ms")))
        lines.append(_line(f"Median {short} (ms):", result.get(f"median_{key}_ms")))
        for p in percentiles:
            if p != 50:
                lines.append(_line(f"P{p} {short} (ms):", result.get(f"p{p}_{key}_ms")))
    if result.get("classes"):
        lines.extend(format_classes(result["classes"]))
    errors = [e for e in result.get("errors", []) if e]
    if errors:
        lines.append("-" * WIDTH)
        lines.append(f"First error ({len(errors)} failed): {errors[0].splitlines()[0][:200]}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


CLASS_COLUMNS = (("prio", 5), ("ok", 5), ("failed", 6), ("TTFT p50", 9), ("TTFT p99", 9), ("TPOT p50", 9),
                 ("TPOT p99", 9), ("out tok/s", 9), ("goodput", 8), ("SLO ttft/tpot", 14))


def format_classes(classes: dict[str, dict[str, Any]]) -> list[str]:
    """One row per request class (latencies in ms, goodput in req/s against the SLO column's targets)."""
    def slo(c: dict[str, Any]) -> str:
        if c.get("slo_ttft_ms") is None and c.get("slo_tpot_ms") is None:
            return "-"
        return "/".join("-" if v is None else f"{v:g}" for v in (c.get("slo_ttft_ms"), c.get("slo_tpot_ms")))

    def row(first: str, cells: Sequence[Any]) -> str:
        return f"{first:<{name_width}} " + " ".join(f"{cell!s:>{w}}" for cell, (_, w) in zip(cells, CLASS_COLUMNS))

    name_width = max([12, *(len(name) for name in classes)])
    lines = [" Per Request Class ".center(WIDTH, "-"), row("class", [title for title, _ in CLASS_COLUMNS])]
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "output_throughput", "request_goodput")
    for name, c in classes.items():
        prio = "-" if c.get("priority") is None else c["priority"]
        lines.append(row(name, [prio, c.get("completed"), c.get("failed"), *(_fmt(c.get(k)) for k in keys), slo(c)]))
    return lines


def format_offline(result: dict[str, Any]) -> str:
    lines = [" Offline Benchmark Result ".center(WIDTH, "=")]
    lines.append(_line("Label:", result.get("label")))
    lines.append(_line("Requests:", result["num_prompts"]))
    lines.append(_line("Elapsed (s):", result["duration"]))
    lines.append(_line("Total input tokens:", result["total_input_tokens"]))
    lines.append(_line("Total generated tokens:", result["total_output_tokens"]))
    lines.append(_line("Request throughput (req/s):", result["request_throughput"]))
    lines.append(_line("Output token throughput (tok/s):", result["output_throughput"]))
    lines.append(_line("Total token throughput (tok/s):", result["total_token_throughput"]))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_result(result: dict[str, Any]) -> str:
    return format_serve(result) if result.get("kind") == "serve" else format_offline(result)
