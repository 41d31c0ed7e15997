// The Python module: every kernel's binding, and nothing else. Only this source includes pybind.h (with the Tensor
// casters the module needs); the kernels include the ATen headers they use, not torch/extension.h (the whole C++
// frontend), which took most of a build's time.
#include <torch/csrc/utils/pybind.h>

#include "decode_stack.h"
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over block tables (CPU)");
  m.def("skinny_linear", &skinny_linear, "x @ w.T (+ b) for few rows, output features split over threads");
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, D] rows");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then RMSNorm of residual");
  m.def("rms_norm_f32_scale", &rms_norm_f32_scale, "x / rms(x) * scale in float32, rounded once (Gemma's norms)");
  m.def("rotary_write_kv", &rotary_write_kv, "rotary on q and k in place, then k and v into the paged caches");
  m.def("first_argmax", &first_argmax, "per row of float32 logits, the first index of the maximum (NaN first)");
  m.def("sampling_weights", &sampling_weights, "the sampler's exp((x - max) / t), 0 below `lowest`, into out; -> max");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [T, 2I] projection");
  m.def("bf16_kernel", &bf16_kernel, "the packed bfloat16 matmul kernel here: amx, avx512_bf16 or none");
  m.def("bf16_pack", &bf16_pack, "a [N, K] bfloat16 weight in the tile layout [N/16, K/32, 16, 32]");
  m.def("bf16_linear", &bf16_linear, "x @ w.T (+ b), w from bf16_pack, on bf16_kernel(); batch-invariant");
  m.def("amx_linear", &amx_linear, "bf16_linear on AMX tiles");
  m.def("bf16_pack_gate_up", &bf16_pack_gate_up, "a [2I, K] gate/up weight as [I/16, 2, K/32, 16, 32]: gate, up pairs");
  m.def("bf16_linear_silu", &bf16_linear_silu, "silu(x @ gate.T) * (x @ up.T) from bf16_pack_gate_up");
  m.def("int8_pack", &int8_pack, "a [N, K] int8 weight as bytes q + 128 in bf16_pack's tile layout");
  m.def("int8_pack_gate_up", &int8_pack_gate_up, "a [2I, K] int8 gate/up weight in gate, up block pairs");
  m.def("int8_linear", &int8_linear, "(x @ q.T) * scale (+ b), q from int8_pack; batch-invariant");
  m.def("int8_linear_silu", &int8_linear_silu, "silu(gate) * up of int8 gate/up pairs");
  m.def("fp8_pack", &fp8_pack, "a [N, K] float8_e4m3fn weight in bf16_pack's tile layout");
  m.def("fp8_pack_gate_up", &fp8_pack_gate_up, "a [2I, K] float8_e4m3fn gate/up weight in gate, up block pairs");
  m.def("fp8_linear", &fp8_linear, "(x @ q.T) * scale (+ b), q e4m3 from fp8_pack; batch-invariant");
  m.def("fp8_linear_silu", &fp8_linear_silu, "silu(gate) * up of FP8 gate/up pairs");
  m.def("gguf_tile_bytes", &gguf_tile_bytes, "packed bytes per 16 x 32 tile of a kept GGML type (0: not kept)");
  m.def("gguf_decode_rows", &gguf_decode_rows, "whole rows of Q8_0, Q4_0, Q4_1 or Q4_Z blocks decoded into out");
  m.def("tile_rows", &tile_rows, "rows ids of a weight packed by bf16_pack or int8_pack, as [n, K]");
  m.def("gather_tile_bytes", &gather_tile_bytes, "packed[rows / 16, kb, sources[rows % 16]] ^ flip");
  m.def("gguf_linear", &gguf_linear, "x @ w.T (+ b), w in GGML blocks packed by gguf_pack for gguf_kernel()");
  m.def("gguf_linear_silu", &gguf_linear_silu, "silu(gate) * up of GGML gate/up block pairs, on gguf_kernel()");
  m.def("gguf_tiles_linear", &gguf_tiles_linear, "gguf_linear widened to bfloat16 tiles: bit for bit the dequantized");
  m.def("gguf_tiles_linear_silu", &gguf_tiles_linear_silu, "gguf_linear_silu widened to bfloat16 tiles");
  m.def("gguf_kernel", &gguf_kernel, "the kept-GGUF kernel here: amx (tiles), vnni or avx2 (int8 x), or none");
  m.def("gguf_vnni_linear", &gguf_vnni_linear, "x @ w.T (+ b), w in GGML blocks packed as quads, x as int8 blocks");
  m.def("gguf_vnni_linear_silu", &gguf_vnni_linear_silu, "silu(gate) * up of GGML gate/up block pairs as quads");
  m.def("gguf_avx2_linear", &gguf_avx2_linear, "gguf_vnni_linear with AVX2 products; x bfloat16 or float32");
  m.def("gguf_avx2_linear_silu", &gguf_avx2_linear_silu, "gguf_vnni_linear_silu with AVX2 products");
  m.def("dpbf16_linear", &dpbf16_linear, "bf16_linear with AVX512-BF16 dot products");
  m.def("gated_delta_rule", &gated_delta_rule, "Gated DeltaNet over each request's rows, its slot's state in place");
  m.def("causal_conv", &causal_conv, "a causal depthwise convolution over each request's rows, its state in place");
  m.def("mamba2_scan", &mamba2_scan, "Mamba2's selective scan over each request's rows, its slot's state in place");
  m.def("gated_rms_norm", &gated_rms_norm, "weight * x / rms(x) * silu(gate) per row");
  m.def("f32_panels_available", &f32_panels_available, "whether this build has the float32 panel matmul");
  // without the GIL: its threads run ATen ops, and one that dispatches to Python (a meta tensor's) would wait on it
  m.def("moe_experts", &moe_experts, "a mixture of experts' MLP: tokens grouped by expert, k products summed per token",
        py::call_guard<py::gil_scoped_release>());
  m.def("lora_add", &lora_add, "y[run rows] += (x A_s^T) B_s per run and part: LoRA adapters (model/lora.py)");
  m.def("f32_pack", &f32_pack, "a [N, K] float32 weight in 16-feature panels [N/16, K, 16]");
  m.def("f32_linear", &f32_linear, "x @ w.T (+ b), w from f32_pack; batch-invariant");
  m.def("paged_attention_vectors", &paged_attention_vectors, "paged_attention on the float32 vector kernel only");
  m.def("paged_attention_window", &paged_attention_window,
        "paged_attention where each token sees its last `window` keys (a sliding-window layer)");
  m.def("amx_attention_applies", &amx_attention_applies,
        "whether paged_attention runs on AMX tiles for a bf16 cache of this block size, head_dim and heads");
  m.def("tile_attention_applies", &tile_attention_applies,
        "whether paged_attention runs bf16 dot products (AMX or AVX512-BF16) for a bf16 cache of this shape");
  // module_local: a build for another CPU (tests/model/test_isa_builds.py) loads into the same process
  py::class_<DecoderStack>(m, "DecoderStack", "every decoder layer of a model, run in one call a step",
                           py::module_local())
      .def(py::init<std::vector<std::vector<at::Tensor>>>())
      .def("__len__", &DecoderStack::size)
      .def("set_lora", &DecoderStack::set_lora, "LoRA slots of every layer's projections (model/lora.py)")
      .def("has_lora", &DecoderStack::has_lora)
      .def("run", &DecoderStack::run, "x through every layer, in place (an all-paged batch); lora_runs: rows "
           "through LoRA slots", py::arg("x"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("eps"),
           py::arg("cos"), py::arg("sin"), py::arg("k_caches"), py::arg("v_caches"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("q_rows"), py::arg("kv_lens"), py::arg("lora_runs") = py::none());
  py::class_<RowLookup>(m, "RowLookup", "token ids -> embedding rows, as the model looks them up",
                        py::module_local())
      .def(py::init<std::string, at::Tensor, at::Tensor, at::Tensor, int64_t, at::Tensor, at::Tensor>())
      .def("rows", &RowLookup::rows, "the rows of these ids");
  // keep_alive: the decoder holds references to the stack and the lookup, which must outlive it
  py::class_<DecodeModel>(m, "DecodeModel", "the whole model for decode steps, no Python between tokens",
                            py::module_local())
      .def(py::init<const DecoderStack&, const RowLookup&, at::Tensor, double, at::Tensor, at::Tensor, at::Tensor,
                    at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t>(),
           py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def("logits", &DecodeModel::logits, "one decode step: float32 logits of each row's next token")
      .def("run", &DecodeModel::run, "up to `steps` greedy tokens per row, each fed back");
}
