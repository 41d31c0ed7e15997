"""Token ids -> rows of a tied embedding, read from its LM head's packed copy (bfloat16 tiles, GGML blocks, int8
tiles), so the embedding's own table need not stay in memory beside it. The CPU backend hands these to the
embedding once it has packed the head (CpuBackend.prepack); each carries, as NativeRows, how ops.DecodeModel looks
the same rows up in C++.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.formats.gguf_blocks import KEPT_TYPES, decode_rows
from tokenmill.model.backends.gguf_tiles import TileByteGather, block_byte_sources, gguf_unpack_rows

DECODED_IN_CPP = KEPT_TYPES  # ops.gguf_decode_rows decodes every block type kept at run time
TileGather = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # ops.tile_rows: (packed, ids) -> [n, K]
BlockDecoder = Callable[[torch.Tensor, int, torch.Tensor], None]  # ops.gguf_decode_rows: (raw, type, out)


@dataclass(frozen=True)
class NativeRows:
    """How an embedding looks its rows up, as ops.RowLookup takes it: a rows-callable below carries one as its
    `native` attribute (None where its lookup is not the C++ ops'), so ops.DecodeModel looks rows up the same way
    between tokens; "dense" is a plain table."""

    kind: str  # RowLookup's kinds: "dense", "tiles", "int8", "gguf"
    table: torch.Tensor
    scale: torch.Tensor | None = None  # int8: per-row scales
    ggml_type: int = 0  # gguf: the block type, its tile byte sources and the bits to flip
    sources: torch.Tensor | None = None
    flip: torch.Tensor | None = None


def tile_rows(packed: torch.Tensor, gather: TileGather | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Token ids -> rows of a weight packed by bf16_pack ([N/16, K/32, 16 r, 16 n x 2]: feature n's K 2r, 2r + 1
    in each 32-wide K block): a tied embedding reads its head's tiles, so the dense table need not stay.
    `gather` (the C++ ops.tile_rows) does it in one call on the CPU; torch indexing otherwise."""
    nb, kb = packed.shape[:2]
    tiles = packed.view(nb, kb, 16, 16, 2)

    def rows(ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(packed.device)
        if gather is not None and packed.device.type == "cpu":
            return gather(packed, flat).view(*ids.shape, kb * 32).to(ids.device)
        return tiles[flat // 16, :, :, flat % 16, :].reshape(*ids.shape, kb * 32).to(ids.device)

    rows.native = NativeRows("tiles", packed) if gather is not None and packed.device.type == "cpu" else None
    return rows


def gguf_tile_rows(packed: torch.Tensor, ggml_type: int, layout: str, dtype: torch.dtype,
                   gather: TileByteGather | None = None, decode: BlockDecoder | None = None
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Token ids -> rows of a tied embedding kept as GGML blocks, read from its LM head's packed copy (gguf_pack's
    `layout`) and decoded as the whole table would be, so the file's table (30 MB of SmolLM2's Q8_0) is not held
    a second time for the lookups. `decode` (the C++ ops.gguf_decode_rows, bit for bit formats/gguf_blocks.py's
    decoders) decodes the blocks in one call where it takes the type."""
    cols = packed.shape[1] * 32
    native = decode is not None and packed.device.type == "cpu" and int(ggml_type) in DECODED_IN_CPP

    def rows(ids: torch.Tensor) -> torch.Tensor:
        raw = gguf_unpack_rows(packed, ggml_type, ids, layout, gather)
        if native:
            out = torch.empty(raw.shape[0], cols, dtype=dtype)
            decode(raw, int(ggml_type), out)
            return out.to(ids.device).view(*ids.shape, cols)
        return decode_rows(raw, ggml_type, cols, dtype).to(ids.device).view(*ids.shape, cols)

    rows.native = None
    if native and gather is not None:
        sources, flip = block_byte_sources(int(ggml_type), layout, str(packed.device))
        if sources.dim() == 2:  # one gather (not Q4 in the AMX tiles, whose nibbles are regrouped)
            rows.native = NativeRows("gguf", packed, ggml_type=int(ggml_type), sources=sources, flip=flip)
    return rows


def int8_tile_rows(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, gather: TileGather | None = None
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Token ids -> rows of a tied embedding quantized to int8 (quant/int8.py), read from its LM head's int8_pack
    copy (bytes q + 128 in bf16_pack's tile layout) and scaled as the int8 table's rows would be, so the int8
    table is not held a second time for the lookups."""
    nb, kb = packed.shape[:2]
    tiles = packed.view(nb, kb, 16, 16, 2)

    def rows(ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(packed.device)
        if gather is not None and packed.device.type == "cpu":
            q = (gather(packed, flat) ^ 0x80).view(torch.int8)
        else:
            q = (tiles[flat // 16, :, :, flat % 16, :] ^ 0x80).view(torch.int8).reshape(-1, kb * 32)
        return (q.float() * scale[flat].unsqueeze(-1)).to(dtype).to(ids.device).view(*ids.shape, kb * 32)

    rows.native = NativeRows("int8", packed, scale) if gather is not None and packed.device.type == "cpu" else None
    return rows
