"""4-bit group-wise weights with a zero point (AWQ's format): as codes and per-group scales in memory, as
AutoAWQ's GEMM tensors on disk (what vLLM and transformers load), and as Q4_Z blocks at run time (the kept-block
kernel, csrc/gguf_linear.cpp).

A weight W [N, K] (features x inputs) is split along K into groups of G; each (feature, group) has a float16 scale
s and an integer zero point z in 0..15, and W[n, k] = (q[n, k] - z) * s with q in 0..15. On disk (AutoAWQ, "gemm"
version): `qweight` int32 [K, N/8], `qzeros` int32 [K/G, N/8], `scales` float16 [K/G, N]; each int32 holds eight
consecutive features' 4-bit values, feature 8c + AWQ_ORDER[i] in bits 4i..4i+3. Run time wants groups of 32 or
more (a Q4_Z block is 32 weights), which covers AutoAWQ's 32, 64 and 128."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.errors import ModelLoadError
from tokenmill.formats.gguf_blocks import Q4_Z, Q4_Z_BLOCK_BYTES, GGMLBlocks

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an int32 holds feature AWQ_ORDER[i] of its eight
BLOCK = 32  # weights per Q4_Z block
LEVELS = 15  # the largest 4-bit code


def pack_features(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] codes 0..15 (C % 8 == 0) -> [R, C/8] int32 in AutoAWQ's order."""
    r, c = codes.shape
    v = codes.to(torch.int32).view(r, c // 8, 8)[..., list(AWQ_ORDER)]
    out = torch.zeros(r, c // 8, dtype=torch.int32)
    for i in range(8):
        out |= v[..., i] << (4 * i)
    return out


def unpack_features(packed: torch.Tensor) -> torch.Tensor:
    """pack_features' inverse: [R, C/8] int32 -> [R, C] uint8."""
    r, c8 = packed.shape
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> (4 * torch.arange(8, dtype=torch.int32))) & 0xF
    out = torch.empty(r, c8, 8, dtype=torch.uint8)
    out[..., list(AWQ_ORDER)] = nibbles.to(torch.uint8)
    return out.view(r, c8 * 8)


@dataclass
class Int4Groups:
    """One weight [N, K] as 4-bit codes `q` [N, K] uint8 with, per feature and group of `group` inputs, a float16
    `scale` [N, K/G] and a uint8 `zero` [N, K/G]."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(q - z) * s, in float32 (exact: a small integer times a float16), then rounded once to `dtype`."""
        z = self.zero.float().repeat_interleave(self.group, dim=1)
        s = self.scale.float().repeat_interleave(self.group, dim=1)
        return ((self.q.float() - z) * s).to(dtype)

    def to_awq(self) -> dict[str, torch.Tensor]:
        """AutoAWQ's GEMM tensors (suffix -> tensor): qweight, qzeros, scales."""
        return {"qweight": pack_features(self.q.T.contiguous()), "qzeros": pack_features(self.zero.T.contiguous()),
                "scales": self.scale.T.contiguous().to(torch.float16)}

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int,
                 name: str = "weight") -> Int4Groups:
        """Read AutoAWQ's GEMM tensors back, checking their shapes agree (a ModelLoadError naming `name` if not)."""
        k, n8 = qweight.shape
        expected = {"qweight": (k, n8), "qzeros": (k // max(group, 1), n8), "scales": (k // max(group, 1), n8 * 8)}
        got = {"qweight": tuple(qweight.shape), "qzeros": tuple(qzeros.shape), "scales": tuple(scales.shape)}
        if group <= 0 or k % group or got != expected:
            raise ModelLoadError(f"{name}: AWQ tensors of shapes {got} do not make a [{n8 * 8}, {k}] weight in "
                                 f"groups of {group} (expected {expected})")
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
            raise ModelLoadError(f"{name}: qweight and qzeros must be int32 (AutoAWQ's GEMM layout), got "
                                 f"{qweight.dtype} and {qzeros.dtype}")
        return cls(q=unpack_features(qweight).T.contiguous(), scale=scales.T.contiguous().to(torch.float16),
                   zero=unpack_features(qzeros).T.contiguous(), group=group)

    def to_blocks(self) -> GGMLBlocks:
        """Q4_Z blocks [N, K/32 * 19] for the kept-block kernel: per 32 inputs, the group's s, z, then byte j =
        code j | code j + 16 << 4 (Q4_0's nibble order)."""
        if self.group % BLOCK:
            raise ModelLoadError(f"AWQ group size {self.group} is not a multiple of {BLOCK}; tokenmill serves groups "
                                 f"of 32, 64, 128, ... (quantize again with --group-size 32, 64 or 128)")
        n, k = self.q.shape
        per = self.group // BLOCK
        s = self.scale.to(torch.float16).repeat_interleave(per, dim=1).unsqueeze(-1).view(torch.uint8)  # [N, KB, 2]
        z = self.zero.repeat_interleave(per, dim=1).unsqueeze(-1)  # [N, KB, 1]
        codes = self.q.view(n, k // BLOCK, BLOCK)
        nibbles = codes[..., :16] | (codes[..., 16:] << 4)
        blocks = torch.cat([s, z, nibbles], dim=-1).reshape(n, -1)
        assert blocks.shape[1] == k // BLOCK * Q4_Z_BLOCK_BYTES
        return GGMLBlocks(Q4_Z, blocks.contiguous(), (n, k))


def quantize_groups(w: torch.Tensor, group: int, shrink: torch.Tensor | None = None) -> Int4Groups:
    """Round-to-nearest asymmetric INT4 of w [N, K] in groups of `group` inputs: per group the range [min, max]
    (widened to hold 0), s = (max - min) / 15, z = round(-min / s), s widened just enough that (0 - z) s and
    (15 - z) s still reach min and max, stored as float16; q = round(w / s) + z. Every weight is then within half
    a step. `shrink` [N, K/G] in (0, 1] narrows each group's range toward zero first (clipping: AWQ's clip search
    picks it; the weights outside are clipped)."""
    n, k = w.shape
    if group <= 0 or k % group:
        raise ValueError(f"group size {group} does not divide the {k} input features")
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)  # zero stays representable
    if shrink is not None:
        lo, hi = lo * shrink, hi * shrink
    s = (hi - lo).clamp(min=1e-5) / LEVELS
    z = (-lo / s).round().clamp(0, LEVELS)
    # the rounded zero point shifts the grid by up to half a step: widen the step so both ends stay on it (an end
    # clipped instead would cost the group's largest weights up to a whole step)
    s = torch.maximum(s, torch.where(z < LEVELS, hi / (LEVELS - z).clamp(min=1), s))
    s = torch.maximum(s, torch.where(z > 0, -lo / z.clamp(min=1), s))
    s16 = s.to(torch.float16)
    s = torch.where(s16.float() < s, torch.nextafter(s16, torch.tensor(torch.inf, dtype=torch.float16)), s16).float()
    q = ((g / s.unsqueeze(-1)).round() + z.unsqueeze(-1)).clamp(0, LEVELS)
    return Int4Groups(q=q.to(torch.uint8).reshape(n, k), scale=s.to(torch.float16), zero=z.to(torch.uint8),
                      group=group)


def fake_quantize(w: torch.Tensor, group: int, shrink: torch.Tensor | None = None) -> torch.Tensor:
    """w as quantize_groups gives it back, in float32."""
    return quantize_groups(w, group, shrink).dequantize()


def awq_config(path: str | Path) -> dict[str, Any] | None:
    """The `quantization_config` of an AWQ checkpoint directory; None for any other model (a GGUF file, a dense
    directory). A config that names AWQ in a form tokenmill does not read is a ModelLoadError naming the field."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    try:
        qc = json.loads(config_file.read_text(encoding="utf-8")).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # load_model_config reports an unreadable config.json
    if not isinstance(qc, dict) or str(qc.get("quant_method", "")).lower() != "awq":
        return None
    bits = qc.get("bits", qc.get("w_bit"))
    group = qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not qc.get("zero_point", True):
        raise ModelLoadError(f"{config_file}: AWQ with bits={bits}, version={version!r}, zero_point="
                             f"{qc.get('zero_point', True)} is not supported; tokenmill reads 4-bit GEMM-layout AWQ "
                             "with zero points (AutoAWQ's default, and what `tokenmill quantize` writes)")
    if not isinstance(group, int) or group <= 0:
        raise ModelLoadError(f"{config_file}: AWQ quantization_config needs a positive group_size, got {group!r}")
    return {**qc, "bits": 4, "group_size": group}
