"""Perplexity of one GGUF file in tokenmill and in llama.cpp's `llama-perplexity`, on the same held-out ShareGPT text
scored the same way, side by side.

    python benchmarks/ppl_vs_llama.py --model gemma3-270m [--texts 200] [--ctx 512] [--chunks 40]
        [--llama-bin /work/peers/llama.cpp/bin] [--out benchmarks/results/ppl_vs_llama.json]

The text: the first `--texts` held-out conversations (tokenmill/eval.py: disjoint from any calibration text), joined
by blank lines into one file. llama-perplexity's method, which tokenmill repeats here: the whole text tokenized
once, cut into chunks of `--ctx` tokens; each chunk's first token replaced by BOS (when the model adds one); only
the second half of each chunk scored (every token there sees at least ctx/2 tokens of context). Both use their own
tokenizer on the same text: the token counts printed show whether they agree.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def llama_perplexity(binary: Path, model: Path, text_file: Path, ctx: int, chunks: int, threads: int) -> dict:
    cmd = [str(binary), "-m", str(model), "-f", str(text_file), "-c", str(ctx), "-b", str(ctx), "--chunks",
           str(chunks), "-t", str(threads)]
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    log = run.stdout + run.stderr
    m = FINAL.search(log)
    if run.returncode != 0 or m is None:
        sys.exit(f"llama-perplexity failed (exit {run.returncode}):\n{log[-3000:]}")
    over = re.search(r"calculating perplexity over (\d+) chunks", log)
    return {"perplexity": float(m.group(1)), "plus_minus": float(m.group(2)), "command": " ".join(cmd),
            "seconds": time.perf_counter() - start, "chunks": int(over.group(1)) if over else None}


def tokenmill_perplexity(model: str, text: str, ctx: int, chunks: int, threads: int,
                         quantization: str | None = None) -> dict:
    """llama-perplexity's computation through tokenmill: prompt logprobs of each chunk, its second half scored
    (`quantization`: the weight format, as --quantization; None: the default)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(model, num_threads=threads, max_model_len=ctx + 1, kv_cache_memory=256 << 20,  # + the one sampled
              quantization=quantization)
    tok = llm.get_tokenizer()
    ids = tok.encode(text)  # as llama.cpp: BOS first where the model adds one
    bos = ids[0] if tok.bos_token_id is not None and ids[:1] == [tok.bos_token_id] else None
    n = min(chunks, len(ids) // ctx)
    batch = []
    for c in range(n):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        batch.append(chunk)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": b} for b in batch],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True))
    first = ctx // 2
    nll, count = 0.0, 0
    for out, chunk in zip(outs, batch):
        for i in range(first, ctx - 1):  # the logits at i score token i + 1
            nll -= out.prompt_logprobs[i + 1][chunk[i + 1]]
            count += 1
    llm.shutdown()
    return {"perplexity": math.exp(nll / count), "tokens_scored": count, "chunks": n, "text_tokens": len(ids),
            "seconds": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m", help="a GGUF path or an installed model package's name")
    ap.add_argument("--texts", type=int, default=200)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-bin", default="/work/peers/llama.cpp/bin")
    ap.add_argument("--out", default="benchmarks/results/ppl_vs_llama.json")
    args = ap.parse_args()

    from tokenmill.eval import heldout_texts
    from tokenmill.model.paths import resolve_model_path

    path = resolve_model_path(args.model)
    text = "\n\n".join(heldout_texts(args.texts))
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    ours = tokenmill_perplexity(str(path), text, args.ctx, args.chunks, args.threads)
    theirs = llama_perplexity(Path(args.llama_bin) / "llama-perplexity", path, Path(f.name), args.ctx,
                              ours["chunks"], args.threads)
    ratio = ours["perplexity"] / theirs["perplexity"]
    result = {"model": str(path), "ctx": args.ctx, "texts": args.texts, "tokenmill": ours, "llama.cpp": theirs,
              "ratio": ratio}
    print(f"tokenmill  PPL {ours['perplexity']:.4f} over {ours['tokens_scored']} tokens in {ours['chunks']} chunks "
          f"({ours['text_tokens']} text tokens)")
    print(f"llama.cpp  PPL {theirs['perplexity']:.4f} +/- {theirs['plus_minus']:.4f}")
    print(f"ratio tokenmill / llama.cpp: {ratio:.4f} ({(ratio - 1) * 100:+.2f}%)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
