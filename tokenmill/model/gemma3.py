"""Gemma 3 (text): the Llama skeleton with Gemma's variations, each a module here:
- the embedding scaled by sqrt(hidden) (the scale rounded to the model's dtype first, as transformers does);
- RMSNorms that scale by (1 + w) (checkpoints hold w; llama.cpp's GGUF files hold 1 + w, which
  gguf_checkpoint.py turns back into w), in float32 and rounded once, as transformers computes them;
- "sandwich" norms: the attention output and the MLP output are normalised before they join the residual, and the
  MLP input has its own norm (pre_feedforward_layernorm);
- a GELU-tanh gated MLP; per-head q/k norms; scores scaled by query_pre_attn_scalar ** -0.5;
- interleaved local / global layers: a local layer (ModelConfig.sliding_layers) sees each token's last
  `sliding_window` keys and rotates with its own base (rope_local_theta); a global layer sees every key and rotates
  with rope_theta and the rope scaling.
A local layer's blocks leave the KV cache once they leave the window (engine/kv_layout.py's hybrid layout: each
layer reads through its own table, `AttentionMetadata.layer_meta`); the backends' whole-layer kernels compute the
Llama layer, so they are off here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.backends import Backend, TorchBackend
from tokenmill.model.layers import RotaryEmbedding, SwiGLU
from tokenmill.model.llama import Attention, LlamaForCausalLM


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w). `weight` is w in the model's dtype (the checkpoint's tensor, as transformers keeps
    it); `scale` is 1 + w in float32, computed once the weights are loaded (refresh)."""

    def __init__(self, dim: int, eps: float, backend: Backend | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))
        self.eps = eps
        self.backend = backend if backend is not None else TorchBackend()
        self.scale: torch.Tensor | None = None

    def refresh(self) -> None:
        self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm_float_scale(x, self.scale, self.eps)


class GeluGLU(SwiGLU):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused into one matmul (never packed for SwiGLU's SiLU
    epilogue)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate_up_proj.silu_pairs = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.backend.gelu_tanh_mul(self.gate_up_proj(x)))
        return out if self.reduce is None else self.reduce(out)


class Gemma3Attention(Attention):
    def __init__(self, cfg, backend, dtype=None, method=None, reduce=None, layer_idx=0):
        super().__init__(cfg, backend, dtype, method, reduce, layer_idx)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend, dtype)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend, dtype)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.window = cfg.sliding_window if layer_idx in cfg.sliding_layers else None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The q/k/v projection with each q and k head normalised (GemmaRMSNorm over head_dim), before rotary."""
        qkv = self.qkv_proj(x)
        t, d = qkv.shape[0], self.head_dim
        for start, heads, norm in ((0, self.num_heads, self.q_norm), (self.q_size, self.num_kv_heads, self.k_norm)):
            part = qkv[:, start:start + heads * d]
            part.copy_(norm(part.reshape(t * heads, d)).view(t, heads * d))
        return qkv


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg, backend, dtype=None, method=None, reduce=None, layer_idx=0):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, backend, dtype)
        self.self_attn = Gemma3Attention(cfg, backend, dtype, method, reduce, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, backend, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, backend, dtype)
        self.mlp = GeluGLU(h, cfg.intermediate_size, backend, dtype, method, reduce)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, backend, dtype)

    def forward(self, x, cos, sin, meta, kv_cache):
        """Updates the residual stream `x` in place and returns it."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        x.add_(self.post_attention_layernorm(h))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x.add_(self.post_feedforward_layernorm(h))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma3ForCausalLM / `gemma3_text` (HF) and `gemma3` (GGUF): Llama's loading, embedding lookup (then scaled),
    LM head and parallel layouts, with Gemma's layers, final norm and two rotary tables."""

    layer_class = Gemma3DecoderLayer
    whole_layer_kernels = False

    def __init__(self, cfg, backend=None, dtype=None, method=None, tp=None, stage=None):
        super().__init__(cfg, backend, dtype, method, tp, stage)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.backend, dtype)
        self.local_rotary: RotaryEmbedding | None = None  # the sliding-window layers' tables (init_rotary)

    def init_rotary(self, device: torch.device) -> None:
        super().init_rotary(device)
        cfg = self.config
        self.local_rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                            cfg.rope_local_theta or cfg.rope_theta, None)
        self.local_rotary.to(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32).to(x.dtype)
        return x * scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], hidden_in: torch.Tensor | None = None
                ) -> torch.Tensor:
        """As LlamaForCausalLM.forward, each layer rotating with its own kind's tables, op by op."""
        x = self.embed(input_ids) if hidden_in is None else hidden_in
        global_tables = self.rotary.tables(positions, x.dtype)
        local_tables = self.local_rotary.tables(positions, x.dtype) if self.config.sliding_layers else None
        for layer, kv, layer_meta in zip(self.layers, kv_caches, meta.per_layer(len(self.layers))):
            cos, sin = local_tables if layer.self_attn.window is not None else global_tables
            x = layer(x, cos, sin, layer_meta, kv)
        return self.norm(x) if self.last else x

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        super().load_hf_weights(weights)
        refresh_norms(self)


def refresh_norms(model: nn.Module) -> None:
    """Every GemmaRMSNorm's (1 + w) from its loaded w."""
    for m in model.modules():
        if isinstance(m, GemmaRMSNorm):
            m.refresh()
