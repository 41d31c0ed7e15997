"""Adapter slots in the model (model/lora.py) and the grouped low-rank update behind the backend seam: the C++ kernel
(csrc/lora.cpp) computes what the reference's per-run matmuls compute, skips parts an adapter leaves alone, and
gives a row the same bits whatever else the step holds (its row loop); the matmul path for long runs agrees too."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tokenmill.model.backends import CpuBackend, TorchBackend
from tokenmill.model.cpu_kernels import _extension
from tokenmill.model.lora import LoRABatch, LoRASlots

ops = _extension()
# as tests/model/test_kernels.py: only a machine without a compiler may skip
pytestmark = pytest.mark.skipif(ops is None and shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="no C++ compiler: the torch reference is what runs")
IN, OUTS, SLOTS, RANK = 96, [64, 32, 32], 3, 8


def make_slots(dtype: torch.dtype, runs: list[tuple[int, int, int]]) -> LoRASlots:
    gen = torch.Generator().manual_seed(0)
    batch = LoRABatch()
    batch.set(runs)
    slots = LoRASlots(batch, ("q_proj", "k_proj", "v_proj"), IN, OUTS, SLOTS, RANK, dtype, torch.device("cpu"))
    adapters = [{"q_proj": 8, "v_proj": 4}, {"k_proj": 2}, {"q_proj": 3, "k_proj": 8, "v_proj": 5}]
    for s, ranks in enumerate(adapters):
        slots.fill(s, {part: (torch.randn(r, IN, generator=gen), torch.randn(r, OUTS[("q_proj", "k_proj",
                       "v_proj").index(part)], generator=gen)) for part, r in ranks.items()})
    return slots


def update(backend, slots: LoRASlots, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    y = y.clone()
    backend.lora_add(y, x, slots)
    return y


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("matmul_rows", [0, 4])
def test_kernel_matches_the_reference(dtype, tol, matmul_rows):
    runs = [(0, 2, 2), (2, 3, 0), (5, 14, 1), (14, 30, 2)]  # rows 3-4 are the base's
    slots = make_slots(dtype, runs)
    x = torch.randn(30, IN).to(dtype)
    y = torch.randn(30, sum(OUTS)).to(dtype)
    cpu = CpuBackend(ops, batch_invariant=matmul_rows == 0)
    cpu.lora_matmul_rows = matmul_rows
    ref = make_slots(dtype, runs)  # the same values, the reference in float32
    ref.a, ref.b = [t.float() for t in ref.a], [t.float() for t in ref.b]
    got, want = update(cpu, slots, x, y), update(TorchBackend(), ref, x.float(), y.float())
    torch.testing.assert_close(got.float(), want, atol=tol * 10, rtol=tol)
    assert torch.equal(got[3:5], y[3:5])  # base rows untouched
    assert torch.equal(got[5:14, 64:], y[5:14, 64:]) is False  # slot 1 changes k ...
    assert torch.equal(got[5:14, :64], y[5:14, :64]) and torch.equal(got[5:14, 96:], y[5:14, 96:])  # ... only k


def test_a_row_gets_the_same_bits_whatever_the_step_holds():
    x = torch.randn(12, IN).to(torch.bfloat16)
    y = torch.randn(12, sum(OUTS)).to(torch.bfloat16)
    cpu = CpuBackend(ops, batch_invariant=True)
    crowd = update(cpu, make_slots(torch.bfloat16, [(0, 5, 2), (5, 9, 0), (9, 12, 2)]), x, y)
    alone = update(cpu, make_slots(torch.bfloat16, [(0, 1, 0)]), x[6:7], y[6:7])
    assert torch.equal(crowd[6:7], alone)
