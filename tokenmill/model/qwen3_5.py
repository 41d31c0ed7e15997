"""Qwen3.5 (text): a hybrid of Gated DeltaNet linear attention and gated full attention, three linear layers to
one full one in the released models.

- A linear-attention layer (GatedDeltaNet) projects the input to q, k and v (through a causal depthwise convolution
  of kernel `conv_kernel` and SiLU), an output gate z and the per-head a and b that set each token's decay and write
  strength; the delta rule runs over a per-request state (Backend.gated_delta_rule), and its output is normalised
  per head and gated by SiLU(z) before out_proj. Its state, per request: the convolution's last conv_kernel - 1
  inputs and the recurrent matrices [value heads, key dim, value dim], both in float32 in the engine's state group.
- A full-attention layer is Qwen3's (per-head q/k norms, GQA) with rotary on a quarter of each head, and a sigmoid
  gate on its output: q_proj gives each head's query then its gate.
- Every RMSNorm but the gated one scales by (1 + w) (gemma3.py's GemmaRMSNorm); the MLP is SwiGLU.
Text positions only: the multimodal checkpoints' three rotary sections see the same position for text, which is
plain rotary. Qwen3.5-MoE is the same with experts and a gated shared expert in every layer (moe.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.gemma3 import GemmaRMSNorm, refresh_norms
from tokenmill.model.layer_cache import LayerCache
from tokenmill.model.layers import DepthwiseConv, SwiGLU
from tokenmill.model.linear import Linear
from tokenmill.model.llama import Attention, LlamaForCausalLM
from tokenmill.model.moe import MoEModelMixin, SharedExpertMoE
from tokenmill.model_config import ModelConfig


class GatedRMSNorm(nn.Module):
    """weight * x / rms(x) * silu(gate) per head: plain w, not (1 + w)."""

    def __init__(self, dim: int, eps: float, backend, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))
        self.eps, self.backend = eps, backend

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.backend.gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, dtype=None, method=None):
        super().__init__()
        self.backend = backend
        self.heads, self.key_heads, self.tiled = cfg.delta_value_heads, cfg.delta_key_heads, cfg.delta_tiled_heads
        self.key_dim, self.value_dim = cfg.delta_key_dim, cfg.delta_value_dim
        keys, values = self.key_heads * self.key_dim, self.heads * self.value_dim
        self.conv_dim = 2 * keys + values
        h = cfg.hidden_size
        # in_proj_qkv and in_proj_z apart: llama-quantize gives them different types (a fused matmul of two
        # GGUF types would be kept dense); in_proj_b and in_proj_a in one matmul (FUSED_SHARDS)
        self.in_proj_qkv = Linear(h, self.conv_dim, bias=False, backend=backend, method=method, dtype=dtype)
        self.in_proj_z = Linear(h, values, bias=False, backend=backend, method=method, dtype=dtype)
        self.in_proj_ba = Linear(h, [self.heads, self.heads], bias=False, backend=backend, method=method, dtype=dtype)
        self.conv1d = DepthwiseConv(self.conv_dim, cfg.conv_kernel, False, dtype)
        self.dt_bias = nn.Parameter(torch.zeros(self.heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(self.heads, dtype=dtype))
        self.norm = GatedRMSNorm(self.value_dim, cfg.rms_norm_eps, backend, dtype)
        self.out_proj = Linear(values, h, bias=False, backend=backend, method=method, dtype=dtype)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        t, keys = x.shape[0], self.key_heads * self.key_dim
        ba = self.in_proj_ba(x)
        qkv = self.backend.short_conv(self.in_proj_qkv(x), self.conv1d.weight.squeeze(1), None, state[0],
                                      meta.state_spans, silu=True)
        q = qkv[:, :keys].view(t, self.key_heads, self.key_dim)
        k = qkv[:, keys:2 * keys].view(t, self.key_heads, self.key_dim)
        v = qkv[:, 2 * keys:].view(t, self.heads, self.value_dim)
        out = self.backend.gated_delta_rule(q, k, v, ba[:, self.heads:], ba[:, :self.heads], self.A_log,
                                            self.dt_bias, state[1], meta.state_spans, self.tiled)
        z = self.in_proj_z(x).view(t * self.heads, self.value_dim)
        out = self.norm(out.view(t * self.heads, self.value_dim), z)
        return self.out_proj(out.view(t, self.heads * self.value_dim))


class GatedAttention(Attention):
    """Qwen3's attention with (1 + w) q/k norms and each head's output times sigmoid of its gate."""

    def __init__(self, cfg, backend, dtype=None, method=None, reduce=None, layer_idx=0):
        super().__init__(cfg, backend, dtype, method, reduce, layer_idx)
        self.qkv_proj = Linear(cfg.hidden_size, [2 * self.q_size, self.kv_size, self.kv_size],
                               bias=cfg.attention_bias, backend=backend, method=method, dtype=dtype)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend, dtype)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend, dtype)

    def forward(self, x, cos, sin, meta, kv_cache):
        projected = self.qkv_proj(x)
        t, d, heads = x.shape[0], self.head_dim, self.num_heads
        query_gate = projected[:, :2 * self.q_size].view(t, heads, 2 * d)
        q = self.q_norm(query_gate[:, :, :d].reshape(t * heads, d)).view(t, self.q_size)
        kv = projected[:, 2 * self.q_size:]
        k = self.k_norm(kv[:, :self.kv_size].reshape(t * self.num_kv_heads, d)).view(t, self.kv_size)
        qkv = torch.cat([q, k, kv[:, self.kv_size:]], dim=1)
        gate = query_gate[:, :, d:].reshape(t, self.q_size)
        return self.output(self.attend(qkv, cos, sin, meta, kv_cache) * torch.sigmoid(gate))


class Qwen3_5Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, dtype=None, method=None, reduce=None, layer_idx: int = 0):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, backend, dtype)
        self.linear = layer_idx in cfg.delta_layers
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, backend, dtype, method)
        else:
            self.self_attn = GatedAttention(cfg, backend, dtype, method, reduce, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, backend, dtype)
        self.mlp = self.make_mlp(cfg, backend, dtype, method, reduce)

    def make_mlp(self, cfg: ModelConfig, backend, dtype, method, reduce) -> nn.Module:
        """The feed-forward block (Qwen3_5MoeLayer's: experts and a shared expert)."""
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size, backend, dtype, method, reduce)

    def forward(self, x, cos, sin, meta, cache):
        """Updates the residual stream `x` in place and returns it."""
        h = self.input_layernorm(x)
        if self.linear:
            h = self.linear_attn(h, meta, cache)
        else:
            h = self.self_attn(h, cos, sin, meta, cache)
        x.add_(h)
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Qwen3_5ForCausalLM (HF), and the text model of Qwen3_5ForConditionalGeneration: Llama's loading, embedding
    and LM head, Qwen3.5's layers and (1 + w) final norm. Op by op (the whole-layer kernels compute Llama's)."""

    layer_class = Qwen3_5Layer
    whole_layer_kernels = False

    def __init__(self, cfg, backend=None, dtype=None, method=None, tp=None, stage=None):
        super().__init__(cfg, backend, dtype, method, tp, stage)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.backend, dtype)

    @classmethod
    def layer_caches(cls, cfg: ModelConfig) -> list[LayerCache]:
        conv_dim = 2 * cfg.delta_key_heads * cfg.delta_key_dim + cfg.delta_value_heads * cfg.delta_value_dim
        delta = LayerCache.state((cfg.conv_kernel - 1, conv_dim),
                                 (cfg.delta_value_heads, cfg.delta_key_dim, cfg.delta_value_dim))
        return [delta if i in cfg.delta_layers else LayerCache.attention() for i in range(cfg.num_layers)]

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        super().load_hf_weights(weights)
        refresh_norms(self)


class Qwen3_5MoeLayer(Qwen3_5Layer):
    def make_mlp(self, cfg: ModelConfig, backend, dtype, method, reduce) -> nn.Module:
        return SharedExpertMoE(cfg, backend, dtype, method, reduce)


class Qwen3_5MoeForCausalLM(MoEModelMixin, Qwen3_5ForCausalLM):
    """Qwen3_5MoeForCausalLM (HF), and Qwen3_5MoeForConditionalGeneration's text model: Qwen3.5's layers with
    experts and a gated shared expert in every one."""

    layer_class = Qwen3_5MoeLayer
