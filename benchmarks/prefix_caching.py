"""Prefix caching on vs off, in one run, against real `tokenmill serve` processes driven over HTTP.

    python benchmarks/prefix_caching.py                      # both workloads, defaults below
    python benchmarks/prefix_caching.py --repeats 3          # median of 3 runs per side
    python benchmarks/prefix_caching.py --workloads shared --num-prompts 64   # a quick look

Workloads:
- `shared`: the bench tool's prefix-sharing set: G system prompts of P tokens (default 8 x 1,000), N questions
  (default 200, 32 tokens each, 32 output tokens, ignore_eos), groups interleaved, Poisson arrivals at
  --request-rate (default 1/s), streamed /v1/completions.
- `multiturn`: ShareGPT conversations (>= 3 human turns) replayed turn by turn through /v1/chat/completions:
  each turn sends the whole history, with the model's own earlier answers, as a chat client does. User turns
  are cut to 256 tokens, answers to the data's reply length capped at 64 tokens (ignore_eos); conversations
  start as a Poisson process at --conversation-rate and run their turns back to back.

For each side a fresh server (same flags but --no-prefix-caching) gets the same requests. Reported: TTFT p50/p99,
output tokens/s, and prefill tokens computed (the server's tokenmill_prefill_tokens_computed_total counter:
prompt tokens run through the model, cache hits excluded). Results go to results/prefix_caching.json and a
TTFT CDF plot to benchmarks/plots/prefix_caching_ttft.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from http_vs_offline import start_tokenmill  # noqa: E402 (benchmarks/ is on sys.path as the script's folder)
from tokenmill.bench.datasets import BenchRequest, iter_sharegpt_records, prefix_sharing_requests, sharegpt_path
from tokenmill.bench.loadgen import LoadConfig, arrival_times, make_client, run_load, send_request
from tokenmill.bench.metrics import RequestResult, calculate_metrics
from tokenmill.model.loader import default_model_path
from tokenmill.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


# ---- a server per side ---------------------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0]] = out.get(name.split("{", 1)[0], 0.0) + float(value)
    return out


# ---- workloads -------------------------------------------------------------------------------------------------------


def shared_workload(tok, args) -> list[BenchRequest]:
    return prefix_sharing_requests(tok, args.groups, args.prefix_len, args.num_prompts, args.question_len,
                                   args.output_len, seed=args.seed)


def conversations(tok, num: int, seed: int, max_turns: int = 4, min_turns: int = 3) -> list[list[tuple[str, int]]]:
    """ShareGPT conversations as [(user message, answer length)] per turn: human turns with a reply after them,
    each message cut to 256 tokens, answer lengths from the data's replies (4 to 64 tokens)."""
    out = []
    records = list(iter_sharegpt_records(sharegpt_path()))
    random.Random(seed).shuffle(records)
    for record in records:
        turns, convo = record.get("conversations") or [], []
        for a, b in zip(turns, turns[1:]):
            if a.get("from") in ("human", "user") and b.get("from") in ("gpt", "assistant", "chatgpt"):
                ids = tok.encode(str(a.get("value", "")), add_special_tokens=False)[:256]
                reply = len(tok.encode(str(b.get("value", "")), add_special_tokens=False))
                if len(ids) >= 4 and reply >= 4:
                    convo.append((tok.decode(ids), min(reply, 64)))
        if len(convo) >= min_turns:
            out.append(convo[:max_turns])
        if len(out) == num:
            break
    return out


async def replay(url: str, model: str, convos: list[list[tuple[str, int]]], rate: float, seed: int
                 ) -> tuple[list[tuple[int, RequestResult]], float]:
    """Each conversation turn by turn (history with the model's own answers); returns (turn, result) pairs."""
    cfg = LoadConfig(base_url=url, model=model, endpoint="chat", progress=False)
    starts = arrival_times(len(convos), rate, seed=seed)
    out: list[tuple[int, RequestResult]] = []

    async with make_client(cfg) as client:
        async def one(convo, start: float) -> None:
            await asyncio.sleep(max(0.0, t0 + start - time.perf_counter()))
            history: list[dict] = []
            for turn, (message, answer_len) in enumerate(convo):
                history.append({"role": "user", "content": message})
                turn_cfg = LoadConfig(base_url=url, model=model, endpoint="chat", extra_body={"messages": history})
                result = await send_request(client, turn_cfg, BenchRequest(message, [], 0, answer_len), t0)
                out.append((turn, result))
                if not result.success:
                    return
                history = history + [{"role": "assistant", "content": result.generated_text}]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(c, float(s)) for c, s in zip(convos, starts)))
        duration = time.perf_counter() - t0
    return out, duration


# ---- one side --------------------------------------------------------------------------------------------------------


def run_side(cache: bool, args, shared: list[BenchRequest], convos) -> dict:
    flags = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)]
    if args.kv_cache_memory:
        flags += ["--kv-cache-memory", args.kv_cache_memory]
    if not cache:
        flags.append("--no-prefix-caching")
    proc, url = start_tokenmill(flags)
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    side: dict = {}
    try:
        if "shared" in args.workloads:
            before = scrape(url)
            cfg = LoadConfig(base_url=url, model=model, request_rate=args.request_rate, seed=args.seed)
            results, duration = asyncio.run(run_load(cfg, shared))
            side["shared"] = summarize(results, duration, before, scrape(url))
        if "multiturn" in args.workloads:
            before = scrape(url)
            pairs, duration = asyncio.run(replay(url, model, convos, args.conversation_rate, args.seed))
            summary = summarize([r for _, r in pairs], duration, before, scrape(url))
            later = [r.ttft for t, r in pairs if t > 0 and r.success]
            summary["ttft_p50_later_turns_ms"] = float(np.percentile(later, 50) * 1000) if later else None
            side["multiturn"] = summary
    finally:
        proc.terminate()
        proc.wait(60)
    return side


def summarize(results: list[RequestResult], duration: float, before: dict, after: dict) -> dict:
    metrics, _ = calculate_metrics(results, duration)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (
        "tokenmill_prefill_tokens_computed_total", "tokenmill_prompt_tokens_total",
        "tokenmill_prefix_cache_hits_total", "tokenmill_prefix_cache_queries_total")}
    return {"completed": metrics.completed, "failed": metrics.failed, "duration_s": duration,
            "output_tokens_per_s": metrics.output_throughput,
            "ttft_p50_ms": metrics.ttft_ms.median, "ttft_p99_ms": metrics.ttft_ms.percentiles[99],
            "prefill_tokens_computed": delta["tokenmill_prefill_tokens_computed_total"],
            "prompt_tokens": delta["tokenmill_prompt_tokens_total"],
            "cache_hit_tokens": delta["tokenmill_prefix_cache_hits_total"],
            "ttfts_s": [r.ttft for r in results if r.success]}


# ---- report ----------------------------------------------------------------------------------------------------------


def table(runs: dict[str, list[dict]], workloads: list[str]) -> str:
    """Medians over repeats, cache on vs off, per workload."""
    lines = ["| workload | prefix cache | TTFT p50 ms | TTFT p99 ms | output tok/s | prefill tokens computed | "
             "prompt tokens | failed |", "|---|---|---|---|---|---|---|---|"]
    ratios = []
    for w in workloads:
        med = {}
        for side in ("on", "off"):
            rs = [r[w] for r in runs[side]]
            med[side] = {k: statistics.median(r[k] for r in rs) for k in (
                "ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s", "prefill_tokens_computed", "prompt_tokens",
                "failed")}
            m = med[side]
            lines.append(f"| {w} | {side} | {m['ttft_p50_ms']:.0f} | {m['ttft_p99_ms']:.0f} | "
                         f"{m['output_tokens_per_s']:.1f} | {m['prefill_tokens_computed']:.0f} | "
                         f"{m['prompt_tokens']:.0f} | {m['failed']:.0f} |")
        on, off = med["on"], med["off"]
        ratios.append(f"{w}: TTFT p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.1f}x lower, "
                      f"prefill tokens {100 * (1 - on['prefill_tokens_computed'] / off['prefill_tokens_computed']):.1f}%"
                      f" fewer, output tok/s {on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x")
    return "\n".join(lines + [""] + ratios)


def plot(runs: dict[str, list[dict]], workloads: list[str], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for side, style in (("on", "-"), ("off", "--")):
            ttfts = np.sort(np.asarray(runs[side][0][w]["ttfts_s"]) * 1000)
            ax.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), style, label=f"prefix cache {side}")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only: minor labels collide
        ax.set_xlabel("TTFT (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{w}: time to first token")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["shared", "multiturn"], choices=["shared", "multiturn"])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--conversation-rate", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--kv-cache-memory", default=None)
    args = p.parse_args(argv)

    tok = Tokenizer.load(default_model_path())
    shared = shared_workload(tok, args) if "shared" in args.workloads else []
    convos = conversations(tok, args.conversations, args.seed) if "multiturn" in args.workloads else []
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for i in range(args.repeats):
        for side in (("on", "off") if i % 2 == 0 else ("off", "on")):  # alternate which side runs first
            print(f"run {i + 1}/{args.repeats}: prefix cache {side}", file=sys.stderr, flush=True)
            runs[side].append(run_side(side == "on", args, shared, convos))
    report = table(runs, args.workloads)
    print(report)
    out = ROOT / "results" / "prefix_caching.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    plot(runs, args.workloads, ROOT / "benchmarks" / "plots" / "prefix_caching_ttft.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
