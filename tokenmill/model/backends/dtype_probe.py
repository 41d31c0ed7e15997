"""What `--dtype auto` means on a CPU with both packed matmul kernels, decided by measuring them here.

Where our bfloat16 kernel runs (csrc/bf16_linear.cpp: AMX tiles, or AVX512-BF16 dot products) and so does the
float32 panel kernel (csrc/f32_linear.cpp), which is faster depends on the CPU: AMX tiles beat float32 vectors
many times over, while AVX512-BF16 dot products on a Zen4-class core may not beat float32 FMAs by enough to
matter. Rather than guess from the flags, a few decode- and batch-shaped matmuls are timed in both (~0.5 s), and
the faster dtype wins. The times are kept beside the kernels' build (one per CPU and source version): later starts
read them rather than spend the half second again, and choose the same dtype.

The probe runs on one thread, the two dtypes in turn within each round: what it compares is the arithmetic of a
core, and a busy neighbour (a test run, a build) then slows both alike. On all cores, one descheduled thread
stalls a whole call, and such a stall in one dtype's turn once made auto pick float32 on an AMX machine.
"""

from __future__ import annotations

import json
import os
import time
from functools import cache
from pathlib import Path
from typing import Any

import torch

PROBE_SHAPES = ((1024, 1024), (1024, 4096), (4096, 1024))  # (K, N): attention- and MLP-shaped weights
PROBE_ROWS = (1, 64)  # one decode token, and a batch of them
PROBE_REPEATS = 5


KERNELS = ("bfloat16", "float32")
CACHE_NAME = "dtype_probe.json"


def measured_ms(ops: Any, directory: Path | None) -> dict[str, float]:
    """probe_matmul_ms's times, read from `directory` (the kernels' build) when an earlier start measured them
    there, else measured now and written there for the next start (None: not kept)."""
    path = directory / CACHE_NAME if directory is not None else None
    if path is not None:
        try:
            kept = json.loads(path.read_text())
            if set(kept) == set(KERNELS) and all(isinstance(v, float) and v > 0 for v in kept.values()):
                return kept
        except (OSError, ValueError):
            pass  # none yet, or unreadable: measure
    ms = probe_matmul_ms(ops)
    if path is not None:
        try:
            scratch = path.with_name(f".{CACHE_NAME}.{os.getpid()}")
            scratch.write_text(json.dumps(ms))
            scratch.replace(path)  # whole or not at all, whoever else starts at the same time
        except OSError:
            pass
    return ms


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
