"""Linear layers behind one interface: the model says "project x", the backend's `linear` decides how (dense
now; quantized formats and tensor-parallel shards become other weight layouts behind the same call).
model/backends/cpu.py says which CPU kernel serves which shape."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.backends import Backend, TorchBackend
from tokenmill.model.backends.cpu import prepack_weight  # noqa: F401 - the oneDNN layout; benchmarks/kernels.py


class Linear(nn.Linear):
    """nn.Linear whose matmul is the backend's. `packed_weight` is a backend-owned copy of the weight in its
    preferred layout (Backend.prepack); the plain weight stays, so the state dict never changes."""

    packed_weight: torch.Tensor | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, backend: Backend | None = None):
        super().__init__(in_features, out_features, bias=bias)
        self.backend = backend if backend is not None else TorchBackend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self)


class TiedLMHead:
    """The LM head of a model whose head shares the input embedding: the embedding's weight read as a linear
    layer's. Not a module, so the checkpoint and state dict keep the one tensor; it holds the module, not the
    tensor, so it follows `to()` and reloads. Backends may give it a packed copy like any Linear."""

    bias = None
    packed_weight: torch.Tensor | None = None

    def __init__(self, embedding: nn.Embedding):
        self.embedding = embedding

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight
