"""Speculative decoding against none, side by side in one process (BENCHMARKS.md "Speculative decoding").

    python benchmarks/spec.py                          # all parts, 3 runs
    python benchmarks/spec.py --parts single --runs 3
    python benchmarks/spec.py --parts cost,threshold --runs 2

- single: one stream (each prompt alone, greedy, up to --max-tokens, natural ends), output tokens/s per
  configuration on three workloads: repetitive (edit a code block: rename a variable, comment its lines; summarise a
  text quoting it), ShareGPT chat (first turns) and random token prompts; acceptance per workload. Greedy output is
  the same tokens under every configuration (checked), so tokens/s compares the same work.
- cost: what a draft-model cycle costs against one decode step, measured on the runners themselves (a 256-token
  context, one request): the target's 1-token step, its (k+1)-token verify step and the draft's 1-token step; the
  speed-up a draft can give is L / (k c + v) with L its mean accepted length, c = draft / target step, v = verify /
  target step.
- threshold: ShareGPT at 4, 16 and 64 at a time (2x as many prompts, at least 16; 128 output tokens, ignore_eos):
  no speculation, n-gram as shipped (the measured step cost decides who speculates) and n-gram always.
Engines are built once; rounds take the configurations in turn, so a slow spell of the machine hits all of them.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill import LLM, SamplingParams
from tokenmill.bench.datasets import chat_token_ids, load_sharegpt, random_requests
from tokenmill.bench.offline import run_offline
from tokenmill.model.cpu_kernels import cpu_isa
from tokenmill.model.loader import default_model_path
from tokenmill.spec.draft_model import last_logits

CODE = [
    '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result''',
    '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise KeyError(name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())''',
    '''function parseQuery(query) {
  const params = {};
  for (const part of query.split("&")) {
    const [key, value] = part.split("=");
    if (!key) continue;
    params[decodeURIComponent(key)] = decodeURIComponent(value || "");
  }
  return params;
}''',
    '''def merge_sorted(left, right):
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged''',
]
EDITS = ["Rewrite this code with the variable `{old}` renamed to `{new}`. Output the whole code.\n\n```\n{code}\n```",
         ("Add a short comment above every line of this code that changes a variable. Output the whole code.\n\n```\n"
          "{code}\n```")]
RENAMES = [("result", "averages"), ("items", "stock"), ("params", "fields"), ("merged", "output")]
TEXTS = [
    ("The city council met on Tuesday to discuss the new bicycle lanes. Several residents said the lanes made "
     "their commute safer, while shop owners on Main Street worried about losing parking spaces. The mayor "
     "promised a review after six months and said the council would publish traffic counts every month."),
    ("Researchers at the university found that students who slept at least seven hours before an exam scored "
     "higher on average than those who stayed up late studying. The study followed 400 students over two "
     "semesters and measured sleep with wrist trackers rather than asking the students to remember."),
]
QUOTE = "Summarise this text in three sentences, quoting its exact words where you can.\n\n\"{text}\""


def repetitive_prompts(tokenizer) -> list[list[int]]:
    prompts = [EDITS[0].format(old=old, new=new, code=code) for code, (old, new) in zip(CODE, RENAMES)]
    prompts += [EDITS[1].format(code=CODE[0]), EDITS[1].format(code=CODE[3])]
    prompts += [QUOTE.format(text=t) for t in TEXTS]
    return [chat_token_ids(tokenizer, p) for p in prompts]


def single_stream(engines: dict[str, LLM], workloads: dict[str, list[list[int]]], runs: int, max_tokens: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    speeds = {(w, c): [] for w in workloads for c in engines}
    reference: dict[str, list[list[int]]] = {}
    for run in range(runs):
        for w, prompts in workloads.items():
            for c, llm in engines.items():
                start, tokens, outs = time.perf_counter(), 0, []
                for ids in prompts:  # one at a time: a single stream
                    o = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
                    tokens += len(o.token_ids)
                    outs.append(o.token_ids)
                speeds[w, c].append(tokens / (time.perf_counter() - start))
                if reference.setdefault(w, outs) != outs:
                    print(f"!! {c} on {w}: greedy output differs from {next(iter(engines))}'s", file=sys.stderr)
            print(f"run {run + 1}: {w}: " + ", ".join(f"{c} {speeds[w, c][-1]:.1f}" for c in engines), file=sys.stderr,
                  flush=True)
    base = next(iter(engines))
    print(f"\n## single stream, greedy, up to {max_tokens} tokens (median of {runs} runs; CPU {cpu_isa()})")
    print("| workload | prompts | output tokens | " + " | ".join(f"{c} tok/s" for c in engines) + " | " +
          " | ".join(f"{c} / {base}" for c in list(engines)[1:]) + " |")
    print("|---" * (3 + 2 * len(engines) - 1) + "|")
    for w, prompts in workloads.items():
        med = {c: statistics.median(speeds[w, c]) for c in engines}
        print(f"| {w} | {len(prompts)} | {sum(map(len, reference[w]))} | " +
              " | ".join(f"{med[c]:.1f}" for c in engines) + " | " +
              " | ".join(f"{med[c] / med[base]:.2f}x" for c in list(engines)[1:]) + " |")


def acceptance(engines: dict[str, LLM], workloads: dict[str, list[list[int]]], max_tokens: int) -> None:
    """Acceptance per workload and configuration, from one more pass with fresh counters."""
    print("\n| workload | configuration | acceptance rate | mean accepted length | by position |")
    print("|---|---|---|---|---|")
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for w, prompts in workloads.items():
        for c, llm in engines.items():
            sched = llm.engine.core.scheduler
            if sched.spec_stats is None:
                continue
            sched.spec_stats = type(sched.spec_stats)()
            for ids in prompts:
                llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            st = sched.spec_stats
            by_pos = ", ".join(f"{r:.2f}" for r in st.acceptance_by_position())
            print(f"| {w} | {c} | {st.acceptance_rate:.1%} | {st.mean_accepted_length:.2f} | {by_pos} |")


def cost(runs: int, kv: int, quantization: str, k: int) -> None:
    llm = LLM(speculative_config={"model": str(default_model_path()), "quantization": quantization,
                                  "num_speculative_tokens": k}, kv_cache_memory=kv, enable_prefix_caching=False)
    core = llm.engine.core
    target, draft = core.runner, core.speculator.proposer.runner
    blocks = list(range(core.cache_info.num_blocks))[:32]  # an idle engine: any blocks, nothing cached
    context = [int(t) for t in torch.randint(100, 20000, (256,), generator=torch.Generator().manual_seed(0))]

    def step_ms(runner, n: int) -> float:
        last_logits(runner, [(blocks, 0, context)])
        times = []
        for _ in range(20 * runs):
            t = time.perf_counter()
            last_logits(runner, [(blocks, 256, context[:n])])
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3

    t1, tv, d1 = step_ms(target, 1), step_ms(target, k + 1), step_ms(draft, 1)
    print(f"\n## draft-model cost (256-token context, median of {20 * runs} forward passes; CPU {cpu_isa()})")
    print("| target 1-token step | target verify step (k+1 tokens) | draft 1-token step | c = draft / target | "
          "v = verify / target | break-even mean accepted length k c + v |\n|---|---|---|---|---|---|")
    c, v = d1 / t1, tv / t1
    print(f"| {t1:.1f} ms | {tv:.1f} ms | {d1:.1f} ms | {c:.2f} | {v:.2f} | {k * c + v:.2f} (k = {k}) |")


def threshold(runs: int, kv: int, levels: list[int]) -> None:
    """ShareGPT at several concurrencies: no speculation, n-gram as shipped (the measured step cost decides who
    speculates) and n-gram always (the cost model off)."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    print(f"\n## ShareGPT by concurrency (128 output tokens, ignore_eos; median of {runs} runs; CPU {cpu_isa()})")
    print("| at a time | prompts | none tok/s | n-gram as shipped | n-gram always | acceptance (as shipped / always) |")
    print("|---|---|---|---|---|---|")
    for level in levels:
        engines = {c: LLM(speculative_config=s, max_num_seqs=level, kv_cache_memory=kv)
                   for c, s in {"none": None, "adaptive": ngram, "always": ngram}.items()}
        engines["always"].engine.core.speculator.cost = None
        requests = load_sharegpt(engines["none"].get_tokenizer(), max(2 * level, 16), seed=1, fixed_output_len=128)
        speeds = {c: [] for c in engines}
        for _ in range(runs):
            for c, llm in engines.items():
                speeds[c].append(run_offline(llm, requests, progress=False)["output_throughput"])
        med = {c: statistics.median(v) for c, v in speeds.items()}
        acc = [engines[c].engine.core.scheduler.spec_stats for c in ("adaptive", "always")]
        print(f"| {level} | {len(requests)} | {med['none']:.1f} | {med['adaptive']:.1f} "
              f"({med['adaptive'] / med['none']:.2f}x) | {med['always']:.1f} ({med['always'] / med['none']:.2f}x) | "
              f"{acc[0].acceptance_rate:.0%} of {acc[0].num_draft_tokens} / {acc[1].acceptance_rate:.0%} of "
              f"{acc[1].num_draft_tokens} |", flush=True)
        del engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="single,cost,threshold")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=8, help="ShareGPT and random prompts in the single-stream part")
    ap.add_argument("--draft", default="int4", help="quantization of the self-draft ('' to leave the draft out)")
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    kv = 256 << 20
    parts = args.parts.split(",")
    if "single" in parts:
        configs = {"none": None, f"ngram k={args.k}": {"method": "ngram", "num_speculative_tokens": args.k}}
        if args.draft:
            configs[f"self-draft {args.draft} k={args.k}"] = {
                "model": str(default_model_path()), "quantization": args.draft, "num_speculative_tokens": args.k}
        engines = {c: LLM(speculative_config=s, kv_cache_memory=kv) for c, s in configs.items()}
        tok = engines["none"].get_tokenizer()
        rng = random.Random(0)
        workloads = {
            "repetitive": repetitive_prompts(tok),
            "sharegpt": [r.prompt_token_ids for r in load_sharegpt(tok, args.num_prompts, seed=0, max_prompt_len=512)],
            "random": [r.prompt_token_ids
                       for r in random_requests(tok, args.num_prompts, 64, 1, seed=rng.randint(0, 99))],
        }
        for llm in engines.values():  # warm up every path (kernels, the draft's first forward)
            llm.generate([{"prompt_token_ids": workloads["repetitive"][0]}],
                         SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        single_stream(engines, workloads, args.runs, args.max_tokens)
        acceptance(engines, workloads, args.max_tokens)
        del engines
    if "cost" in parts:
        cost(args.runs, kv, args.draft or "int4", args.k)
    if "threshold" in parts:
        threshold(args.runs, kv, [4, 16, 64])


if __name__ == "__main__":
    main()
