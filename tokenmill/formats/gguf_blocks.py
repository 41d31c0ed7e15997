"""The GGML block formats: what each tensor type's bytes are and their torch dequantizers.

Apart from the file reader (formats/gguf.py) because more than GGUF files hold these blocks: AWQ groups become Q4_Z
blocks (formats/awq_format.py), a model may keep blocks at run time (quant/gguf_linear.py) and the CPU backend decodes
an embedding's rows from them. Why our own dequantizers: they are vectorized torch ops (fast at load), and the
quantized kernel path keeps these same block layouts. torch is imported inside the functions that use it: the API
process reads GGUF headers (the tokenizer) without loading the model stack.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenmill.errors import ModelLoadError

if TYPE_CHECKING:
    import torch


# tokenmill's own block type, never in a GGUF file: 32 four-bit weights with a float16 scale s and an integer
# zero point z, w = (q - z) * s (AWQ's format, group sizes of 32 or more, formats/awq_format.py). 19 bytes a block:
# s, z, then 16 bytes of nibbles ordered as Q4_0's.
Q4_Z = 256
Q4_Z_BLOCK_BYTES = 19
# A K-quant's 256-weight super-block re-cut into blocks of 32 (formats/kquants.py), never in a file either: the file's
# quants and scales, so each block dequantizes to exactly the values of llama.cpp's dequantizer, whatever 32-wide
# block kernel reads it.
#   Q4_KS (from Q4_K): 24 bytes: float32 d * sc and -(dmin * m) (the super-block's float16 scales times the
#          sub-block's 6-bit ones: exact in float32), 16 bytes of nibbles ordered as Q4_0's; w = (d * sc) * q - dmin * m.
#   Q6_KS (from Q6_K): 36 bytes: float16 d, int8 scales of the two 16-weight halves, 32 bytes q in 0..63;
#          w = (d * scale) * (q - 32).
#   Q5_KS (from Q5_K): 28 bytes: Q4_KS's two float32 scales, 32 fifth bits (bit i: weight i's, as Q5_0's), 16 bytes
#          of low nibbles; w = (d * sc) * q - dmin * m with q in 0..31.
Q4_KS, Q6_KS, Q5_KS = 257, 258, 259
INTERNAL_TYPES = {Q4_Z: ("Q4_Z", Q4_Z_BLOCK_BYTES), Q4_KS: ("Q4_KS", 24), Q6_KS: ("Q6_KS", 36), Q5_KS: ("Q5_KS", 28)}

# The types whose blocks a model can keep at run time (quant/gguf_linear.py, csrc/gguf_linear.cpp).
KEPT_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, Q4_Z)


def kept_gguf_type(ggml_type: int) -> bool:
    return int(ggml_type) in KEPT_TYPES


@dataclass
class GGMLBlocks:
    """One tensor as its raw blocks: `data` [rows, row bytes] uint8 of `ggml_type`, `shape` (rows, columns) of
    the weight it encodes. What a GGUF checkpoint hands a method that keeps blocks."""

    ggml_type: int
    data: torch.Tensor
    shape: tuple[int, int]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.data, self.ggml_type, self.shape, dtype)


def tensor_nbytes(ggml_type: int, shape: Sequence[int]) -> int:
    """Bytes a tensor of this type and (torch-order) shape occupies; rows must hold whole blocks."""
    block, type_size = _block_layout(ggml_type)
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if shape and shape[-1] % block:
        raise ValueError(f"row length {shape[-1]} is not a multiple of the {_type_name(ggml_type)} "
                         f"block size {block}")
    return n // block * type_size


def _block_layout(ggml_type: int) -> tuple[int, int]:
    if int(ggml_type) in INTERNAL_TYPES:
        return 32, INTERNAL_TYPES[int(ggml_type)][1]
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))]
    except (ValueError, KeyError):
        raise ModelLoadError(f"unknown GGML tensor type {int(ggml_type)}; supported: "
                             f"{', '.join(SUPPORTED_TYPE_NAMES)} (others via the gguf package)") from None


def _type_name(ggml_type: int) -> str:
    if int(ggml_type) in INTERNAL_TYPES:
        return INTERNAL_TYPES[int(ggml_type)][0]
    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"type {int(ggml_type)}"


# ---------------------------------------------------------------------------------------------------------
# Dequantizing
# ---------------------------------------------------------------------------------------------------------


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 stored at bytes [start, start+2) of every block, as float32 of shape [n_blocks, 1]."""
    import torch
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 packed bytes per block -> 32 float32 values: low nibbles are elements 0..15, high ones 16..31.

    Written into one preallocated output (no torch.cat, no temporary float copies): load time is
    dominated by allocation and memory traffic, not arithmetic.
    """
    import torch
    out = torch.empty(qs.shape[0], 32, dtype=torch.float32)
    out[:, :16].copy_(qs & 0x0F)
    out[:, 16:].copy_(qs >> 4)
    return out


def _deq_f32(raw: torch.Tensor) -> torch.Tensor:
    import torch
    return raw.view(torch.float32).clone()


def _deq_f16(raw: torch.Tensor) -> torch.Tensor:
    import torch
    return raw.view(torch.float16).float()


def _deq_bf16(raw: torch.Tensor) -> torch.Tensor:
    import torch
    return raw.view(torch.bfloat16).float()


def _deq_q8_0(raw: torch.Tensor) -> torch.Tensor:
    import torch
    blocks = raw.view(-1, 34)
    out = torch.empty(blocks.shape[0], 32, dtype=torch.float32)
    out.copy_(blocks[:, 2:].contiguous().view(torch.int8))
    return out.mul_(_half(blocks, 0))


def _deq_q4_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 18)
    return _unpack_nibbles(blocks[:, 2:]).sub_(8.0).mul_(_half(blocks, 0))


def _deq_q4_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 20)
    # q*d then +m: two roundings, like ggml's reference (no fused multiply-add)
    return _unpack_nibbles(blocks[:, 4:]).mul_(_half(blocks, 0)).add_(_half(blocks, 2))


def _deq_q4_z(raw: torch.Tensor) -> torch.Tensor:
    import torch
    blocks = raw.view(-1, Q4_Z_BLOCK_BYTES)
    zero = blocks[:, 2:3].to(torch.float32)
    return _unpack_nibbles(blocks[:, 3:]).sub_(zero).mul_(_half(blocks, 0))  # exact: a small integer times a half


def _deq_q4_ks(raw: torch.Tensor) -> torch.Tensor:
    import torch
    blocks = raw.view(-1, 24)
    scales = blocks[:, :8].contiguous().view(torch.float32)  # d * sc, -(dmin * m)
    return _unpack_nibbles(blocks[:, 8:]).mul_(scales[:, :1]).add_(scales[:, 1:])  # as llama.cpp: (d sc) q - dmin m


def _deq_q5_ks(raw: torch.Tensor) -> torch.Tensor:
    import torch
    blocks = raw.view(-1, 28)
    scales = blocks[:, :8].contiguous().view(torch.float32)  # d * sc, -(dmin * m)
    high = blocks[:, 8:12].contiguous().view(torch.int32)  # bit j: weight j's fifth bit
    bits = ((high >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.float32)
    q = _unpack_nibbles(blocks[:, 12:]).add_(bits.mul_(16.0))  # 0..31, exact
    return q.mul_(scales[:, :1]).add_(scales[:, 1:])  # as llama.cpp: (d sc) q - dmin m


def _deq_q5_0(raw: torch.Tensor) -> torch.Tensor:
    import torch
    blocks = raw.view(-1, 22)
    high = blocks[:, 2:6].contiguous().view(torch.int32)  # bit j: weight j's fifth bit
    bits = ((high >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.float32)
    return _unpack_nibbles(blocks[:, 6:]).add_(bits.mul_(16.0)).sub_(16.0).mul_(_half(blocks, 0))


def _deq_q6_ks(raw: torch.Tensor) -> torch.Tensor:
    import torch
    blocks = raw.view(-1, 36)
    d = _half(blocks, 0)
    out = blocks[:, 4:].to(torch.float32).sub_(32.0)
    out[:, :16].mul_(d * blocks[:, 2:3].view(torch.int8).to(torch.float32))
    out[:, 16:].mul_(d * blocks[:, 3:4].view(torch.int8).to(torch.float32))
    return out


_DEQUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.F32: _deq_f32,
    GGMLQuantizationType.F16: _deq_f16,
    GGMLQuantizationType.BF16: _deq_bf16,
    GGMLQuantizationType.Q8_0: _deq_q8_0,
    GGMLQuantizationType.Q4_0: _deq_q4_0,
    GGMLQuantizationType.Q4_1: _deq_q4_1,
    GGMLQuantizationType.Q5_0: _deq_q5_0,
}
SUPPORTED_TYPE_NAMES = tuple(GGMLQuantizationType(t).name for t in _DEQUANTIZERS)
_DEQUANTIZERS.update({Q4_Z: _deq_q4_z, Q4_KS: _deq_q4_ks, Q6_KS: _deq_q6_ks, Q5_KS: _deq_q5_ks})


DEQUANTIZE_CHUNK = 1 << 20  # elements decoded at a time into a narrower dtype: 4 MiB of float32 in flight


def dequantize(raw: np.ndarray | torch.Tensor, ggml_type: int, shape: Sequence[int],
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode a tensor's raw GGML bytes into a tensor of `shape` (torch order, blocks along rows) in `dtype`
    (float32 if None). Decoding is in float32; for another dtype it goes a chunk of rows at a time, so no float32
    copy of the whole tensor exists (on SmolLM2 the embedding alone is 113 MB of float32)."""
    import torch
    shape = tuple(int(s) for s in shape)
    raw_u8 = _as_uint8(raw)
    expected = tensor_nbytes(ggml_type, shape)
    if raw_u8.numel() != expected:
        raise ModelLoadError(f"{_type_name(ggml_type)} tensor of shape {list(shape)} needs {expected} bytes, "
                             f"got {raw_u8.numel()}")
    if dtype is None or dtype == torch.float32 or len(shape) < 2:
        out = _decode(raw_u8, int(ggml_type), shape)
        return out if dtype is None else out.to(dtype)
    out = torch.empty(shape, dtype=dtype)
    rows, cols = out.view(-1, shape[-1]), shape[-1]
    raw_rows = raw_u8.view(rows.shape[0], -1)
    step = max(1, DEQUANTIZE_CHUNK // cols)
    for start in range(0, rows.shape[0], step):
        chunk = raw_rows[start:start + step]
        rows[start:start + step].copy_(_decode(chunk.reshape(-1), int(ggml_type), (chunk.shape[0], cols)))
    return out


def decode_rows(rows: torch.Tensor, ggml_type: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Whole rows of blocks [n, row bytes] uint8 -> [n, cols] in `dtype`, the values `dequantize` gives them,
    without its checks and chunks: a kept embedding's lookup, once per step (one row's lookup 0.17 -> 0.13 ms
    of a 4 ms decode step)."""
    return _decode(rows.reshape(-1), int(ggml_type), (rows.shape[0], cols)).to(dtype)


def _decode(raw_u8: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values of `shape` from exactly the bytes they take."""
    fn = _DEQUANTIZERS.get(ggml_type)
    out = fn(raw_u8) if fn is not None else _dequantize_with_gguf(raw_u8, ggml_type, shape)
    return out.reshape(shape)


def _as_uint8(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A flat, contiguous uint8 view of any array's bytes (the reader may hand typed F32/F16 arrays)."""
    import torch
    if isinstance(raw, np.ndarray):
        arr = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        if not arr.flags.writeable:
            arr = arr.copy()  # torch warns on read-only memory (e.g. a memmap)
        return torch.from_numpy(arr)
    return raw.contiguous().reshape(-1).view(torch.uint8)


def _dequantize_with_gguf(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Types we do not decode ourselves (K-quants, IQ...): the gguf package's numpy reference."""
    import torch
    from gguf import quants

    block, type_size = _block_layout(ggml_type)
    rows = raw.numpy().reshape(-1, shape[-1] // block * type_size) if shape else raw.numpy()
    try:
        out = quants.dequantize(rows, GGMLQuantizationType(ggml_type))
    except NotImplementedError:
        raise ModelLoadError(f"GGML tensor type {_type_name(ggml_type)} is not supported; supported: "
                             f"{', '.join(SUPPORTED_TYPE_NAMES)} and the K/IQ quants the gguf package "
                             f"decodes") from None
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))
