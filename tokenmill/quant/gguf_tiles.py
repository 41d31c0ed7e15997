"""GGUF blocks in the tile layout of csrc/gguf_linear.cpp: the packing, in plain torch (no model imports, so the
CPU backend can use it)."""

from __future__ import annotations

import torch

from tokenmill.quant.gguf import KEPT_TYPES, Q4_Z, GGMLQuantizationType

Q4_0, Q4_1, Q8_0 = (int(GGMLQuantizationType.Q4_0), int(GGMLQuantizationType.Q4_1),
                    int(GGMLQuantizationType.Q8_0))
# type -> (bytes per block, offset of the quants in a block, the widths in bytes of the per-block fields before
# them: float16 scales and mins, Q4_Z's uint8 zero point)
BLOCK_LAYOUT = {Q4_0: (18, 2, (2,)), Q4_1: (20, 4, (2, 2)), Q8_0: (34, 2, (2,)), Q4_Z: (19, 3, (2, 1))}
assert set(BLOCK_LAYOUT) == set(KEPT_TYPES)


def gguf_pack(data: torch.Tensor, ggml_type: int, pairs: bool = False, layout: str = "tiles") -> torch.Tensor:
    """Raw blocks [N, K/32 * block bytes] -> tiles [N/16, K/32, tile bytes] for csrc/gguf_linear.cpp: per
    16 features x 32 K, the quants in the VNNI order of an AMX B tile (row r: each feature's K 2r and 2r + 1),
    then the 16 blocks' fields (float16 scales, and mins or zero points). `pairs`: a fused gate/up weight
    [2I, K] as gate, up block pairs [I/16, 2, K/32, tile bytes], whose matmul applies SiLU-and-multiply.
    `layout="quads"`: the quants as csrc/gguf_vnni.cpp reads them instead (vector t, lane j: feature j's
    quant bytes 4t .. 4t + 3; Q8_0's as q + 128), the same size."""
    size, quants_at, widths = BLOCK_LAYOUT[int(ggml_type)]
    n = data.shape[0]
    kb = data.shape[1] // size
    if n % (32 if pairs else 16):
        raise ValueError(f"{n} rows do not make whole 16-feature tiles{' pairs' if pairs else ''}")
    blocks = data.reshape(n, kb, size)
    if pairs:  # [gate rows | up rows] -> gate block 0, up block 0, gate block 1, ...
        blocks = blocks.view(2, n // 32, 16, kb, size).transpose(0, 1).reshape(n, kb, size)
    quants = blocks[..., quants_at:]
    if layout == "quads":  # [N/16, 16 n, KB, T t, 4 i] -> [N/16, KB, T t, 16 n, 4 i]
        if ggml_type == Q8_0:
            quants = (quants.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        ordered = quants.reshape(n // 16, 16, kb, -1, 4).permute(0, 2, 3, 1, 4)
    elif layout == "tiles":
        ordered = _tile_order(quants, ggml_type)
    else:
        raise ValueError(f"unknown layout {layout!r}: tiles or quads")
    starts = [sum(widths[:i]) for i in range(len(widths))]
    fields = [blocks[..., at:at + w].reshape(n // 16, 16, kb, w).permute(0, 2, 1, 3).reshape(n // 16, kb, 16 * w)
              for at, w in zip(starts, widths, strict=True)]
    tiles = torch.cat([ordered.reshape(n // 16, kb, -1), *fields], dim=-1)
    tiles = tiles.contiguous()
    return tiles.view(n // 32, 2, kb, -1) if pairs else tiles


def _tile_order(quants: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """quants [N, KB, quant bytes] -> [N/16, KB, 16 r, 16 n, (2 e or a nibble pair)]: the VNNI order of an AMX B
    tile, row r holding each feature's K 2r and 2r + 1."""
    n, kb = quants.shape[:2]
    if ggml_type == Q8_0:
        values = quants  # 32 int8 (as bytes) in K order
    else:  # byte j: element j (low nibble), element j + 16 (high nibble)
        values = torch.cat([quants & 0x0F, quants >> 4], dim=-1)
    # [N/16, 16 n, KB, 16 r, 2 e] -> [N/16, KB, 16 r, 16 n, 2 e]
    ordered = values.reshape(n // 16, 16, kb, 16, 2).permute(0, 2, 3, 1, 4)
    return ordered if ggml_type == Q8_0 else ordered[..., 0] | (ordered[..., 1] << 4)  # one byte per pair
