"""Adapter slots inside the model: each adapted projection holds every slot's low-rank pairs, and a step's
LoRABatch says which runs of its flat token batch go through which slot.

    y = x W^T (the base matmul, once for the whole batch)  +  for each run (rows a..b, slot s), for each part p:
        y[a:b, part p's columns] += (x[a:b] A_sp^T) B_sp        A_sp [r, in], B_sp [r, out_p]

A fused projection (q/k/v, gate/up) keeps one pair per part (each part of an adapter may have its own rank, or be
absent: rank 0, skipped), so nothing is spent on zeros. The backend runs the update (Backend.lora_add: one C++ call
per projection on the CPU). The model knows no request: slots are numbers, filled by the runner
(engine/lora_pool.py), which orders a step's requests by slot so each adapter is one run.
"""

from __future__ import annotations

import torch
from torch import nn

# our projections and the PEFT targets they hold, in output order
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoRABatch:
    """This step's runs (first row, end row, slot) of rows through an adapter, as a list and as the [n, 3] tensor
    the backend reads, and the slots they use; empty: none in the step, and the base's whole-layer fast paths
    stay open."""

    NONE = torch.empty(0, 3, dtype=torch.int64)

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, int]] = []
        self.runs_tensor = self.NONE
        self.slots: set[int] = set()

    def set(self, runs: list[tuple[int, int, int]]) -> None:
        """This step's runs (a step without adapters, every step of a base-only load, builds no tensor)."""
        if not runs and not self.runs:
            return
        self.runs = runs
        self.runs_tensor = torch.tensor(runs, dtype=torch.int64).reshape(-1, 3) if runs else self.NONE
        self.slots = {slot for _, _, slot in runs}


class LoRASlots:
    """One projection's adapter pairs for `num_slots` slots: per part, A [slots, R, in] and B [slots, R, out_p] (a
    slot's adapter of rank r in the first r rows) and each slot's rank (0: its adapter leaves the part alone)."""

    def __init__(self, batch: LoRABatch, parts: tuple[str, ...], in_features: int, output_sizes: list[int],
                 num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.batch, self.parts = batch, parts
        self.col0s = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        self.a = [torch.zeros(num_slots, max_rank, in_features, dtype=dtype, device=device) for _ in parts]
        self.b = [torch.zeros(num_slots, max_rank, n, dtype=dtype, device=device) for n in output_sizes]
        self.ranks = [torch.zeros(num_slots, dtype=torch.int64) for _ in parts]  # read in place by C++
        self.active = [False] * num_slots  # whether the slot's adapter changes this projection at all

    def fill(self, slot: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` <- the adapter's (A [r, in], scaled B^T [r, out]) per target part (parts it lacks get rank
        0)."""
        for p, part in enumerate(self.parts):
            self.a[p][slot].zero_()
            self.b[p][slot].zero_()
            pair = pairs.get(part)
            self.ranks[p][slot] = 0 if pair is None else int(pair[0].shape[0])
            if pair is not None:
                a, b = pair
                self.a[p][slot, :a.shape[0]].copy_(a)
                self.b[p][slot, :b.shape[0]].copy_(b)
        self.active[slot] = any(part in pairs for part in self.parts)

    def clear(self, slot: int) -> None:
        self.fill(slot, {})

    def applies(self) -> bool:
        """Whether any adapter of this step changes this projection."""
        return any(self.active[s] for s in self.batch.slots)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.a, *self.b))


def attach_lora(model: nn.Module, num_slots: int, max_rank: int) -> LoRABatch:
    """Give every decoder layer's projections adapter slots (before the backend packs the weights: a fused gate/up
    then keeps its plain layout, since its adapter changes gate and up before SiLU). Returns the batch the runner
    sets each step; model.lora_batch holds it too."""
    batch = LoRABatch()
    dtype, device = model.norm.weight.dtype, model.norm.weight.device
    for layer in model.layers:
        for module in (layer.self_attn, layer.mlp):
            for name, parts in PARTS.items():
                linear = getattr(module, name, None)
                if linear is None or not hasattr(linear, "output_sizes"):  # a model/linear.py Linear
                    continue
                if len(linear.output_sizes) != len(parts):
                    raise ValueError(f"{name} has {len(linear.output_sizes)} parts, LoRA expects {len(parts)}")
                linear.lora = LoRASlots(batch, parts, linear.in_features, linear.output_sizes, num_slots, max_rank,
                                        dtype, device)
                if name == "gate_up_proj":
                    linear.silu_pairs = False
    model.lora_batch = batch
    return batch


def lora_slots(model: nn.Module) -> list[tuple[int, LoRASlots]]:
    """(layer index, slots) of every adapted projection."""
    out = []
    for i, layer in enumerate(model.layers):
        for module in (layer.self_attn, layer.mlp):
            for name in PARTS:
                slots = getattr(getattr(module, name, None), "lora", None)
                if slots is not None:
                    out.append((i, slots))
    return out
