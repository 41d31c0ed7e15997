"""What each weight format costs in quality, against the model as served by default (BENCHMARKS.md "Quantized
serving: quality"), all in one process on the same held-out samples:

    python benchmarks/quality.py --num-samples 200 --formats int8,gguf
    python benchmarks/quality.py --formats rtn=DIR1,awq=DIR2   # checkpoints (`tokenmill quantize --out DIR`)
    python benchmarks/quality.py --formats none:kv-fp8,gguf:kv-fp8   # an FP8 KV cache (--kv-cache-dtype fp8)
    python benchmarks/quality.py --reference none@float32 --formats auto@auto,gguf@float32 --json out.json

A format may name its compute dtype after an @ (else --dtype); `auto` is the engine's own choice (no --quantization),
so `auto@auto` is the model as served by default on this CPU. benchmarks/quality_per_cpu.py runs this script once
per CPU kind this machine builds kernels for (docs/models/quality.md).

- perplexity on held-out ShareGPT text (tokenmill.eval: the half calibration never sees), with its bootstrap 95%
  interval, and the change against the reference with a *paired* bootstrap interval (the same samples resampled
  for both models, so the sample-to-sample spread, far larger than any format's effect, cancels);
- greedy agreement: of `--greedy-prompts` held-out prompts, how many give the reference's 128 greedy tokens
  exactly, and the mean length of the common prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tokenmill import LLM, SamplingParams
from tokenmill.eval import evaluate_perplexity, heldout_samples


def paired_change(ref: list[float], other: list[float], tokens: list[int], resamples: int = 1000,
                  seed: int = 0) -> tuple[float, float, float]:
    """Perplexity ratio other / ref - 1 and its 95% interval, resampling samples jointly."""
    a, b, n = (np.asarray(v, dtype=np.float64) for v in (ref, other, tokens))
    change = float(np.exp((b.sum() - a.sum()) / n.sum()) - 1)
    picks = np.random.default_rng(seed).integers(0, len(a), size=(resamples, len(a)))
    boot = np.exp((b[picks].sum(1) - a[picks].sum(1)) / n[picks].sum(1)) - 1
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return change, float(lo), float(hi)


def greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                           use_tqdm=False)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--formats", default="int8,gguf", help="--quantization values to compare with the reference "
                                                         "(the weights dequantized to --dtype: `none`), or "
                                                         "LABEL=PATH for another checkpoint in its own format; "
                                                         "a :kv-fp8 suffix adds --kv-cache-dtype fp8")
    p.add_argument("--num-samples", type=int, default=200)
    p.add_argument("--max-tokens-per-sample", type=int, default=512)
    p.add_argument("--greedy-prompts", type=int, default=32)
    p.add_argument("--greedy-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", default="none", help="the format the others are compared with (default: the "
                                                        "weights dequantized to --dtype)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    results = {}
    for fmt in ["reference", *args.formats.split(",")]:
        spec = args.reference if fmt == "reference" else fmt
        weights, _, kv = spec.partition(":kv-")  # e.g. none:kv-fp8: the dequantized weights with an FP8 KV cache
        weights, _, dtype = weights.partition("@")
        dtype = dtype or args.dtype
        _, is_path, path = weights.partition("=")
        kv_dtype = kv or "auto"
        if is_path:  # a checkpoint served in its own format (e.g. an AWQ directory)
            llm = LLM(path, dtype=dtype, kv_cache_dtype=kv_dtype)
        else:
            llm = LLM(args.model, dtype=dtype, quantization=None if weights == "auto" else weights,
                      kv_cache_dtype=kv_dtype)
        if fmt == "reference":
            samples = heldout_samples(llm.get_tokenizer(), args.num_samples, args.seed, args.max_tokens_per_sample)
            prompts = [s[:64] for s in samples[:args.greedy_prompts]]
        ppl = evaluate_perplexity(llm, samples, use_tqdm=False)
        results[fmt] = (ppl, greedy(llm, prompts, args.greedy_tokens), llm.engine.core.runner.weight_summary())
        del llm
    ref, ref_greedy, _ = results["reference"]
    print(f"{ref.num_samples} held-out ShareGPT samples, {ref.num_tokens} tokens scored; greedy: "
          f"{len(prompts)} prompts x {args.greedy_tokens} tokens")
    print("format | weights | perplexity (95% CI) | change vs reference (paired 95% CI) | greedy identical | "
          "mean common prefix")
    rows = []
    for fmt, (ppl, outs, weights) in results.items():
        change, lo, hi = paired_change(ref.sample_nlls, ppl.sample_nlls, ref.sample_tokens)
        same = sum(o == r for o, r in zip(outs, ref_greedy))
        prefix = statistics.mean(common_prefix(o, r) for o, r in zip(outs, ref_greedy))
        print(f"{fmt} | {weights} | {ppl.perplexity:.3f} ({ppl.ci95[0]:.3f}-{ppl.ci95[1]:.3f}) | "
              f"{change:+.2%} ({lo:+.2%} to {hi:+.2%}) | {same}/{len(outs)} | {prefix:.1f}")
        rows.append({"format": args.reference if fmt == "reference" else fmt, "weights": weights,
                     "perplexity": ppl.perplexity, "ci95": list(ppl.ci95), "change": change, "change_ci95": [lo, hi],
                     "greedy_identical": same, "greedy_prompts": len(outs), "mean_common_prefix": prefix})
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": ref.num_samples, "tokens": ref.num_tokens,
                                               "greedy_tokens": args.greedy_tokens, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
