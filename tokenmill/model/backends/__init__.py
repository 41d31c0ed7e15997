"""Backends: how the model's ops run on this machine (base.py says why there is one seam).

    select_backend(device)      # once, at start-up: CpuBackend on a CPU with the kernels built, else TorchBackend
"""

from __future__ import annotations

import logging
from functools import cache

import torch

from tokenmill.model import cpu_kernels
from tokenmill.model.backends.base import Backend, LinearWeights
from tokenmill.model.backends.cpu import CpuBackend
from tokenmill.model.backends.reference import TorchBackend

__all__ = ["Backend", "CpuBackend", "LinearWeights", "TorchBackend", "select_backend"]

log = logging.getLogger("tokenmill")


def select_backend(device: str | torch.device, use_kernels: bool = True) -> Backend:
    """The backend for `device`: the C++ CPU kernels where they are built (and wanted), otherwise the torch
    reference. `use_kernels=False` always gives the reference, which then runs no C++ op at all."""
    device = torch.device(device)
    backend: Backend = TorchBackend()
    if use_kernels and device.type == "cpu":
        ops = cpu_kernels._extension()
        if ops is not None:
            backend = CpuBackend(ops, ops.bf16_kernel())
    _log_once(f"backend: {backend.describe()} on {device}")
    return backend


@cache
def _log_once(message: str) -> None:
    """Engines built again in one process (tests, benchmarks) choose the same backend: say it once."""
    log.info(message)
