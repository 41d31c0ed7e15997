"""The one interface between model code and the hardware.

Model code (llama.py, layers.py, linear.py) describes *what* a layer computes, in the order the paper writes it;
a `Backend` decides *how* each op runs on this machine. It is chosen once at start-up (`select_backend`), so no
module ever asks which device it is on, and every fast implementation has the plain-PyTorch `TorchBackend` as
the reference it is tested against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch

from tokenmill.model.backends import recurrent

if TYPE_CHECKING:
    from torch import nn

    from tokenmill.model.attention import AttentionMetadata
    from tokenmill.model.lora import LoRASlots


class LinearWeights(Protocol):
    """What `Backend.linear` reads from a layer: its weight [out, in], optional bias, and `packed_weight`, a
    copy of the weight in the layout the backend prefers (set by `Backend.prepack`; None means use `weight`).
    Quantized formats and tensor-parallel shards become other layouts behind this same call."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    packed_weight: torch.Tensor | None


class Backend(ABC):
    """The ops of a decoder layer over a flat token batch ([T, ...] rows, see model/attention.py)."""

    name: str = "abstract"

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / rms(x) over the last dim; normalised in float32, scaled in x's dtype (as HF does)."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += x in place, then rms_norm(residual): the residual add and the next norm in one pass."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate and up projections side by side) -> silu(gate) * up [T, I]."""

    @abstractmethod
    def rotary_and_write_kv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                            sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the fused projection qkv [T, (H + 2 KVH) D] into q [T, H, D], k, v [T, KVH, D], rotate q and k
        (cos, sin [T, 1, R]: the first R <= D dims of each head, the rest passing through, as Phi-4-mini's partial
        rotary; None: no rotation, a NoPE layer of SmolLM3), and write k, v into the caches at slot_mapping [T].
        May rotate qkv in place."""

    def short_conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                   spans: list[tuple[int, int, int]], silu: bool = False) -> torch.Tensor:
        """A causal depthwise convolution over each request's rows of x [T, C] (LFM2's short convolution; with
        `silu`, followed by SiLU, Gated DeltaNet's over q, k and v): weight [C, K], bias [C] or None. A span
        (start, end, slot) is one request's rows, which continue the K - 1 inputs before them that its slot of
        `state` [slots, K - 1, C] holds; the slot then holds the span's last K - 1 (in place). In float32 (the
        state's dtype), rounded once to x's dtype; each output element is the same sequence of multiply-adds
        whatever else is in the batch."""
        k = weight.shape[1]
        w = weight.float().t()  # [K, C]
        b = bias.float() if bias is not None else None
        out = torch.empty_like(x)

        def taps(window: torch.Tensor, n: int) -> torch.Tensor:  # window [..., n + K - 1, C] -> [..., n, C]
            acc = window[..., 0:n, :] * w[0]
            for j in range(1, k):
                acc = acc + window[..., j:j + n, :] * w[j]
            acc = acc if b is None else acc + b
            return torch.nn.functional.silu(acc) if silu else acc

        if spans and all(end - start == 1 for start, end, _ in spans):  # decodes: one gather for the batch
            rows = torch.tensor([start for start, _, _ in spans], device=x.device)
            slots = torch.tensor([slot for _, _, slot in spans], device=x.device)
            window = torch.cat([state[slots], x[rows].float().unsqueeze(1)], dim=1)  # [B, K, C]
            out[rows] = taps(window, 1).squeeze(1).to(x.dtype)
            state[slots] = window[:, 1:]
            return out
        for start, end, slot in spans:
            window = torch.cat([state[slot], x[start:end].float()])  # [K - 1 + n, C]
            out[start:end] = taps(window, end - start).to(x.dtype)
            state[slot] = window[end - start:]
        return out

    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         a_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                         spans: list[tuple[int, int, int]], tiled: bool = False) -> torch.Tensor:
        """Gated DeltaNet's linear attention over each request's rows (Qwen3.5's linear-attention layers): q, k
        [T, Hk, Dk], v [T, Hv, Dv], each key head serving Hv / Hk consecutive value heads (`tiled`: value head h
        reads key head h % Hk); a, b [T, Hv] the gate
        projections (decay exp(-exp(a_log) * softplus(a + dt_bias)), write strength sigmoid(b)). A span (start, end,
        slot) continues the state [Hv, Dk, Dv] its slot of `state` holds (float32, updated in place). Returns
        [T, Hv, Dv] in v's dtype (model/backends/recurrent.py says how)."""
        return recurrent.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, state, spans, tiled)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / rms(x) * silu(gate) over the last dim (Gated DeltaNet's output norm), rounded as
        transformers rounds it: the normalised x to x's dtype before the weight, the gate in float32."""
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return ((weight * normed) * torch.nn.functional.silu(gate.float())).to(x.dtype)

    def mamba2_scan(self, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, a_log: torch.Tensor,
                    d: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                    spans: list[tuple[int, int, int]]) -> torch.Tensor:
        """Mamba2's selective scan over each request's rows (Granite-4.0-H's Mamba layers): x [T, H, P], dt [T, H]
        (the step before dt_bias and softplus), b, c [T, G, N] each shared by H / G consecutive heads; per token
        s <- exp(dt A) s + dt x b^T with A = -exp(a_log), y = s c + d x. A span (start, end, slot) continues the
        state [H, P, N] its slot holds (float32, in place). Returns y [T, H, P] in x's dtype."""
        return recurrent.mamba2_scan(x, dt, b, c, a_log, d, dt_bias, state, spans)

    def gated_group_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                         groups: int) -> torch.Tensor:
        """weight * rms-normalised(x * silu(gate)) over each of `groups` equal parts of the last dim (Mamba2's
        output norm: gated first, then normalised per group), in float32, rounded to x's dtype before the weight."""
        xf = x.float() * torch.nn.functional.silu(gate.float())
        parts = xf.view(*xf.shape[:-1], groups, -1)
        normed = (parts * torch.rsqrt(parts.pow(2).mean(-1, keepdim=True) + eps)).view(xf.shape)
        return weight * normed.to(x.dtype)

    def qk_norm(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Qwen3's q_norm and k_norm: each q and k head of the fused projection's output qkv [T, (H + 2 KVH) D]
        RMS-normalised over D with its weight [D], written back into qkv, which is returned (rotary comes next).
        Through `rms_norm` on [T * heads, D] rows, so a backend's norm kernel serves it."""
        t, d = qkv.shape[0], q_weight.shape[0]
        for start, heads, weight in ((0, num_heads, q_weight), (num_heads * d, num_kv_heads, k_weight)):
            part = qkv[:, start:start + heads * d]
            part.copy_(self.rms_norm(part.reshape(t * heads, d), weight, eps).view(t, heads * d))
        return qkv

    @abstractmethod
    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata, scale: float | None = None,
                        window: int | None = None) -> torch.Tensor:
        """q [T, H, D]; k, v [T, KVH, D] for the new tokens, already in the caches [blocks, block_size, KVH, D].
        Paged tokens read their context through block tables, fresh prefills attend over their own k, v.
        Scores are scaled by `scale` (None: D ** -0.5). `window` (a sliding-window layer, Gemma 3's local ones): a
        token sees only its last `window` keys, itself included. Returns [T, H, D]."""

    def rms_norm_float_scale(self, x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        """x / rms(x) times a float32 scale [D], in float32, rounded once to x's dtype: Gemma's (1 + w) norms, as
        transformers computes them (Llama's rms_norm rounds to x's dtype before the weight). In float32 that is
        rms_norm, so a backend's norm kernel serves it."""
        if x.dtype == scale.dtype:
            return self.rms_norm(x, scale, eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate and up projections side by side) -> gelu_tanh(gate) * up [T, I]: Gemma's gated MLP."""
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up

    @abstractmethod
    def linear(self, x: torch.Tensor, layer: LinearWeights) -> torch.Tensor:
        """x @ layer.weight.T (+ layer.bias), through whatever copy of the weight this backend keeps."""

    def int8_linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        """Weight-only int8 (tokenmill/quant/int8.py): (x @ layer.qweight.T) * layer.weight_scale (+ bias). On a
        CPU without our kernel, torch's own int8 matmul (which reads the int8 bytes, but scales in x's dtype);
        elsewhere in float32, rounded once to x's dtype, widening the whole weight on every call."""
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
            y = torch._weight_int8pack_mm(x.contiguous(), layer.qweight, layer.weight_scale)
            return y if layer.bias is None else y.add_(layer.bias)
        return _scaled_product(x, layer)

    def fp8_linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        """Weight-only FP8 (tokenmill/quant/fp8.py): (x @ layer.qweight.T) * layer.weight_scale (+ bias), in
        float32 and rounded once to x's dtype; this reference widens the whole weight on every call."""
        return _scaled_product(x, layer)

    def gguf_linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        """A weight kept as GGUF blocks (quant/gguf_linear.py: layer.gguf_blocks of layer.gguf_type): x @ w.T
        (+ bias) with w dequantized as the loader would. This reference dequantizes the whole weight on every
        call; a backend with a block kernel reads the blocks instead."""
        from tokenmill.formats.gguf_blocks import dequantize

        w = dequantize(layer.gguf_blocks, layer.gguf_type, (layer.gguf_blocks.shape[0], x.shape[-1]), x.dtype)
        return torch.nn.functional.linear(x, w, layer.bias)

    def keeps_gguf_type(self, ggml_type: int) -> bool:
        """Whether a weight may be kept in blocks of this type (quant/gguf_linear.py): this reference dequantizes
        any of them per call."""
        return True

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, slots: LoRASlots) -> None:
        """y += each LoRA adapter's update of its run of rows (model/lora.py), in place: per run and part, two
        matmuls. A backend may run them all in one call."""
        for start, end, slot in slots.batch.runs:
            for p, col0 in enumerate(slots.col0s):
                r = int(slots.ranks[p][slot])
                if r:
                    b = slots.b[p][slot, :r]
                    y[start:end, col0:col0 + b.shape[1]].addmm_(x[start:end] @ slots.a[p][slot, :r].t(), b)

    def gate_up_silu(self, x: torch.Tensor, gate_up: nn.Module) -> torch.Tensor:
        """silu(gate) * up of a fused gate/up projection of x: the layer, then silu_mul. A backend may fuse them."""
        return self.silu_mul(gate_up(x))

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: nn.ModuleList,
                    first: int) -> torch.Tensor:
        """A mixture of experts' output [T, hidden] in x's dtype: for each token, the sum over its k experts
        (ids [T, k], global numbers; experts[i] is expert first + i, others add nothing) of weights [T, k] (float32)
        times the expert's SwiGLU of the token. Grouped by expert: each expert's weights are read once, for all
        of its tokens, through the layers' own matmuls (whatever their format). A token's k products are summed
        in float32 in its own top-k order, so its result does not depend on the other tokens of the step."""
        t, k = ids.shape
        local = ids.flatten() - first
        hit = (local >= 0) & (local < len(experts))
        order = torch.argsort(torch.where(hit, local, len(experts)), stable=True)  # slots by expert, the rest last
        counts = torch.bincount(local[hit], minlength=len(experts)).tolist()
        products = x.new_zeros(t * k, x.shape[1])
        start = 0
        for e, n in enumerate(counts):
            if n:
                slots = order[start:start + n]
                products[slots] = experts[e](x[slots // k])
                start += n
        return (products.view(t, k, -1).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)

    def prepack(self, model: nn.Module) -> bool:
        """Give each of `model.linear_layers()` the weight layout this backend multiplies fastest, once, after
        loading and the dtype cast. Returns whether anything was packed; the default keeps the plain weights."""
        return False

    def decode_layers(self, model: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                      ) -> torch.Tensor | None:
        """Optional fast path: run every decoder layer of `model` over the residual stream x [T, hidden] and
        return it (before the final norm), or None, meaning "not here: run the modules". Exists because a
        decode step is tiny and per-op Python overhead would dominate it."""
        return None

    def decode_greedy(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                      block_tables: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
                      stop_ids: torch.Tensor) -> torch.Tensor | None:
        """Optional fast path: up to `steps` greedy decode steps of `model` for a batch of one token per row (ids
        and positions [B], block tables [B, blocks] holding every slot the steps write), each step's first argmax
        of the logits fed back as the next input, ending early once every row has produced one of its stop ids
        (stop_ids [B, S], -1 pads). Returns the tokens [steps run, B], or None ("not here": the caller steps the
        model itself). Exists because a one-stream decode step's Python is a tenth of it on a CPU."""
        return None

    def decode_logits(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                      block_tables: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                      ) -> torch.Tensor | None:
        """Optional fast path: one decode step of `model` for one token per row (as decode_greedy takes them),
        returning float32 logits [B, V] equal to its forward and compute_logits, or None ("not here")."""
        return None

    def sampling_weights(self, logits: torch.Tensor, temperature: torch.Tensor, lowest: float, out: torch.Tensor
                         ) -> torch.Tensor | None:
        """Optional fast path for the sampler (engine/sampler.py): from float32 logits [R, V] into `out`, per row
        exp((x - max) / temperature), 0 where that exponent is below `lowest`; returns each row's max [R] (NaN if
        the row has a NaN; such rows of `out` are not written), or None, meaning "not here: the sampler's torch
        ops"."""
        return None

    def first_argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Optional fast path for greedy rows (engine/sampler.py): per row of float32 logits [R, V], the index of
        the first maximal value, a NaN counting as the maximum (as torch's max(dim=1).indices), int64 [R]; or
        None, meaning "not here: torch's max"."""
        return None

    def describe(self) -> str:
        """One line for the start-up log: which backend, and on what."""
        return self.name


def _scaled_product(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """(x @ layer.qweight.T) * layer.weight_scale (+ bias) in float32, rounded once to x's dtype: the reference of
    the 8-bit weight formats, widening the whole weight."""
    y = torch.nn.functional.linear(x.float(), layer.qweight.float()) * layer.weight_scale
    if layer.bias is not None:
        y += layer.bias.float()
    return y.to(x.dtype)
