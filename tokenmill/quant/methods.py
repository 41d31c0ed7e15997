"""The weight formats `--quantization` names, as LinearMethods (model/linear.py) the model builds its layers with."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.config import QUANTIZATION_CHOICES
from tokenmill.errors import ConfigError
from tokenmill.model import cpu_kernels
from tokenmill.model.backends.gguf_tiles import default_kept_dtypes
from tokenmill.model.linear import DenseLinearMethod, LinearMethod
from tokenmill.model.paths import is_gguf


def checkpoint_quantization(model_path: str | Path) -> str | None:
    """The format a checkpoint is stored in, where it names one: `awq` for an AWQ directory, else None."""
    from tokenmill.formats.awq_format import awq_config

    return None if is_gguf(Path(model_path)) else ("awq" if awq_config(model_path) is not None else None)


def resolve_quantization(requested: str | None, model_path: str | Path, dtype: torch.dtype,
                         device: str | torch.device, dtype_asked: bool = False) -> str | None:
    """The weight format to serve: what was asked; by default an AWQ checkpoint's own groups, or a GGUF file's
    blocks kept where their kernel runs in `dtype`, the CPU's own compute dtype (AMX tiles: the same outputs, bit
    for bit, in a third of the memory; AVX512-VNNI and AVX2: int8 products of x split in two int8 parts, as close
    to the dequantized weights as x's dtype is; docs/models/quality.md; gguf_tiles.py default_kept_dtypes), else
    the dequantized weights (None). `none` asks for the dequantized weights, and so
    does float32 asked for by name (`dtype_asked`): it means the reference, whatever this CPU's kernels."""
    stored = checkpoint_quantization(model_path)
    if requested == "gguf" and not is_gguf(Path(model_path)):
        raise ConfigError(f"--quantization gguf keeps a GGUF file's blocks, and {model_path} is not a .gguf file; "
                          "use --quantization int8 or fp8 to quantize other checkpoints")
    if requested == "awq" and stored != "awq":
        raise ConfigError(f"--quantization awq serves an AWQ checkpoint, and {model_path} is not one; make one with "
                          f"`tokenmill quantize --method awq --model {model_path} --out DIR` and serve DIR")
    if requested is not None:
        return None if requested == "none" else requested
    if stored is not None:
        return stored
    if not is_gguf(Path(model_path)) or torch.device(device).type != "cpu" or (dtype_asked and dtype == torch.float32):
        return None
    ops = cpu_kernels._extension()
    return "gguf" if ops is not None and dtype in default_kept_dtypes(ops.gguf_kernel()) else None


def linear_method(quantization: str | None) -> LinearMethod:
    """The LinearMethod of a `--quantization` name (None or `none`: the checkpoint's own dense weights)."""
    if quantization is None or quantization == "none":
        return DenseLinearMethod()
    if quantization == "int8":
        from tokenmill.quant.int8 import Int8LinearMethod

        return Int8LinearMethod()
    if quantization == "fp8":
        from tokenmill.quant.fp8 import Fp8LinearMethod

        return Fp8LinearMethod()
    if quantization == "int4":
        from tokenmill.quant.int4 import Int4LinearMethod

        return Int4LinearMethod()
    if quantization == "gguf":
        from tokenmill.quant.gguf_linear import GGUFLinearMethod

        return GGUFLinearMethod()
    if quantization == "awq":
        from tokenmill.quant.gguf_linear import AWQLinearMethod

        return AWQLinearMethod()
    raise ConfigError(f"unknown --quantization {quantization!r}; choose one of {', '.join(QUANTIZATION_CHOICES)}")
