"""A GGUF model's matmul weights kept in llama.cpp's blocks at run time (`--quantization gguf`), as llama.cpp
serves them, instead of dequantized at load: Q4_0, Q4_1, Q8_0 and Q5_0 as they are (SmolLM2's file: Q4_1 layers,
a Q8_0 embedding that is also its LM head); Q4_K, Q5_K and Q6_K re-cut into blocks of 32 (formats/kquants.py).
Other types, and shapes the tiles do not fit, are dequantized as before.

Three kernels, by CPU (ops.gguf_kernel(); model/backends/gguf_tiles.py kernel_layout says how CpuBackend.prepack packs each
type for it): on AMX, csrc/gguf_linear.cpp widens Q4_0/Q4_1/Q8_0 blocks to the very bfloat16 values the
dequantize-at-load path loads and multiplies them on the same tiles, so those layers' outputs are bit for bit the
dequantized model's (Q5_0 and the K-quants take the VNNI kernel there); with AVX512-VNNI, csrc/gguf_vnni.cpp
multiplies the blocks' integers with x rounded to int8 blocks, as llama.cpp does (2.1x bfloat16's one-stream
decode on Zen4, at a measured perplexity cost: BENCHMARKS.md "Quantized serving"); with AVX2 alone,
csrc/gguf_avx2.cpp computes the same integer sums with VPMADDUBSW (float32 or bfloat16 rows)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.formats.gguf_blocks import GGMLBlocks, decode_rows, kept_gguf_type
from tokenmill.formats.kquants import Q5_0, TRANSCODED, transcode
from tokenmill.model.linear import DenseLinearMethod, Linear, copy_checked


def embedding_rows(blocks: GGMLBlocks, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """Token ids -> their rows of an embedding kept as blocks, dequantized as the whole table would be (the
    rows are independent, so they are bit for bit the dense table's)."""
    data, cols = blocks.data, blocks.shape[1]

    def rows(ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        picked = data.index_select(0, flat.to(data.device))
        return decode_rows(picked, blocks.ggml_type, cols, dtype).to(ids.device).view(*ids.shape, cols)

    return rows


def kept_form(blocks: GGMLBlocks, backend: object, beside_q8_0: bool = False) -> GGMLBlocks | None:
    """The blocks as this backend keeps them: as they are (Q4_0, Q4_1, Q8_0; Q5_0 where `backend.keeps_gguf_type`
    takes it and not `beside_q8_0`), re-cut (a TRANSCODED type, where the backend takes the result), or None
    (dequantized). `beside_q8_0`: part of a fused layer with other types, where Q5_0 becomes Q8_0, exactly."""
    t = int(blocks.ggml_type)
    if kept_gguf_type(t) or (t == Q5_0 and not beside_q8_0 and backend.keeps_gguf_type(t)):
        return blocks
    target = TRANSCODED.get(t)
    if target is None or not backend.keeps_gguf_type(target):
        return None
    ggml_type, data = transcode(blocks.data, blocks.ggml_type)
    return GGMLBlocks(ggml_type, data, blocks.shape)


def kept_summary(layers: list[nn.Module]) -> str:
    """Each format the matmuls are served in, with its count and bytes, for the start-up log: "Q8_0 x10 171 MiB,
    Q4_KS (Q4_K) x27 17 MiB, dense (from Q3_K) x2 9 MiB": a kept type, with the file's type it was re-cut from, or
    dense, with the file types dequantized at load."""
    from tokenmill.formats.gguf_blocks import _type_name

    kinds: dict[str, list[int]] = {}
    for m in layers:
        t = getattr(m, "gguf_type", None)
        if t is None:  # dequantized at load: from which file types (Q2_K, Q3_K, IQ..., or mixed in one layer)
            files = [_type_name(f) for f in getattr(m, "gguf_file_types", [])]
            name = "dense" + (f" (from {'+'.join(files)})" if files else "")
            tensors = [getattr(m, "packed_weight", None), m.weight]
        else:
            files = [_type_name(f) for f in getattr(m, "gguf_file_types", []) if f != t]
            name = _type_name(t) + (f" ({'+'.join(files)})" if files else "")
            tensors = [getattr(m, "packed_weight", None), getattr(m, "gguf_blocks", None)]
        size = next((x.numel() * x.element_size() for x in tensors
                     if isinstance(x, torch.Tensor) and not x.is_meta and not x.is_mkldnn), 0)
        entry = kinds.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += size
    return ", ".join(f"{name} x{n} {size / 2**20:.0f} MiB" for name, (n, size) in kinds.items())


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
            blocks = kept_form(blocks, layer.backend) if isinstance(blocks, GGMLBlocks) else None
            if blocks is not None:
                layer.gguf_type, layer.gguf_blocks = blocks.ggml_type, blocks.data
                layer.embedding.keep_rows(embedding_rows(blocks, layer.embedding.weight.dtype))
            return
        shards = layer.__dict__.pop("_gguf_shards", {})
        if not shards:
            return
        layer.gguf_file_types = sorted({int(b.ggml_type) for b in shards.values()})
        kept = {i: kept_form(b, layer.backend) for i, b in shards.items()}
        types = {b.ggml_type if b is not None else None for b in kept.values()}
        if len(types) > 1:  # Gemma 3's q, k (Q5_0) and v (Q8_0): one type, Q8_0
            kept = {i: kept_form(b, layer.backend, beside_q8_0=True) for i, b in shards.items()}
            types = {b.ggml_type if b is not None else None for b in kept.values()}
        if len(shards) == len(layer.output_sizes) and len(types) == 1 and None not in types:
            shards = kept
            layer.gguf_type = next(iter(types))
            layer.gguf_blocks = torch.cat([shards[i].data for i in range(len(shards))])
            layer.weight = nn.Parameter(layer.weight.to("meta"), requires_grad=False)
            return
        for i, blocks in shards.items():  # mixed or unkept types: the dense weight, as the default loads it
            target = layer.weight.narrow(0, layer.shard_offsets[i], layer.output_sizes[i])
            copy_checked(target, blocks.dequantize(layer.weight.dtype))

    def keep_embedding(self, embedding: nn.Module, blocks: torch.Tensor | GGMLBlocks, backend: object) -> None:
        """An untied embedding table kept in the file's blocks (or re-cut ones, kept_form): each step decodes the
        rows it looks up, bit for bit the dequantized table's, and the dense table is released."""
        kept = kept_form(blocks, backend) if isinstance(blocks, GGMLBlocks) else None
        if kept is not None:
            embedding.keep_rows(embedding_rows(kept, embedding.weight.dtype), kept.data)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if getattr(layer, "gguf_type", None) is None:
            return layer.backend.linear(x, layer)
        return layer.backend.gguf_linear(x, layer)


class AWQLinearMethod(GGUFLinearMethod):
    """An AWQ checkpoint's 4-bit groups (model/hf_checkpoint.py AWQCheckpoint hands them as Q4_Z blocks), kept and multiplied
    as GGUF blocks are: the same tiles, widened to exactly (q - z) * s."""

    name = "awq"
