"""Tensor and pipeline parallelism on this CPU: N ranks of one thread each against one process with N threads, same
model, same weights (SmolLM2-135M dequantized: the ranks cannot split a GGUF file's kept blocks), same requests
(BENCHMARKS.md "Tensor parallelism", "Pipeline parallelism").

    python benchmarks/parallel.py --runs 3 [--tp 2 --even-shape]
    python benchmarks/parallel.py --runs 3 --pp 2 --micro-batches 1,2,4
    python benchmarks/parallel.py --runs 3 --cp 2 --lengths 2048,8000

Context mode: one long prompt's prefill (in one chunk) and the decode steps after it, C ranks of one thread against
one process with 1 and C threads; first chunks by ring attention (--no-batch-invariant) and through the sharded
cache (the default, batch-invariant), and the KV bytes each rank holds for the context.

Pipeline mode: prefill tokens/s (8 x 512-token prompts: compute-bound) and batched decode (32 x 128 tokens:
memory-bound) of 2 stages with 1, 2 and 4 micro-batches per step against one process with 1 and 2 threads; the
bubble, the share of the stages' time spent idle, estimated from the one-thread process's time split evenly over
the stages: 1 - (T1 / stages) / T.

Tensor parallelism twice: the ranks' collectives through shared memory (the default on one host) and through gloo
(TOKENMILL_SHM_COLLECTIVES=0), and the all-reduce alone both ways.

Measured: single-stream decode step time (one request, 128 tokens), batched output tokens/s (32 requests x 128
tokens), weight bytes and resident memory per rank, and the collectives alone (gloo all-reduce of one decode step's
hidden state [rows, 576] among the ranks), whose count per step is 2 per layer + 1 (the embedding) plus the
LM head's gather and the step's broadcast.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import AddRequest
from tokenmill.engine.runner import weight_bytes
from tokenmill.model.cpu_kernels import cpu_isa
from tokenmill.parallel.shm_collectives import ShmCollectives
from tokenmill.sampling_params import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(engine: EngineCore, n: int, prompt_len: int, out_len: int) -> tuple[float, list[float]]:
    """Output tokens/s for n requests, and every step's seconds."""
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    rng = random.Random(time.monotonic_ns())  # new prompts every call: no prefix-cache hits between runs
    for i in range(n):
        prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
        engine.add_request(AddRequest(f"r{i}-{time.monotonic()}", prompt, params, out_len, frozenset(),
                                      time.monotonic()))
    steps, start = [], time.perf_counter()
    while engine.has_unfinished:
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    return n * out_len / (time.perf_counter() - start), steps


def collectives(shm: bool) -> None:
    """The ranks' collectives on one host: shared memory (the default) or gloo's TCP loopback for all (the ranks
    inherit the environment)."""
    os.environ["TOKENMILL_SHM_COLLECTIVES"] = "1" if shm else "0"


def measure(tp: int, threads: int, runs: int, model: str | None, pp: int = 1, micro: int | None = None,
            shm: bool = True) -> dict:
    collectives(shm)
    engine = EngineCore(EngineConfig(model=model, tensor_parallel_size=tp, num_threads=threads, quantization="none",
                                     pipeline_parallel_size=pp, pipeline_micro_batches=micro,
                                     cache=CacheConfig(kv_cache_memory=256 << 20)))
    try:
        run(engine, 2, 32, 8)  # warm
        single, batched, batched_step, prefill = [], [], [], []
        for _ in range(runs):
            start = time.perf_counter()
            run(engine, 8, 512, 1)  # prefill-bound: 4,096 prompt tokens
            prefill.append(8 * 512 / (time.perf_counter() - start))
            _, steps = run(engine, 1, 64, 128)
            single.append(statistics.median(steps[1:]))  # decode steps (the first is the prefill)
            tps, steps = run(engine, 32, 64, 128)
            batched.append(tps)
            batched_step.append(statistics.median(steps[1:]))
        pids = [os.getpid()] + ([p.pid for p in engine.workers.procs] if engine.workers else [])
        return {"step_ms": statistics.median(single) * 1e3, "tps": statistics.median(batched),
                "batched_step_ms": statistics.median(batched_step) * 1e3, "prefill_tps": statistics.median(prefill),
                "weights_mib": weight_bytes(engine.runner.model) / 2**20,
                "rss_mib": [rss_mib(p) for p in pids]}
    finally:
        engine.close()


def _all_reduce_worker(rank: int, size: int, port: int, rows: list[int], iters: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    path = f"/dev/shm/tokenmill-bench-{port}"
    if rank == 0:
        ShmCollectives(path, 0, size, 60.0, create=True).close()
    dist.barrier()
    shm = ShmCollectives(path, rank, size, 60.0, create=False)
    dist.barrier()
    result = {}
    for name, reduce in (("gloo", dist.all_reduce), ("shm", shm.all_reduce)):
        for r in rows:
            x = torch.randn(r, 576).to(torch.bfloat16)
            for _ in range(20):
                reduce(x)
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                reduce(x)
                times.append(time.perf_counter() - t)
            result[name, r] = statistics.median(times) * 1e6
    dist.barrier()
    if rank == 0:
        os.unlink(path)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def all_reduce_us(size: int, rows: list[int], iters: int = 2000) -> dict[int, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_all_reduce_worker, args=(r, size, port, rows, iters, out)) for r in range(size)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join(60)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tp", type=int, default=3, help="ranks (SmolLM2's 9 heads / 3 KV heads: 3 or 9)")
    ap.add_argument("--even-shape", action="store_true",
                    help="a random model of SmolLM2's size whose heads 2 ranks divide (8 heads / 2 KV heads x 64, "
                         "hidden 512, 30 layers, vocabulary 49,152): 2 ranks on 2 cores, no oversubscription")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (then the pipeline table, not tensor parallel)")
    ap.add_argument("--micro-batches", default="1,2,4")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks (then the context table)")
    ap.add_argument("--lengths", default="2048,8000", help="prompt lengths for --cp")
    args = ap.parse_args()
    if args.pp > 1:
        pipeline(args)
        return
    if args.cp > 1:
        context(args)
        return
    model, name = None, "SmolLM2-135M"
    if args.even_shape:
        import tempfile

        from tests.models.tiny import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()), num_heads=8, num_kv_heads=2, hidden_size=512,
                                    intermediate_size=1536, num_layers=30))
        name = "a random 8-head SmolLM2-sized model"
    one = measure(1, args.tp, args.runs, model)
    over_gloo = measure(args.tp, 1, args.runs, model, shm=False)
    many = measure(args.tp, 1, args.runs, model)
    print(f"\n## Tensor parallelism: {args.tp} ranks x 1 thread vs 1 process x {args.tp} threads ({name}, "
          f"bfloat16 dense, median of {args.runs}; CPU {cpu_isa()})")
    print("| configuration | decode step, 1 stream | output tok/s, 32 x 128 | weights per rank | RSS per rank |")
    print("|---|---|---|---|---|")
    for name, m in ((f"1 process, {args.tp} threads", one), (f"TP={args.tp}, 1 thread per rank, gloo", over_gloo),
                    (f"TP={args.tp}, 1 thread per rank, shared memory", many)):
        rss = " / ".join(f"{r:.0f}" for r in m["rss_mib"])
        print(f"| {name} | {m['step_ms']:.1f} ms | {m['tps']:.1f} | {m['weights_mib']:.0f} MiB | {rss} MiB |")
    ar = all_reduce_us(args.tp, [1, 32])
    for how in ("gloo", "shm"):
        print(f"\n{how} all-reduce of a [rows, 576] bfloat16 hidden state among {args.tp} processes (median of "
              f"2,000): 1 row {ar[how, 1]:.0f} us, 32 rows {ar[how, 32]:.0f} us; a decode step makes 61 of them (2 per "
              f"layer x 30 + the embedding's): {61 * ar[how, 1] / 1e3:.1f} ms at 1 row, "
              f"{61 * ar[how, 32] / 1e3:.1f} ms at 32 rows")


def pipeline(args) -> None:
    micro = [int(m) for m in args.micro_batches.split(",")]
    one = measure(1, 1, args.runs, None)
    base = measure(1, args.pp, args.runs, None)
    stages = {m: measure(1, 1, args.runs, None, pp=args.pp, micro=m) for m in micro}
    print(f"\n## Pipeline parallelism: {args.pp} stages x 1 thread (SmolLM2-135M, bfloat16 dense, 32 requests x 128 "
          f"tokens; median of {args.runs}; CPU {cpu_isa()})")
    print("| configuration | prefill tok/s (8 x 512) | bubble, prefill | batched decode step | output tok/s | "
          "bubble, decode | weights on rank 0 |")
    print("|---|---|---|---|---|---|---|")
    for name, r in (("1 process, 1 thread", one), (f"1 process, {args.pp} threads", base)):
        print(f"| {name} | {r['prefill_tps']:.0f} | | {r['batched_step_ms']:.1f} ms | {r['tps']:.1f} | | "
              f"{r['weights_mib']:.0f} MiB |")
    for m, r in stages.items():
        decode_bubble = 1 - (one["batched_step_ms"] / args.pp) / r["batched_step_ms"]
        prefill_bubble = 1 - r["prefill_tps"] / (args.pp * one["prefill_tps"])  # the same estimate, from rates
        print(f"| {args.pp} stages, {m} micro-batch{'es' if m > 1 else ''} | {r['prefill_tps']:.0f} | "
              f"{prefill_bubble:.0%} | {r['batched_step_ms']:.1f} ms | {r['tps']:.1f} | {decode_bubble:.0%} | "
              f"{r['weights_mib']:.0f} MiB |")


def long_prompt(cp: int, threads: int, batch_invariant: bool, lengths: list[int], runs: int,
                shm: bool = True) -> dict:
    """Per prompt length: prefill seconds (one chunk) and the median decode step after it, medians over runs."""
    collectives(shm)
    engine = EngineCore(EngineConfig(context_parallel_size=cp, num_threads=threads, quantization="none",
                                     batch_invariant=batch_invariant, cache=CacheConfig(kv_cache_memory=512 << 20),
                                     scheduler=SchedulerConfig(max_num_batched_tokens=max(lengths),
                                                               max_model_len=max(lengths) + 64)))
    try:
        run(engine, 1, 64, 4)  # warm
        out = {}
        for n in tqdm(lengths, desc=f"cp={cp} threads={threads} batch_invariant={batch_invariant}", leave=False):
            prefill, decode = [], []
            for _ in range(runs):
                _, steps = run(engine, 1, n, 33)
                prefill.append(steps[0])
                decode.append(statistics.median(steps[1:]))
            out[n] = (statistics.median(prefill), statistics.median(decode) * 1e3)
        out["kv_per_token"] = engine.cache_info.kv_bytes_per_token / cp  # per rank
        out["capacity"] = engine.cache_info.token_capacity
        return out
    finally:
        engine.close()


def context(args) -> None:
    lengths = [int(n) for n in args.lengths.split(",")]
    c = args.cp
    rows = [("1 process, 1 thread", long_prompt(1, 1, False, lengths, args.runs)),
            (f"1 process, {c} threads", long_prompt(1, c, False, lengths, args.runs)),
            (f"CP={c}, ring attention (first chunk), gloo", long_prompt(c, 1, False, lengths, args.runs, shm=False)),
            (f"CP={c}, ring attention (first chunk)", long_prompt(c, 1, False, lengths, args.runs)),
            (f"1 process, {c} threads, batch-invariant", long_prompt(1, c, True, lengths, args.runs)),
            (f"CP={c}, through the sharded cache (batch-invariant)", long_prompt(c, 1, True, lengths, args.runs))]
    print(f"\n## Context parallelism: {c} ranks x 1 thread vs 1 process (SmolLM2-135M, bfloat16 dense, one prompt "
          f"prefilled in one chunk, then 32 decode steps; median of {args.runs}; CPU {cpu_isa()})")
    head = " | ".join(f"prefill {n} | decode step at {n}" for n in lengths)
    print(f"| configuration | {head} | KV per rank per token | token capacity (512 MiB per rank) |")
    print("|---|" + "---|---|" * len(lengths) + "---|---|")
    base = rows[1][1]
    for name, r in rows:
        cells = " | ".join(f"{r[n][0]:.2f} s ({base[n][0] / r[n][0]:.2f}x) | {r[n][1]:.0f} ms" for n in lengths)
        print(f"| {name} | {cells} | {r['kv_per_token']:.0f} B | {r['capacity']:,} |")


if __name__ == "__main__":
    main()
