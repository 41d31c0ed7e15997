"""What --batch-invariant costs and what the default guarantees, in one run (--dtype auto, the bundled SmolLM2):

1. sameness: one greedy prompt ("Monday, Tuesday, Wednesday,", 16 tokens, logprobs on) run alone, then 32 copies of
   it among 64 requests, some with long prompts that get chunked: how many of the 32 differ from alone, in tokens
   and in logprobs (bit for bit), with and without --batch-invariant;
2. prefill cost: time to the first token of one prompt of N tokens, alone, with and without --batch-invariant
   (then prompt tokens read their context through the paged-attention kernel instead of SDPA), median of --runs;
3. throughput: single-stream decode ms/step and 64 concurrent ShareGPT requests (outputs capped at 128), output
   tokens/s, with and without (float32 matmuls then run on the panel kernel instead of skinny GEMV + oneDNN).

    python benchmarks/batch_invariant.py --runs 3                       # --dtype auto
    python benchmarks/batch_invariant.py --runs 3 --dtype float32 --parts throughput
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.datasets import load_sharegpt  # noqa: E402
from tokenmill.model.cpu_kernels import _cpu_info, cpu_isa  # noqa: E402

PROMPT = "Monday, Tuesday, Wednesday,"


def sameness(llm: LLM) -> tuple[int, int]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    long_text = " ".join(f"item {i}: the quick brown fox jumps over the lazy dog." for i in range(60))  # ~800 tok
    others = [long_text, "The capital of France is", long_text[:1500], "def fibonacci(n):"]
    batch = [PROMPT if i % 2 == 0 else others[i % len(others) // 2 % len(others)] for i in range(64)]
    outs = [o.outputs[0] for o, p in zip(llm.generate(batch, params, use_tqdm=False), batch) if p == PROMPT]
    return sum(o.token_ids != alone.token_ids for o in outs), sum(o.logprobs != alone.logprobs for o in outs)


def ttft(llm: LLM, n: int, salt: int) -> float:
    prompt = {"prompt_token_ids": [(1000 + 7 * j + 131 * salt) % 40000 + 100 for j in range(n)]}  # no cache hits
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - t0


def decode_ms(llm: LLM) -> float:
    engine, prompt = llm.engine, {"prompt_token_ids": list(range(1000, 1128))}
    engine.add_request("single", prompt, SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
    engine.step()
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def batch_tok_s(llm: LLM, reqs) -> float:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return sum(r.output_len for r in reqs) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--lengths", default="128,512,1024")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--parts", default="sameness,ttft,throughput")
    args = p.parse_args()
    parts = args.parts.split(",")
    engines = {mode: LLM(dtype=args.dtype, kv_cache_memory=512 << 20, batch_invariant=mode, max_num_seqs=64,
                         enable_prefix_caching=False) for mode in (False, True)}
    print(f"CPU: {_cpu_info()[0]} (isa: {cpu_isa()}), {os.cpu_count()} cores; dtype "
          f"{engines[False].engine.core.cache_info.dtype}")
    if "throughput" in parts:
        reqs = load_sharegpt(engines[True].engine.tokenizer, 64, seed=0, max_prompt_len=1024, max_output_len=128)
        results: dict[str, dict[bool, list[float]]] = {"decode ms/step": {False: [], True: []},
                                                       "64 concurrent tok/s": {False: [], True: []}}
        for _ in range(args.runs):
            for mode, llm in engines.items():
                results["decode ms/step"][mode].append(decode_ms(llm))
                results["64 concurrent tok/s"][mode].append(batch_tok_s(llm, reqs))
        print("| measure | --no-batch-invariant | --batch-invariant | ratio |\n|---|---|---|---|")
        for label, by in results.items():
            a, b = statistics.median(by[False]), statistics.median(by[True])
            print(f"| {label} | {a:.1f} | {b:.1f} | {b / a:.2f}x |", flush=True)
    for mode, llm in engines.items() if "sameness" in parts else ():
        tokens, logprobs = sameness(llm)
        print(f"batch_invariant={mode}: of 32 copies among 64 requests, {tokens} differ in tokens, "
              f"{logprobs} in logprobs", flush=True)
    if "ttft" not in parts:
        return
    print("| prompt tokens | TTFT --no-batch-invariant, s | TTFT --batch-invariant, s | ratio |\n|---|---|---|---|")
    for n in (int(x) for x in args.lengths.split(",")):
        times: dict[bool, list[float]] = {False: [], True: []}
        for run in range(args.runs):
            for mode, llm in engines.items():
                times[mode].append(ttft(llm, n, run * 2 + mode))
        a, b = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {n} | {a:.3f} | {b:.3f} | {b / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
