"""A GGUF model's matmul weights kept in llama.cpp's blocks at run time (`--quantization gguf`), as llama.cpp
serves them, instead of dequantized at load: Q4_0, Q4_1 and Q8_0 (SmolLM2's file: Q4_1 layers, a Q8_0 embedding
that is also its LM head). Other types, and shapes the tiles do not fit, are dequantized as before.

Two kernels, one per CPU kind (ops.gguf_kernel(), the layout CpuBackend.prepack packs for): on AMX,
csrc/gguf_linear.cpp widens each block to the very bfloat16 values the dequantize-at-load path loads and multiplies
them on the same tiles, so a kept model's output is bit for bit the dequantized model's; elsewhere with
AVX512-VNNI, csrc/gguf_vnni.cpp multiplies the blocks' integers with x rounded to int8 blocks, as llama.cpp does
(2.1x bfloat16's one-stream decode on Zen4, at a measured perplexity cost: BENCHMARKS.md "Quantized serving")."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.model.linear import DenseLinearMethod, Linear, copy_checked
from tokenmill.quant.gguf_blocks import GGMLBlocks, decode_rows
from tokenmill.quant.gguf_blocks import kept_gguf_type as kept


def embedding_rows(blocks: GGMLBlocks, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """Token ids -> their rows of an embedding kept as blocks, dequantized as the whole table would be (the
    rows are independent, so they are bit for bit the dense table's)."""
    data, cols = blocks.data, blocks.shape[1]

    def rows(ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        picked = data.index_select(0, flat.to(data.device))
        return decode_rows(picked, blocks.ggml_type, cols, dtype).to(ids.device).view(*ids.shape, cols)

    return rows


class GGUFLinearMethod(DenseLinearMethod):
    """Matmul weights as the GGUF file holds them. The loader hands each shard as GGMLBlocks (a dense tensor
    where the file's type is not kept); once every shard of a layer is in, a layer whose shards share one kept
    type keeps `gguf_blocks` [N, row bytes] of it (and releases the dense weight, left on the meta device),
    anything else is dequantized into the dense weight as the default method would load it. `apply` is the
    backend's gguf_linear."""

    name = "gguf"
    takes_blocks = True

    def weight_loader(self, layer: Linear, param: nn.Parameter, loaded: torch.Tensor | GGMLBlocks,
                      shard_id: int | None) -> None:
        if param is not layer.weight or not isinstance(loaded, GGMLBlocks):
            return super().weight_loader(layer, param, loaded, shard_id)
        shards = layer.__dict__.setdefault("_gguf_shards", {})
        rows = layer.output_sizes[shard_id or 0]
        if loaded.shape != (rows, layer.in_features):
            raise ModelLoadError(f"shape disagrees with the model's: {loaded.shape} != {(rows, layer.in_features)}")
        shards[shard_id or 0] = loaded

    def process_weights_after_loading(self, layer: Linear | nn.Module, checkpoint: object = None) -> None:
        layer.gguf_type = None
        source = getattr(layer, "source_name", None)  # the tied LM head: the embedding's blocks
        if source is not None:
            blocks = checkpoint.blocks(source) if hasattr(checkpoint, "blocks") else None
            if isinstance(blocks, GGMLBlocks) and kept(blocks.ggml_type):
                layer.gguf_type, layer.gguf_blocks = blocks.ggml_type, blocks.data
                layer.embedding.keep_rows(embedding_rows(blocks, layer.embedding.weight.dtype))
            return
        shards = layer.__dict__.pop("_gguf_shards", {})
        if not shards:
            return
        types = {b.ggml_type for b in shards.values()}
        if len(shards) == len(layer.output_sizes) and len(types) == 1 and kept(next(iter(types))):
            layer.gguf_type = next(iter(types))
            layer.gguf_blocks = torch.cat([shards[i].data for i in range(len(shards))])
            layer.weight = nn.Parameter(layer.weight.to("meta"), requires_grad=False)
            return
        for i, blocks in shards.items():  # mixed or unkept types: the dense weight, as the default loads it
            target = layer.weight.narrow(0, layer.shard_offsets[i], layer.output_sizes[i])
            copy_checked(target, blocks.dequantize(layer.weight.dtype))

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "gguf_type", None) is None:
            return layer.backend.linear(x, layer)
        return layer.backend.gguf_linear(x, layer)


class AWQLinearMethod(GGUFLinearMethod):
    """An AWQ checkpoint's 4-bit groups (model/hf_checkpoint.py AWQCheckpoint hands them as Q4_Z blocks), kept and multiplied
    as GGUF blocks are: the same tiles, widened to exactly (q - z) * s."""

    name = "awq"
