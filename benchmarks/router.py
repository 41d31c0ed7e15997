"""The router, measured (BENCHMARKS.md "Router"):

    python benchmarks/router.py --runs 1

- policies: two SmolLM2 replicas (one compute thread each: this machine has two cores; a KV cache of 128 MiB each,
  ~5,800 tokens: room for half the shared prompts) behind `tokenmill router`, the shared-system-prompt workload (8
  prompts of 1,000 tokens, 64 questions in a shuffled order, 32 output tokens, Poisson), once per policy with fresh
  replicas (empty caches): TTFT p50/p99 and the prompt tokens the replicas computed (not found in their prefix
  caches), prefix vs round robin vs least load;
- cascade: SmolLM2 in INT4 (`--quantization int4`, the cheap tier) then SmolLM2 in bfloat16 (`--quantization none`,
  the dear one) behind `--cascade`, 64 ShareGPT prompts (64 output tokens, greedy), at several `--escalate-below`
  thresholds: the share the cheap tier answered, the cost against sending everything to the dear tier, and how
  many answers are word for word what the dear tier alone writes (a quality proxy);
- overhead: the latency the router adds per request (one-token completions, one at a time, direct vs routed, same
  replica), and the requests/s one router process carries in front of a stub replica that answers at once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from http_vs_offline import start_tokenmill

from tokenmill.bench.datasets import prefix_sharing_requests
from tokenmill.bench.loadgen import LoadConfig, first_model, run_load
from tokenmill.model.cpu_kernels import cpu_isa
from tokenmill.model.loader import default_model_path
from tokenmill.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
STUB = '''
from fastapi import FastAPI
import uvicorn, sys
app = FastAPI()
BODY = {"id": "x", "object": "text_completion", "created": 0, "model": "stub",
        "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
@app.post("/v1/completions")
async def c(): return BODY
@app.get("/health")
async def h(): return {}
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


def start_router(urls: list[str], policy: str) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "tokenmill.cli", "router", "--port", "0", "--policy", policy,
            *[a for u in urls for a in ("--backend", u)]]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    line = ""
    while "tokenmill router at" not in line:
        line = proc.stdout.readline()
        if proc.poll() is not None:
            raise RuntimeError("the router did not start")
    url = line.rsplit(" at ", 1)[1].strip()
    while httpx.get(url + "/health").status_code != 200:
        time.sleep(0.2)
    return proc, url


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def policies(args) -> None:
    tok = Tokenizer.load(default_model_path()).hf_tokenizer
    work = prefix_sharing_requests(tok, 8, 1000, 64, 24, 32, seed=args.seed)
    random.Random(args.seed).shuffle(work)  # groups in no fixed turn: round robin must not line up with them
    print(f"\n## Router policies: 2 replicas x 1 thread, 8 shared prompts x 1,000 tokens, 64 requests, "
          f"{args.rate:g} req/s (CPU {cpu_isa()})")
    print("| policy | TTFT p50 | TTFT p99 | prompt tokens computed | requests per replica | output tok/s |")
    print("|---|---|---|---|---|---|")
    for policy in ("prefix", "round_robin", "least_load"):
        rows = []
        for run in range(args.runs):
            # each replica's cache holds ~5,800 tokens: half the groups' prefixes, not all eight
            replicas = [start_tokenmill(["--threads", "1", "--kv-cache-memory", args.kv]) for _ in range(2)]
            router, url = start_router([u for _, u in replicas], policy)
            try:
                cfg = LoadConfig(base_url=url, model=first_model(url), request_rate=args.rate, seed=args.seed + run,
                                 progress=False)
                results, duration = asyncio.run(run_load(cfg, work))
                ok = [r for r in results if r.success]
                computed = sum(metric(u, "tokenmill_prefill_tokens_computed_total") for _, u in replicas)
                per = [int(metric(u, "tokenmill_requests_total")) for _, u in replicas]
                rows.append((pct([r.ttft for r in ok], 0.5), pct([r.ttft for r in ok], 0.99), computed, per,
                             sum(r.output_tokens or 0 for r in ok) / duration, len(ok)))
            finally:
                router.terminate()
                for p, _ in replicas:
                    p.terminate()
                for p, _ in replicas:
                    p.wait(60)
        med = [statistics.median(r[i] for r in rows) for i in (0, 1, 2, 4)]
        print(f"| {policy} | {med[0] * 1e3:.0f} ms | {med[1] * 1e3:.0f} ms | {med[2]:,.0f} | "
              f"{' / '.join(str(x) for x in rows[-1][3])} | {med[3]:.1f} |", flush=True)


def cascade(args) -> None:
    from tokenmill.bench.datasets import load_sharegpt

    tok = Tokenizer.load(default_model_path()).hf_tokenizer
    work = load_sharegpt(tok, 64, seed=args.seed, max_prompt_len=256, fixed_output_len=64)
    cheap, cheap_url = start_tokenmill(["--threads", "1", "--quantization", "int4", "--kv-cache-memory", "256MiB"])
    dear, dear_url = start_tokenmill(["--threads", "1", "--quantization", "none", "--kv-cache-memory", "256MiB"])
    prices = {"cheap": (0.02, 0.04), "dear": (0.50, 1.00)}
    try:
        with httpx.Client(timeout=300) as c:
            alone = [c.post(dear_url + "/v1/completions", json={"prompt": r.prompt, "max_tokens": 64,
                                                                 "temperature": 0}).json()["choices"][0]["text"]
                     for r in work]
        print(f"\n## Cascade: SmolLM2 INT4 ($0.02/$0.04 per M tokens) then bfloat16 ($0.50/$1.00), 64 ShareGPT "
              f"prompts, 64 tokens (CPU {cpu_isa()})")
        print("| --escalate-below | answered by the cheap tier | cost | cost if all dear | saved | same answer as "
              "the dear tier alone |\n|---|---|---|---|---|---|")
        for threshold in args.thresholds:
            router = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "router", "--port", "0",
                                       "--cascade", f"cheap={cheap_url}", "--cascade", f"dear={dear_url}",
                                       "--tier-price", "cheap=0.02,0.04", "--tier-price", "dear=0.5,1.0",
                                       "--escalate-below", str(threshold)], stdout=subprocess.PIPE, text=True)
            line = ""
            while "tokenmill router at" not in line:
                line = router.stdout.readline()
            url = line.rsplit(" at ", 1)[1].strip()
            try:
                while httpx.get(url + "/health").status_code != 200:
                    time.sleep(0.2)
                outs = []
                with httpx.Client(timeout=300) as c:
                    for r in work:
                        outs.append(c.post(url + "/v1/completions", json={"prompt": r.prompt, "max_tokens": 64,
                                                                           "temperature": 0}).json())
                cost = sum(o["usage"]["cost_usd"] for o in outs)
                all_dear = sum((o["usage"]["prompt_tokens"] * prices["dear"][0]
                                + o["usage"]["completion_tokens"] * prices["dear"][1]) / 1e6 for o in outs)
                cheap_share = sum(o["tier"] == "cheap" for o in outs) / len(outs)
                same = sum(o["choices"][0]["text"] == a for o, a in zip(outs, alone))
                print(f"| {threshold:g} | {cheap_share:.0%} | ${cost:.5f} | ${all_dear:.5f} | "
                      f"{1 - cost / all_dear:.0%} | {same}/{len(outs)} |", flush=True)
            finally:
                router.terminate()
    finally:
        for p in (cheap, dear):
            p.terminate()


def overhead(args) -> None:
    replica, direct = start_tokenmill(["--threads", "1", "--kv-cache-memory", "128MiB"])
    router, routed = start_router([direct], "least_load")
    port = 18000 + os.getpid() % 1000
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(port)])
    try:
        body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
        lat = {}
        with httpx.Client(timeout=60) as c:
            for name, url in (("direct", direct), ("routed", routed)) * 2:
                times = []
                for _ in range(50):
                    t = time.perf_counter()
                    assert c.post(url + "/v1/completions", json=body).status_code == 200
                    times.append(time.perf_counter() - t)
                lat[name] = times
        added = statistics.median(lat["routed"]) - statistics.median(lat["direct"])
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        stub_router, stub_url = start_router([f"http://127.0.0.1:{port}"], "prefix")
        try:
            rps = asyncio.run(_flood(stub_url, 2000, 64))
        finally:
            stub_router.terminate()
        print(f"\n## Router overhead (CPU {cpu_isa()}): one-token completion p50 direct "
              f"{statistics.median(lat['direct']) * 1e3:.1f} ms, routed {statistics.median(lat['routed']) * 1e3:.1f} ms "
              f"(+{added * 1e3:.1f} ms); one router process in front of a stub replica: {rps:.0f} requests/s "
              "(64 clients, the stub and the clients on the same 2 cores)")
    finally:
        for p in (router, replica, stub):
            p.terminate()


async def _flood(url: str, n: int, concurrency: int) -> float:
    queue = asyncio.Queue()
    for _ in range(n):
        queue.put_nowait(None)

    async def worker(c: httpx.AsyncClient) -> None:
        while not queue.empty():
            queue.get_nowait()
            await c.post(url + "/v1/completions", json={"prompt": "x" * 200, "max_tokens": 1})

    t = time.perf_counter()
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as c:
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="policies,overhead")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s of the policies part")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv", default="128MiB", help="each replica's --kv-cache-memory in the policies part")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[-0.5, -1.0, -2.0],
                    help="--escalate-below values of the cascade part")
    args = ap.parse_args()
    if "policies" in args.parts:
        policies(args)
    if "cascade" in args.parts:
        cascade(args)
    if "overhead" in args.parts:
        overhead(args)


if __name__ == "__main__":
    main()
