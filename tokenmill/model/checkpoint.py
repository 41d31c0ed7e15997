"""Checkpoint: the one state-dict view every on-disk form of a model is read through (model/loader.py picks the
form), and the parameter names and shapes a config requires, which opening a checkpoint checks."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.family_config import GRANITE_HYBRID, LFM2, QWEN3_5, QWEN3_5_MOE, lfm2_name
from tokenmill.model_config import REGISTERED_ARCHITECTURES, ModelConfig


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the model needs, by HF name, with its [out_features, in_features] shape."""
    registered = REGISTERED_ARCHITECTURES.get(config.architecture)
    if registered is not None:  # a family registered from outside the package knows its own
        return registered(config)
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
        })
        shapes.update(_mlp_shapes(config, i))
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.architecture == "Gemma3ForCausalLM":  # sandwich norms: after attention, around the MLP
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)})
        if config.qk_norm:  # per head, or (OLMoE) over the whole projection
            whole = config.architecture == "OlmoeForCausalLM"
            shapes.update({p + "self_attn.q_norm.weight": (q if whole else config.head_dim,),
                           p + "self_attn.k_norm.weight": (kv if whole else config.head_dim,)})
    if config.architecture in (QWEN3_5, QWEN3_5_MOE):
        return _qwen3_5_shapes(config, shapes)
    if config.architecture == GRANITE_HYBRID:
        return _granite_hybrid_shapes(config, shapes)
    return _lfm2_shapes(config, shapes) if config.architecture == LFM2 else shapes


def _lfm2_shapes(config: ModelConfig, llama: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """LFM2's tensors: the Llama family's under LFM2's names, its convolution layers' in place of attention."""
    conv = {f"model.layers.{i}." for i in config.conv_layers}
    shapes = {lfm2_name(name): shape for name, shape in llama.items()
              if ".self_attn." not in name or name[:name.index("self_attn")] not in conv}
    h, bias = config.hidden_size, config.conv_bias
    for p in conv:
        shapes.update({p + "conv.in_proj.weight": (3 * h, h), p + "conv.conv.weight": (h, 1, config.conv_kernel),
                       p + "conv.out_proj.weight": (h, h)})
        if bias:
            shapes.update({p + "conv.in_proj.bias": (3 * h,), p + "conv.conv.bias": (h,),
                           p + "conv.out_proj.bias": (h,)})
    return shapes


def _qwen3_5_shapes(config: ModelConfig, llama: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Qwen3.5's tensors: the attention layers' query projection twice as wide (each head's query, then its output
    gate), Gated DeltaNet's in place of attention in its linear layers."""
    delta = {f"model.layers.{i}." for i in config.delta_layers}
    shapes = {name: shape for name, shape in llama.items()
              if ".self_attn." not in name or name[:name.index("self_attn")] not in delta}
    h, q = config.hidden_size, config.num_heads * config.head_dim
    for i in range(config.num_layers):
        if f"model.layers.{i}." not in delta:
            shapes[f"model.layers.{i}.self_attn.q_proj.weight"] = (2 * q, h)
    heads, kd, vd = config.delta_value_heads, config.delta_key_heads * config.delta_key_dim, \
        config.delta_value_heads * config.delta_value_dim
    for p in delta:
        p += "linear_attn."
        shapes.update({p + "in_proj_qkv.weight": (2 * kd + vd, h), p + "in_proj_z.weight": (vd, h),
                       p + "in_proj_b.weight": (heads, h), p + "in_proj_a.weight": (heads, h),
                       p + "conv1d.weight": (2 * kd + vd, 1, config.conv_kernel), p + "dt_bias": (heads,),
                       p + "A_log": (heads,), p + "norm.weight": (config.delta_value_dim,),
                       p + "out_proj.weight": (h, vd)})
    return shapes


def _granite_hybrid_shapes(config: ModelConfig, llama: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Granite-4.0-H's tensors: the MLP as its shared_mlp (gate and up rows in one input_linear tensor, which
    FUSED_TENSORS splits into the parts listed here), Mamba2's in place of attention in its Mamba layers."""
    mamba = {f"model.layers.{i}." for i in config.mamba_layers}
    shapes = {name.replace(".mlp.down_proj.", ".shared_mlp.output_linear.").replace(".mlp.", ".shared_mlp."): shape
              for name, shape in llama.items()
              if ".self_attn." not in name or name[:name.index("self_attn")] not in mamba}
    h, heads = config.hidden_size, config.mamba_heads
    inner = heads * config.mamba_head_dim
    conv = inner + 2 * config.mamba_groups * config.mamba_state
    for p in mamba:
        p += "mamba."
        shapes.update({p + "in_proj.weight": (inner + conv + heads, h),
                       p + "conv1d.weight": (conv, 1, config.conv_kernel),
                       p + "dt_bias": (heads,), p + "A_log": (heads,), p + "D": (heads,), p + "norm.weight": (inner,),
                       p + "out_proj.weight": (h, inner)})
        if config.conv_bias:
            shapes[p + "conv1d.bias"] = (conv,)
        if config.mamba_proj_bias:
            shapes.update({p + "in_proj.bias": (inner + conv + heads,), p + "out_proj.bias": (h,)})
    return shapes


def _mlp_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s feed-forward tensors: a SwiGLU MLP's, or a mixture of experts' router and experts, named as
    the family's checkpoints name them (Mixtral: `block_sparse_moe`, experts' w1/w3/w2 for gate/up/down)."""
    h, p = config.hidden_size, f"model.layers.{layer}."
    if not config.is_moe_layer(layer):
        i = config.intermediate_size
        return {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i)}
    m, s = config.moe_intermediate_size, config.shared_expert_size
    shapes = {router_tensor_name(config, layer): (config.num_experts, h)}
    if s:  # Qwen3.5-MoE's shared expert and its gate
        shapes.update({p + "mlp.shared_expert.gate_proj.weight": (s, h), p + "mlp.shared_expert.up_proj.weight": (s, h),
                       p + "mlp.shared_expert.down_proj.weight": (h, s), p + "mlp.shared_expert_gate.weight": (1, h)})
    for e in config.local_experts:
        shapes.update({expert_tensor_name(config, layer, e, "gate"): (m, h),
                       expert_tensor_name(config, layer, e, "up"): (m, h),
                       expert_tensor_name(config, layer, e, "down"): (h, m)})
    return shapes


def router_tensor_name(config: ModelConfig, layer: int) -> str:
    """The HF name of a mixture of experts' router weight (Mixtral's `block_sparse_moe.gate`, the others'
    `mlp.gate`)."""
    block = "block_sparse_moe" if config.architecture == "MixtralForCausalLM" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


def expert_tensor_name(config: ModelConfig, layer: int, expert: int, proj: str) -> str:
    """The HF name of an expert's `proj` (gate, up or down): Mixtral's `block_sparse_moe.experts.E.w1` (w3, w2),
    the others' `mlp.experts.E.gate_proj` (up_proj, down_proj)."""
    if config.architecture == "MixtralForCausalLM":
        leaf = {"gate": "w1", "up": "w3", "down": "w2"}[proj]
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{leaf}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"


# a fused checkpoint tensor (Phi-3's) -> the tensors it stacks, in row order
FUSED_TENSORS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                 "shared_mlp.input_linear": ("shared_mlp.gate_proj", "shared_mlp.up_proj")}
Part = tuple[str, int, int]  # (fused tensor's name, first row, rows)


def fused_parts(name: str, expected: dict[str, tuple[int, ...]]) -> dict[str, Part] | None:
    """For a fused tensor (`...self_attn.qkv_proj.weight`), each part the model expects (`...q_proj.weight`) as
    a block of its rows; None for any other name. Why: every form of a checkpoint reads as the one layout the model
    loads (q/k/v and gate/up shards), so fused checkpoints need nothing from the model, tensor parallelism or the
    weight formats."""
    for fused, parts in FUSED_TENSORS.items():
        if f".{fused}." in name:
            names = [name.replace(f".{fused}.", f".{part}.") for part in parts]
            if not all(n in expected for n in names):
                return None
            out, row = {}, 0
            for n in names:
                out[n] = (name, row, expected[n][0])
                row += expected[n][0]
            return out
    return None


class Checkpoint(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by HF name, read from disk on each access and never kept.

    Why lazy: the model loads one tensor at a time straight into its parameter (LlamaForCausalLM.load_hf_weights),
    so at no point does a second copy of the whole model exist. Opening checks every name and shape, so a
    checkpoint that does not fit the config fails before any tensor is read."""

    def __init__(self, path: Path, config: ModelConfig, dtype: torch.dtype, shapes: dict[str, tuple[int, ...]]):
        expected = expected_shapes(config)
        self._parts: dict[str, Part] = {}  # a part of a fused tensor -> where its rows are
        self._fused: tuple[str, torch.Tensor] | None = None  # the fused tensor read last: its parts come in a row
        for name in [n for n in shapes if n not in expected]:
            parts = fused_parts(name, expected)
            if parts is None:
                continue
            first = next(iter(parts))
            need = (sum(rows for _, _, rows in parts.values()), *expected[first][1:])
            if tuple(shapes[name]) != need:
                raise ModelLoadError(f"{path}: fused tensor {name} has shape {shapes[name]}, but its parts "
                                     f"({', '.join(n.rpartition('.')[0].rpartition('.')[2] for n in parts)}) "
                                     f"need {need}")
            shapes = {k: v for k, v in shapes.items() if k != name}
            shapes.update({n: expected[n] for n in parts})
            self._parts.update(parts)
        self.path, self.dtype, self._shapes = path, dtype, shapes
        missing = sorted(set(expected) - set(shapes))
        if missing:
            raise ModelLoadError(f"{path} lacks {len(missing)} weights the config needs, e.g. {missing[:4]}")
        unknown = sorted(set(shapes) - set(expected))
        if unknown:
            raise ModelLoadError(f"{path} has weights a {config.architecture} model does not have: {unknown[:4]}")
        wrong = [f"{n}: {s} != {expected[n]}" for n, s in shapes.items() if s != expected[n]]
        if wrong:
            raise ModelLoadError(f"{path} has weights whose shape disagrees with its config: {wrong[:4]}")

    @abstractmethod
    def _read(self, name: str) -> torch.Tensor:
        """The tensor `name` (a known one), in self.dtype."""

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        part = self._parts.get(name)
        if part is None:
            return self._read(name)
        fused, row, rows = part
        if self._fused is None or self._fused[0] != fused:
            self._fused = (fused, self._read(fused))
        whole = self._fused[1]
        if row + rows == whole.shape[0]:  # its last part: not kept past it
            self._fused = None
        return whole.narrow(0, row, rows)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)
