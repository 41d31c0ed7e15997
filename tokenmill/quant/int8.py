"""Weight-only INT8 (W8A16): each output feature's weights as int8 with one float32 scale (symmetric, the row's
largest magnitude maps to 127), activations and arithmetic in the model's dtype. Quantized on the fly from the
checkpoint's dense weights as they load, the way vLLM's on-the-fly formats work: the checkpoint stays as it is.

Halves the weight bytes a decode step reads against bfloat16; the kernel (csrc/int8_linear.cpp) widens int8 tiles
to bfloat16 once per call and multiplies on the same AMX tiles as the dense weights."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.linear import DenseLinearMethod, Linear

INT8_MAX = 127


@torch.no_grad()
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] int8, scale [N] float32) with weight ~ q * scale[:, None]; an all-zero row gets
    scale 1 (q = 0) rather than a division by zero."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale in float32: the weight the int8 matmul multiplies by."""
    return q.float() * scale[:, None]


class Int8LinearMethod(DenseLinearMethod):
    """The checkpoint loads into a dense weight as for DenseLinearMethod; once it has, the weight becomes
    `qweight` (int8) and `weight_scale` (float32 per output feature) and the dense copy is released (left on the
    meta device, as a packed layer's is). A tied embedding's lookups read the LM head's int8 rows too, so no dense
    table stays. `apply` is the backend's int8_linear."""

    name = "int8"

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8(weight)

    def process_weights_after_loading(self, layer: Linear | nn.Module, checkpoint: object = None) -> None:
        q, scale = self.quantize(layer.weight)
        if isinstance(layer, nn.Module) and not getattr(layer, "shares_weight", False):
            layer.register_buffer("qweight", q, persistent=False)
            layer.register_buffer("weight_scale", scale, persistent=False)
            layer.weight = nn.Parameter(layer.weight.to("meta"), requires_grad=False)
        else:  # the tied LM head: its weight is the embedding's, whose lookups now read the same quantized rows
            layer.qweight, layer.weight_scale = q, scale
            dtype = layer.weight.dtype
            layer.embedding.keep_rows(lambda ids: (q[ids].float() * scale[ids].unsqueeze(-1)).to(dtype))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return layer.backend.int8_linear(x, layer)
