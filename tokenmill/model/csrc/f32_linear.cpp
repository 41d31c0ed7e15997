// float32 linear layer, y = x @ w.T (+ b), over a weight packed once at load into 16-feature panels: the float32
// counterpart of bf16_linear.cpp, and for the same reason. BLAS and oneDNN pick their algorithm by the row count
// (and the skinny GEMV serves only a few rows), so a row's result depended on its batch. Here every output element
// is one FMA chain over K in order, x[m][k] broadcast against 8 features at a time: the same operations whatever
// M is and wherever the row sits, so greedy output is batch-invariant in float32 too. AVX2 + FMA (8 features per
// register), or AVX-512 (all 16 in one, 8 rows at a time) where the CPU has it: each lane runs the same FMA chain
// either way, so the two give identical results.
//
// Packed layout, [N/16, K, 16] float32: panel p holds features 16p..16p+15, one row of 16 per k.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#if defined(__AVX2__) && defined(__FMA__)
#define TOKENMILL_F32_PANELS 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;

#ifdef TOKENMILL_F32_PANELS
// Rows [m0, m0 + Rows) x the 16 features of panel p: acc[r] over k in order, then + bias, stored.
template <int Rows>
void panel_rows(const float* x, int64_t x_stride, const float* panel, const float* bias, float* y, int64_t N,
                int64_t K, int64_t m0, int64_t p) {
  __m256 acc[Rows][2];
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const float* xr[Rows];
  for (int r = 0; r < Rows; ++r) xr[r] = x + (m0 + r) * x_stride;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kPanel), b1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    for (int r = 0; r < Rows; ++r) {
      const __m256 xv = _mm256_broadcast_ss(xr[r] + k);
      acc[r][0] = _mm256_fmadd_ps(xv, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    float* out = y + (m0 + r) * N + p * kPanel;
    __m256 lo = acc[r][0], hi = acc[r][1];
    if (bias != nullptr) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias + p * kPanel));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + p * kPanel + 8));
    }
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
  }
}
#endif

#if defined(__AVX512F__)
// panel_rows with one 16-lane register per row, up to 8 rows: twice the FMAs per instruction.
template <int Rows>
void panel_rows512(const float* x, int64_t x_stride, const float* panel, const float* bias, float* y, int64_t N,
                   int64_t K, int64_t m0, int64_t p) {
  __m512 acc[Rows];
  const float* xr[Rows];
  for (int r = 0; r < Rows; ++r) {
    acc[r] = _mm512_setzero_ps();
    xr[r] = x + (m0 + r) * x_stride;
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m512 b = _mm512_loadu_ps(panel + k * kPanel);
    for (int r = 0; r < Rows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr[r][k]), b, acc[r]);
  }
  for (int r = 0; r < Rows; ++r) {
    __m512 v = acc[r];
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + p * kPanel));
    _mm512_storeu_ps(y + (m0 + r) * N + p * kPanel, v);
  }
}

// The last M % 8 rows.
template <int Rows>
void panel_tail512(int64_t rows, const float* x, int64_t x_stride, const float* panel, const float* bias, float* y,
                   int64_t N, int64_t K, int64_t m0, int64_t p) {
  if constexpr (Rows > 0) {
    if (rows == Rows) panel_rows512<Rows>(x, x_stride, panel, bias, y, N, K, m0, p);
    else panel_tail512<Rows - 1>(rows, x, x_stride, panel, bias, y, N, K, m0, p);
  }
}
#endif

}  // namespace

// Whether this build has the float32 panel kernel (AVX2 + FMA).
bool f32_panels_available() {
#ifdef TOKENMILL_F32_PANELS
  return true;
#else
  return false;
#endif
}

// w [N, K] float32, N % 16 == 0 -> [N/16, K, 16].
at::Tensor f32_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "f32_pack takes a [N, K] float32 weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kPanel == 0, "f32_pack needs N % 16 == 0");
  return w.contiguous().view({N / kPanel, kPanel, K}).transpose(1, 2).contiguous();
}

// x [M, K] float32 (rows may be strided), packed from f32_pack, bias [N] or none -> [M, N] float32.
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
              packed.size(2) == kPanel, "a weight packed by f32_pack");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "[M, K] float32 input");
  const int64_t P = packed.size(0), K = packed.size(1), N = P * kPanel, M = x.size(0);
  TORCH_CHECK(x.size(1) == K, "input has ", x.size(1), " features, the weight ", K);
  auto y = at::empty({M, N}, x.options());
#ifdef TOKENMILL_F32_PANELS
  const auto xs = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor bias_c;
  if (bias.has_value()) bias_c = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bias_c.data_ptr<float>() : nullptr;
  const float* xp = xs.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t x_stride = xs.stride(0);
  const int64_t grain = std::max<int64_t>(1, P / (4 * at::get_num_threads()));
  at::parallel_for(0, P, grain, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * K * kPanel;
      int64_t m = 0;
#if defined(__AVX512F__)
      for (; m + 8 <= M; m += 8) panel_rows512<8>(xp, x_stride, panel, bp, yp, N, K, m, p);
      panel_tail512<7>(M - m, xp, x_stride, panel, bp, yp, N, K, m, p);
      continue;
#endif
      for (; m + 4 <= M; m += 4) panel_rows<4>(xp, x_stride, panel, bp, yp, N, K, m, p);
      switch (M - m) {
        case 3: panel_rows<3>(xp, x_stride, panel, bp, yp, N, K, m, p); break;
        case 2: panel_rows<2>(xp, x_stride, panel, bp, yp, N, K, m, p); break;
        case 1: panel_rows<1>(xp, x_stride, panel, bp, yp, N, K, m, p); break;
        default: break;
      }
    }
  });
#else
  TORCH_CHECK(false, "this build has no float32 panel kernel (the CPU it was built for lacks AVX2/FMA)");
#endif
  return y;
}
