"""The tensors csrc/moe.cpp's grouped-experts call takes from a mixture-of-experts layer's expert modules, gathered
once per packing (CpuBackend.moe_experts)."""

from __future__ import annotations

import torch
from torch import nn


def expert_tensors(experts: nn.ModuleList) -> tuple[list[torch.Tensor], ...] | None:
    """Per expert, what csrc/moe.cpp's moe_experts takes: the gate/up weight, its packed copy and scales, then the
    down projection's (empty tensors where a layer has none), as the whole-layer stack's _layer_weights gathers
    them; None where a quantized weight has no packed copy (the C++ linear reads those only packed). Kept on the
    module list until its experts' packed weights are replaced (a reload packs them anew)."""
    first = experts[0].gate_up_proj
    cached = getattr(experts, "_kernel_tensors", None)
    if cached is not None and cached[0] is first.packed_weight and cached[1] is first.weight:
        return cached[2]
    layers = [m for e in experts for m in (e.gate_up_proj, e.down_proj)]
    if any((getattr(m, "qweight", None) is not None or getattr(m, "gguf_type", None) is not None)
           and m.packed_weight is None for m in layers):
        experts._kernel_tensors = (first.packed_weight, first.weight, None)
        return None
    empty = torch.empty(0, dtype=experts[0].gate_up_proj.weight.dtype)

    def packed(m: nn.Module) -> torch.Tensor:
        return empty if m.packed_weight is None else m.packed_weight

    def scale(m: nn.Module) -> torch.Tensor:
        s = getattr(m, "weight_scale", None)
        return s if s is not None and m.packed_weight is not None else empty

    gate_up, down = [e.gate_up_proj for e in experts], [e.down_proj for e in experts]
    tensors = ([m.weight for m in gate_up], [packed(m) for m in gate_up], [scale(m) for m in gate_up],
               [m.weight for m in down], [packed(m) for m in down], [scale(m) for m in down])
    experts._kernel_tensors = (first.packed_weight, first.weight, tensors)
    return tensors
