"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat token batch with a paged KV cache.

The model knows nothing about requests: it sees token ids, positions, attention metadata and the caches.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.model.attention import AttentionMetadata, paged_attention, write_kv
from tokenmill.model.cpu_kernels import fused_ops
from tokenmill.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary
from tokenmill.model.linear import Linear, linear, prepack_weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        ops = fused_ops(qkv)
        if ops is not None:  # rotary in place and the K/V cache write, in one call
            ops.rotary_write_kv(qkv, self.num_heads, self.num_kv_heads, cos.view(t, -1), sin.view(t, -1),
                                kv_cache[0], kv_cache[1], meta.slot_mapping)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = (y.view(t, -1, self.head_dim) for y in (q, k, v))
        if ops is None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            write_kv(kv_cache[0], kv_cache[1], k, v, meta.slot_mapping)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.view(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, meta, kv_cache):
        """Updates the residual stream `x` in place and returns it."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        h = self.post_attention_layernorm.add_forward(h, x)  # x += attention output; h = norm(x)
        return x.add_(self.mlp(h))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary: RotaryEmbedding | None = None  # built by init_rotary once the model is on its device
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._layer_weight_lists: list[list[torch.Tensor]] | None = None
        self._lm_head_packed: torch.Tensor | None = None

    def init_rotary(self, device: torch.device) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for every token of the flat batch."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(positions, x.dtype)
        ops = fused_ops(x)
        if ops is not None and meta.use_kernel and not meta.fresh_spans:
            # every token reads the cache (decode steps): each layer is one C++ call, same math as below
            t, cfg = x.shape[0], self.config
            cos, sin = cos.view(t, -1), sin.view(t, -1)
            for weights, (k_cache, v_cache) in zip(self._layer_weights(), kv_caches):
                ops.decoder_layer(x, weights, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, cos, sin, k_cache,
                                  v_cache, meta.slot_mapping, meta.block_tables, meta.q_rows, meta.kv_lens)
            return self.norm(x)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, meta, kv)
        return self.norm(x)

    def prepack_weights(self) -> bool:
        """Add oneDNN-packed copies of every matmul weight (model/linear.py says why); call after loading and
        the dtype cast. Returns False, changing nothing, where this device or dtype has no packed kernel."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if not linears or not linears[0].prepack():
            return False
        for m in linears[1:]:
            m.prepack()
        if self.lm_head is None:
            self._lm_head_packed = prepack_weight(self.embed_tokens.weight)
        self._layer_weight_lists = None
        return True

    def _layer_weights(self) -> list[list[torch.Tensor]]:
        """Per layer, the tensors `decoder_layer` takes, gathered once (they only change when prepacked)."""
        if self._layer_weight_lists is None:
            empty = torch.empty(0, dtype=self.norm.weight.dtype, device=self.norm.weight.device)

            def packed(m: Linear) -> torch.Tensor:
                return empty if m.packed_weight is None else m.packed_weight

            self._layer_weight_lists = [
                [l.input_layernorm.weight, l.self_attn.qkv_proj.weight,
                 l.self_attn.qkv_proj.bias if l.self_attn.qkv_proj.bias is not None else empty,
                 l.self_attn.o_proj.weight, l.post_attention_layernorm.weight,
                 l.mlp.gate_up_proj.weight, l.mlp.down_proj.weight,
                 packed(l.self_attn.qkv_proj), packed(l.self_attn.o_proj), packed(l.mlp.gate_up_proj),
                 packed(l.mlp.down_proj)] for l in self.layers]
        return self._layer_weight_lists

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return linear(hidden, self.embed_tokens.weight, packed=self._lm_head_packed).float()

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up. Every parameter must be covered. Packed
        copies of the old weights are dropped (call prepack_weights again)."""
        cfg, loaded = self.config, set()
        for m in self.modules():
            if isinstance(m, Linear):
                m.packed_weight = None
        self._lm_head_packed, self._layer_weight_lists = None, None

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
