"""Linear layers behind one interface. Dense for now; quantized and tensor-parallel variants plug in here.

On CPU, three kernels serve three shapes (measured on 2 AVX2 cores, BENCHMARKS.md "Kernels"):
- decode-shaped inputs (a few rows) go to the skinny kernel, which splits output features across cores and
  streams the weight at memory speed (BLAS runs a one-row product on a single core);
- batched decode (8-128 rows) goes to oneDNN with the weight prepacked once into its blocked layout: BLAS
  repacks the weight on every call, which at these shapes costs as much as the arithmetic (1.5-3x slower);
- large prefill chunks run as fast either way.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.cpu_kernels import skinny_linear_kernel

log = logging.getLogger("tokenmill")

SKINNY_MAX_ROWS = 4  # measured on 2 AVX2 cores: at 8 rows BLAS gemm is already as fast (BENCHMARKS.md)
PREPACK_ROWS_HINT = 64  # oneDNN picks its blocking for this many rows; measured best across 2-512 rows


def prepack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] in oneDNN's blocked layout, or None where oneDNN cannot run it (not on the CPU, no
    oneDNN in this torch build, or a dtype this CPU lacks instructions for, e.g. bfloat16 without AVX512)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PREPACK_ROWS_HINT)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        return packed
    except (RuntimeError, AttributeError) as e:
        log.debug("no prepacked weights for %s %s: %s", weight.dtype, tuple(weight.shape), e)
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); `packed` is `prepack_weight(weight)` when the caller holds one."""
    if x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and x.device.type == "cpu" and torch.get_num_threads() > 1:
        kernel = skinny_linear_kernel()
        if kernel is not None:
            return kernel(x, weight, bias)
    if packed is not None and x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `linear`; `prepack()` adds the oneDNN copy of the weight (the plain
    weight stays: the skinny kernel and the state dict read it)."""

    packed_weight: torch.Tensor | None = None

    def prepack(self) -> bool:
        self.packed_weight = prepack_weight(self.weight)
        return self.packed_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)
