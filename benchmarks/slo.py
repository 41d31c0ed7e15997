"""Priorities and latency targets under overload, side by side (BENCHMARKS.md "SLO-aware scheduling").

    python benchmarks/slo.py --parts mixed --duration 60
    python benchmarks/slo.py --parts itl

- mixed: a real server under a mixed Poisson load past its capacity: interactive requests (ShareGPT prompts, 64
  output tokens, priority 0, TTFT target 1 s, ITL target 150 ms) and batch requests (1,024-token random prompts,
  256 output tokens, priority 1, no target). First come first served (--scheduling-policy continuous) against
  --scheduling-policy priority, same engine, same arrivals: interactive goodput (requests/s meeting both
  targets: TTFT and TPOT, vLLM's --goodput), interactive TTFT p50/p99, batch output tokens/s.
- itl: decode ITL while 4,000-token prompts arrive: 8 streams decoding, a long prompt every few seconds; an ITL
  target (--slo-itl-ms 150: the step sized by the measured step cost) against a fixed 512-token budget (the
  default, a long prompt taking a quarter of it a step) and no chunking (a long prompt's whole prefill in one step).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from http_vs_offline import start_tokenmill
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.bench.datasets import load_sharegpt, random_requests
from tokenmill.bench.loadgen import LoadConfig, RequestResult, first_model, run_load
from tokenmill.model.cpu_kernels import cpu_isa
from tokenmill.model.loader import default_model_path
from tokenmill.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TTFT_S, ITL_S = 1.0, 0.150


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def tpot(r: RequestResult) -> float:
    return statistics.mean(r.itl) if r.itl else 0.0


def server_view(url: str) -> str:
    """What the server counted: preemptions by cause, and how its TTFT prediction (admission's) compared with the
    TTFT it measured (mean error, share of requests that took longer than predicted)."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)}
    causes = {s.labels["cause"]: int(s.value) for s in families["tokenmill_num_preemptions_by_cause"].samples
              if s.name.endswith("_total")}
    err = families["tokenmill_ttft_prediction_error_seconds"].samples
    buckets = sorted((float(s.labels["le"]), s.value) for s in err if s.name.endswith("_bucket"))
    count = buckets[-1][1] if buckets else 0
    at_most_0 = next((n for le, n in buckets if le == 0.0), 0)
    # a histogram with negative buckets exposes no _sum: the median's bucket instead
    lo, median_bucket = -math.inf, "n/a"
    for le, n in buckets:
        if count and n >= count / 2:
            median_bucket = f"({lo:g}, {le:g}] s"
            break
        lo = le
    late = (count - at_most_0) / count if count else math.nan
    return (f"preemptions {causes}; TTFT prediction error (actual - predicted): median in {median_bucket}, "
            f"{late:.0%} later than predicted")


async def mixed_load(url: str, model: str, interactive, batch, rate_i: float, rate_b: float, seed: int):
    common = {"base_url": url, "model": model, "progress": False}
    cfg_i = LoadConfig(**common, request_rate=rate_i, seed=seed, ignore_eos=True,
                       extra_body={"priority": 0, "slo_ttft_ms": TTFT_S * 1e3, "slo_itl_ms": ITL_S * 1e3})
    cfg_b = LoadConfig(**common, request_rate=rate_b, seed=seed + 1, ignore_eos=True, extra_body={"priority": 1})
    (res_i, dur_i), (res_b, dur_b) = await asyncio.gather(run_load(cfg_i, interactive), run_load(cfg_b, batch))
    return res_i, res_b, max(dur_i, dur_b)


def mixed(args) -> None:
    tok = Tokenizer.load(default_model_path()).hf_tokenizer
    n_i, n_b = int(args.rate_interactive * args.duration), int(args.rate_batch * args.duration)
    interactive = load_sharegpt(tok, n_i, seed=args.seed, max_prompt_len=256, fixed_output_len=64)
    batch = random_requests(tok, n_b, 1024, 256, seed=args.seed)
    rows = {}
    configs = {"continuous": ["--scheduling-policy", "continuous"], "priority": ["--scheduling-policy", "priority"],
               "priority + --slo-admission reject": ["--scheduling-policy", "priority", "--slo-admission", "reject"],
               "priority, no KV headroom (--new-token-ratio 0)": ["--scheduling-policy", "priority",
                                                                  "--new-token-ratio", "0"]}
    short = {"continuous": "continuous", "priority": "priority", "reject": "priority + --slo-admission reject",
             "noheadroom": "priority, no KV headroom (--new-token-ratio 0)"}
    configs = {short[k]: configs[short[k]] for k in args.policies.split(",")}
    for policy, flags in configs.items():
        runs = []
        for run in range(args.runs):
            proc, url = start_tokenmill([*flags, "--kv-cache-memory", "512MiB"])
            try:
                runs.append(asyncio.run(mixed_load(url, first_model(url, None), interactive, batch,
                                                   args.rate_interactive, args.rate_batch, args.seed + run)))
                print(f"{policy} run {run + 1}: {server_view(url)}", file=sys.stderr, flush=True)
            finally:
                proc.terminate()
                proc.wait(60)
            res_i, res_b, dur = runs[-1]
            ok_i = [r for r in res_i if r.success]
            print(f"{policy} run {run + 1}: interactive {len(ok_i)}/{len(res_i)} ok, TTFT p99 "
                  f"{pct([r.ttft for r in ok_i], 0.99):.2f} s; batch {sum(r.success for r in res_b)}/{len(res_b)}",
                  file=sys.stderr, flush=True)
        rows[policy] = runs
    print(f"\n## Mixed load: interactive {args.rate_interactive:g} req/s (ShareGPT, 64 out, priority 0, "
          f"TTFT {TTFT_S:g} s"
          f", ITL {ITL_S * 1e3:.0f} ms) + batch {args.rate_batch:g} req/s (1,024 in, 256 out, priority 1), "
          f"{args.duration:g} s of arrivals, median of {args.runs} runs (CPU {cpu_isa()})")
    print("| policy | interactive goodput req/s | met SLO | refused (429) | TTFT p50 | TTFT p99 | TPOT p50 | "
          "batch output tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    summary = {}
    for policy, runs in rows.items():
        goodput, met, p50, p99, tp, batch_tps, refused = [], [], [], [], [], [], []
        for res_i, res_b, dur in runs:
            ok = [r for r in res_i if r.success]
            refused.append(sum(1 for r in res_i if not r.success and "429" in (r.error or "")))
            good = [r for r in ok if r.ttft <= TTFT_S and tpot(r) <= ITL_S]
            goodput.append(len(good) / dur)
            met.append(len(good) / max(len(res_i), 1))
            p50.append(pct([r.ttft for r in ok], 0.5))
            p99.append(pct([r.ttft for r in ok], 0.99))
            tp.append(pct([tpot(r) for r in ok], 0.5))
            batch_tps.append(sum(r.output_tokens or 0 for r in res_b if r.success) / dur)
        m = {k: statistics.median(v) for k, v in (("goodput", goodput), ("met", met), ("p50", p50), ("p99", p99),
                                                   ("tpot", tp), ("batch", batch_tps), ("refused", refused))}
        summary[policy] = m
        print(f"| {policy} | {m['goodput']:.2f} | {m['met']:.0%} | {m['refused']:.0f} | {m['p50']:.2f} s | "
              f"{m['p99']:.2f} s | "
              f"{m['tpot'] * 1e3:.0f} ms | {m['batch']:.1f} |")
    if "continuous" not in summary or "priority" not in summary:
        return
    f, p = summary["continuous"], summary["priority"]
    print(f"\npriority / FCFS: interactive goodput {p['goodput'] / max(f['goodput'], 1e-9):.2f}x, batch throughput "
          f"{p['batch'] / max(f['batch'], 1e-9):.2f}x")


async def itl_load(url: str, streams, longs, gap: float):
    model = first_model(url, None)
    cfg = LoadConfig(base_url=url, model=model, progress=False, ignore_eos=True)
    cfg_long = LoadConfig(base_url=url, model=model, progress=False, ignore_eos=True, request_rate=1 / gap, seed=3)
    (res_s, _), _ = await asyncio.gather(run_load(cfg, streams), run_load(cfg_long, longs))
    return res_s


def itl(args) -> None:
    tok = Tokenizer.load(default_model_path()).hf_tokenizer
    streams = random_requests(tok, 8, 64, 256, seed=5)
    longs = random_requests(tok, 4, 4000, 1, seed=6)
    configs = {"ITL target 150 ms (--slo-itl-ms 150)": ["--slo-itl-ms", "150"],
               "fixed budget 512 (default)": [],
               "no chunking (budget 4,096, whole prompts)": ["--max-num-batched-tokens", "4096",
                                                             "--long-prefill-token-threshold", "4096"]}
    print(f"\n## Decode ITL while 4,000-token prompts arrive (8 streams x 256 tokens, a long prompt every "
          f"{args.gap:g} s; median of {args.runs} runs; CPU {cpu_isa()})")
    print("| configuration | ITL p50 | ITL p99 | ITL max | streams' output tok/s |\n|---|---|---|---|---|")
    for name, flags in configs.items():
        p50, p99, mx, tps = [], [], [], []
        for _ in range(args.runs):
            proc, url = start_tokenmill([*flags, "--kv-cache-memory", "512MiB", "--max-model-len", "8192"])
            try:
                res = asyncio.run(itl_load(url, streams, longs, args.gap))
            finally:
                proc.terminate()
                proc.wait(60)
            gaps = [g for r in res if r.success for g in r.itl]
            p50.append(pct(gaps, 0.5))
            p99.append(pct(gaps, 0.99))
            mx.append(max(gaps))
            span = max(r.start_time + r.latency for r in res if r.success)
            tps.append(sum(r.output_tokens or 0 for r in res if r.success) / span)
        print(f"| {name} | {statistics.median(p50) * 1e3:.0f} ms | {statistics.median(p99) * 1e3:.0f} ms | "
              f"{statistics.median(mx) * 1e3:.0f} ms | {statistics.median(tps):.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="mixed,itl")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals in the mixed part")
    ap.add_argument("--rate-interactive", type=float, default=2.0)
    ap.add_argument("--rate-batch", type=float, default=0.5)
    ap.add_argument("--policies", default="continuous,priority,reject",
                    help="mixed part: configurations to run (continuous, priority, reject: priority with "
                         "--slo-admission reject, noheadroom: priority with --new-token-ratio 0)")
    ap.add_argument("--gap", type=float, default=6.0, help="seconds between long prompts in the itl part")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if "mixed" in args.parts:
        mixed(args)
    if "itl" in args.parts:
        itl(args)


if __name__ == "__main__":
    main()
