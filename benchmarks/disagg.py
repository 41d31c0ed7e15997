"""Disaggregated prefill/decode against one colocated instance at equal cores (BENCHMARKS.md "Disaggregated prefill
and decode").

    python benchmarks/disagg.py --runs 2

The workload where it matters: 8 decode streams (64-token prompts, 256 tokens each) while long prompts (2,000-4,000
tokens, 16 output tokens) arrive every --gap seconds. Every configuration sits behind `tokenmill router` (one client
path), the default model, chunked prefill on (the default budget):
- colocated: one `tokenmill serve` on cores 0-1 (--threads 2);
- colocated, ITL target: the same with --slo-itl-ms 150 (the scheduler's own answer to the same problem);
- disaggregated: a producer on core 0 and a consumer on core 1 (--threads 1 each, --kv-transfer-config),
  `tokenmill router --prefill --decode`.
Reported: the streams' ITL p50/p99/max and output tokens/s, the long prompts' TTFT p50/p99; for the disaggregated
runs the TTFT split the router measured (prefill half, of which the transfer after the prompt's last step, and the
decode half's first byte); and each connector's bandwidth for one 4,000-token prompt's KV (in-process, loopback).
The router and this client run on the same two cores as the servers, in every configuration alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import torch
from http_vs_offline import launch, start_tokenmill
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.bench.datasets import random_requests
from tokenmill.bench.loadgen import LoadConfig, first_model, run_load
from tokenmill.disagg import make_connector
from tokenmill.disagg.transfer import KVTransferParams, TransferLayout
from tokenmill.kv_transfer_config import KVTransferConfig
from tokenmill.model.cpu_kernels import cpu_isa
from tokenmill.model.loader import default_model_path
from tokenmill.tokenizer import Tokenizer

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None  # a tmpfs: the shm connector's default home
COMMON = ["--kv-cache-memory", "512MiB", "--max-model-len", "8192"]


def serve(cores: str, threads: int, *flags: str) -> tuple[subprocess.Popen, str]:
    return start_tokenmill(["--threads", str(threads), *COMMON, *flags], ["taskset", "-c", cores])


def router(*flags: str) -> tuple[subprocess.Popen, str]:
    proc, url = launch([sys.executable, "-m", "tokenmill.cli", "router", "--port", "0", *flags], "tokenmill router")
    while httpx.get(url + "/health").status_code != 200:
        time.sleep(0.2)
    return proc, url


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def histogram(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a histogram in a /metrics page."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        if family.name == name:
            total = next(s.value for s in family.samples if s.name.endswith("_sum"))
            count = next(s.value for s in family.samples if s.name.endswith("_count"))
            return total, count
    return 0.0, 0.0


async def load(url: str, streams, longs, gap: float):
    model = first_model(url)
    cfg = LoadConfig(base_url=url, model=model, progress=False, ignore_eos=True)
    cfg_long = LoadConfig(base_url=url, model=model, progress=False, ignore_eos=True, request_rate=1 / gap, seed=3)
    (res_s, _), (res_l, _) = await asyncio.gather(run_load(cfg, streams), run_load(cfg_long, longs))
    return res_s, res_l


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(name: str, streams, longs, gap: float, connector: str) -> dict:
    procs, shm = [], None
    try:
        if name.startswith("disaggregated"):
            shm = tempfile.mkdtemp(prefix="tokenmill-bench-kv-", dir=SHM)
            port = free_port()  # the consumer's, named in the producer's kv_peers
            kv = {"kv_connector": connector, "shm_dir": shm, "kv_secret": secrets.token_hex(32)}
            p = serve("0", 1, "--kv-transfer-config", json.dumps({**kv, "kv_role": "kv_producer",
                                                                  "kv_peers": [f"127.0.0.1:{port}"]}))
            procs.append(p[0])
            d = serve("1", 1, "--kv-transfer-config", json.dumps({**kv, "kv_role": "kv_consumer", "kv_port": port}))
            procs.append(d[0])
            r = router("--prefill", p[1], "--decode", d[1])
        else:
            flags = ["--slo-itl-ms", "150"] if "target" in name else []
            c = serve("0,1", 2, *flags)
            procs.append(c[0])
            r = router("--backend", c[1])
        procs.append(r[0])
        res_s, res_l = asyncio.run(load(r[1], streams, longs, gap))
        failed = sum(not x.success for x in res_s + res_l)
        gaps = [g for x in res_s if x.success for g in x.itl]
        span = max(x.start_time + x.latency for x in res_s if x.success)
        out = {"itl_p50": pct(gaps, 0.5), "itl_p99": pct(gaps, 0.99), "itl_max": max(gaps),
               "tps": sum(x.output_tokens or 0 for x in res_s if x.success) / span,
               "ttft_p50": pct([x.ttft for x in res_l if x.success], 0.5),
               "ttft_p99": pct([x.ttft for x in res_l if x.success], 0.99), "failed": failed}
        if name.startswith("disaggregated"):
            for key, metric in (("prefill", "tokenmill_router_pd_prefill_seconds"),
                                ("tail", "tokenmill_router_pd_transfer_tail_seconds"),
                                ("first_decode", "tokenmill_router_pd_first_decode_seconds")):
                total, count = histogram(r[1], metric)
                out[key] = total / count if count else float("nan")
        return out
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)


def bandwidth(tokens: int = 4000) -> dict[str, tuple[float, float]]:
    """(GB/s through the connector, ms to load it into a block pool) for one prompt's KV, SmolLM2's layout."""
    layout = TransferLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16", itemsize=2)
    data = torch.randn(tokens, 30, 2, 3, 64).to(torch.bfloat16)
    cache = [(torch.zeros(tokens // 16 + 1, 16, 3, 64, dtype=torch.bfloat16),) * 2 for _ in range(30)]
    slots = torch.arange(tokens)
    out = {}
    for name in ("shm", "tcp"):
        common = {"kv_connector": name, "kv_port": 0, "shm_dir": tempfile.mkdtemp(prefix="tokenmill-bw-", dir=SHM),
                  "kv_secret": secrets.token_hex(32)}
        producer = make_connector(KVTransferConfig(kv_role="kv_producer", **common), layout)
        consumer = make_connector(KVTransferConfig(kv_role="kv_consumer", **common), layout)
        address = consumer.address()
        host, port = address.rsplit(":", 1) if address else (None, "0")
        runs = []
        for i in range(5):
            tid = f"bw{i}"
            start = time.perf_counter()
            producer.begin(KVTransferParams(tid, True, host, int(port)), list(range(tokens)))
            for s in range(0, tokens, 512):
                producer.send(tid, s, data[s:s + 512].clone())
            producer.end(tid)
            while not producer.results(0.01):
                pass
            sent = time.perf_counter() - start
            got = consumer.claim(tid)
            t0 = time.perf_counter()
            for layer, (k, v) in enumerate(cache):
                k.view(-1, 3, 64).index_copy_(0, slots, got.data[:, layer, 0])
                v.view(-1, 3, 64).index_copy_(0, slots, got.data[:, layer, 1])
            runs.append((data.nbytes / sent / 1e9, (time.perf_counter() - t0) * 1e3))
        producer.close()
        consumer.close()
        shutil.rmtree(common["shm_dir"], ignore_errors=True)
        out[name] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--gap", type=float, default=6.0, help="seconds between long prompts")
    ap.add_argument("--longs", type=int, default=6, help="long prompts per run")
    ap.add_argument("--connector", default="tcp", choices=["tcp", "shm"])
    ap.add_argument("--configs", default="colocated,colocated-target,disaggregated")
    args = ap.parse_args()
    tok = Tokenizer.load(default_model_path()).hf_tokenizer
    streams = random_requests(tok, 8, 64, 256, seed=5)
    longs = random_requests(tok, args.longs, 3000, 16, range_ratio=1 / 3, seed=6)
    names = {"colocated": "colocated (cores 0-1, --threads 2)",
             "colocated-target": "colocated, ITL target (--slo-itl-ms 150)",
             "disaggregated": f"disaggregated ({args.connector}: producer core 0, consumer core 1)"}
    chosen = [names[c] for c in args.configs.split(",")]
    results: dict[str, list[dict]] = {n: [] for n in chosen}
    for run in range(args.runs):  # configurations interleaved, so drift hits each alike
        for name in chosen:
            results[name].append(run_config(name, streams, longs, args.gap, args.connector))
            print(f"run {run + 1} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    print(f"\n## Decode ITL while 2,000-4,000-token prompts arrive (8 streams x 256 tokens, a long prompt every "
          f"{args.gap:g} s; median of {args.runs} runs; CPU {cpu_isa()})")
    print("| configuration | ITL p50 | ITL p99 | ITL max | streams' tok/s | long TTFT p50 | long TTFT p99 | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['itl_p50'] * 1e3:.0f} ms | {m['itl_p99'] * 1e3:.0f} ms | {m['itl_max'] * 1e3:.0f} ms "
              f"| {m['tps']:.1f} | {m['ttft_p50']:.2f} s | {m['ttft_p99']:.2f} s | {m['failed']:.0f} |")
    base = med.get(names["colocated"])
    dis = med.get(names["disaggregated"])
    if base and dis:
        print(f"\ncolocated / disaggregated ITL p99: {base['itl_p99'] / dis['itl_p99']:.2f}x; long-prompt TTFT p50 "
              f"{dis['ttft_p50'] / base['ttft_p50']:.2f}x colocated's")
    if dis:
        print(f"disaggregated, router's split per request (mean over all requests): prefill half "
              f"{dis['prefill'] * 1e3:.0f} ms, of which transfer after the last prompt step {dis['tail'] * 1e3:.1f} "
              f"ms; decode half to first byte {dis['first_decode'] * 1e3:.0f} ms")
    print("\n| connector | GB/s, one 4,000-token prompt's KV (92 MB) | load into the block pool |\n|---|---|---|")
    for name, (gbs, ms) in bandwidth().items():
        print(f"| {name} | {gbs:.2f} | {ms:.0f} ms |")


if __name__ == "__main__":
    main()
