"""Checkpoint: the one state-dict view every on-disk form of a model is read through (model/loader.py picks the
form), and the parameter names and shapes a config requires, which opening a checkpoint checks."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the model needs, by HF name, with its [out_features, in_features] shape."""
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
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


class Checkpoint(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by HF name, read from disk on each access and never kept.

    Why lazy: the model loads one tensor at a time straight into its parameter (LlamaForCausalLM.load_hf_weights),
    so at no point does a second copy of the whole model exist. Opening checks every name and shape, so a
    checkpoint that does not fit the config fails before any tensor is read."""

    def __init__(self, path: Path, config: ModelConfig, dtype: torch.dtype, shapes: dict[str, tuple[int, ...]]):
        self.path, self.dtype, self._shapes = path, dtype, shapes
        expected = expected_shapes(config)
        missing = sorted(set(expected) - set(shapes))
        if missing:
            raise ModelLoadError(f"{path} lacks {len(missing)} weights the config needs, e.g. {missing[:4]}")
        wrong = [f"{n}: {s} != {expected[n]}" for n, s in shapes.items() if s != expected[n]]
        if wrong:
            raise ModelLoadError(f"{path} has weights whose shape disagrees with its config: {wrong[:4]}")

    @abstractmethod
    def _read(self, name: str) -> torch.Tensor:
        """The tensor `name` (a known one), in self.dtype."""

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        return self._read(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)
