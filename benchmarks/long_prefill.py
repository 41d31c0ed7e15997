"""Long prefills share the step: time to first token of short requests that arrive while an ~8,000-token prompt
is prefilling, with the scheduler's sharing (default `--long-prefill-token-threshold`) and without it (threshold =
`--max-num-batched-tokens`: the first long prefill takes the whole step, the schedule from before sharing).

    python benchmarks/long_prefill.py --threads 1                # the run in BENCHMARKS.md (a busy machine)
    python benchmarks/long_prefill.py --runs 1 --long-len 2000   # a quick look

A full run prefills the long prompt 12 times (4 cases x 3 runs): ~37 min on a busy 2-core machine with 1 thread
(the 8,000-token prefill at ~65 tokens/s); use --threads 2 on a quiet one.

Offline, through the real engine (`LLM(...).engine`, stepped by this script), SmolLM2 GGUF default model, float32.
Each run has five cases, interleaved run by run:
  shorts alone       `--num-short` requests of 10-30 prompt tokens, max_tokens 2, one every `--interval` s
  long alone         one `--long-len`-token prompt, max_tokens 2, with and without sharing (nothing to share with:
                     the same steps, so the same time, is the claim)
  long + shorts      the long prompt at t = 0, the shorts from t = `--first-arrival` s on (it is still prefilling),
                     with and without sharing
Short TTFT = first token time - the short's scheduled arrival time (a request arriving mid-step waits for that
step, as it would at the server). Every prompt is fresh random token ids, so the prefix cache never hits.
Reported: median over runs of the shorts' median and max TTFT, and of the long prompt's TTFT (the cost to it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill import LLM, SamplingParams


def cpu_line() -> str:
    """The CPU model, its core count and the instruction sets that matter for the kernels."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())  # the first core's
    except OSError:
        pass
    name = info.get("model name") or platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (f"{name}, {os.cpu_count()} cores, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"
            f"{' (' + ', '.join(isa) + ')' if isa else ''}")


def run_case(llm: LLM, rng: random.Random, args, long: bool, shorts: bool) -> dict:
    """Drive arrivals by the wall clock while stepping the engine; return TTFTs in seconds."""
    engine = llm.engine
    vocab = engine.core.model_config.vocab_size
    arrivals = []  # (offset s, request id, prompt, max_tokens)
    if long:
        arrivals.append((0.0, "long", [rng.randrange(1000, vocab) for _ in range(args.long_len)], 2))
    if shorts:
        start = args.first_arrival if long else 0.0
        for k in range(args.num_short):
            ids = [rng.randrange(1000, vocab) for _ in range(rng.randint(10, 30))]
            arrivals.append((start + k * args.interval, f"short{k}", ids, 2))
    due = {rid: offset for offset, rid, _, _ in arrivals}
    first: dict[str, float] = {}
    t0 = time.monotonic()
    pending = list(arrivals)
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while pending and pending[0][0] <= now:
            _, rid, ids, max_tokens = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": ids},
                               SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - (time.monotonic() - t0)))
            continue
        for out in engine.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = out.metrics.first_token_time - t0
    ttft = {rid: first[rid] - due[rid] for rid in due}
    short = [v for rid, v in ttft.items() if rid.startswith("short")]
    return {"long_ttft_s": ttft.get("long"), "short_ttft_s": short,
            "short_ttft_median_s": statistics.median(short) if short else None,
            "short_ttft_max_s": max(short) if short else None}


CASES = (  # name, engine, long, shorts
    ("shorts alone", "sharing", False, True),
    ("long alone, sharing", "sharing", True, False),
    ("long alone, no sharing", "no sharing", True, False),
    ("long + shorts, sharing", "sharing", True, True),
    ("long + shorts, no sharing", "no sharing", True, True),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compute threads (LLM num_threads)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--long-len", type=int, default=8000, help="prompt tokens of the long request")
    p.add_argument("--num-short", type=int, default=8)
    p.add_argument("--interval", type=float, default=0.5, help="seconds between short arrivals")
    p.add_argument("--first-arrival", type=float, default=1.0, help="first short's arrival after the long one (s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="the sharing side's threshold (default: the engine's default)")
    p.add_argument("--kv-cache-memory", type=int, default=768 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/long_prefill.json")
    args = p.parse_args(argv)
    cpu = cpu_line()
    print(f"CPU: {cpu}; {args.threads} threads", flush=True)
    common = {"dtype": args.dtype, "num_threads": args.threads, "kv_cache_memory": args.kv_cache_memory,
              "max_num_batched_tokens": args.max_num_batched_tokens}
    engines = {"sharing": LLM(**common, long_prefill_token_threshold=args.long_prefill_token_threshold),
               "no sharing": LLM(**common, long_prefill_token_threshold=args.max_num_batched_tokens)}
    thresholds = {k: llm.engine.core.scheduler.long_prefill_threshold for k, llm in engines.items()}
    for llm in engines.values():  # warm-up: kernel build, allocator, a prefill chunk at a long context
        llm.generate([{"prompt_token_ids": list(range(1000, 2200))}], SamplingParams(max_tokens=2), use_tqdm=False)
    rng = random.Random(args.seed)
    runs: dict[str, list[dict]] = {name: [] for name, *_ in CASES}
    for i in range(args.runs):
        for name, engine, long, shorts in CASES:
            r = run_case(engines[engine], rng, args, long, shorts)
            runs[name].append(r)
            parts = [f"long TTFT {r['long_ttft_s']:.2f} s" if r["long_ttft_s"] is not None else "",
                     f"short TTFT median {r['short_ttft_median_s']:.2f} s, max {r['short_ttft_max_s']:.2f} s"
                     if r["short_ttft_s"] else ""]
            print(f"run {i + 1} {name}: {'; '.join(x for x in parts if x)}", flush=True)

    def med(name: str, key: str) -> float | None:
        values = [r[key] for r in runs[name] if r[key] is not None]
        return statistics.median(values) if values else None

    summary = {name: {k: med(name, k) for k in ("short_ttft_median_s", "short_ttft_max_s", "long_ttft_s")}
               for name in runs}

    def fmt(v: float | None) -> str:
        return "" if v is None else f"{v:.2f}"

    print(f"\n{args.num_short} short requests (10-30 prompt tokens, max_tokens 2, one every {args.interval} s) and "
          f"one {args.long_len:,}-token prompt; max_num_batched_tokens {args.max_num_batched_tokens}, threshold "
          f"{thresholds['sharing']} (sharing) / {thresholds['no sharing']} (no sharing); median of {args.runs} runs, "
          f"seconds\n")
    print("| case | short TTFT, median | short TTFT, max | long prompt TTFT |")
    print("|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {fmt(s['short_ttft_median_s'])} | {fmt(s['short_ttft_max_s'])} | "
              f"{fmt(s['long_ttft_s'])} |")
    result = {"command": " ".join(["python benchmarks/long_prefill.py", *(argv or sys.argv[1:])]), "cpu": cpu,
              "args": vars(args), "thresholds": thresholds, "summary": summary, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
