"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen3-MoE, OLMoE): a router picks each token's top-k experts,
each a SwiGLU MLP, and the token's output is their weighted sum.

The experts are ordinary `SwiGLU` modules, so every weight format (dense, int8, FP8, GGUF blocks) and every
backend kernel serves them unchanged; how a step's tokens meet their experts is the backend's `moe_experts`
(grouped by expert: each expert's weights read once per step, for all of its tokens)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.model.checkpoint import expert_tensor_name, router_tensor_name
from tokenmill.model.layers import SwiGLU
from tokenmill.model.linear import Linear

if TYPE_CHECKING:
    from tokenmill.model.backends import Backend
    from tokenmill.model.linear import LinearMethod
    from tokenmill.model.llama import Reduce
    from tokenmill.model_config import ModelConfig

ROUTER_ROWS = 16  # a router's rows are padded to a multiple of this (Router)
# our HF-style names of an MoE block's tensors (model/llama.py FUSED_SHARDS splits gate_up into gate and up)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")


class Router(Linear):
    """The router's [E, hidden] weight, its rows padded with zeros to a multiple of 16 and their logits dropped: a
    backend then packs it in the tiles its batch-invariant kernels read whatever E is (Mixtral's 8 experts), so a
    token's routing, like the rest of its step, does not depend on the other tokens."""

    def __init__(self, hidden: int, experts: int, backend: Backend, dtype: torch.dtype | None):
        super().__init__(hidden, -(-experts // ROUTER_ROWS) * ROUTER_ROWS, bias=False, backend=backend, dtype=dtype)
        self.num_experts = experts

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is not None or tuple(loaded.shape) != (self.num_experts, self.in_features):
            raise ModelLoadError(f"a router of {self.num_experts} experts x {self.in_features} takes "
                                 f"{[self.num_experts, self.in_features]}, not {list(loaded.shape)}")
        with torch.no_grad():
            param.zero_()
            param[:self.num_experts].copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[:, :self.num_experts]


class SparseMoE(nn.Module):
    """Router + experts. `cfg.local_experts` are the experts this model holds (all of them, or this rank's range
    under expert parallelism, where tokens routed elsewhere add nothing here and `reduce` sums the ranks' parts).
    Under tensor parallelism without it, each expert's columns are split like a dense MLP's, and `reduce` sums the
    partial products likewise."""

    def __init__(self, cfg: ModelConfig, backend: Backend, dtype: torch.dtype | None = None,
                 method: LinearMethod | None = None, reduce: Reduce | None = None,
                 round_weights: bool = True):
        super().__init__()
        self.backend, self.reduce = backend, reduce
        self.top_k, self.norm_topk_prob, self.round_weights = cfg.num_experts_per_tok, cfg.norm_topk_prob, round_weights
        # the router stays dense in the model's dtype (llama.cpp keeps it unquantized too): it is E x hidden
        self.gate = Router(cfg.hidden_size, cfg.num_experts, backend, dtype)
        self.first_expert = cfg.local_experts.start
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size, backend, dtype, method)
                                     for _ in cfg.local_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts [T, k] (int64) and their float32 weights [T, k]: the softmax over every
        expert, its top k, renormalised to sum to 1 where the family does (Mixtral always, Qwen3-MoE and OLMoE by
        `norm_topk_prob`), rounded to the model's dtype where transformers rounds them (all but Mixtral)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(x.dtype).float()
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self.backend.moe_experts(x, ids, weights, self.experts, self.first_expert)
        return out if self.reduce is None else self.reduce(out)


class SharedExpertMoE(SparseMoE):
    """Qwen3.5-MoE's block: the routed experts plus one shared expert every token takes, its output scaled by
    sigmoid(shared_expert_gate(x)), a [1, hidden] projection kept dense."""

    def __init__(self, cfg: ModelConfig, backend: Backend, dtype: torch.dtype | None = None,
                 method: LinearMethod | None = None, reduce: Reduce | None = None, round_weights: bool = True):
        super().__init__(cfg, backend, dtype, method, reduce, round_weights)
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_size, backend, dtype, method, reduce)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False, backend=backend, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class MoELayerMixin:
    """A decoder layer whose MLP is a SparseMoE, but in the config's dense layers (Qwen3-MoE's mlp_only_layers)."""

    round_router_weights = True

    def make_mlp(self, cfg, backend, dtype, method, reduce, layer_idx):
        if not cfg.is_moe_layer(layer_idx):
            return super().make_mlp(cfg, backend, dtype, method, reduce, layer_idx)
        return SparseMoE(cfg, backend, dtype, method, reduce, self.round_router_weights)


class MoEModelMixin:
    """A model with SparseMoE layers: no backend's whole-layer Llama kernel computes them, so they run op by op;
    their tensors take the checkpoint's names (model/checkpoint.py: Mixtral's `block_sparse_moe.experts.N.w1`),
    experts numbered globally (a rank's first is `first_expert`)."""

    whole_layer_kernels = False

    def weight_targets(self):
        first = self.config.local_experts.start
        return {self.checkpoint_name(name, first): target for name, target in super().weight_targets().items()}

    def checkpoint_name(self, name: str, first: int) -> str:
        """Our HF-style name of a tensor -> the checkpoint's (only an MoE block's differ)."""
        expert = _EXPERT.fullmatch(name)
        if expert is not None:
            layer, e, proj = expert.groups()
            return expert_tensor_name(self.config, int(layer), int(e) + first, proj)
        router = _ROUTER.fullmatch(name)
        if router is not None and self.config.is_moe_layer(int(router.group(1))):
            return router_tensor_name(self.config, int(router.group(1)))
        return name
