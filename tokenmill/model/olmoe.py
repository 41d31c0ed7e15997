"""OLMoE: a mixture of experts in every layer, and q and k each RMS-normalised over their whole projection (all
heads together, not per head as Qwen3), then q, k and v clamped to +-clip_qkv where the config sets it.

Under tensor parallelism a rank holds some of the heads: the norm's sum of squares is summed over the ranks (the
KV heads' counted once where ranks share them) before each rank scales its own part."""

from __future__ import annotations

import torch

from tokenmill.model.layers import RMSNorm
from tokenmill.model.llama import Attention, DecoderLayer, LlamaForCausalLM
from tokenmill.model.moe import MoELayerMixin, MoEModelMixin


class OlmoeAttention(Attention):
    def __init__(self, cfg, backend, dtype=None, method=None, reduce=None, layer_idx=0):
        super().__init__(cfg, backend, dtype, method, reduce, layer_idx)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps, backend, dtype)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps, backend, dtype)
        self.clip = cfg.clip_qkv
        # tensor parallelism: the whole model's q and k widths, and how many ranks hold each KV head
        self.widths, self.kv_copies = (self.q_size, self.kv_size), 1

    def split(self, ranks: int, num_heads: int, num_kv_heads: int) -> None:
        """This rank's part of a model of `num_heads` / `num_kv_heads` over `ranks` (OlmoeForCausalLM sets it)."""
        self.widths = (num_heads * self.head_dim, num_kv_heads * self.head_dim)
        self.kv_copies = max(1, ranks // num_kv_heads)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        for start, width, norm, whole in ((0, self.q_size, self.q_norm, self.widths[0]),
                                          (self.q_size, self.kv_size, self.k_norm, self.widths[1])):
            part = qkv[:, start:start + width]
            part.copy_(self.norm_part(part, norm, whole, 1 if start == 0 else self.kv_copies))
        if self.clip is not None:
            qkv.clamp_(-self.clip, self.clip)
        return qkv

    def norm_part(self, part: torch.Tensor, norm: RMSNorm, whole: int, copies: int) -> torch.Tensor:
        if self.reduce is None:
            return norm(part.contiguous())
        xf = part.float()  # as transformers' RMSNorm, over the whole width: the ranks' sums of squares added
        squares = self.reduce(xf.pow(2).sum(-1, keepdim=True).contiguous()) / copies
        return (xf * torch.rsqrt(squares / whole + norm.eps)).to(part.dtype) * norm.weight


class OlmoeDecoderLayer(MoELayerMixin, DecoderLayer):
    attention_class = OlmoeAttention


class OlmoeForCausalLM(MoEModelMixin, LlamaForCausalLM):
    layer_class = OlmoeDecoderLayer

    def __init__(self, cfg, backend=None, dtype=None, method=None, tp=None, stage=None):
        super().__init__(cfg, backend, dtype, method, tp, stage)
        if tp is not None:
            whole = tp.layout.cfg
            for layer in self.layers:
                layer.self_attn.split(tp.layout.size, whole.num_heads, whole.num_kv_heads)
