"""LFM2 (Liquid AI): a hybrid of gated short convolutions and attention. Most layers are convolutions: the input is
projected to three parts B, C and x, B * x goes through a causal depthwise convolution over the last `conv_kernel`
positions, and C gates its output. The other layers are the Llama layer with per-head q/k norms (Qwen3's). Every
layer has the same SwiGLU feed-forward block.

A convolution layer keeps, per request, the last conv_kernel - 1 inputs of its convolution: a fixed-size state in
the engine's state group (model/layer_cache.py), carried across prefill chunks and reset at position 0. The
checkpoint names (operator_norm, ffn_norm, feed_forward.w1/w3/w2, out_proj, q/k_layernorm, embedding_norm for the
final norm) map onto the Llama modules' (`weight_targets`).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.family_config import lfm2_name
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.layer_cache import LayerCache
from tokenmill.model.layers import DepthwiseConv, RMSNorm, SwiGLU
from tokenmill.model.linear import Linear
from tokenmill.model.llama import LlamaForCausalLM, WeightTarget
from tokenmill.model.qwen3 import Qwen3DecoderLayer
from tokenmill.model_config import ModelConfig


class ShortConv(nn.Module):
    """in_proj -> B, C, x; y = C * conv(B * x); out_proj(y)."""

    def __init__(self, cfg: ModelConfig, backend, dtype=None, method=None):
        super().__init__()
        h = self.hidden = cfg.hidden_size
        self.backend = backend
        self.in_proj = Linear(h, 3 * h, bias=cfg.conv_bias, backend=backend, method=method, dtype=dtype)
        self.conv = DepthwiseConv(h, cfg.conv_kernel, cfg.conv_bias, dtype)
        self.out_proj = Linear(h, h, bias=cfg.conv_bias, backend=backend, method=method, dtype=dtype)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: tuple[torch.Tensor]) -> torch.Tensor:
        h = self.hidden
        bcx = self.in_proj(x)
        b, c, u = bcx[:, :h], bcx[:, h:2 * h], bcx[:, 2 * h:]
        conv = self.conv
        y = self.backend.short_conv(b * u, conv.weight.squeeze(1), conv.bias, state[0], meta.state_spans)
        return self.out_proj(c * y)


class ConvLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, dtype=None, method=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, dtype)
        self.conv = ShortConv(cfg, backend, dtype, method)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, backend, dtype, method)

    def forward(self, x, cos, sin, meta, state):
        """Updates the residual stream `x` in place and returns it."""
        h = self.post_attention_layernorm.add_forward(self.conv(self.input_layernorm(x), meta, state), x)
        return x.add_(self.mlp(h))


def make_layer(cfg: ModelConfig, backend, dtype=None, method=None, reduce=None, layer_idx: int = 0) -> nn.Module:
    if layer_idx in cfg.conv_layers:
        return ConvLayer(cfg, backend, dtype, method)
    return Qwen3DecoderLayer(cfg, backend, dtype, method, reduce, layer_idx)


class Lfm2ForCausalLM(LlamaForCausalLM):
    """Lfm2ForCausalLM (HF): Llama's loading, embedding, final norm and LM head, LFM2's layers. Op by op (the
    backends' whole-layer kernels compute the Llama layer)."""

    layer_class = staticmethod(make_layer)
    whole_layer_kernels = False

    @classmethod
    def layer_caches(cls, cfg: ModelConfig) -> list[LayerCache]:
        conv = LayerCache.state((cfg.conv_kernel - 1, cfg.hidden_size))
        return [conv if i in cfg.conv_layers else LayerCache.attention() for i in range(cfg.num_layers)]

    def weight_targets(self) -> dict[str, WeightTarget]:
        return {lfm2_name(name): target for name, target in super().weight_targets().items()}
