"""A toy hybrid family: full-attention, sliding-window and recurrent layers in turn, each keeping a different kind of
state (model/layer_cache.py), to test the engine's cache groups before a real hybrid family uses them.

The recurrent layer is a short causal convolution followed by a gated linear recurrence (the shape of LFM2's and
Mamba's layers, not their math): its state per request is the convolution's last inputs and the recurrence's
hidden vector. `reference_logits` runs the same weights over a whole sequence at once, without any cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.backends import TorchBackend
from tokenmill.model.layer_cache import LayerCache
from tokenmill.model.layers import RMSNorm, SwiGLU
from tokenmill.model.linear import Linear
from tokenmill.model.llama import DecoderLayer, LlamaForCausalLM
from tokenmill.model.registry import register_model
from tokenmill.model_config import ModelConfig

ARCH = "ToyHybridForCausalLM"
WINDOW = 8  # keys a window layer sees
CONV = 3  # the recurrent layer's convolution width: it keeps the last CONV - 1 inputs


def layer_kind(i: int) -> str:
    return ("attention", "window", "state")[i % 3]


class ToyRecurrence(nn.Module):
    """in_proj -> causal depthwise conv over the last CONV inputs -> h = decay * h + conv -> out_proj(h)."""

    def __init__(self, cfg: ModelConfig, backend, dtype, method):
        super().__init__()
        h = cfg.hidden_size
        self.in_proj = Linear(h, h, bias=False, backend=backend, method=method, dtype=dtype)
        self.out_proj = Linear(h, h, bias=False, backend=backend, method=method, dtype=dtype)
        self.conv = nn.Parameter(torch.empty(CONV, h, dtype=dtype))
        self.decay = nn.Parameter(torch.empty(h, dtype=dtype))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        conv_state, hidden_state = state  # [slots, CONV - 1, H], [slots, H]
        u = self.in_proj(x).float()
        out = torch.empty_like(u)
        conv, decay = self.conv.float(), torch.sigmoid(self.decay.float())
        for start, end, slot in meta.state_spans:
            window, h = conv_state[slot].clone(), hidden_state[slot].clone()
            for row in range(start, end):
                window = torch.cat([window, u[row:row + 1]])  # the last CONV inputs, oldest first
                h = decay * h + (window * conv).sum(0)
                out[row] = h
                window = window[1:]
            conv_state[slot], hidden_state[slot] = window, h
        return self.out_proj(out.to(x.dtype))

    def over_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The same over one whole sequence from a zero state (the reference)."""
        u = self.in_proj(x).float()
        window, h = torch.zeros(CONV - 1, u.shape[1]), torch.zeros(u.shape[1])
        out = torch.empty_like(u)
        conv, decay = self.conv.float(), torch.sigmoid(self.decay.float())
        for row in range(u.shape[0]):
            window = torch.cat([window, u[row:row + 1]])
            h = decay * h + (window * conv).sum(0)
            out[row] = h
            window = window[1:]
        return self.out_proj(out.to(x.dtype))


class RecurrentLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, dtype, method):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, dtype)
        self.mixer = ToyRecurrence(cfg, backend, dtype, method)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, backend, dtype, method)

    def forward(self, x, cos, sin, meta, state):
        h = self.post_attention_layernorm.add_forward(self.mixer(self.input_layernorm(x), meta, state), x)
        return x.add_(self.mlp(h))


def make_layer(cfg, backend, dtype=None, method=None, reduce=None, layer_idx=0) -> nn.Module:
    kind = layer_kind(layer_idx)
    if kind == "state":
        return RecurrentLayer(cfg, backend, dtype, method)
    layer = DecoderLayer(cfg, backend, dtype, method, reduce, layer_idx)
    if kind == "window":
        layer.self_attn.window = WINDOW
    return layer


class ToyHybridForCausalLM(LlamaForCausalLM):
    layer_class = staticmethod(make_layer)
    whole_layer_kernels = False

    @classmethod
    def layer_caches(cls, cfg: ModelConfig) -> list[LayerCache]:
        h = cfg.hidden_size
        return [LayerCache.attention() if layer_kind(i) == "attention" else LayerCache.sliding(WINDOW)
                if layer_kind(i) == "window" else LayerCache.state((CONV - 1, h), (h,))
                for i in range(cfg.num_layers)]

    @torch.inference_mode()
    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every position of one sequence, computed at once with plain attention (no cache)."""
        ids = torch.tensor(tokens)
        x = self.embed(ids)
        cos, sin = self.rotary.tables(torch.arange(len(tokens)), x.dtype)
        n = len(tokens)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for i, layer in enumerate(self.layers):
            if layer_kind(i) == "state":
                h = layer.post_attention_layernorm.add_forward(layer.mixer.over_sequence(layer.input_layernorm(x)), x)
                x = x.add_(layer.mlp(h))
                continue
            attn = layer.self_attn
            scratch = torch.zeros(n, 1, attn.num_kv_heads, attn.head_dim)  # a one-token block per position
            q, k, v = TorchBackend().rotary_and_write_kv(attn.project(layer.input_layernorm(x)), attn.num_heads,
                                                         attn.num_kv_heads, cos, sin, scratch, scratch.clone(),
                                                         torch.arange(n))
            mask = causal & ~torch.ones(n, n, dtype=torch.bool).tril(-WINDOW) if layer_kind(i) == "window" else causal
            rep = attn.num_heads // attn.num_kv_heads
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                v.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask)
            h = layer.post_attention_layernorm.add_forward(attn.o_proj(out.transpose(0, 1).reshape(n, -1)), x)
            x = x.add_(layer.mlp(h))
        return self.compute_logits(self.norm(x))


register_model(ARCH, ToyHybridForCausalLM)


def make_toy_hybrid(path: Path, *, num_layers: int = 6, hidden_size: int = 32, vocab_size: int = 64,
                    seed: int = 0) -> Path:
    """A directory with config.json and model.safetensors of a random toy hybrid model (token ids only: no
    tokenizer)."""
    cfg = {"architectures": [ARCH], "model_type": "llama", "vocab_size": vocab_size, "hidden_size": hidden_size,
           "intermediate_size": 2 * hidden_size, "num_hidden_layers": num_layers, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": True}
    model = ToyHybridForCausalLM(ModelConfig.from_hf_dict(cfg), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, (module, param, shard) in model.weight_targets().items():
        shape = param.shape if shard is None else (module.output_sizes[shard], param.shape[1])
        if name.endswith("norm.weight"):
            weights[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:
            weights[name] = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(path / "model.safetensors"))
    return path


def load_reference(path: Path) -> ToyHybridForCausalLM:
    cfg = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    model = ToyHybridForCausalLM(cfg, dtype=torch.float32)
    from safetensors.torch import load_file

    model.load_hf_weights(load_file(str(path / "model.safetensors")))
    model.init_rotary(torch.device("cpu"))
    return model.eval()
