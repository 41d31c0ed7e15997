"""Several models in one `tokenmill serve`: what a cold load costs the request that causes it, and whether unloading a
model gives its memory back.

One server serves the same GGUF under two names (`--model a=PATH --model b=PATH`: two engine processes) with
`--keep-alive K`. Each run:
  1. baseline: the RSS of the server and every process under it, with a loaded and b not;
  2. cold: a streamed request to b, from sending it to its first token (b's engine process starting, its weights,
     warm-up and tokenizer loading, then the prefill), and the same request again, warm;
  3. both: the RSS with a and b loaded;
  4. after: b left idle past --keep-alive is unloaded; the RSS again, which should be within 5% of the baseline.
A thread sends a a one-token request every second throughout, so only b ever goes idle long enough to unload.
Medians over --runs; prints a markdown table (--out also appends it to a file).

    python benchmarks/multi_model.py [--model PATH] [--runs 3] [--keep-alive 5] [--serve-args "--threads 2"]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

MiB = 2**20
PROMPT = "Write one sentence about the sea."


class Server:
    """`tokenmill serve` in a subprocess, on a free port, its stderr in a file."""

    def __init__(self, args: list[str], log: Path):
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", "0", *args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("TOKENMILL_API_KEY", None)
        self.log = log
        started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), env=env, text=True)
        line = ""
        while "tokenmill serving" not in line:
            if self.proc.poll() is not None or time.monotonic() - started > 600:
                raise RuntimeError(f"the server did not start:\n{log.read_text()}")
            if select.select([self.proc.stdout], [], [], 1.0)[0]:
                line = self.proc.stdout.readline()
        self.ready_s = time.monotonic() - started
        self.url = line.rsplit(" at ", 1)[1].strip()
        self.http = httpx.Client(base_url=self.url, timeout=600)

    def rss(self) -> int:
        """The resident bytes of the server and all its descendants (engine processes, their helpers)."""
        root = psutil.Process(self.proc.pid)
        total = 0
        for p in [root, *root.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def status(self) -> dict[str, str]:
        return {c["id"]: c["status"] for c in self.http.get("/v1/models").json()["data"]}

    def ttft(self, model: str, max_tokens: int = 8) -> float:
        """Seconds from sending a streamed request to its first text."""
        body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        sent = time.perf_counter()
        first = None
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read()}")
            for line in r.iter_lines():
                if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    first = time.perf_counter() - sent
        if first is None:
            raise RuntimeError("no text came")
        return first

    def load_seconds(self, model: str) -> float | None:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(f'tokenmill_model_load_seconds{{model_name="{model}"}}'):
                return float(line.rsplit(" ", 1)[1])
        return None

    def stop(self) -> None:
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class KeepWarm(threading.Thread):
    """A one-token request to `model` every second, so --keep-alive never unloads it."""

    def __init__(self, url: str, model: str):
        super().__init__(daemon=True)
        self.url, self.model, self.stopped = url, model, threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=600) as http:
            while not self.stopped.wait(1.0):
                http.post("/v1/completions", json={"model": self.model, "prompt": "x", "max_tokens": 1})


def settle(server: Server, want: dict[str, str], timeout: float) -> None:
    """Wait until /v1/models shows `want`, then 1 s more for exited processes to be reaped."""
    deadline = time.monotonic() + timeout
    while server.status() != want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"models stayed {server.status()}, wanted {want}")
        time.sleep(0.2)
    time.sleep(1.0)


def one_run(server: Server, keep_alive: float) -> dict[str, float]:
    settle(server, {"a": "loaded", "b": "unloaded"}, keep_alive * 4 + 60)
    baseline = server.rss()
    cold = server.ttft("b")
    warm = server.ttft("b")
    both = server.rss()  # right away: b unloads --keep-alive seconds after that request
    if server.status() != {"a": "loaded", "b": "loaded"}:
        raise RuntimeError(f"both models should be loaded, found {server.status()}: raise --keep-alive")
    load = server.load_seconds("b")
    settle(server, {"a": "loaded", "b": "unloaded"}, keep_alive * 4 + 60)
    after = server.rss()
    return {"cold_ttft_s": cold, "warm_ttft_s": warm, "load_s": load or float("nan"), "baseline": baseline,
            "both": both, "after": after}


def table(runs: list[dict[str, float]], server: Server, args: argparse.Namespace) -> str:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ratio = [r["after"] / r["baseline"] for r in runs]
    rows = [
        ("cold model: request sent to first token", f"{med['cold_ttft_s']:.2f} s",
         ", ".join(f"{r['cold_ttft_s']:.2f}" for r in runs)),
        ("same request, model warm", f"{med['warm_ttft_s']:.3f} s", ", ".join(f"{r['warm_ttft_s']:.3f}" for r in runs)),
        ("model load, engine start to ready (server's own figure)", f"{med['load_s']:.2f} s",
         ", ".join(f"{r['load_s']:.2f}" for r in runs)),
        ("RSS, server + engines: a loaded (baseline)", f"{med['baseline'] / MiB:.0f} MiB",
         ", ".join(f"{r['baseline'] / MiB:.0f}" for r in runs)),
        ("RSS: a and b loaded", f"{med['both'] / MiB:.0f} MiB", ", ".join(f"{r['both'] / MiB:.0f}" for r in runs)),
        ("RSS: b unloaded again", f"{med['after'] / MiB:.0f} MiB", ", ".join(f"{r['after'] / MiB:.0f}" for r in runs)),
        ("after / baseline (within 5%?)", f"{statistics.median(ratio):.3f} "
         f"({'yes' if all(abs(x - 1) <= 0.05 for x in ratio) else 'NO'})", ", ".join(f"{x:.3f}" for x in ratio)),
    ]
    head = (f"`tokenmill serve --model a=M --model b=M --keep-alive {args.keep_alive:g} {args.serve_args}`, "
            f"M = {Path(args.model).name}; {args.runs} runs; server ready after {server.ready_s:.1f} s; "
            f"{os.cpu_count()} CPUs\n\n| measure | median | runs |\n|---|---|---|\n")
    return head + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2 GGUF)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--keep-alive", type=float, default=5.0, help="seconds idle before b unloads")
    p.add_argument("--serve-args", default="--kv-cache-memory 256MiB", help="more `tokenmill serve` flags")
    p.add_argument("--out", default=None, help="append the table to this file")
    args = p.parse_args(argv)
    if args.model is None:
        from tokenmill.model.paths import default_model_path

        args.model = str(default_model_path())
    log = Path(f"/tmp/multi_model_bench_{os.getpid()}.log")
    server = Server(["--model", f"a={args.model}", "--model", f"b={args.model}", "--keep-alive",
                     str(args.keep_alive), *shlex.split(args.serve_args)], log)
    warm = KeepWarm(server.url, "a")
    warm.start()
    try:
        runs = []
        for i in range(args.runs):
            runs.append(one_run(server, args.keep_alive))
            print(f"run {i + 1}: " + ", ".join(f"{k} {v / MiB if v > MiB else v:.3g}" for k, v in runs[-1].items()),
                  file=sys.stderr, flush=True)
        out = table(runs, server, args)
    finally:
        warm.stopped.set()
        server.stop()
    print(out)
    if args.out:
        with open(args.out, "a") as f:
            f.write(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
