"""CpuBackend: the C++ kernels of model/csrc (built per CPU by model/cpu_kernels.py) where they apply, the torch
reference op by op where they do not (another device, a shape or dtype a kernel does not take). Beside it:
cpu_rows.py (a tied embedding's rows read from its LM head's packed copy) and cpu_decode.py (the whole-model decode
path as C++ objects).

Linear layers. Where a packed kernel of our own takes the weight, it serves every row count, so a row's result
never depends on its batch (greedy output is batch-invariant), and the weight is held once:
- bfloat16 on a CPU with AMX or AVX512-BF16: csrc/bf16_linear.cpp (faster than oneDNN at 1-64 rows, BENCHMARKS.md
  "Engine seams");
- float32 with batch_invariant: csrc/f32_linear.cpp's panels (AVX2 or AVX-512).
Otherwise three kernels serve three shapes (measured on 2 AVX2 cores, BENCHMARKS.md "Kernels"):
- decode-shaped inputs (a few rows) go to the skinny kernel, which splits output features across cores and
  streams the weight at memory speed (BLAS runs a one-row product on a single core);
- batched decode (8-128 rows) goes to oneDNN with the weight prepacked once into its blocked layout: BLAS
  repacks the weight on every call, which at these shapes costs as much as the arithmetic (1.5-3x slower);
- large prefill chunks run as fast either way.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.model.backends.base import LinearWeights
from tokenmill.model.backends.cpu_decode import (
    DECODE_MODEL,
    LAYER_STACK,
    LAYER_WEIGHTS,
    decode_model,
    layer_stack,
)
from tokenmill.model.backends.cpu_experts import expert_tensors
from tokenmill.model.backends.cpu_rows import gguf_tile_rows, int8_tile_rows, tile_rows
from tokenmill.model.backends.gguf_tiles import gguf_pack, kernel_dtypes, kernel_layout
from tokenmill.model.backends.huge_pages import move_to_huge_pages
from tokenmill.model.backends.reference import TorchBackend, split_qkv
from tokenmill.model.cpu_kernels import cpu_isa, cpu_tag

if TYPE_CHECKING:
    from tokenmill.model.attention import AttentionMetadata
    from tokenmill.model.lora import LoRASlots

log = logging.getLogger("tokenmill")

SKINNY_MAX_ROWS = 4  # measured on 2 AVX2 cores: at 8 rows BLAS gemm is already as fast (BENCHMARKS.md)
LORA_MATMUL_ROWS = 16  # without batch invariance, a LoRA run of more rows than this takes two matmuls (lora.cpp)
PREPACK_ROWS_HINT = 64  # oneDNN picks its blocking for this many rows; measured best across 2-512 rows


def prepack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] in oneDNN's blocked layout, or None where oneDNN cannot run it (not on the CPU, no
    oneDNN in this torch build, or a dtype this CPU lacks instructions for, e.g. bfloat16 without AVX512)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PREPACK_ROWS_HINT)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        return packed
    except (RuntimeError, AttributeError) as e:
        log.debug("no prepacked weights for %s %s: %s", weight.dtype, tuple(weight.shape), e)
        return None


def _head_tiles_serve_lookups(m: LinearWeights) -> bool:
    """A tied LM head packed in bfloat16 tiles: its embedding looks rows up in them (tile_rows)."""
    return (getattr(m, "shares_weight", False) and m.packed_weight is not None
            and m.packed_weight.dtype == torch.bfloat16 and m.packed_weight.dim() == 4)


def _spans(spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """A step's state spans (AttentionMetadata.state_spans) as the recurrent kernels take them: int64 [n, 3]."""
    return torch.tensor(spans, dtype=torch.long)


def _rows(x: torch.Tensor) -> bool:
    """A [T, D] CPU tensor with unit stride along D and some rows: what every fused kernel takes (an empty batch, a
    context-parallel rank's share of a lone decode, takes the reference path)."""
    return x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1 and x.shape[0] > 0


class CpuBackend(TorchBackend):
    """`ops` is the compiled extension (cpu_kernels._extension()); tests may hand in a stand-in."""

    name = "cpu"

    def __init__(self, ops: Any, bf16_kernel: str = "", f32_panels: bool = False, gguf_kernel: str = "",
                 batch_invariant: bool = False):
        self.ops = ops
        # LoRA updates: every row on csrc/lora.cpp's row loop (a row's result independent of its batch), or runs of
        # more rows than this through two matmuls (LORA_MATMUL_ROWS)
        self.lora_matmul_rows = 0 if batch_invariant else LORA_MATMUL_ROWS
        self.bf16_kernel = bf16_kernel  # ops.bf16_kernel(): "amx", "avx512_bf16", or "" (no packed bf16 kernel)
        # ops.gguf_kernel(), for kept GGUF blocks: "amx" (tiles, bit for bit the dequantized model), "vnni" or
        # "avx2" (int8 activations), or "" (the reference dequantizes them)
        self.gguf_kernel = gguf_kernel
        self.gguf_dtypes = kernel_dtypes(gguf_kernel)  # activations the kept-block kernel takes
        self.f32_panels = f32_panels  # float32 weights in csrc/f32_linear.cpp's panels (batch-invariant)

    def describe(self) -> str:
        bf16 = self.bf16_kernel or "oneDNN / skinny GEMV"
        f32 = "panels" if self.f32_panels else "oneDNN / skinny GEMV"
        amx = getattr(self.ops, "amx_attention_applies", None)
        dots = getattr(self.ops, "tile_attention_applies", None)
        attention = ("AMX tiles for bf16 16-token blocks, else vectors" if amx and amx(16, 64, 2, 1) else
                     "AVX512-BF16 for bf16 16-token blocks, else vectors" if dots and dots(16, 64, 2, 1) else "vectors")
        gguf = {"amx": "AMX tiles", "vnni": "VNNI, int8 activations", "avx2": "AVX2, int8 activations"}.get(
            self.gguf_kernel, "dequantized per call")
        return (f"cpu (C++ kernels, cpu {cpu_tag()}, isa: {cpu_isa() or 'baseline'}; matmuls: bf16 {bf16}, "
                f"f32 {f32}, GGUF blocks {gguf}; paged attention: {attention})")

    # ---- elementwise -----------------------------------------------------------------------------------
    def sampling_weights(self, logits, temperature, lowest, out):
        fused = getattr(self.ops, "sampling_weights", None)
        if fused is None or logits.dtype != torch.float32 or not logits.is_contiguous():
            return None
        return fused(logits, temperature, lowest, out)

    def first_argmax(self, logits):
        fused = getattr(self.ops, "first_argmax", None)
        if fused is None or logits.dtype != torch.float32 or not logits.is_contiguous() or logits.dim() != 2:
            return None
        return fused(logits)

    def rms_norm(self, x, weight, eps):
        if _rows(x) and weight.dtype == x.dtype and weight.is_contiguous():
            return self.ops.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def rms_norm_float_scale(self, x, scale, eps):
        if (_rows(x) and x.dtype != scale.dtype and scale.dtype == torch.float32 and scale.is_contiguous()
                and hasattr(self.ops, "rms_norm_f32_scale")):
            return self.ops.rms_norm_f32_scale(x, scale, eps)
        return super().rms_norm_float_scale(x, scale, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if (_rows(x) and residual.is_contiguous() and x.shape == residual.shape and
                x.dtype == residual.dtype == weight.dtype and weight.is_contiguous()):
            return self.ops.add_rms_norm(x, residual, weight, eps)
        return super().add_rms_norm(x, residual, weight, eps)

    def lora_add(self, y: torch.Tensor, x: torch.Tensor, slots: LoRASlots) -> None:
        if x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu" and x.stride(1) == 1:
            self.ops.lora_add(y, x, slots.a, slots.b, slots.col0s, slots.ranks, slots.batch.runs_tensor,
                              self.lora_matmul_rows)
            return
        super().lora_add(y, x, slots)

    def gated_delta_rule(self, q, k, v, a, b, a_log, dt_bias, state, spans, tiled=False):
        if v.dtype not in (torch.float32, torch.bfloat16) or not spans:
            return super().gated_delta_rule(q, k, v, a, b, a_log, dt_bias, state, spans, tiled)
        out = torch.empty(v.shape, dtype=v.dtype)
        self.ops.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, state, _spans(spans), out, tiled)
        return out

    def mamba2_scan(self, x, dt, b, c, a_log, d, dt_bias, state, spans):
        if x.dtype not in (torch.float32, torch.bfloat16) or not spans:
            return super().mamba2_scan(x, dt, b, c, a_log, d, dt_bias, state, spans)
        out = torch.empty(x.shape, dtype=x.dtype)
        self.ops.mamba2_scan(x, dt, b, c, a_log, d, dt_bias, state, _spans(spans), out)
        return out

    def short_conv(self, x, weight, bias, state, spans, silu=False):
        if not (_rows(x) and spans and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == x.dtype):
            return super().short_conv(x, weight, bias, state, spans, silu)
        out = torch.empty(x.shape, dtype=x.dtype)
        self.ops.causal_conv(x, weight.contiguous(), bias, state, _spans(spans), out, silu)
        return out

    def gated_rms_norm(self, x, gate, weight, eps):
        same = gate.dtype == weight.dtype == x.dtype
        if _rows(x) and _rows(gate) and x.dtype in (torch.float32, torch.bfloat16) and same:
            return self.ops.gated_rms_norm(x, gate, weight, eps)
        return super().gated_rms_norm(x, gate, weight, eps)

    def silu_mul(self, gate_up):
        if _rows(gate_up) and gate_up.is_contiguous():
            return self.ops.silu_mul(gate_up)
        return super().silu_mul(gate_up)

    def rotary_and_write_kv(self, qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping):
        t = qkv.shape[0]
        cache_ok = k_cache.dtype == v_cache.dtype in (qkv.dtype, torch.float8_e4m3fn)  # FP8: written as codes
        # the kernel rotates whole heads: a NoPE layer (cos None) or partial rotary takes the reference path
        whole_heads = cos is not None and cos.shape[-1] == k_cache.shape[-1]
        if (whole_heads and _rows(qkv) and k_cache.is_contiguous() and v_cache.is_contiguous()
                and qkv.dtype == cos.dtype and cache_ok and slot_mapping.dtype == torch.long):
            # rotary in place and the K/V cache write, in one call
            self.ops.rotary_write_kv(qkv, num_heads, num_kv_heads, cos.reshape(t, -1).contiguous(),
                                     sin.reshape(t, -1).contiguous(), k_cache, v_cache, slot_mapping)
            return split_qkv(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
        return super().rotary_and_write_kv(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache,
                                           slot_mapping)

    # ---- attention ---------------------------------------------------------------------------------------
    def attend_paged(self, q, k_cache, v_cache, meta, scale, window=None):
        # a sliding-window layer: the vector kernel, each token from the first key of its window (the reference
        # where the build has no such op)
        kernel = self.ops.paged_attention if window is None else getattr(self.ops, "paged_attention_window", None)
        if (kernel is not None and q.device.type == "cpu"
                and k_cache.dtype == v_cache.dtype in (q.dtype, torch.float8_e4m3fn)
                and k_cache.is_contiguous() and v_cache.is_contiguous()):
            idx = (meta.block_tables, meta.q_rows, meta.kv_lens)
            if all(i.dtype == torch.long and i.is_contiguous() for i in idx):
                return kernel(q.contiguous(), k_cache, v_cache, *idx, scale, *(() if window is None else (window,)))
        return super().attend_paged(q, k_cache, v_cache, meta, scale, window)

    # ---- matmuls -----------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, layer: LinearWeights) -> torch.Tensor:
        packed = layer.packed_weight
        if packed is not None and packed.dim() == 5 and x.dim() == 2:  # gate/up pairs: the plain product too
            blocks = packed.shape[0]
            y = self.ops.bf16_linear(x, packed.view(2 * blocks, *packed.shape[2:]), None)  # packed without bias
            return y.view(-1, blocks, 2, 16).transpose(1, 2).reshape(y.shape)  # [g0 u0 g1 u1 ..] -> [gate | up]
        if packed is not None and packed.dim() == 4 and x.dim() == 2:  # bf16_pack'ed: one kernel, any rows
            return self.ops.bf16_linear(x, packed, layer.bias)
        if packed is not None and packed.dim() == 3 and x.dim() == 2:  # f32_pack'ed panels: the same
            return self.ops.f32_linear(x, packed, layer.bias)
        if (x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and x.device.type == "cpu"
                and torch.get_num_threads() > 1):
            return self.ops.skinny_linear(x, layer.weight, layer.bias)
        if packed is not None and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, layer.bias, "none", [], "")
        return super().linear(x, layer)

    def int8_linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        y = self._w8_linear(x, layer, torch.uint8, self.ops.int8_linear)
        return y if y is not None else super().int8_linear(x, layer)

    def fp8_linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        y = self._w8_linear(x, layer, torch.float8_e4m3fn, self.ops.fp8_linear)
        return y if y is not None else super().fp8_linear(x, layer)

    @staticmethod
    def _w8_linear(x: torch.Tensor, layer: nn.Module, dtype: torch.dtype, kernel: Any) -> torch.Tensor | None:
        """An 8-bit weight's product on its tile kernel, or None where it has no packed copy for x."""
        packed = layer.packed_weight
        if packed is None or packed.dtype != dtype or x.dim() != 2 or x.dtype != torch.bfloat16:
            return None
        if packed.dim() == 5:  # gate/up pairs: the plain product too
            blocks = packed.shape[0]
            y = kernel(x, packed.view(2 * blocks, *packed.shape[2:]), layer.pair_scale, None)
            return y.view(-1, blocks, 2, 16).transpose(1, 2).reshape(y.shape)
        return kernel(x, packed, layer.weight_scale, layer.bias)

    def gguf_linear(self, x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        packed = layer.packed_weight
        if packed is not None and packed.dtype == torch.uint8 and x.dim() == 2 and x.dtype in self.gguf_dtypes:
            if packed.dim() == 4:  # gate/up pairs: the plain product too
                blocks = packed.shape[0]
                y = self.ops.gguf_linear(x, packed.view(2 * blocks, *packed.shape[2:]), None)
                return y.view(-1, blocks, 2, 16).transpose(1, 2).reshape(y.shape)
            return self.ops.gguf_linear(x, packed, layer.bias)
        return super().gguf_linear(x, layer)

    def gate_up_silu(self, x: torch.Tensor, gate_up: nn.Module) -> torch.Tensor:
        packed = getattr(gate_up, "packed_weight", None)
        if (packed is not None and _rows(x) and x.dtype in self.gguf_dtypes and packed.dim() == 4
                and packed.dtype == torch.uint8):
            return self.ops.gguf_linear_silu(x, packed)
        if packed is not None and _rows(x) and x.dtype == torch.bfloat16:
            if packed.dim() == 5 and packed.dtype == torch.uint8:
                return self.ops.int8_linear_silu(x, packed, gate_up.weight_scale)
            if packed.dim() == 5 and packed.dtype == torch.float8_e4m3fn:
                return self.ops.fp8_linear_silu(x, packed, gate_up.weight_scale)
            if packed.dim() == 5:
                return self.ops.bf16_linear_silu(x, packed)  # SiLU-and-multiply in the matmul's epilogue
        return super().gate_up_silu(x, gate_up)

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: nn.ModuleList,
                    first: int) -> torch.Tensor:
        """csrc/moe.cpp: the grouped experts in one call (the experts spread over the threads while each has few
        tokens), through the same linear kernels as the reference path, so the same bits."""
        kernel = getattr(self.ops, "moe_experts", None)
        tensors = expert_tensors(experts) if kernel is not None and _rows(x) else None
        if tensors is None:
            return super().moe_experts(x, ids, weights, experts, first)
        return kernel(x, ids, weights, first, *tensors)

    def pack_int8(self, q: torch.Tensor, silu_pairs: bool = False) -> torch.Tensor | None:
        """An int8 or FP8 weight (quant/int8.py, quant/fp8.py) in csrc/int8_linear.cpp's tile layout, where that
        kernel runs (AMX or AVX512-BF16, and the model computes in bfloat16); None keeps the weight for the
        reference."""
        n, k = q.shape
        if q.device.type != "cpu" or not self.bf16_kernel or n % 16 or k % 32:
            return None
        fp8 = q.dtype == torch.float8_e4m3fn
        if silu_pairs and n % 32 == 0:
            return self.ops.fp8_pack_gate_up(q) if fp8 else self.ops.int8_pack_gate_up(q)
        return self.ops.fp8_pack(q) if fp8 else self.ops.int8_pack(q)

    def pack_weight(self, weight: torch.Tensor, silu_pairs: bool = False) -> torch.Tensor | None:
        """`weight` in the layout this CPU multiplies fastest: for bfloat16 where the CPU has AMX or AVX512-BF16,
        the tile layout of csrc/bf16_linear.cpp (one kernel for every row count: batch-invariant), and a fused
        gate/up weight (`silu_pairs`) in gate/up pairs whose matmul applies SiLU-and-multiply itself
        (bit for bit the separate ops, without the [T, 2I] intermediate); else oneDNN's blocked layout; else None
        (keep the plain one)."""
        if weight.device.type != "cpu":
            return None
        n, k = weight.shape
        if (silu_pairs and weight.dtype == torch.bfloat16 and self.bf16_kernel and n % 32 == 0
                and k % 32 == 0):
            return self.ops.bf16_pack_gate_up(weight)
        if weight.dtype == torch.bfloat16 and self.bf16_kernel and n % 16 == 0 and k % 32 == 0:
            return self.ops.bf16_pack(weight)
        if weight.dtype == torch.float32 and self.f32_panels and n % 16 == 0:
            return self.ops.f32_pack(weight)
        return prepack_weight(weight)

    def prepack(self, model: nn.Module) -> bool:
        """Packed copies of every matmul weight; returns whether any was packed. A oneDNN copy sits beside the
        plain weight (the skinny kernel reads that for a few rows); a bfloat16 tile or float32 panel copy serves
        every row count, so the plain weight is released as soon as its copy exists (left on the meta device: shape
        and dtype, no memory; load_hf_weights allocates it again), which keeps the peak one layer above the final
        weights. A tied LM head's packed copy (bfloat16 tiles, GGML blocks, int8 tiles) serves the embedding's
        lookups too, and the table they read before is released likewise (_lookups_from_head)."""
        packed_any = False
        for m in model.linear_layers():
            pairs = getattr(m, "silu_pairs", False) and m.bias is None  # the fused epilogue adds no bias
            if getattr(m, "gguf_type", None) is not None:  # GGUF blocks: packed, or the reference on the blocks
                # (a weight whose rows do not fill whole 16-feature tiles, e.g. Mamba2's in_proj, takes the latter)
                whole_tiles = m.gguf_blocks.shape[0] % (32 if pairs else 16) == 0
                if model.norm.weight.dtype in self.gguf_dtypes and whole_tiles:
                    m.packed_weight = gguf_pack(m.gguf_blocks, m.gguf_type, pairs=pairs,
                                                layout=kernel_layout(self.gguf_kernel, m.gguf_type))
                    m.gguf_blocks = m.gguf_blocks.to("meta")
                    self._lookups_from_head(m)
                    packed_any = True
                continue
            if getattr(m, "qweight", None) is not None:  # int8: its own layout, or the reference on the int8
                if model.norm.weight.dtype == torch.bfloat16:
                    m.packed_weight = self.pack_int8(m.qweight, silu_pairs=pairs)
                if m.packed_weight is not None:
                    m.pair_scale = self._pair_order(m.weight_scale) if m.packed_weight.dim() == 5 else None
                    packed_any = True
                    m.qweight = m.qweight.to("meta")
                    self._lookups_from_head(m)
                continue
            m.packed_weight = self.pack_weight(m.weight, silu_pairs=pairs)
            packed_any |= m.packed_weight is not None
            if isinstance(m, nn.Module) and m.packed_weight is not None and m.packed_weight.dim() in (3, 4, 5):
                m.weight = nn.Parameter(m.weight.to("meta"), requires_grad=False)
            else:
                self._lookups_from_head(m)
        self._to_huge_pages(model)
        for key in (LAYER_WEIGHTS, LAYER_STACK, DECODE_MODEL):
            model.backend_cache.pop(key, None)
        return packed_any

    def _to_huge_pages(self, model: nn.Module) -> None:
        """The packed weights (every decode step streams them) into 2 MiB pages: backends/huge_pages.py."""
        layers = [m for m in model.linear_layers() if isinstance(m.packed_weight, torch.Tensor)
                  and m.packed_weight.device.type == "cpu" and not m.packed_weight.is_mkldnn]
        moved = move_to_huge_pages([(m, "packed_weight") for m in layers])
        if moved:
            log.info("packed weights on 2 MiB pages: %.1f MiB", moved / 2**20)
            for m in layers:  # the moved copy now
                self._lookups_from_head(m)

    def _lookups_from_head(self, m: LinearWeights) -> None:
        """A tied LM head with a packed copy the embedding can read (bfloat16 tiles, GGML blocks, int8 tiles):
        the lookups read that copy from now on, and the table they read before is released."""
        packed = m.packed_weight
        if (not getattr(m, "shares_weight", False) or not isinstance(packed, torch.Tensor) or packed.is_mkldnn
                or packed.dim() not in (3, 4)):
            return
        dtype = m.embedding.weight.dtype
        gather = getattr(self.ops, "tile_rows", None)
        if getattr(m, "gguf_type", None) is not None and packed.dim() == 3:
            decode = getattr(self.ops, "gguf_decode_rows", None)
            layout = kernel_layout(self.gguf_kernel, m.gguf_type)
            m.embedding.keep_rows(gguf_tile_rows(packed, m.gguf_type, layout, dtype, self.ops.gather_tile_bytes,
                                                 decode))
        elif getattr(m, "weight_scale", None) is not None and packed.dtype == torch.uint8 and packed.dim() == 4:
            m.embedding.keep_rows(int8_tile_rows(packed, m.weight_scale, dtype, gather))
        elif _head_tiles_serve_lookups(m):
            m.embedding.keep_rows(tile_rows(packed, gather))

    @staticmethod
    def _pair_order(scale: torch.Tensor) -> torch.Tensor:
        """A gate/up projection's [2I] scales (gate, then up) in the feature order of its packed pairs (16 gate,
        16 up, ...): the scales of its plain product from the pairs."""
        return scale.view(2, -1, 16).transpose(0, 1).reshape(-1).contiguous()

    # ---- the whole-model decode path ---------------------------------------------------------------------
    def decode_layers(self, model: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                      ) -> torch.Tensor | None:
        """When every token reads the cache (decode steps, later prefill chunks), the Llama decoder layers are
        one C++ call (`DecoderStack.run`: no Python between a step's ~300 ops, each layer's residual add joined
        with the next one's input norm), the same math as the modules."""
        if meta.fresh_spans or not _rows(x) or not x.is_contiguous():
            return None
        stack = layer_stack(self.ops, model, self.lora_matmul_rows)
        if stack is None or len(stack) != len(kv_caches):
            return None
        lora = getattr(model, "lora_batch", None)  # adapter runs (model/lora.py): added after each projection
        runs = lora.runs_tensor if lora is not None and lora.runs else None
        if runs is not None and (x.dtype not in (torch.float32, torch.bfloat16) or not stack.has_lora()):
            return None
        cfg, t = model.config, x.shape[0]
        cos, sin = cos.reshape(t, -1).contiguous(), sin.reshape(t, -1).contiguous()
        stack.run(x, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps, cos, sin, [k for k, _ in kv_caches],
                  [v for _, v in kv_caches], meta.slot_mapping, meta.block_tables, meta.q_rows, meta.kv_lens, runs)
        return x

    def decode_greedy(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                      block_tables: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], steps: int,
                      stop_ids: torch.Tensor) -> torch.Tensor | None:
        """The steps in one C++ call (`DecodeModel.run`): the embedding lookup, the layers, the final norm, the LM
        head and the argmax, each the op the Python step runs, so the same tokens."""
        decoder = decode_model(self.ops, model, input_ids, int(positions.max()) + steps if positions.numel() else 1)
        if decoder is None:
            return None
        return decoder.run(input_ids, positions, block_tables, [k for k, _ in kv_caches], [v for _, v in kv_caches],
                           steps, stop_ids)

    def decode_logits(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                      block_tables: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                      ) -> torch.Tensor | None:
        """One step in one C++ call (`DecodeModel.logits`), the same logits as the modules and compute_logits."""
        decoder = decode_model(self.ops, model, input_ids, int(positions.max()) + 1 if positions.numel() else 1)
        if decoder is None:
            return None
        return decoder.logits(input_ids, positions, block_tables, [k for k, _ in kv_caches], [v for _, v in kv_caches])
