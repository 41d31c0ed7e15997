"""The weight formats `--quantization` names, as LinearMethods (model/linear.py) the model builds its layers with."""

from __future__ import annotations

from tokenmill.config import QUANTIZATION_CHOICES
from tokenmill.errors import ConfigError
from tokenmill.model.linear import DenseLinearMethod, LinearMethod


def linear_method(quantization: str | None) -> LinearMethod:
    """The LinearMethod of a `--quantization` name (None: the checkpoint's own dense weights)."""
    if quantization is None:
        return DenseLinearMethod()
    if quantization == "int8":
        from tokenmill.quant.int8 import Int8LinearMethod

        return Int8LinearMethod()
    if quantization == "fp8":
        from tokenmill.quant.fp8 import Fp8LinearMethod

        return Fp8LinearMethod()
    if quantization == "gguf":
        from tokenmill.quant.gguf_linear import GGUFLinearMethod

        return GGUFLinearMethod()
    raise ConfigError(f"unknown --quantization {quantization!r}; choose one of {', '.join(QUANTIZATION_CHOICES)}")
