"""Weight-only INT4 by round-to-nearest (`--quantization int4`): each group of 32 input weights of a feature gets a
float16 scale and minimum (asymmetric, 16 levels), quantized on the fly as the checkpoint loads. It is the
baseline activation-aware scaling (AWQ) must beat at the same group size, and a quarter of bfloat16's bytes plus
the scales (5 bits a weight).

The groups are written as llama.cpp's Q4_1 blocks, so the kept-GGUF path serves them unchanged
(quant/gguf_linear.py, csrc/gguf_linear.cpp): the same tiles, the same bit-exact widening."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.formats.gguf_blocks import GGMLBlocks, GGMLQuantizationType
from tokenmill.model.linear import Linear
from tokenmill.quant.gguf_linear import GGUFLinearMethod, embedding_rows

GROUP = 32  # Q4_1's block
Q4_1 = int(GGMLQuantizationType.Q4_1)


@torch.no_grad()
def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (K % 32 == 0) -> Q4_1 blocks [N, K/32 * 20] uint8: per group, float16 d = (max - min) / 15
    and m = min, then q = round((w - m) / d) in 0..15 against the float16 values stored, so a weight is off by at
    most half a step of what the kernel multiplies."""
    n, k = weight.shape
    g = weight.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    step = d.float().unsqueeze(-1)
    q = torch.where(step > 0, ((g - m.float().unsqueeze(-1)) / step.clamp_min(1e-30)).round(), torch.zeros_like(g))
    q = q.clamp_(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # byte j: element j (low), element j + 16 (high)
    blocks = torch.cat([d.unsqueeze(-1).view(torch.uint8), m.unsqueeze(-1).view(torch.uint8), nibbles], dim=-1)
    return blocks.reshape(n, -1)


class Int4LinearMethod(GGUFLinearMethod):
    """The checkpoint loads dense (as DenseLinearMethod); once in, a weight whose input features are whole groups
    becomes Q4_1 blocks (`gguf_blocks`), the dense copy released; a tied embedding looks up the head's blocks."""

    name = "int4"
    takes_blocks = False

    def process_weights_after_loading(self, layer: Linear | nn.Module, checkpoint: object = None) -> None:
        layer.gguf_type = None
        w = layer.weight
        if w.shape[1] % GROUP:
            return  # not whole groups: stays dense
        blocks = quantize_q4_1(w)
        layer.gguf_type, layer.gguf_blocks = Q4_1, blocks
        if getattr(layer, "shares_weight", False):  # the tied LM head: lookups read the same blocks
            layer.embedding.keep_rows(embedding_rows(GGMLBlocks(Q4_1, blocks, tuple(w.shape)), w.dtype))
        else:
            layer.weight = nn.Parameter(w.to("meta"), requires_grad=False)
