"""Mixtral: the Llama layer with a mixture of experts for its MLP (`block_sparse_moe`: a router and experts named
w1/w3/w2 for gate/up/down), the top weights always renormalised and kept in float32 (as transformers keeps them)."""

from __future__ import annotations

from tokenmill.model.llama import DecoderLayer, LlamaForCausalLM
from tokenmill.model.moe import MoELayerMixin, MoEModelMixin


class MixtralDecoderLayer(MoELayerMixin, DecoderLayer):
    round_router_weights = False


class MixtralForCausalLM(MoEModelMixin, LlamaForCausalLM):
    layer_class = MixtralDecoderLayer
