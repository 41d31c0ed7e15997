"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat token batch with a paged KV cache.

The model knows nothing about requests: it sees token ids, positions, attention metadata and the caches. Nor
does it know the device: every op goes through the backend it is built with (model/backends/).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.backends import Backend, LinearWeights, TorchBackend
from tokenmill.model.layers import RMSNorm, RotaryEmbedding, SwiGLU
from tokenmill.model.linear import Linear, TiedLMHead


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend):
        super().__init__()
        self.backend = backend
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias,
                               backend=backend)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False, backend=backend)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        q, k, v = self.backend.rotary_and_write_kv(self.qkv_proj(x), self.num_heads, self.num_kv_heads, cos, sin,
                                                   k_cache, v_cache, meta.slot_mapping)
        out = self.backend.paged_attention(q, k, v, k_cache, v_cache, meta)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, backend)

    def forward(self, x, cos, sin, meta, kv_cache):
        """Updates the residual stream `x` in place and returns it."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        h = self.post_attention_layernorm.add_forward(h, x)  # x += attention output; h = norm(x)
        return x.add_(self.mlp(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: Backend | None = None):
        super().__init__()
        self.config = cfg
        self.backend = backend = backend if backend is not None else TorchBackend()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.rotary: RotaryEmbedding | None = None  # built by init_rotary once the model is on its device
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False,
                                                                   backend=backend)
        self.tied_head = TiedLMHead(self.embed_tokens) if cfg.tie_word_embeddings else None
        self.backend_cache: dict[str, object] = {}  # the backend's per-model state; emptied when weights change

    def init_rotary(self, device: torch.device) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for every token of the flat batch."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(positions, x.dtype)
        fast = self.backend.decode_layers(self, x, cos, sin, meta, kv_caches)  # None: run the layers below
        if fast is not None:
            return self.norm(fast)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, meta, kv)
        return self.norm(x)

    def linear_layers(self) -> list[LinearWeights]:
        """Every matmul weight of the model (the tied LM head included): what a backend may repack."""
        layers: list[LinearWeights] = [m for m in self.modules() if isinstance(m, Linear)]
        return layers + ([self.tied_head] if self.tied_head is not None else [])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return self.backend.linear(hidden, self.tied_head).float()

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up. Every parameter must be covered. Packed
        copies of the old weights and the backend's cache are dropped (call backend.prepack again)."""
        cfg, loaded = self.config, set()
        for m in self.linear_layers():
            m.packed_weight = None
        self.backend_cache.clear()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint is missing tensor {name}")
            loaded.add(name)
            return weights[name]

        self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        if self.lm_head is not None:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
            attn = layer.self_attn
            attn.qkv_proj.weight.copy_(torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
            if cfg.attention_bias:
                attn.qkv_proj.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
            attn.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
            mlp = layer.mlp
            mlp.gate_up_proj.weight.copy_(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            mlp.down_proj.weight.copy_(take(p + "mlp.down_proj.weight"))
        unused = set(weights) - loaded - {"lm_head.weight"}
        unused = {n for n in unused if not n.endswith("rotary_emb.inv_freq")}
        if unused:
            raise KeyError(f"checkpoint has tensors this model does not use: {sorted(unused)[:5]}")
