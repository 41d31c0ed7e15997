"""Granite-4.0-H (IBM's GraniteMoeHybridForCausalLM, its dense models): Mamba2 layers beside attention, every
layer with the same SwiGLU MLP (its "shared MLP"), and Granite's multipliers.

- A Mamba2 layer projects the input to a gate z, the convolution's channels (x, then B and C for each of
  mamba_groups groups) and a step dt per head; x, B and C go through a causal depthwise convolution and SiLU, the
  selective scan runs over the per-request state (Backend.mamba2_scan: a mamba_head_dim x mamba_state matrix per
  head, float32, in the engine's state group beside the convolution's last conv_kernel - 1 inputs), and its output,
  gated by SiLU(z) and normalised per group, goes through out_proj.
- An attention layer is Llama's with the scores scaled by attention_multiplier, and rotary only where the config
  asks for it (position_embedding_type "rope"; the released models have none).
- The embedding is scaled by embedding_multiplier, each block's output by residual_multiplier before it joins the
  residual stream, and the logits divided by logits_scaling.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.family_config import granite_name
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.layer_cache import LayerCache
from tokenmill.model.layers import DepthwiseConv, RMSNorm, SwiGLU
from tokenmill.model.linear import Linear
from tokenmill.model.llama import Attention, LlamaForCausalLM, WeightTarget
from tokenmill.model_config import ModelConfig


class GroupGatedRMSNorm(nn.Module):
    """weight * rms-normalised(x * silu(gate)), over each of `groups` equal parts of the inner width."""

    def __init__(self, dim: int, groups: int, eps: float, backend, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))
        self.groups, self.eps, self.backend = groups, eps, backend

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.backend.gated_group_norm(x, gate, self.weight, self.eps, self.groups)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, dtype=None, method=None):
        super().__init__()
        self.backend = backend
        self.heads, self.head_dim, self.state, self.groups = (cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_state,
                                                              cfg.mamba_groups)
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state
        h = cfg.hidden_size
        self.in_proj = Linear(h, self.inner + self.conv_dim + self.heads, bias=cfg.mamba_proj_bias, backend=backend,
                              method=method, dtype=dtype)
        self.conv1d = DepthwiseConv(self.conv_dim, cfg.conv_kernel, cfg.conv_bias, dtype)
        self.dt_bias = nn.Parameter(torch.zeros(self.heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(self.heads, dtype=dtype))
        self.D = nn.Parameter(torch.zeros(self.heads, dtype=dtype))
        self.norm = GroupGatedRMSNorm(self.inner, self.groups, cfg.rms_norm_eps, backend, dtype)
        self.out_proj = Linear(self.inner, h, bias=cfg.mamba_proj_bias, backend=backend, method=method, dtype=dtype)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        t, inner, bc = x.shape[0], self.inner, self.groups * self.state
        projected = self.in_proj(x)
        xbc = self.backend.short_conv(projected[:, inner:inner + self.conv_dim], self.conv1d.weight.squeeze(1),
                                      self.conv1d.bias, state[0], meta.state_spans, silu=True)
        y = self.backend.mamba2_scan(xbc[:, :inner].view(t, self.heads, self.head_dim),
                                     projected[:, inner + self.conv_dim:],
                                     xbc[:, inner:inner + bc].view(t, self.groups, self.state),
                                     xbc[:, inner + bc:].view(t, self.groups, self.state),
                                     self.A_log, self.D, self.dt_bias, state[1], meta.state_spans)
        return self.out_proj(self.norm(y.view(t, inner), projected[:, :inner]))


class GraniteAttention(Attention):
    def __init__(self, cfg, backend, dtype=None, method=None, reduce=None, layer_idx=0):
        super().__init__(cfg, backend, dtype, method, reduce, layer_idx)
        self.scale = cfg.attention_multiplier
        self.rope = layer_idx not in cfg.nope_layers


class GraniteHybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, dtype=None, method=None, reduce=None, layer_idx: int = 0):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.residual_multiplier = cfg.residual_multiplier
        self.input_layernorm = RMSNorm(h, eps, backend, dtype)
        self.is_mamba = layer_idx in cfg.mamba_layers
        if self.is_mamba:
            self.mamba = Mamba2Mixer(cfg, backend, dtype, method)
        else:
            self.self_attn = GraniteAttention(cfg, backend, dtype, method, reduce, layer_idx)
        self.post_attention_layernorm = RMSNorm(h, eps, backend, dtype)
        self.shared_mlp = SwiGLU(h, cfg.intermediate_size, backend, dtype, method, reduce)

    def forward(self, x, cos, sin, meta, cache):
        """Updates the residual stream `x` in place and returns it; each block's output times residual_multiplier
        (rounded, as transformers does) before it joins."""
        h = self.input_layernorm(x)
        h = self.mamba(h, meta, cache) if self.is_mamba else self.self_attn(h, cos, sin, meta, cache)
        x.add_(h.mul_(self.residual_multiplier))
        return x.add_(self.shared_mlp(self.post_attention_layernorm(x)).mul_(self.residual_multiplier))


class GraniteHybridForCausalLM(LlamaForCausalLM):
    """GraniteMoeHybridForCausalLM (HF) without experts: Llama's loading and LM head, Granite-4.0-H's layers and
    multipliers. Op by op (the whole-layer kernels compute Llama's layer)."""

    layer_class = GraniteHybridLayer
    whole_layer_kernels = False

    @classmethod
    def layer_caches(cls, cfg: ModelConfig) -> list[LayerCache]:
        conv_dim = cfg.mamba_heads * cfg.mamba_head_dim + 2 * cfg.mamba_groups * cfg.mamba_state
        mamba = LayerCache.state((cfg.conv_kernel - 1, conv_dim),
                                 (cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_state))
        return [mamba if i in cfg.mamba_layers else LayerCache.attention() for i in range(cfg.num_layers)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling

    def weight_targets(self) -> dict[str, WeightTarget]:
        return {granite_name(name): target for name, target in super().weight_targets().items()}
