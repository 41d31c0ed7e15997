"""GGUF types re-cut at load into blocks of 32 that a kept-block kernel reads (csrc/gguf_vnni.cpp, csrc/gguf_avx2.cpp),
each weight
exactly the value llama.cpp's dequantizer gives it:

- Q4_K  -> Q4_KS: each 32-weight sub-block with its scale d * sc and its min dmin * m in float32 (24 bytes per 32
                   weights against the file's 18: 1.33x);
- Q5_K  -> Q5_KS: Q4_KS's scales, the fifth bits as a 32-bit field and the low nibbles (28 bytes per 32 against
                   22: 1.27x);
- Q5_1  -> Q5_KS: d and m widened to float32, the rest as it is (28 bytes against 24: 1.17x); a Q5_K_M file holds
                   Q5_1 where a row is not a multiple of 256 long (q * d + m is Q5_KS's arithmetic);
- Q6_K  -> Q6_KS: each 32 weights with the super-block's d and the two 16-weight halves' int8 scales, the 6-bit
                   quants one a byte (36 bytes per 32 against 26.25: 1.37x);
- Q5_0  -> Q8_0:  q - 16 is a signed byte, under the same float16 d (34 bytes against 22: 1.55x), only where a
                   fused layer's other parts are Q8_0 (Gemma 3's q and k beside a Q8_0 v); elsewhere Q5_0 is kept
                   as it is (Q4_K_M files hold it where a row is not a multiple of 256 long).

The blocks of 256 themselves would take an integer dot product per 256 weights (llama.cpp's Q8_K activations); the
kernels here round x per 32 (one scale per block of 32, as for Q4_0/Q8_0), so a block carries its own scales. The
cost is bytes: measured against the file's size in BENCHMARKS.md ("K-quants kept").
"""

from __future__ import annotations

import torch

from tokenmill.formats.gguf_blocks import Q4_KS, Q5_KS, Q6_KS, GGMLQuantizationType

Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0 = (int(GGMLQuantizationType.Q4_K), int(GGMLQuantizationType.Q5_K),
                                      int(GGMLQuantizationType.Q6_K), int(GGMLQuantizationType.Q5_0),
                                      int(GGMLQuantizationType.Q5_1), int(GGMLQuantizationType.Q8_0))
# file type -> the type its blocks are kept as
TRANSCODED = {Q4_K: Q4_KS, Q5_K: Q5_KS, Q6_K: Q6_KS, Q5_1: Q5_KS, Q5_0: Q8_0}


def transcode(data: torch.Tensor, ggml_type: int) -> tuple[int, torch.Tensor]:
    """Raw blocks [N, row bytes] of a TRANSCODED type -> (the kept type, its raw blocks [N, K/32 * bytes])."""
    fn = {Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k, Q5_1: _q5_1, Q5_0: _q5_0}[int(ggml_type)]
    n = data.shape[0]
    return TRANSCODED[int(ggml_type)], fn(data.reshape(-1)).reshape(n, -1).contiguous()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 32] values in 0..15 -> [..., 16] bytes ordered as Q4_0's: byte i = q[i] | q[i + 16] << 4."""
    return q[..., :16] | (q[..., 16:] << 4)


def _sub_block_scales(blocks: torch.Tensor) -> torch.Tensor:
    """A Q4_K or Q5_K super-block's d, dmin (float16) and 12 bytes of 6-bit scales and mins -> per sub-block of 32
    (d * sc, -(dmin * m)) in float32 [n, 8, 2]: exact products."""
    s = blocks[:, 4:16]
    sc = torch.empty(blocks.shape[0], 8, dtype=torch.uint8)
    mn = torch.empty_like(sc)
    sc[:, :4], mn[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return torch.stack([d * sc.float(), -(dmin * mn.float())], dim=-1)


def _low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes of a K-quant's nibbles -> [n, 8, 32] values: 4 chunks of 64 weights, sub-block 2c in the low
    nibbles, 2c + 1 in the high ones."""
    qs = qs.reshape(-1, 4, 32)
    return torch.stack([qs & 0x0F, qs >> 4], dim=2).view(-1, 8, 32)


def _q4_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 144)  # d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
    out = torch.empty(blocks.shape[0], 8, 24, dtype=torch.uint8)
    out[:, :, 0:8] = _sub_block_scales(blocks).view(torch.uint8).view(-1, 8, 8)
    out[:, :, 8:] = _nibbles(_low_nibbles(blocks[:, 16:]))
    return out


def _q5_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 176)  # Q4_K's d, dmin and scales, 32 bytes of fifth bits, 128 bytes of nibbles
    qh = blocks[:, 16:48].to(torch.int64)  # byte l, bit s: sub-block s's weight l
    bits = (qh[:, None, :] >> torch.arange(8)[None, :, None]) & 1  # [n, 8 sub-blocks, 32]
    field = (bits << torch.arange(32)).sum(-1).to(torch.int32)  # bit l: weight l's fifth bit
    out = torch.empty(blocks.shape[0], 8, 28, dtype=torch.uint8)
    out[:, :, 0:8] = _sub_block_scales(blocks).view(torch.uint8).view(-1, 8, 8)
    out[:, :, 8:12] = field.contiguous().view(torch.uint8).view(-1, 8, 4)
    out[:, :, 12:] = _nibbles(_low_nibbles(blocks[:, 48:]))
    return out


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 210)  # 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, d (float16)
    ql, qh = blocks[:, :128].view(-1, 2, 64), blocks[:, 128:192].view(-1, 2, 32)
    q = torch.empty(blocks.shape[0], 2, 4, 32, dtype=torch.uint8)  # per half of 128: four runs of 32
    q[:, :, 0] = (ql[:, :, :32] & 0x0F) | ((qh & 3) << 4)
    q[:, :, 1] = (ql[:, :, 32:] & 0x0F) | (((qh >> 2) & 3) << 4)
    q[:, :, 2] = (ql[:, :, :32] >> 4) | (((qh >> 4) & 3) << 4)
    q[:, :, 3] = (ql[:, :, 32:] >> 4) | (((qh >> 6) & 3) << 4)
    out = torch.empty(blocks.shape[0], 8, 36, dtype=torch.uint8)
    out[:, :, 0:2] = blocks[:, None, 208:210]
    out[:, :, 2:4] = blocks[:, 192:208].view(-1, 8, 2)  # the scales of each 32's two halves of 16
    out[:, :, 4:] = q.view(-1, 8, 32)
    return out


def _q5_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 24)  # d, m (float16), 32 high bits, 16 bytes of nibbles (Q4_0's order)
    out = torch.empty(blocks.shape[0], 28, dtype=torch.uint8)
    scales = blocks[:, 0:4].contiguous().view(torch.float16).float()  # d, m: exact in float32
    out[:, 0:8] = scales.view(torch.uint8)
    out[:, 8:] = blocks[:, 4:]
    return out


def _q5_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(-1, 22)  # d (float16), 32 high bits, 16 bytes of nibbles (Q4_0's order)
    high = blocks[:, 2:6].contiguous().view(torch.int32)  # bit j: weight j's fifth bit
    bits = (high >> torch.arange(32, dtype=torch.int32)) & 1
    low = torch.cat([blocks[:, 6:] & 0x0F, blocks[:, 6:] >> 4], dim=1).to(torch.int32)
    q = (low | (bits << 4)) - 16
    out = torch.empty(blocks.shape[0], 34, dtype=torch.uint8)
    out[:, :2] = blocks[:, :2]
    out[:, 2:] = q.to(torch.int8).view(torch.uint8)
    return out
