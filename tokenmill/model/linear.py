"""Linear layers behind one interface. Dense for now; quantized and tensor-parallel variants plug in here.

On CPU, decode-shaped inputs (few rows) go to the skinny kernel, which splits output features across cores:
BLAS runs a one-row product on a single core, which cannot pull the memory bandwidth a decode step needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.cpu_kernels import skinny_linear_kernel

SKINNY_MAX_ROWS = 4  # measured on 2 AVX2 cores: at 8 rows BLAS gemm is already as fast (BENCHMARKS.md)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and x.device.type == "cpu" and torch.get_num_threads() > 1:
        kernel = skinny_linear_kernel()
        if kernel is not None:
            return kernel(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
