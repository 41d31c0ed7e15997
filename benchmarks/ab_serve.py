"""Two source trees served side by side: the same model, the same ShareGPT requests, alternating rounds, so a
refactor's cost (or gain) shows as a ratio measured in one run on this noisy machine.

    git worktree add /tmp/before <commit>
    python benchmarks/ab_serve.py --tree before=/tmp/before --tree after=. --concurrency 1,16,64 --rounds 3

Each round starts `tokenmill serve` from each tree in turn (its own source, the same venv), runs
`tokenmill bench serve` (ShareGPT, --sharegpt-output-len, ignore_eos) at each concurrency, and stops it. Prints
output tokens/s, TTFT p50 and TPOT p50 per tree and concurrency (medians over the rounds), and each tree's
throughput ratio to the first tree (the median of the per-round ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SERVER_FLAGS = ["--port", "0", "--kv-cache-memory", "512MiB"]


def start(tree: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", *SERVER_FLAGS, *extra], cwd=tree,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline, line = time.monotonic() + 300, ""
    while "tokenmill serving" not in line:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server from {tree} did not start")
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
    url = line.rsplit(" at ", 1)[1].strip()
    while httpx.get(url + "/health").status_code != 200:
        time.sleep(0.2)
    return proc, url


def bench(url: str, concurrency: int, prompts: int, output_len: int, seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url, "--dataset",
                    "sharegpt", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
                    "--sharegpt-output-len", str(output_len), "--seed", str(seed), "--disable-tqdm",
                    "--save-result", out], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(Path(out).read_text())


def pick(result: dict, *names: str) -> float:
    """A figure from a saved result, whichever of the names its schema uses (nested dicts searched too)."""
    stack = [result]
    while stack:
        d = stack.pop()
        for name in names:
            if isinstance(d.get(name), (int, float)):
                return float(d[name])
        stack += [v for v in d.values() if isinstance(v, dict)]
    raise KeyError(f"none of {names} in the result: {sorted(result)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH, repeated; the first is the baseline")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prompts-per-stream", type=int, default=4, help="requests per level: this x concurrency, "
                                                                       "at least 16")
    ap.add_argument("--sharegpt-output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server-args", default="", help="extra flags for every server")
    args = ap.parse_args()
    trees = [(n, Path(p).resolve()) for n, p in (t.split("=", 1) for t in args.tree)]
    levels = [int(c) for c in args.concurrency.split(",")]
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        for name, tree in trees if r % 2 == 0 else trees[::-1]:
            proc, url = start(tree, args.server_args.split())
            try:
                for c in levels:
                    res = bench(url, c, max(16, args.prompts_per_stream * c), args.sharegpt_output_len, seed=r)
                    runs.setdefault((name, c), []).append(res)
                    print(f"round {r + 1} {name} c={c}: {pick(res, 'output_throughput'):.1f} tok/s", flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
    base = trees[0][0]
    print(f"\n| tree | streams | output tok/s (median of {args.rounds}) | TTFT p50 ms | TPOT p50 ms | "
          f"ratio to {base} (median of rounds) |")
    print("|---|---|---|---|---|---|")
    for c in levels:
        for name, _ in trees:
            rs = runs[(name, c)]
            tput = [pick(x, "output_throughput") for x in rs]
            ratio = statistics.median(a / b for a, b in zip(tput, (pick(x, "output_throughput")
                                                                     for x in runs[(base, c)])))
            print(f"| {name} | {c} | {statistics.median(tput):.1f} | "
                  f"{statistics.median(pick(x, 'median_ttft_ms', 'ttft_p50_ms') for x in rs):.0f} | "
                  f"{statistics.median(pick(x, 'median_tpot_ms', 'tpot_p50_ms') for x in rs):.1f} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
