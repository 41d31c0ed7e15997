"""How fast a full server says no: 429 latency from a cold start, one at a time, and under a burst.

A server whose queue is full should refuse at once, so clients back off or go to another replica. This starts
`tokenmill serve` with a tiny queue (--max-num-seqs 1, --max-waiting-requests 4), fills it with long requests,
then times, over raw sockets (an HTTP client library's own overhead would swamp the figure on 2 cores):
  - the first 429 after start (cold),
  - 20 more, one at a time (warm),
  - a burst of --burst concurrent requests on connections opened beforehand (p50 / p99 / max).

    python benchmarks/shed.py [--runs 3] [--burst 100] [--prompt-chars 0] [--baseline-tree DIR]

--baseline-tree DIR runs a second tokenmill from another checkout (e.g. `git worktree add DIR COMMIT`),
alternating with this one, and prints both side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_vs_offline import start_tokenmill  # noqa: E402 (benchmarks/ is on sys.path as the script's folder)
from long_prefill import cpu_line  # noqa: E402

QUEUE = 4


def request_bytes(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(data), data))


def timed(host: str, port: int, body: dict) -> tuple[int, float]:
    """(status, milliseconds from the request's first byte sent to the status line read)."""
    with socket.create_connection((host, port), timeout=60) as sock:
        t0 = time.perf_counter()
        sock.sendall(request_bytes(body))
        head = sock.recv(65536)
        return int(head.split()[1]), (time.perf_counter() - t0) * 1000


async def burst(host: str, port: int, n: int, prompt_chars: int) -> list[tuple[int, float]]:
    conns = [await asyncio.open_connection(host, port) for _ in range(n)]
    filler = ("All work and no play makes a dull model. " * (prompt_chars // 40 + 1))[:prompt_chars]
    payloads = [request_bytes({"prompt": f"Item {i}. {filler}", "max_tokens": 4}) for i in range(n)]

    async def one(i: int) -> tuple[int, float]:
        reader, writer = conns[i]
        t0 = time.perf_counter()
        writer.write(payloads[i])
        await writer.drain()
        line = await reader.readline()
        writer.close()
        return int(line.split()[1]), (time.perf_counter() - t0) * 1000

    return await asyncio.gather(*(one(i) for i in range(n)))


def fill_queue(url: str, host: str, port: int) -> list[socket.socket]:
    """One long request running and QUEUE waiting; their sockets stay open (closing them would abort them)."""
    held = []
    long = request_bytes({"prompt": "Write a long story.", "max_tokens": 4000, "ignore_eos": True})
    for _ in range(QUEUE + 1):
        sock = socket.create_connection((host, port))
        sock.sendall(long)
        held.append(sock)
        deadline = time.monotonic() + 30
        want = len(held)
        while True:  # the server counts it before the next one goes
            text = httpx.get(url + "/metrics").text
            running = waiting = 0.0
            for line in text.splitlines():
                if line.startswith("tokenmill_num_requests_running{"):
                    running = float(line.rsplit(" ", 1)[1])
                elif line.startswith("tokenmill_num_requests_waiting{"):
                    waiting = float(line.rsplit(" ", 1)[1])
            if running + waiting >= want or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    return held


def run_once(burst_size: int, prompt_chars: int, tree: str | None = None) -> dict:
    saved = os.environ.get("PYTHONPATH")
    if tree:  # the server (and its spawned engine) import tokenmill from that checkout first
        os.environ["PYTHONPATH"] = tree
    try:
        proc, url = start_tokenmill(["--max-num-seqs", "1", "--max-waiting-requests", str(QUEUE), "--dtype", "float32",
                                     "--kv-cache-memory", "256MiB"])
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
    try:
        held = fill_queue(url, host, int(port))
        cold = timed(host, int(port), {"prompt": "Hi", "max_tokens": 2})
        warm = [timed(host, int(port), {"prompt": "Hi", "max_tokens": 2}) for _ in range(20)]
        results = asyncio.run(burst(host, int(port), burst_size, prompt_chars))
        for sock in held:
            sock.close()
    finally:
        proc.terminate()
        proc.wait(60)
    codes = [cold[0], *(c for c, _ in warm), *(c for c, _ in results)]
    assert set(codes) == {429}, f"expected only 429s, got {sorted(set(codes))}"
    lat = sorted(ms for _, ms in results)
    return {"cold_ms": cold[1], "warm_ms": statistics.median(ms for _, ms in warm),
            "burst_p50_ms": statistics.median(lat), "burst_p99_ms": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "burst_max_ms": lat[-1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--burst", type=int, default=100)
    ap.add_argument("--prompt-chars", type=int, default=0, help="pad each burst prompt to this many characters")
    ap.add_argument("--baseline-tree", default=None, help="another checkout to run alternately, side by side")
    args = ap.parse_args()
    trees = {"this tree": None, **({f"baseline {args.baseline_tree}": args.baseline_tree} if args.baseline_tree else {})}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name, tree in trees.items():
            runs[name].append(run_once(args.burst, args.prompt_chars, tree))
    print(f"CPU: {cpu_line()}")
    print(f"| 429 latency, ms (median of {args.runs} server starts) | " + " | ".join(trees) + " |")
    print("|---|" + "---|" * len(trees))
    for key, label in (("cold_ms", "first 429 after start"), ("warm_ms", "one at a time (median of 20)"),
                       ("burst_p50_ms", f"burst of {args.burst} x {args.prompt_chars} chars: p50"),
                       ("burst_p99_ms", f"burst of {args.burst} x {args.prompt_chars} chars: p99"),
                       ("burst_max_ms", f"burst of {args.burst} x {args.prompt_chars} chars: max")):
        print(f"| {label} | " + " | ".join(f"{statistics.median(r[key] for r in runs[n]):.1f}" for n in trees) + " |")
    print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
