"""What `--dtype auto` means on a CPU with both packed matmul kernels, decided by measuring them here.

Where our bfloat16 kernel runs (csrc/bf16_linear.cpp: AMX tiles, or AVX512-BF16 dot products) and so does the
float32 panel kernel (csrc/f32_linear.cpp), which is faster depends on the CPU: AMX tiles beat float32 vectors
many times over, while AVX512-BF16 dot products on a Zen4-class core may not beat float32 FMAs by enough to
matter. Rather than guess from the flags, a few decode- and batch-shaped matmuls are timed in both, once per
process (~0.2 s), and the faster dtype wins.

The probe runs on one thread, the two dtypes in turn within each round: what it compares is the arithmetic of a
core, and a busy neighbour (a test run, a build) then slows both alike. On all cores, one descheduled thread
stalls a whole call, and such a stall in one dtype's turn once made auto pick float32 on an AMX machine.
"""

from __future__ import annotations

import time
from functools import cache
from typing import Any

import torch

PROBE_SHAPES = ((1024, 1024), (1024, 4096), (4096, 1024))  # (K, N): attention- and MLP-shaped weights
PROBE_ROWS = (1, 64)  # one decode token, and a batch of them
PROBE_REPEATS = 5


@cache
def probe_matmul_ms(ops: Any) -> dict[str, float]:
    """Milliseconds for the probe matmuls on one thread (best of 3 rounds, summed over shapes and row counts) on
    the packed bfloat16 kernel and on the float32 panels."""
    g = torch.Generator().manual_seed(0)
    kernels = {"bfloat16": (torch.bfloat16, ops.bf16_pack, ops.bf16_linear),
               "float32": (torch.float32, ops.f32_pack, ops.f32_linear)}
    totals = dict.fromkeys(kernels, 0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for k, n in PROBE_SHAPES:
            weight = (torch.randn(n, k, generator=g) * 0.02)
            packed = {name: pack(weight.to(dtype)) for name, (dtype, pack, _) in kernels.items()}
            for m in PROBE_ROWS:
                x = torch.randn(m, k, generator=g)
                best = dict.fromkeys(kernels, float("inf"))
                for _ in range(3):
                    for name, (dtype, _, linear) in kernels.items():
                        xd = x.to(dtype)
                        linear(xd, packed[name], None)  # first touch
                        start = time.perf_counter()
                        for _ in range(PROBE_REPEATS):
                            linear(xd, packed[name], None)
                        best[name] = min(best[name], (time.perf_counter() - start) / PROBE_REPEATS)
                for name in kernels:
                    totals[name] += best[name] * 1e3
    finally:
        torch.set_num_threads(threads)
    return totals
