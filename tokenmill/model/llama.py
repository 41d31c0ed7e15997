"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat token batch with a paged KV cache.

The model knows nothing about requests: it sees token ids, positions, attention metadata and the caches. Nor
does it know the device: every op goes through the backend it is built with (model/backends/).
Other families are small variations of these modules, each in its own file (qwen3.py, phi3.py, smollm3.py):
a subclass swaps a module through `attention_class` / `layer_class` and overrides a hook.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.backends import Backend, LinearWeights, TorchBackend
from tokenmill.model.layer_cache import LayerCache
from tokenmill.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, VocabEmbedding
from tokenmill.model.linear import Linear, LinearMethod, TiedLMHead, default_weight_loader
from tokenmill.model.loader import allocate_parameters, one_torch_thread
from tokenmill.model_config import ModelConfig

if TYPE_CHECKING:
    from tokenmill.model.lora import LoRABatch
    from tokenmill.model.splits import StageSplit, TensorSplit

Reduce = Callable[[torch.Tensor], torch.Tensor]  # sums a row-parallel layer's partial products over the ranks

# A fused projection's checkpoint tensors in row order: checkpoint `q_proj` is shard 0 of our `qkv_proj`.
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                "in_proj_ba": ("in_proj_b", "in_proj_a")}
WeightTarget = tuple[nn.Module, nn.Parameter, int | None]  # the parameter's owner, the parameter, its shard


class Attention(nn.Module):
    rope = True  # False: a layer without rotary (smollm3.py's NoPE layers)
    scale: float | None = None  # the scores' scale (None: head_dim ** -0.5; gemma3.py sets its own)
    window: int | None = None  # keys a token sees, itself included (gemma3.py's sliding-window layers); None: all

    def __init__(self, cfg: ModelConfig, backend: Backend, dtype: torch.dtype | None = None,
                 method: LinearMethod | None = None, reduce: Reduce | None = None, layer_idx: int = 0):
        super().__init__()
        self.backend, self.reduce = backend, reduce
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                               bias=cfg.attention_bias, backend=backend, method=method, dtype=dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False, backend=backend, method=method, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.output(self.attend(self.project(x), cos, sin, meta, kv_cache))

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
               kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The heads' outputs [T, H * D] from the projection qkv (rotated, its k and v written to the cache)."""
        k_cache, v_cache = kv_cache
        if not self.rope:
            cos = sin = None
        q, k, v = self.backend.rotary_and_write_kv(qkv, self.num_heads, self.num_kv_heads, cos, sin,
                                                   k_cache, v_cache, meta.slot_mapping)
        if meta.context is None:
            out = self.backend.paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.window)
        elif self.scale is not None or self.window is not None:
            raise NotImplementedError("context parallelism attends with head_dim ** -0.5 over every key: not for "
                                      "a layer with its own scale or a sliding window (Gemma 3)")
        else:  # context parallelism: this rank's share of the step attends with the other ranks (parallel/context.py)
            out = meta.context.attend(q, k, v, k_cache, v_cache, meta.num_paged_tokens)
        return out.reshape(qkv.shape[0], self.q_size)

    def output(self, heads: torch.Tensor) -> torch.Tensor:
        out = self.o_proj(heads)
        return out if self.reduce is None else self.reduce(out)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The fused q/k/v projection [T, (H + 2 KVH) D], before rotary (qwen3.py normalises q and k here)."""
        return self.qkv_proj(x)


class DecoderLayer(nn.Module):
    attention_class: type[Attention] = Attention

    def __init__(self, cfg: ModelConfig, backend: Backend, dtype: torch.dtype | None = None,
                 method: LinearMethod | None = None, reduce: Reduce | None = None, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, dtype)
        self.self_attn = self.attention_class(cfg, backend, dtype, method, reduce, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, dtype)
        self.mlp = self.make_mlp(cfg, backend, dtype, method, reduce, layer_idx)

    def make_mlp(self, cfg: ModelConfig, backend: Backend, dtype: torch.dtype | None, method: LinearMethod | None,
                 reduce: Reduce | None, layer_idx: int) -> nn.Module:
        """The layer's feed-forward block (model/moe.py's layers pick a mixture of experts)."""
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size, backend, dtype, method, reduce)

    def forward(self, x, cos, sin, meta, kv_cache):
        """Updates the residual stream `x` in place and returns it."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        h = self.post_attention_layernorm.add_forward(h, x)  # x += attention output; h = norm(x)
        return x.add_(self.mlp(h))


class LlamaForCausalLM(nn.Module):
    """`dtype` is the parameters' dtype from the start (the runner builds on the meta device, then loads every
    parameter in place), so no copy of the model in another dtype ever exists. `method` is the weight format of
    every matmul, the LM head included (default dense; tokenmill/quant/methods.py names the others).
    With `tp` (tensor parallelism) `cfg` is this rank's shard of the model (parallel/layout.py): the attention
    output and MLP down projections are row-parallel (their partial sums all-reduced), the vocabulary is split by
    rows (embedding lookups all-reduced, the LM head's logits gathered on rank 0).
    With `stage` (pipeline parallelism) `cfg` has the stage's layers; only the first stage embeds and holds the LM
    head, only the last applies the final norm, and a later stage's forward starts from the hidden state it is given
    (parallel/layout.py PPStage)."""

    layer_class: type[DecoderLayer] = DecoderLayer
    # whether a backend may run the layers as its own whole-layer Llama kernel (Backend.decode_layers and the
    # whole-step paths): False where a layer computes something else (a family's variation, partial rotary)
    whole_layer_kernels = True

    def __init__(self, cfg: ModelConfig, backend: Backend | None = None, dtype: torch.dtype | None = None,
                 method: LinearMethod | None = None, tp: TensorSplit | None = None, stage: StageSplit | None = None):
        super().__init__()
        self.config, self.tp = cfg, tp
        self.first, self.last = stage is None or stage.first, stage is None or stage.last
        self.backend = backend = backend if backend is not None else TorchBackend()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype) if self.first else None
        reduce = tp.group.all_reduce if tp is not None else None
        self.layers = nn.ModuleList(self.layer_class(cfg, backend, dtype, method, reduce, i)
                                    for i in range(cfg.num_layers))
        if cfg.rotary_dim != cfg.head_dim:
            self.whole_layer_kernels = False
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend, dtype)
        self.rotary: RotaryEmbedding | None = None  # built by init_rotary once the model is on its device
        untied, tied = self.first and not cfg.tie_word_embeddings, self.first and cfg.tie_word_embeddings
        head_method = method if method is None or method.quantizes_lm_head else None
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, backend=backend, method=head_method,
                              dtype=dtype) if untied else None
        self.tied_head = TiedLMHead(self.embed_tokens, backend, head_method) if tied else None
        self.backend_cache: dict[str, object] = {}  # the backend's per-model state; emptied when weights change
        self.lora_batch: LoRABatch | None = None  # adapter slots' runs this step (model/lora.py attach_lora)

    @classmethod
    def layer_caches(cls, cfg: ModelConfig) -> list[LayerCache]:
        """What each layer keeps between steps (model/layer_cache.py): every key, or its last window's (a family's
        sliding-window layers). A hybrid family's recurrent layers say "state" here."""
        window = set(cfg.sliding_layers) if cfg.sliding_window else set()
        return [LayerCache.sliding(cfg.sliding_window) if i in window else LayerCache.attention()
                for i in range(cfg.num_layers)]

    def init_rotary(self, device: torch.device) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      cfg.rotary_dim)
        self.rotary.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], hidden_in: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for every token of the flat batch (a pipeline stage
        before the last: after its layers, from `hidden_in` unless it is the first)."""
        x = self.embed(input_ids) if hidden_in is None else hidden_in
        cos, sin = self.rotary.tables(positions, x.dtype)
        # the backend's whole-layer kernel has no place for the all-reduces or the context-parallel collectives:
        # such layers run op by op
        # (nor for layers reading through tables of their own: a hybrid KV layout)
        # (a step's LoRA adapter runs go with it: model/lora.py; a backend whose kernel cannot add them says None)
        split = self.tp is not None or meta.context is not None or meta.layer_meta is not None
        fast = None if split else self.backend.decode_layers(self, x, cos, sin, meta, kv_caches)
        if fast is None:
            for layer, kv, layer_meta in zip(self.layers, kv_caches, meta.per_layer(len(self.layers))):
                x = layer(x, cos, sin, layer_meta, kv)
        else:
            x = fast
        return self.norm(x) if self.last else x

    def decode_greedy(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]], steps: int, stop_ids: torch.Tensor
                      ) -> torch.Tensor | None:
        """Up to `steps` greedy decode steps of one token per row in one backend call (Backend.decode_greedy: the
        tokens [steps run, B]), or None where the backend has no such path or the model is split over ranks."""
        if self.tp is not None or not (self.first and self.last):
            return None
        return self.backend.decode_greedy(self, input_ids, positions, block_tables, kv_caches, steps, stop_ids)

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """One decode step of one token per row in one backend call: forward then compute_logits, or None where the
        backend has no such path or the model is split over ranks."""
        if self.tp is not None or not (self.first and self.last):
            return None
        return self.backend.decode_logits(self, input_ids, positions, block_tables, kv_caches)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.tp.layout.vocab_start  # this rank's rows; the others' ids look up zeros
        inside = (local >= 0) & (local < self.config.vocab_size)
        x = self.embed_tokens(torch.where(inside, local, 0))
        return self.tp.group.all_reduce(x.masked_fill_(~inside.unsqueeze(1), 0))

    def linear_layers(self) -> list[LinearWeights]:
        """Every matmul weight of the model (the tied LM head included): what a backend may repack."""
        layers: list[LinearWeights] = [m for m in self.modules() if isinstance(m, Linear)]
        return layers + ([self.tied_head] if self.tied_head is not None else [])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if self.lm_head is not None else self.tied_head
        logits = head(hidden).float()
        if self.tp is None:
            return logits
        full = self.tp.group.gather_last_dim(logits)  # rank 0: every rank's vocabulary rows; the others: None
        return full[:, :self.tp.layout.cfg.vocab_size] if full is not None else logits

    def weight_targets(self) -> dict[str, WeightTarget]:
        """Where each checkpoint tensor goes, by Hugging Face name. HF names are ours with `model.` in front (the
        LM head aside), and each fused projection is split into the shards FUSED_SHARDS lists."""
        targets: dict[str, WeightTarget] = {}
        for name, param in self.named_parameters():
            module_name, _, leaf = name.rpartition(".")
            module = self.get_submodule(module_name)
            hf_module = module_name if module_name == "lm_head" else f"model.{module_name}"
            parent, _, proj = hf_module.rpartition(".")
            shards = FUSED_SHARDS.get(proj)
            if shards is None:
                targets[f"{hf_module}.{leaf}"] = (module, param, None)
            else:
                targets.update({f"{parent}.{shard}.{leaf}": (module, param, i) for i, shard in enumerate(shards)})
        return targets

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Write Hugging Face-named tensors into the parameters one at a time, each through its owner's
        `weight_loader` (Linear: its LinearMethod's, so q/k/v and gate/up land in their rows of the fused weight;
        others: a checked copy), cast to the parameter's dtype in place. A lazy checkpoint.Checkpoint is read as this
        goes, so the model is never held twice. Every parameter must be covered and every tensor used; packed
        copies of the old weights and the backend's cache are dropped (call backend.prepack again)."""
        if any(p.is_meta for p in self.parameters()):  # plain weights a backend released after packing
            allocate_parameters(self, self.norm.weight.device)  # the norms stay dense; a table may be released
        targets = self.weight_targets()
        missing = sorted(set(targets) - set(weights))
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
        unused = sorted(n for n in weights if n not in targets and not _recomputed(n))
        if unused:
            raise ModelLoadError(f"checkpoint has tensors this model does not use: {unused[:5]}")
        for m in self.linear_layers():
            m.packed_weight = None
        self.backend_cache.clear()
        with one_torch_thread():
            for name, (module, param, shard) in targets.items():
                loader = getattr(module, "weight_loader", default_weight_loader)
                # a method that keeps a GGUF file's blocks gets them as they are (quant/gguf_linear.py)
                blocks = getattr(getattr(module, "method", None), "takes_blocks", False) and hasattr(weights, "blocks")
                try:
                    loader(param, weights.blocks(name) if blocks else weights[name], shard)
                except ModelLoadError as e:
                    raise ModelLoadError(f"checkpoint tensor {name!r}: {e}") from None
            for m in self.linear_layers():
                m.method.process_weights_after_loading(m, weights)  # on-the-fly formats quantize here
            keep = getattr(getattr(self.lm_head, "method", None), "keep_embedding", None)  # an untied table's blocks
            if keep is not None and self.embed_tokens is not None and hasattr(weights, "blocks"):
                keep(self.embed_tokens, weights.blocks("model.embed_tokens.weight"), self.backend)


def _recomputed(name: str) -> bool:
    """Tensors some checkpoints carry that the model recomputes (rotary tables) or shares (a tied LM head)."""
    return name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight"
