"""Speculative decoding against none, side by side in one process (BENCHMARKS.md "Speculative decoding").

    python benchmarks/spec.py                          # all parts, 3 runs
    python benchmarks/spec.py --parts single --runs 3
    python benchmarks/spec.py --parts batched --runs 2

- single: one stream (each prompt alone, greedy, up to --max-tokens, natural ends), output tokens/s per
  configuration on three workloads: repetitive (edit a code block: rename a variable, add a docstring; summarise a
  text quoting it), ShareGPT chat (first turns) and random token prompts; acceptance per workload. Greedy output is
  the same tokens under every configuration (checked), so tokens/s compares the same work.
- batched: ShareGPT through the offline engine with 64 requests at a time (128 prompts, 128 output tokens,
  ignore_eos): output tokens/s with n-gram speculation as shipped (it pauses above its batch threshold), with
  the threshold lifted (speculating at 64), and without speculation.
- threshold: ShareGPT at 4, 8, 16 and 32 at a time (4x as many prompts, 128 output tokens, ignore_eos), n-gram
  never paused against none: where speculation stops paying, which sets the default pause threshold.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill import LLM, SamplingParams
from tokenmill.bench.datasets import chat_token_ids, load_sharegpt, random_requests
from tokenmill.bench.offline import run_offline
from tokenmill.model.cpu_kernels import cpu_isa
from tokenmill.model.loader import default_model_path

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


def batched(runs: int, kv: int) -> None:
    configs = {"none": None, "ngram k=4 (pauses above 8 running)": {"method": "ngram", "num_speculative_tokens": 4},
               "ngram k=4, never paused": {"method": "ngram", "num_speculative_tokens": 4,
                                           "disable_by_batch_size": 1024}}
    engines = {c: LLM(speculative_config=s, max_num_seqs=64, kv_cache_memory=kv) for c, s in configs.items()}
    requests = load_sharegpt(engines["none"].get_tokenizer(), 128, seed=0, fixed_output_len=128)
    speeds = {c: [] for c in engines}
    for run in range(runs):
        for c, llm in engines.items():
            speeds[c].append(run_offline(llm, requests, progress=False)["output_throughput"])
        print(f"run {run + 1}: " + ", ".join(f"{c} {speeds[c][-1]:.1f}" for c in engines), file=sys.stderr, flush=True)
    print(f"\n## ShareGPT, 64 at a time (128 prompts, 128 output tokens; median of {runs} runs; CPU {cpu_isa()})")
    print("| configuration | output tok/s | vs none |\n|---|---|---|")
    base = statistics.median(speeds["none"])
    for c, llm in engines.items():
        med = statistics.median(speeds[c])
        print(f"| {c} | {med:.1f} | {med / base:.2f}x |")
        st = llm.engine.core.scheduler.spec_stats
        if st is not None:
            print(f"|   ({st.describe()}) | | |")


def threshold(runs: int, kv: int, levels: list[int]) -> None:
    always = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 1024}
    print(f"\n## ShareGPT by concurrency, n-gram never paused vs none (median of {runs} runs; CPU {cpu_isa()})")
    print("| at a time | prompts | none tok/s | ngram tok/s | ratio | acceptance |\n|---|---|---|---|---|---|")
    for level in levels:
        engines = {c: LLM(speculative_config=s, max_num_seqs=level, kv_cache_memory=kv)
                   for c, s in {"none": None, "ngram": always}.items()}
        requests = load_sharegpt(engines["none"].get_tokenizer(), 4 * level, seed=1, fixed_output_len=128)
        speeds = {c: [] for c in engines}
        for _ in range(runs):
            for c, llm in engines.items():
                speeds[c].append(run_offline(llm, requests, progress=False)["output_throughput"])
        none, ngram = statistics.median(speeds["none"]), statistics.median(speeds["ngram"])
        st = engines["ngram"].engine.core.scheduler.spec_stats
        print(f"| {level} | {len(requests)} | {none:.1f} | {ngram:.1f} | {ngram / none:.2f}x | "
              f"{st.acceptance_rate:.1%} |", flush=True)
        del engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="single,batched")
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
            "random": [r.prompt_token_ids for r in random_requests(tok, args.num_prompts, 64, 1, seed=rng.randint(0, 99))],
        }
        for llm in engines.values():  # warm up every path (kernels, the draft's first forward)
            llm.generate([{"prompt_token_ids": workloads["repetitive"][0]}], SamplingParams(temperature=0, max_tokens=8),
                         use_tqdm=False)
        single_stream(engines, workloads, args.runs, args.max_tokens)
        acceptance(engines, workloads, args.max_tokens)
        del engines
    if "threshold" in parts:
        threshold(args.runs, kv, [4, 8, 16, 32])
    if "batched" in parts:
        batched(args.runs, kv)


if __name__ == "__main__":
    main()
