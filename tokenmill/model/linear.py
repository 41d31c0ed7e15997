"""Linear layers behind one interface: the model says "project x"; the layer's LinearMethod owns how the weight is
stored, loaded from a checkpoint and multiplied, and the backend's `linear` runs the matmul. Dense is the one method
by default; a quantized format (tokenmill/quant/: int8, fp8, int4, GGUF blocks) or a tensor-parallel shard is one
more LinearMethod subclass.
model/backends/cpu.py says which CPU kernel serves which shape."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.model.backends import Backend, TorchBackend
from tokenmill.model.backends.cpu import prepack_weight  # noqa: F401 - the oneDNN layout; benchmarks/kernel_timings.py

if TYPE_CHECKING:
    from tokenmill.model.lora import LoRASlots


@torch.no_grad()
def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """target <- loaded, cast to target's dtype on target's device. A shape mismatch is an error, never a
    broadcast: a checkpoint that does not fit must not load quietly."""
    if loaded.shape != target.shape:
        raise ModelLoadError(f"shape disagrees with the model's: {tuple(loaded.shape)} != {tuple(target.shape)}")
    target.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    """The loader of a parameter that is one checkpoint tensor as it is (norms, the embedding)."""
    if shard_id is not None:
        raise ModelLoadError(f"shard {shard_id} given for a parameter that has no shards")
    copy_checked(param, loaded)


class LinearMethod(ABC):
    """One weight format: which parameters hold a linear layer's weight, how checkpoint tensors are written into
    them, and how x is multiplied by them. A quantized format subclasses this: `create_weights` registers its own
    parameters (e.g. packed integers and scales), `weight_loader` quantizes a checkpoint shard or copies its
    blocks as they are, `apply` calls a backend op that reads them."""

    quantizes_lm_head = True  # False: the LM head (and a tied embedding) stays dense in the model's dtype

    @abstractmethod
    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        """Register the layer's parameters on the current device (meta while the runner builds the model)."""

    @abstractmethod
    def weight_loader(self, layer: Linear, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        """Write checkpoint tensor `loaded` into `param`: whole, or as shard `shard_id` of a fused projection
        (layer.output_sizes[shard_id] rows from layer.shard_offsets[shard_id])."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T (+ bias)."""

    def process_weights_after_loading(self, layer: Linear | TiedLMHead, checkpoint: object = None) -> None:
        """Called once every checkpoint tensor is in (`checkpoint`: the mapping they came from): an on-the-fly
        format quantizes the loaded weight here, a kept one finishes its layout."""


class DenseLinearMethod(LinearMethod):
    """A plain [out, in] weight (and optional bias) in the model's dtype; the shards of a fused projection are row
    blocks of it, so q/k/v and gate/up load in place with no concatenation."""

    name = "dense"

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype))
        layer.register_parameter("bias", nn.Parameter(torch.empty(layer.out_features, dtype=dtype))
                                 if layer.has_bias else None)
        # nn.Linear's init, so a layer built off the meta device computes something finite (free on meta)
        bound = 1 / math.sqrt(layer.in_features)
        for p in (layer.weight, layer.bias):
            if p is not None:
                nn.init.uniform_(p, -bound, bound)

    def weight_loader(self, layer: Linear, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        target = param if shard_id is None else param.narrow(0, layer.shard_offsets[shard_id],
                                                             layer.output_sizes[shard_id])
        copy_checked(target, loaded)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return layer.backend.linear(x, layer)


class Linear(nn.Module):
    """y = x W^T (+ b), its weight in the format of `method` (dense by default).

    `output_sizes` lists the output blocks of a fused projection (q, k, v or gate, up): checkpoint shard i lands in
    output rows [shard_offsets[i], shard_offsets[i] + output_sizes[i]). `packed_weight` is a backend-owned copy of
    the weight in its preferred layout (Backend.prepack). Where that copy serves every row count the backend releases
    the plain weight (left on the meta device: its shape and dtype, no memory); load_hf_weights allocates it again."""

    packed_weight: torch.Tensor | None = None
    lora: LoRASlots | None = None  # adapter slots (model/lora.py attach_lora): their runs are added to the output

    def __init__(self, in_features: int, output_sizes: int | Sequence[int], bias: bool = True,
                 backend: Backend | None = None, method: LinearMethod | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.shard_offsets = [0, *accumulate(self.output_sizes)][:-1]
        self.in_features, self.out_features, self.has_bias = in_features, sum(self.output_sizes), bias
        self.backend = backend if backend is not None else TorchBackend()
        self.method = method if method is not None else DenseLinearMethod()
        self.method.create_weights(self, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        self.method.weight_loader(self, param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        if self.lora is not None and self.lora.batch.runs and self.lora.applies():
            self.backend.lora_add(y, x, self.lora)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, output_sizes={self.output_sizes}, bias={self.has_bias}"


class TiedLMHead:
    """The LM head of a model whose head shares the input embedding: the embedding's weight read as a linear
    layer's. Not a module, so the checkpoint and state dict keep the one tensor; it holds the module, not the
    tensor, so it follows `to()` and reloads. Backends may give it a packed copy like any Linear, and a
    quantization method its own quantized copy, whose rows the embedding's lookups may then read instead of the
    dense table (VocabEmbedding.keep_rows)."""

    bias = None
    packed_weight: torch.Tensor | None = None
    shares_weight = True
    source_name = "model.embed_tokens.weight"  # the checkpoint tensor it reads

    def __init__(self, embedding: nn.Module, backend: Backend | None = None, method: LinearMethod | None = None):
        self.embedding = embedding
        self.backend = backend if backend is not None else TorchBackend()
        self.method = method if method is not None else DenseLinearMethod()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight
