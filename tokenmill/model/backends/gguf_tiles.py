"""GGUF blocks in the tile layout of csrc/gguf_linear.cpp: the packing, in plain torch (no model imports, so the
CPU backend can use it)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tokenmill.formats.gguf_blocks import KEPT_TYPES, Q4_KS, Q4_Z, Q5_KS, Q6_KS, GGMLQuantizationType

Q4_0, Q4_1, Q8_0, Q5_0 = (int(GGMLQuantizationType.Q4_0), int(GGMLQuantizationType.Q4_1),
                          int(GGMLQuantizationType.Q8_0), int(GGMLQuantizationType.Q5_0))
# type -> (bytes per block, offset of the quants in a block, the widths in bytes of the per-block fields before
# them: float16 scales and mins, Q4_Z's uint8 zero point, the K-quants' super-block scales and 6-bit or int8 ones)
BLOCK_LAYOUT = {Q4_0: (18, 2, (2,)), Q4_1: (20, 4, (2, 2)), Q8_0: (34, 2, (2,)), Q4_Z: (19, 3, (2, 1)),
                Q4_KS: (24, 8, (4, 4)), Q6_KS: (36, 4, (2, 1, 1)), Q5_0: (22, 6, (2, 4)), Q5_KS: (28, 12, (4, 4, 4))}
# the K-quants' blocks (formats/kquants.py) and Q5_0 (its fifth bits a 32-bit field per block): the int8 kernels'
# alone (csrc/gguf_vnni.cpp, csrc/gguf_avx2.cpp), no AMX tiles (an AMX CPU runs them on the VNNI kernel)
QUADS_ONLY = (Q4_KS, Q6_KS, Q5_0, Q5_KS)
assert set(BLOCK_LAYOUT) == set(KEPT_TYPES) | set(QUADS_ONLY)


def kernel_layout(kernel: str, ggml_type: int) -> str:
    """The layout a kept-block kernel (ops.gguf_kernel()) reads a type's blocks in: the int8 kernels' quads (VNNI,
    AVX2), or AMX's tiles, but for the QUADS_ONLY types, which an AMX CPU multiplies on the VNNI kernel (every AMX
    CPU has AVX512-VNNI; csrc/gguf_linear.cpp picks it by the tile size)."""
    return "tiles" if kernel == "amx" and int(ggml_type) not in QUADS_ONLY else "quads"


def default_kept_dtypes(kernel: str) -> tuple[torch.dtype, ...]:
    """The compute dtypes in which a GGUF file's blocks are kept by default: those whose rows the int8 kernels round
    in two parts (float32-grade for float32 x, csrc/gguf_quads.h), so on AVX2 and AVX512-VNNI both dtypes `--dtype
    auto` may pick; AMX's tiles widen to bfloat16 only. float32 asked for by name keeps none
    (quant/methods.py resolve_quantization)."""
    if not kernel:
        return ()
    return (torch.bfloat16,) if kernel == "amx" else (torch.bfloat16, torch.float32)


def kernel_dtypes(kernel: str) -> tuple[torch.dtype, ...]:
    """The activation dtypes a kept-block kernel takes: bfloat16 everywhere, and float32 where the quads are read
    (an AVX2 CPU computes in float32: model/backends/__init__.py auto_dtype; on a VNNI CPU float32 rows take the
    AVX2 kernel, csrc/gguf_linear.cpp). AMX's tiles widen to bfloat16 only."""
    if not kernel:
        return ()
    return (torch.bfloat16,) if kernel == "amx" else (torch.bfloat16, torch.float32)


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
        if ggml_type in QUADS_ONLY:
            raise ValueError(f"type {ggml_type} blocks have no AMX tile layout (quads only)")
        ordered = _tile_order(quants, ggml_type)
    else:
        raise ValueError(f"unknown layout {layout!r}: tiles or quads")
    starts = [sum(widths[:i]) for i in range(len(widths))]
    fields = [blocks[..., at:at + w].reshape(n // 16, 16, kb, w).permute(0, 2, 1, 3).reshape(n // 16, kb, 16 * w)
              for at, w in zip(starts, widths, strict=True)]
    tiles = torch.cat([ordered.reshape(n // 16, kb, -1), *fields], dim=-1)
    tiles = tiles.contiguous()
    return tiles.view(n // 32, 2, kb, -1) if pairs else tiles


# gather(packed, rows, sources [16, size], flip [size]) -> [n, KB, size]: packed[rows / 16, kb, sources[rows % 16]]
# ^ flip (the C++ kernels' gather_tile_bytes; _gather_tile_bytes is the same in torch ops)
TileByteGather = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def gguf_unpack_rows(tiles: torch.Tensor, ggml_type: int, rows: torch.Tensor, layout: str = "tiles",
                     gather: TileByteGather | None = None) -> torch.Tensor:
    """The raw blocks [n, K/32 * block bytes] of features `rows` of a weight packed by gguf_pack (not in pairs):
    gguf_pack undone for a few rows, so a tied embedding looks its rows up in its LM head's packed copy and the
    file's table need not stay beside it. Each block byte is one tile byte (block_byte_sources says which, per
    lane), Q8_0's quads with the + 128 undone; only Q4 in the AMX tiles regroups nibbles, from two gathers."""
    size, quants_at, _ = BLOCK_LAYOUT[int(ggml_type)]
    if tiles.dim() != 3:
        raise ValueError("rows of a weight packed by gguf_pack without pairs: [N/16, K/32, tile bytes]")
    gather = gather or _gather_tile_bytes
    flat = rows.reshape(-1).to(tiles.device)
    sources, flip = block_byte_sources(int(ggml_type), layout, str(tiles.device))
    if sources.dim() == 2:
        return gather(tiles, flat, sources, flip).reshape(flat.numel(), tiles.shape[1] * size)
    # Q4 in AMX tiles: quant byte j = nibble of K j | nibble of K j + 16 << 4, each nibble half of a tile byte
    low, high = gather(tiles, flat, sources[0], flip), gather(tiles, flat, sources[1], flip)
    shift = _nibble_shifts(size - quants_at, str(tiles.device))
    low[..., quants_at:] = ((low[..., quants_at:] >> shift[0]) & 0x0F) | (
        ((high[..., quants_at:] >> shift[1]) & 0x0F) << 4)
    return low.reshape(flat.numel(), tiles.shape[1] * size)


def _gather_tile_bytes(tiles: torch.Tensor, rows: torch.Tensor, sources: torch.Tensor, flip: torch.Tensor
                       ) -> torch.Tensor:
    n, kb, tile_bytes = rows.numel(), tiles.shape[1], tiles.shape[2]
    starts = (rows // 16 * (kb * tile_bytes)).view(-1, 1, 1) + (
        torch.arange(kb, device=tiles.device).view(1, -1, 1) * tile_bytes)
    at = (starts + sources[rows % 16].unsqueeze(1)).view(-1)
    return tiles.view(-1).index_select(0, at).view(n, kb, sources.shape[-1]) ^ flip


@functools.cache
def block_byte_sources(ggml_type: int, layout: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of a tile's 16 features, the tile byte of each byte of its block: [16, block bytes] (for Q4 in the
    AMX tiles [2, 16, block bytes]: the bytes holding the nibbles of K j and of K j + 16 of quant byte j), and
    the bits to flip in each block byte (Q8_0's quads hold q + 128)."""
    size, quants_at, widths = BLOCK_LAYOUT[ggml_type]
    qbytes = size - quants_at
    lanes = torch.arange(16).view(16, 1)
    fields, at = [], 16 * qbytes
    for w in widths:  # each field: 16 lanes x w bytes
        fields.append(at + lanes * w + torch.arange(w))
        at += 16 * w
    flip = torch.zeros(size, dtype=torch.uint8)
    j = torch.arange(qbytes)
    if layout == "quads":  # vector t = j // 4, lane, byte j % 4
        if ggml_type == Q8_0:
            flip[quants_at:] = 0x80
        sources = torch.cat([*fields, j // 4 * 64 + lanes * 4 + j % 4], dim=1)
    elif layout != "tiles":
        raise ValueError(f"unknown layout {layout!r}: tiles or quads")
    elif ggml_type == Q8_0:  # [16 r, 16 lanes, 2 e]: K j at r = j // 2, e = j % 2
        sources = torch.cat([*fields, j // 2 * 32 + lanes * 2 + j % 2], dim=1)
    else:  # [16 r, 16 lanes], one byte per K pair 2r, 2r + 1: K j's nibble in byte r = j // 2
        sources = torch.stack([torch.cat([*fields, (k // 2) * 16 + lanes], dim=1) for k in (j, j + 16)])
    return sources.contiguous().to(device), flip.to(device)


@functools.cache
def _nibble_shifts(qbytes: int, device: str) -> torch.Tensor:
    """Q4 in the AMX tiles: how far to shift the tile bytes holding K j and K j + 16 for their nibbles."""
    j = torch.arange(qbytes)
    return torch.stack([j % 2 * 4, (j + 16) % 2 * 4]).to(torch.uint8).to(device)


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
