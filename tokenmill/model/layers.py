"""Building blocks of the Llama family: vocab embedding, RMSNorm, rotary embedding (with llama3 scaling), SwiGLU MLP.

Each module holds its weights and says what it computes; the backend it is given computes it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.backends import Backend, TorchBackend
from tokenmill.model.linear import Linear, LinearMethod


class VocabEmbedding(nn.Module):
    """Token ids -> rows of a [vocab, hidden] weight (the LM head's too, when tied). A weight format that keeps the
    table in compressed rows (`keep_rows`: e.g. a GGUF file's blocks, quant/gguf_linear.py) decodes only the rows
    a step looks up, and the dense table is released."""

    rows: Callable[[torch.Tensor], torch.Tensor] | None = None  # token ids -> their dense rows, when kept
    kept: torch.Tensor | None = None  # what `rows` reads, where only it holds it (weight_bytes counts it)

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden, dtype=dtype))
        # finite when built off the meta device; not nn.init.normal_, which on meta imports torch._dynamo (1 s, 36 MB)
        nn.init.uniform_(self.weight, -1.0, 1.0)

    def keep_rows(self, rows: Callable[[torch.Tensor], torch.Tensor], kept: torch.Tensor | None = None) -> None:
        """Look rows up through `rows` from now on (until the weights are loaded again) and release the table;
        `kept`: the data `rows` reads, where no other module holds it (an untied table's blocks)."""
        self.rows, self.kept = rows, kept
        self.weight = nn.Parameter(self.weight.to("meta"), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.rows is not None and self.weight.is_meta:
            return self.rows(input_ids)
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, backend: Backend | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps
        self.backend = backend if backend is not None else TorchBackend()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x (in place), then the norm of residual: the residual add and the next norm in one pass."""
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.get("rope_type") == "longrope":  # longrope: rope_frequencies
        return inv_freq
    if scaling.get("rope_type") == "linear":  # positions divided by `factor` (Gemma 3's global layers)
        return inv_freq / scaling["factor"]
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    factor = scaling["factor"]
    low_ff, high_ff = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_frequencies(dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
                     ) -> tuple[torch.Tensor, float]:
    """The rotary frequencies [dim / 2] (a position's angles are position x these) and the scale of cos and sin (1
    but for long-rope).

    Long-rope (Phi-3): the frequencies divided by `short_factor` or `long_factor`, cos and sin scaled by
    `attention_factor`, as transformers computes them. Transformers picks the set by a sequence's length so far
    and, once a sequence grows past the original context, recomputes its whole cache with the long factors
    (Phi3ForCausalLM.prepare_inputs_for_generation). A cache that is never recomputed must hold one set, or a
    sequence's keys would disagree on positions; so the set is chosen once, for the context served
    (`max_positions`; `long`, ModelConfig.serving), as llama.cpp chooses: long where sequences may grow past the
    original context. Equal to transformers for every sequence when the served context fits the original one, and
    otherwise for every sequence whose prompt is longer than it."""
    if scaling is None or scaling.get("rope_type") != "longrope":
        return rope_inv_freq(dim, theta, scaling), 1.0
    long = scaling.get("long", max_positions > scaling["original_max_position_embeddings"])
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    inv_freq = 1.0 / (factors * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, scaling["attention_factor"]


TABLE_POSITIONS = 4096  # rotary tables start this long and double as positions past them are served


class RotaryEmbedding(nn.Module):
    """cos/sin tables, rotation in the non-interleaved (HF) layout, of the first `rotary_dim` dims of each head (all
    of head_dim unless the model rotates part of it, as Phi-4-mini).

    The tables cover the positions served so far, from TABLE_POSITIONS rows, doubling up to `max_positions` when a
    step reaches past them (`cover`): whole tables for a 32k context are 64 MiB a table pair in float32 (Gemma 3
    holds two pairs, 128 MiB beside a 241 MiB file). A position's row is the same whatever the tables' length (the
    angle is position x frequency, elementwise), so growing changes no output."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.max_positions = max_positions
        self.inv_freq, self.scale = rope_frequencies(rotary_dim or head_dim, max_positions, theta, scaling)
        cos, sin = self._compute(min(max_positions, TABLE_POSITIONS), self.inv_freq.device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._rounded: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def _compute(self, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(positions, dtype=torch.float32), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:  # as transformers: scaled in float32, rounded to the model's dtype afterwards
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(device), sin.to(device)

    def cover(self, positions: int) -> bool:
        """Make the tables hold positions [0, positions) (at most max_positions); True if they grew (tables handed
        out before, by `rounded`, are then too short)."""
        held = self.cos.shape[0]
        if positions <= held or held >= self.max_positions:
            return False
        self.cos, self.sin = self._compute(min(self.max_positions, max(positions, 2 * held)), self.cos.device)
        self._rounded.clear()
        return True

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] cos and sin for the batch's positions, shared by every layer of one step. The whole
        tables are rounded to `dtype` once (the same values as rounding the rows picked), so a step indexes them
        and nothing more: a decode step ran ~6 torch ops here."""
        if positions.device.type != "cpu":
            self.cover(self.max_positions)  # the whole tables once: no device sync per step to read a position
        elif positions.numel():
            self.cover(int(positions.max()) + 1)
        cos, sin = self.rounded(dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def rounded(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The [positions covered, head_dim] cos and sin tables in `dtype`, rounded once."""
        key = (dtype, self.cos.device)
        tables = self._rounded.get(key)
        if tables is None:
            tables = self._rounded[key] = (self.cos.to(dtype), self.sin.to(dtype))
        return tables


class DepthwiseConv(nn.Module):
    """The convolution's weights as the checkpoint holds them: weight [C, 1, K], bias [C] or none."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype | None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(channels, dtype=dtype)) if bias else None


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, backend: Backend | None = None,
                 dtype: torch.dtype | None = None, method: LinearMethod | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        super().__init__()
        self.backend = backend if backend is not None else TorchBackend()
        self.reduce = reduce  # tensor parallelism: down_proj is row-parallel, its partial sums are all-reduced
        self.gate_up_proj = Linear(hidden, [intermediate, intermediate], bias=False, backend=self.backend,
                                   method=method, dtype=dtype)
        self.gate_up_proj.silu_pairs = True  # a backend may pack it to apply SiLU-and-multiply in the matmul
        self.down_proj = Linear(intermediate, hidden, bias=False, backend=self.backend, method=method, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj  # with adapter slots: the plain matmul (its runs added), then SiLU-and-multiply
        h = self.backend.gate_up_silu(x, gate_up) if gate_up.lora is None else self.backend.silu_mul(gate_up(x))
        out = self.down_proj(h)
        return out if self.reduce is None else self.reduce(out)
