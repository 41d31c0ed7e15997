// The kernels' entry points, one block per source: what bindings.cpp binds and what the sources call of each
// other (the decode stack calls the norms, attention and linear_any; moe.cpp linear_any and gate_up_silu). Declared
// once here, for every source that calls them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <vector>

// paged_attention.cpp: attention over the block-structured KV cache (the vector kernel, or tile_attention.cpp's).
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                           at::Tensor q_rows, at::Tensor kv_lens, double scale);
at::Tensor paged_attention_window(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor q_rows, at::Tensor kv_lens, double scale, int64_t window);
at::Tensor paged_attention_vectors(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                   at::Tensor q_rows, at::Tensor kv_lens, double scale);
// tile_attention.cpp: which shapes run on bfloat16 dot products (AMX tiles or AVX512-BF16).
bool amx_attention_applies(int64_t block_size, int64_t head_dim, int64_t num_heads, int64_t num_kv_heads);
bool tile_attention_applies(int64_t block_size, int64_t head_dim, int64_t num_heads, int64_t num_kv_heads);
// elementwise.cpp: a decoder layer's fused elementwise ops, and the sampler's per-row passes over the logits.
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor rms_norm_f32_scale(at::Tensor x, at::Tensor scale, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w, double eps);
void rotary_write_kv(at::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, at::Tensor cos, at::Tensor sin,
                     at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping);
at::Tensor silu_mul(at::Tensor gate_up);
at::Tensor sampling_weights(const at::Tensor& logits, const at::Tensor& temperature, double lowest, at::Tensor out);
at::Tensor first_argmax(const at::Tensor& logits);
// linear.cpp: the decode path's linear layer, whatever copy of the weight it holds.
at::Tensor skinny_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& b);
at::Tensor linear_any(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed, const at::Tensor& scale,
                      c10::optional<at::Tensor> b);
at::Tensor gate_up_silu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed, const at::Tensor& scale);
// bf16_linear.cpp: the bfloat16 matmuls (AMX tiles, AVX512-BF16 dot products) over one packed weight layout.
std::string bf16_kernel();
at::Tensor bf16_pack(const at::Tensor& w);
at::Tensor tile_rows(const at::Tensor& packed, const at::Tensor& ids);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor bf16_pack_gate_up(const at::Tensor& w);
at::Tensor bf16_linear_silu(const at::Tensor& x, const at::Tensor& packed);
at::Tensor dpbf16_linear(const at::Tensor& x, const at::Tensor& packed,
                            const c10::optional<at::Tensor>& bias);
// int8_linear.cpp: weight-only int8 (W8A16) on the same tiles.
at::Tensor int8_pack(const at::Tensor& q);
at::Tensor int8_pack_gate_up(const at::Tensor& q);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const c10::optional<at::Tensor>& bias);
at::Tensor int8_linear_silu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale);
at::Tensor fp8_pack(const at::Tensor& q);
at::Tensor fp8_pack_gate_up(const at::Tensor& q);
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& bias);
at::Tensor fp8_linear_silu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale);
// gguf_linear.cpp: llama.cpp's Q4_0, Q4_1 and Q8_0 blocks kept, widened on the same tiles.
int64_t gguf_tile_bytes(int64_t type);
at::Tensor gather_tile_bytes(const at::Tensor& packed, const at::Tensor& rows, const at::Tensor& sources,
                             const at::Tensor& flip);
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias);
at::Tensor gguf_linear_silu(const at::Tensor& x, const at::Tensor& pairs);
std::string gguf_kernel();
void gguf_decode_rows(const at::Tensor& raw, int64_t type, const at::Tensor& out);
at::Tensor gguf_tiles_linear(const at::Tensor& x, const at::Tensor& packed,
                                const c10::optional<at::Tensor>& bias);
at::Tensor gguf_tiles_linear_silu(const at::Tensor& x, const at::Tensor& pairs);
// gguf_vnni.cpp: the same blocks times int8-quantized activations (AVX512-VNNI, no AMX), as llama.cpp.
at::Tensor gguf_vnni_linear(const at::Tensor& x, const at::Tensor& packed,
                               const c10::optional<at::Tensor>& bias);
at::Tensor gguf_vnni_linear_silu(const at::Tensor& x, const at::Tensor& pairs);
// gguf_avx2.cpp: the same int8 products with AVX2 (VPMADDUBSW), for CPUs without AVX512-VNNI.
at::Tensor gguf_avx2_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor gguf_avx2_linear_silu(const at::Tensor& x, const at::Tensor& pairs);
// f32_linear.cpp: the float32 matmul over 16-feature panels.
bool f32_panels_available();
at::Tensor f32_pack(const at::Tensor& w);
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
// lora.cpp: LoRA adapters' grouped low-rank update, run by run
void lora_add(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& as,
              const std::vector<at::Tensor>& bs, const std::vector<int64_t>& col0s,
              const std::vector<at::Tensor>& ranks, const at::Tensor& runs, int64_t matmul_rows);

// moe.cpp: a mixture of experts' MLP over a step's tokens.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, int64_t first,
                       const std::vector<at::Tensor>& gate_up_w, const std::vector<at::Tensor>& gate_up_packed,
                       const std::vector<at::Tensor>& gate_up_scale, const std::vector<at::Tensor>& down_w,
                       const std::vector<at::Tensor>& down_packed, const std::vector<at::Tensor>& down_scale);

// recurrent.cpp: a request's rows at a time (spans [n, 3] int64: start, end, state slot), its slot's float32
// state updated in place. Gated DeltaNet: q, k [T, Hk, Dk], v [T, Hv, Dv], gates a, b [T, Hv], state [S, Hv, Dk, Dv],
// out [T, Hv, Dv]; value head h reads key head h / (Hv / Hk), or with `tiled` h % Hk
void gated_delta_rule(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor a, at::Tensor b, at::Tensor a_log,
                      at::Tensor dt_bias, at::Tensor state, at::Tensor spans, at::Tensor out, bool tiled);
// a causal depthwise convolution of x [T, C] (weight [C, K], state [S, K - 1, C]) into out, then SiLU if asked
void causal_conv(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias, at::Tensor state, at::Tensor spans,
                 at::Tensor out, bool apply_silu);
// Mamba2's scan: x [T, H, P], dt [T, H] (before dt_bias and softplus), b, c [T, G, N], state [S, H, P, N]; out
// [T, H, P] with the d skip
void mamba2_scan(at::Tensor x, at::Tensor dt, at::Tensor b, at::Tensor c, at::Tensor a_log, at::Tensor d,
                 at::Tensor dt_bias, at::Tensor state, at::Tensor spans, at::Tensor out);
// weight * x / rms(x) * silu(gate) over the rows of x [N, D]
at::Tensor gated_rms_norm(at::Tensor x, at::Tensor gate, at::Tensor weight, double eps);
