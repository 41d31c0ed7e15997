"""HTTP server vs offline engine on the same workload, in one run: output tokens/s of `tokenmill serve` driven by
64 concurrent streaming clients (httpx) against `LLM.generate` on the same requests.

    python benchmarks/http_vs_offline.py                       # 256 ShareGPT requests, 64 clients
    python benchmarks/http_vs_offline.py --num-prompts 32      # a quick look

Workload: the engine-core benchmark's (ShareGPT first human turn, prompts <= 1024 tokens, outputs capped at 256,
seed 0), each request greedy with max_tokens = its reply's token count and ignore_eos; the server gets the same
token ids as the offline engine (no re-tokenization). Output tokens/s = tokens generated / wall time from the
first request sent to the last one finished. Both sides use the same engine flags.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill import LLM, SamplingParams
from tokenmill.bench.datasets import BenchRequest, load_sharegpt
from tokenmill.model.loader import default_model_path
from tokenmill.tokenizer import Tokenizer


def workload(num_prompts: int) -> list[BenchRequest]:
    tok = Tokenizer.load(default_model_path())
    return load_sharegpt(tok, num_prompts, seed=0, max_prompt_len=1024, max_output_len=256)


def engine_flags(args) -> dict:
    return {"dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens}


def run_offline(args, reqs: list[BenchRequest]) -> dict:
    from tokenmill.cli import parse_bytes

    flags = engine_flags(args)
    flags["kv_cache_memory"] = parse_bytes(flags["kv_cache_memory"])
    llm = LLM(**flags)
    llm.generate(["warm up"], SamplingParams(max_tokens=4), use_tqdm=False)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm, outs
    gc.collect()
    return {"output_tokens": tokens, "elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed}


def start_server(args) -> tuple[subprocess.Popen, str]:
    flags = []
    for k, v in engine_flags(args).items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    return start_tokenmill(flags)


def start_tokenmill(flags: list[str], prefix: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """`tokenmill serve FLAGS` on a free loopback port with unbounded queues (a benchmark's burst must not get
    429s); returns the process and its URL once it has printed its ready line. `prefix`: e.g. taskset -c 0."""
    cmd = [*(prefix or []), sys.executable, "-m", "tokenmill.cli", "serve", "--port", "0", "--max-waiting-requests",
           "100000", "--max-waiting-tokens", str(1 << 30), *flags]
    return launch(cmd, "tokenmill serving")


def launch(cmd: list[str], ready: str) -> tuple[subprocess.Popen, str]:
    """Start a tokenmill command and wait for its ready line ("READY ... at URL"); returns it and the URL."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True)
    line, deadline = "", time.monotonic() + 600
    while ready not in line:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{' '.join(cmd[:8])} did not start (code {proc.poll()})")
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
    return proc, line.rsplit(" at ", 1)[1].strip()


async def run_http(url: str, reqs: list[BenchRequest], concurrency: int) -> dict:
    queue: asyncio.Queue[BenchRequest] = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    ttfts: list[float] = []
    tokens = 0

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            r = queue.get_nowait()
            body = {"prompt": r.prompt_token_ids, "max_tokens": r.output_len, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first = None
            last = ""
            async with c.stream("POST", "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if first is None and line.startswith("data: "):
                        first = time.perf_counter() - t0
                    if line.startswith('data: {"id"') and '"usage"' in line:
                        last = line
            ttfts.append(first or 0.0)
            tokens += json.loads(last[6:])["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    ttfts.sort()
    return {"output_tokens": tokens, "elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed,
            "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()

    reqs = workload(args.num_prompts)
    expected = sum(r.output_len for r in reqs)
    print(f"workload: {len(reqs)} ShareGPT requests, {sum(r.prompt_len for r in reqs)} prompt tokens, "
          f"{expected} output tokens; {args.concurrency} HTTP clients", flush=True)

    offline = run_offline(args, reqs)
    print(f"offline LLM.generate: {offline['output_tokens_per_s']:.1f} output tokens/s "
          f"({offline['output_tokens']} tokens in {offline['elapsed_s']:.1f} s)", flush=True)

    proc, url = start_server(args)
    try:
        http = asyncio.run(run_http(url, reqs, args.concurrency))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    print(f"HTTP, {args.concurrency} streaming clients: {http['output_tokens_per_s']:.1f} output tokens/s "
          f"({http['output_tokens']} tokens in {http['elapsed_s']:.1f} s; TTFT p50 {http['ttft_p50_s']:.2f} s, "
          f"p99 {http['ttft_p99_s']:.2f} s)", flush=True)
    assert offline["output_tokens"] == http["output_tokens"] == expected, (offline, http, expected)
    ratio = http["output_tokens_per_s"] / offline["output_tokens_per_s"]
    print(f"HTTP / offline: {ratio:.3f} (target >= 0.90)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"num_prompts": len(reqs), "concurrency": args.concurrency,
                                         "offline": offline, "http": http, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
