"""PNG charts from result files: latency CDFs per run, and throughput / p99 TTFT against request rate.

Lines are labelled by each result's `label` (the system's name), so runs of several servers at several rates
fall into one line per server. Offline results have no latencies: they appear on the throughput chart as a
dashed horizontal line (their rate is "everything at once").
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.report import rate_from_json


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def run_name(result: dict[str, Any]) -> str:
    label = result.get("label") or result.get("model") or "run"
    if result.get("kind") == "offline":
        return label if "offline" in label else f"{label} (offline)"
    name = f"{label} @ {_rate_name(rate_from_json(result.get('request_rate')))} req/s"
    if result.get("max_concurrency"):
        name += f", c={result['max_concurrency']}"
    return name


def _cdf(ax, values_ms: np.ndarray, name: str) -> None:
    xs = np.sort(values_ms)
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=name)


def plot_latency_cdf(results: Sequence[dict[str, Any]], key: str, title: str, path: Path) -> Path | None:
    """Empirical CDF of per-request TTFTs (key 'ttfts') or pooled ITLs ('itls'), in ms; None if no samples."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for result in results:
        values = result.get(key) or []
        if key == "itls":
            values = [gap for per_request in values if per_request for gap in per_request]
        samples = np.asarray([v for v in values if v is not None], dtype=np.float64) * 1000.0
        if samples.size:
            _cdf(ax, samples, run_name(result))
            drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel(f"{title} (ms)")
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{title}: CDF")
    return _save(plt, fig, ax, path)


def _save(plt, fig, ax, path: Path) -> Path:
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_against_rate(results: Sequence[dict[str, Any]], key: str, ylabel: str, path: Path) -> Path | None:
    """One line per label of `key` against request rate; rates are categories (so 'inf' has a place)."""
    serve = [r for r in results if r.get("kind") == "serve" and r.get(key) is not None]
    if not serve:
        return None
    plt = _pyplot()
    rates = sorted({rate_from_json(r.get("request_rate")) for r in serve})
    position = {rate: i for i, rate in enumerate(rates)}
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in serve:
        lines[r.get("label") or r.get("model") or "run"].append(
            (position[rate_from_json(r.get("request_rate"))], float(r[key])))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in lines.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    if key == "output_throughput":
        for r in results:
            if r.get("kind") == "offline" and r.get(key) is not None:
                ax.axhline(float(r[key]), linestyle="--", color="gray", alpha=0.8)
                ax.annotate(run_name(r), (0, float(r[key])), fontsize="small", va="bottom")
    ax.set_xticks(range(len(rates)), [_rate_name(rate) for rate in rates])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel} against request rate")
    ax.set_ylim(bottom=0)
    return _save(plt, fig, ax, path)


def plot_results(results: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write every chart that the results support into `out_dir`; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [
        plot_latency_cdf(results, "ttfts", "TTFT", out / "ttft_cdf.png"),
        plot_latency_cdf(results, "itls", "ITL", out / "itl_cdf.png"),
    ]
    if len(results) > 1:
        written.append(plot_against_rate(results, "output_throughput", "output tokens/s",
                                         out / "throughput_vs_rate.png"))
        written.append(plot_against_rate(results, "p99_ttft_ms", "p99 TTFT (ms)", out / "p99_ttft_vs_rate.png"))
    return [p for p in written if p is not None]
