"""Backends: how the model's ops run on this machine (base.py says why there is one seam).

    select_backend(device)      # once, at start-up: CpuBackend on a CPU with the kernels built, else TorchBackend
    auto_dtype(device)          # what `--dtype auto` means on this device
"""

from __future__ import annotations

import logging
from functools import cache

import torch

from tokenmill.model import cpu_kernels
from tokenmill.model.backends import dtype_probe
from tokenmill.model.backends.base import Backend, LinearWeights
from tokenmill.model.backends.cpu import CpuBackend
from tokenmill.model.backends.reference import TorchBackend

__all__ = ["Backend", "CpuBackend", "LinearWeights", "TorchBackend", "auto_dtype", "select_backend"]

log = logging.getLogger("tokenmill")


def select_backend(device: str | torch.device, use_kernels: bool = True, batch_invariant: bool = False) -> Backend:
    """The backend for `device`: the C++ CPU kernels where they are built (and wanted), otherwise the torch
    reference. `use_kernels=False` always gives the reference, which then runs no C++ op at all.
    `batch_invariant`: float32 matmuls on the panel kernel (one kernel for every row count) rather than the
    skinny GEMV + oneDNN pair (faster for large batches, but a row's result depends on its batch's size)."""
    device = torch.device(device)
    backend: Backend = TorchBackend()
    if use_kernels and device.type == "cpu":
        ops = cpu_kernels._extension()
        if ops is not None:
            backend = CpuBackend(ops, ops.bf16_kernel(), f32_panels=batch_invariant and ops.f32_panels_available(),
                                 gguf_kernel=ops.gguf_kernel(), batch_invariant=batch_invariant)
    _log_once(f"backend: {backend.describe()} on {device}")
    return backend


def auto_dtype(device: str | torch.device, quantization: str | None = None, gguf: bool = False) -> str:
    """bfloat16 on GPUs. On a CPU, float32 unless our bfloat16 matmul kernel runs (AMX or AVX512-BF16, kernels
    built): elsewhere bfloat16 would be emulated (about 2x slower, BENCHMARKS.md "dtype"), or run on oneDNN,
    whose result for a row changes with the batch size (csrc/bf16_linear.cpp says why). Where it runs, both dtypes
    keep a request's greedy output bit-for-bit the same whatever else is batched, and the faster one on this CPU,
    measured once per kernel build (model/backends/dtype_probe.py), wins. Quantized weights (`quantization`)
    compute in bfloat16 wherever their kernels (AMX tiles or AVX512-BF16) run: they are the only fast paths for
    them here. A GGUF file (`gguf`) whose blocks the VNNI kernel keeps computes in float32: in bfloat16 its kept
    blocks flipped the default model's answer to the quickstart's first question, in float32 they track the
    exact weights (docs/performance/quantization.md, quality per CPU kind); AMX's tiles are the bfloat16 weights
    themselves, and answer it."""
    if torch.device(device).type != "cpu":
        return "bfloat16"
    ops = cpu_kernels._extension()
    if ops is None or not ops.bf16_kernel():
        return "float32"
    if gguf and quantization in (None, "gguf") and ops.gguf_kernel() == "vnni":
        _log_once("--dtype auto: float32 (a GGUF file's blocks kept on VNNI: float32 tracks the exact weights)")
        return "float32"
    if quantization not in (None, "none"):
        return "bfloat16"
    if not ops.f32_panels_available():
        return "bfloat16"
    ms = dtype_probe.measured_ms(ops, cpu_kernels.build_directory())
    choice = "bfloat16" if ms["bfloat16"] <= ms["float32"] else "float32"
    _log_once(f"--dtype auto: {choice} (probe matmuls here: bfloat16 {ms['bfloat16']:.2f} ms, "
              f"float32 {ms['float32']:.2f} ms)")
    return choice


@cache
def _log_once(message: str) -> None:
    """Engines built again in one process (tests, benchmarks) choose the same backend: say it once."""
    log.info(message)
