"""Weight-only FP8 (`--quantization fp8`, vLLM's name): each output feature's weights as float8 e4m3 with one
float32 scale (the row's largest magnitude maps to e4m3's 448), quantized on the fly as the checkpoint loads.

No CPU here multiplies FP8, so this is W8A16 on the int8 kernel's tiles (csrc/int8_linear.cpp widens e4m3 bytes
to bfloat16 exactly). That widening rebiases the exponent and so needs normal numbers: the few weights below
e4m3's smallest normal (2^-6 of the scale) round to 0 or to it, not to e4m3's subnormals; a weight that small is
under 1/28,000 of its row's largest."""

from __future__ import annotations

import torch

from tokenmill.model.linear import Linear
from tokenmill.quant.int8 import Int8LinearMethod

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0 ** -6


@torch.no_grad()
def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] float8_e4m3fn without subnormals, scale [N] float32), weight ~ q * scale."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    v = (w / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    tiny = v.abs() < E4M3_MIN_NORMAL
    v = torch.where(tiny, torch.where(v.abs() >= E4M3_MIN_NORMAL / 2, v.sign() * E4M3_MIN_NORMAL, 0.0), v)
    return v.to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


class Fp8LinearMethod(Int8LinearMethod):
    """As Int8LinearMethod, with e4m3 weights (`qweight` float8_e4m3fn); `apply` is the backend's fp8_linear."""

    name = "fp8"
    # As vLLM's fp8: the LM head stays in the model's dtype. e4m3 rounds each weight to 1/16-1/8 of itself; on the
    # head (the tied embedding here) that doubled the perplexity cost (+3.1% vs +1.5% on SmolLM2, BENCHMARKS.md).
    quantizes_lm_head = False

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8(weight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return layer.backend.fp8_linear(x, layer)
