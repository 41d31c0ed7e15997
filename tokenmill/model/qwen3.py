"""Qwen3: the Llama layer with a per-head RMSNorm of q and k (`q_norm`, `k_norm`, over head_dim) after the
projection and before rotary, and head_dim given by the config (it need not be hidden / heads)."""

from __future__ import annotations

import torch

from tokenmill.model.layers import RMSNorm
from tokenmill.model.llama import Attention, DecoderLayer, LlamaForCausalLM


class Qwen3Attention(Attention):
    def __init__(self, cfg, backend, dtype=None, method=None, reduce=None, layer_idx=0):
        super().__init__(cfg, backend, dtype, method, reduce, layer_idx)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend, dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend, dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.qk_norm(self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.q_norm.weight,
                                    self.k_norm.weight, self.q_norm.eps)


class Qwen3DecoderLayer(DecoderLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """The backends' whole-layer kernels compute the plain Llama layer, without the q/k norms: op by op here."""

    layer_class = Qwen3DecoderLayer
    whole_layer_kernels = False
