"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a mixture of experts in every layer but the dense ones
the config lists (mlp_only_layers, decoder_sparse_step)."""

from __future__ import annotations

from tokenmill.model.moe import MoELayerMixin, MoEModelMixin
from tokenmill.model.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM


class Qwen3MoeDecoderLayer(MoELayerMixin, Qwen3DecoderLayer):
    pass


class Qwen3MoeForCausalLM(MoEModelMixin, Qwen3ForCausalLM):
    layer_class = Qwen3MoeDecoderLayer
