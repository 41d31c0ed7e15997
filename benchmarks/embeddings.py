"""/v1/embeddings served by tokenmill against llama.cpp's `llama-server --embedding`, same GGUF, same texts, side by
side in one run: embeddings per second at batch 1 (one text per request, one request at a time) and batch 64 (64
texts per request), and how close the two servers' vectors are (cosine).

    python benchmarks/embeddings.py                        # the run in BENCHMARKS.md
    python benchmarks/embeddings.py --runs 1 --texts 64   # a quick look

Both pool the last token's final hidden state and normalize it (tokenmill `--runner pooling --pooling last`,
llama-server `--embedding --pooling last`), with 2 threads. Texts: held-out ShareGPT turns, cut to
`--max-tokens` tokens. Rounds take each server in turn; the figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.compare import LLAMA_SERVER, Peer, free_port, gguf_path, running  # noqa: E402
from benchmarks.long_prefill import cpu_line  # noqa: E402
from tokenmill.eval import heldout_texts  # noqa: E402


def texts(n: int, max_tokens: int) -> list[str]:
    from tokenmill.tokenizer import Tokenizer

    tok = Tokenizer.load(gguf_path())
    out = []
    for text in heldout_texts(4 * n):
        ids = tok.encode(text, add_special_tokens=False)[:max_tokens]
        if len(ids) >= 8:
            out.append(tok.decode(ids))
        if len(out) == n:
            break
    return out


def peers(threads: int, slots: int, ctx: int, llama_server: str) -> list[Peer]:
    model = str(gguf_path())
    return [
        Peer("tokenmill", "tokenmill", [sys.executable, "-m", "tokenmill.cli", "serve", "--model", model,
                                        "--runner", "pooling", "--pooling", "last", "--threads", str(threads),
                                        "--port", "{port}", "--no-ui"]),
        Peer("llamacpp", "llama.cpp", [llama_server, "-m", model, "--embedding", "--pooling", "last", "-t",
                                       str(threads), "-np", str(slots), "-c", str(slots * ctx), "-b", str(ctx),
                                       "-ub", str(ctx), "--port", "{port}"]),
    ]


def embed(client: httpx.Client, inputs: list[str]) -> list[list[float]]:
    r = client.post("/v1/embeddings", json={"input": inputs, "encoding_format": "float"})
    r.raise_for_status()
    return [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]


def rate(client: httpx.Client, items: list[str], batch: int) -> tuple[float, list[list[float]]]:
    """Embeddings per second sending `batch` texts per request, one request at a time."""
    vectors = []
    start = time.perf_counter()
    for i in range(0, len(items), batch):
        vectors += embed(client, items[i:i + batch])
    return len(items) / (time.perf_counter() - start), vectors


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / ((sum(x * x for x in a) ** 0.5) * (sum(y * y for y in b) ** 0.5))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=LLAMA_SERVER)
    ap.add_argument("--out", default="benchmarks/results/embeddings.json")
    args = ap.parse_args(argv)
    items = texts(args.texts, args.max_tokens)
    rates: dict[str, dict[int, list[float]]] = {}
    vectors: dict[str, list[list[float]]] = {}
    logs = Path("/tmp/tokenmill-embeddings-logs")
    logs.mkdir(exist_ok=True)
    for r in range(args.runs):
        for peer in peers(args.threads, 8, 2 * args.max_tokens, args.llama_server):
            port = free_port()
            peer.command = [c.replace("{port}", str(port)) for c in peer.command]
            with running(peer, port, logs / f"{peer.name}.log") as url, httpx.Client(base_url=url, timeout=600) as c:
                embed(c, items[:4])  # warm
                for batch in (1, 64):
                    per_s, got = rate(c, items, batch)
                    rates.setdefault(peer.name, {}).setdefault(batch, []).append(per_s)
                    vectors[peer.name] = got
            print(f"round {r + 1} {peer.name}: " + ", ".join(f"batch {b} {v[-1]:.1f}/s"
                                                             for b, v in rates[peer.name].items()), flush=True)
    median = {name: {b: statistics.median(v) for b, v in by.items()} for name, by in rates.items()}
    cos = [cosine(a, b) for a, b in zip(vectors["tokenmill"], vectors["llamacpp"])]
    result = {"cpu": cpu_line(), "args": vars(args), "rates": rates, "median": median,
              "ratio": {b: median["tokenmill"][b] / median["llamacpp"][b] for b in (1, 64)},
              "cosine": {"min": min(cos), "median": statistics.median(cos)}}
    print(json.dumps({k: result[k] for k in ("median", "ratio", "cosine")}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"CPU: {result['cpu']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
