// The decode path's linear layer (linear_any): the kernel for whichever copy of the weight the model holds
// (bf16_linear.cpp, int8_linear.cpp, gguf_linear.cpp, f32_linear.cpp), else the skinny GEMV below for a few rows,
// oneDNN's prepacked GEMM, or BLAS; and gate_up_silu, its fused gate/up projection with SiLU.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <string>

#include "kernels.h"
#include "simd.h"

// Skinny matmul (few rows, as in decode): y = x @ w.T + b with w [N, K]. A single-row product runs on one
// core inside BLAS and cannot pull full memory bandwidth; here the output features are split across the
// intra-op threads. float32 with AVX2: each thread streams its contiguous slice of w once, 4 rows at a time,
// against every row of x (held in L1). Other dtypes: each thread calls the (then single-threaded) BLAS.
namespace {

#if defined(__AVX2__) && defined(__FMA__)
// y[m, n] for n in [begin, end): dot(x[m], w[n]) over K.
void gemv_rows_f32(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t begin,
                   int64_t end) {
  const int64_t K8 = K / 8 * 8;
  int64_t n = begin;
  for (; n + 4 <= end; n += 4) {
    const float* w0 = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int64_t k = 0; k < K8; k += 8) {
        if (m == 0) {  // fetch the next 4 rows (contiguous) at the pace these are consumed: hides DRAM latency
          const char* next = reinterpret_cast<const char*>(w0 + 4 * K + 4 * k);
          _mm_prefetch(next, _MM_HINT_T0);
          _mm_prefetch(next + 64, _MM_HINT_T0);
        }
        const __m256 xv = _mm256_loadu_ps(xm + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), xv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + K + k), xv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + 2 * K + k), xv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + 3 * K + k), xv, a3);
      }
      float r[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
      for (int64_t k = K8; k < K; ++k)
        for (int i = 0; i < 4; ++i) r[i] += w0[i * K + k] * xm[k];
      for (int i = 0; i < 4; ++i) y[m * N + n + i] = r[i];
    }
  }
  for (; n < end; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += w[n * K + k] * x[m * K + k];
      y[m * N + n] = acc;
    }
  }
}
#endif

}  // namespace

at::Tensor skinny_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  auto x_c = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  const int64_t threads = at::get_num_threads();
#if defined(__AVX2__) && defined(__FMA__)
  if (x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.is_contiguous()) {
    auto out = at::empty({M, N}, x.options());
    const float* xp = x_c.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* yp = out.data_ptr<float>();
    const int64_t chunk = std::max<int64_t>(64, (N / threads + 3) / 4 * 4);  // whole 4-row groups per thread
    at::parallel_for(0, N, chunk, [&](int64_t begin, int64_t end) { gemv_rows_f32(xp, wp, yp, M, N, K, begin, end); });
    if (bias.has_value()) out.add_(*bias);
    return out;
  }
#endif
  auto out_t = at::empty({N, M}, x.options());
  const int64_t chunk = std::max<int64_t>(64, (N + threads - 1) / threads);
  const at::ThreadLocalState caller_state;  // inference mode, grad mode: worker threads must match the caller
  at::parallel_for(0, N, chunk, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard guard(caller_state);
    auto o = out_t.narrow(0, begin, end - begin);
    at::mm_out(o, w.narrow(0, begin, end - begin), x_c.t());
  });
  auto out = out_t.t().contiguous();
  if (bias.has_value()) out.add_(*bias);
  return out;
}

// x @ w.T (+ b) with w prepacked in oneDNN's blocked layout (model/linear.py prepacks it once at load). Called
// through the dispatcher: the op is registered by torch, its C++ symbol is not exported.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& b) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>();
  return op.call(x, packed, b, "none", c10::List<std::optional<at::Scalar>>(), std::optional<std::string_view>(""));
}

// The linear layer of the decode path. A packed copy of the weight serves every row count: bytes (uint8) are a
// quantized weight, int8 with its per-feature scales (int8_pack, [N/16, K/32, 16, 32]) or GGML blocks without
// (gguf_pack, [N/16, K/32, tile bytes]); FP8 (fp8_pack) runs fp8_linear with its scales; bfloat16 tiles
// (bf16_pack) run bf16_linear; float32 panels f32_linear.
// Without one: the skinny GEMV for a few rows (it reads the plain weight at memory speed), oneDNN's prepacked
// GEMM when there is a oneDNN copy (1.5-3x BLAS at 8-128 rows), else BLAS.
at::Tensor linear_any(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed,
                         const at::Tensor& scale, c10::optional<at::Tensor> b) {
  if (packed.scalar_type() == at::kByte) {
    return scale.numel() > 0 ? int8_linear(x, packed, scale, b) : gguf_linear(x, packed, b);
  }
  if (packed.scalar_type() == at::kFloat8_e4m3fn) return fp8_linear(x, packed, scale, b);
  if (packed.dim() == 4) return bf16_linear(x, packed, b);
  if (packed.dim() == 3) return f32_linear(x, packed, b);
  if (x.size(0) <= 4 && at::get_num_threads() > 1) return skinny_linear(x, w, b);
  if (packed.is_mkldnn()) return onednn_linear(x, packed, b);
  return at::linear(x, w, b);
}

// silu(gate) * up of a fused gate/up projection: where its packed copy holds gate and up in pairs
// (bf16_pack_gate_up, int8_pack_gate_up: 5-D; gguf_pack in pairs: 4-D bytes without scales) the matmul's
// epilogue applies it; else the plain product, then silu_mul.
at::Tensor gate_up_silu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed,
                           const at::Tensor& scale) {
  const bool bytes = packed.scalar_type() == at::kByte;
  if (packed.dim() == 5 && packed.scalar_type() == at::kFloat8_e4m3fn) return fp8_linear_silu(x, packed, scale);
  if (packed.dim() == 5) return bytes ? int8_linear_silu(x, packed, scale) : bf16_linear_silu(x, packed);
  if (bytes && packed.dim() == 4 && scale.numel() == 0) return gguf_linear_silu(x, packed);
  return silu_mul(linear_any(x, w, packed, scale, c10::nullopt));
}
