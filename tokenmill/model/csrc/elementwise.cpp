// The small fused ops of a decoder layer (RMSNorm with the residual add, rotary + KV-cache write,
// SiLU-and-multiply) and the sampler's passes over a step's logits. On a 2-core CPU one decode step of a 30-layer
// model runs ~1,300 tiny torch ops, and their dispatch overhead rivals the matmuls; these collapse each layer's
// elementwise work into 4 calls. Each rounds like the torch code it replaces (products and sums rounded to the
// tensor dtype where torch rounds them), so results match the reference.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "dtypes.h"
#include "kernels.h"
#include "simd.h"

namespace {

// A row's norm factor from its sum of squares, 1 / sqrt(ss / dim + eps), with the mean and the add in one rounding
// (ss times 1 / dim, fused with + eps). Fast-math compiles the plain expression to this form in some builds and to a
// division and an add in others, depending on what else is inlined around it; written out, every build (this CPU's,
// an AVX2 one) rounds it the same.
inline float inverse_rms(float ss, int64_t dim, float eps) {
  return 1.f / std::sqrt(std::fma(ss, 1.f / static_cast<float>(dim), eps));
}

template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* out, int64_t rows, int64_t dim, float eps,
                   T* residual) {
  // residual != nullptr: residual += x first (rounded to T, as `residual + x` is), then normalise residual.
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      float ss = 0.f;
      int64_t d0 = 0;  // bfloat16: the first dim / 8 * 8 elements 8 at a time, rounded where the scalar loop rounds
      if (residual != nullptr) {
        T* res = residual + r * dim;
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          for (; d0 + 8 <= dim; d0 += 8) {
            const __m256 sum = round_to_bf16_ps(_mm256_add_ps(bf16x8_to_ps(res + d0), bf16x8_to_ps(xr + d0)));
            store_bf16x8(res + d0, sum);
            _mm256_storeu_ps(buf.data() + d0, sum);
          }
        }
#endif
        for (int64_t d = d0; d < dim; ++d) {
          const T sum = round_to<T>(to_float(res[d]) + to_float(xr[d]));
          res[d] = sum;
          buf[d] = to_float(sum);
        }
      } else {
        for (int64_t d = 0; d < dim; ++d) buf[d] = to_float(xr[d]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < dim; ++d) ss += buf[d] * buf[d];
      const float inv = inverse_rms(ss, dim, eps);
      T* o = out + r * dim;
      int64_t d1 = 0;
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        const __m256 inv_v = _mm256_set1_ps(inv);
        for (; d1 + 8 <= dim; d1 += 8) {
          const __m256 normed = round_to_bf16_ps(_mm256_mul_ps(_mm256_loadu_ps(buf.data() + d1), inv_v));
          store_bf16x8(o + d1, round_to_bf16_ps(_mm256_mul_ps(bf16x8_to_ps(w + d1), normed)));
        }
      }
#endif
      for (int64_t d = d1; d < dim; ++d) o[d] = round_to<T>(to_float(w[d]) * to_float(round_to<T>(buf[d] * inv)));
    }
  });
}

// rms_norm_f32_scale's rows: x / rms(x) * scale in float32, rounded once.
template <typename T>
void rms_norm_scaled_rows(const T* x, int64_t x_stride, const float* scale, T* out, int64_t rows, int64_t dim,
                          float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dim);
    for (int64_t r = begin; r < end; ++r) {
      float ss = 0.f;
      for (int64_t d = 0; d < dim; ++d) buf[d] = to_float(x[r * x_stride + d]);
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < dim; ++d) ss += buf[d] * buf[d];
      const float inv = inverse_rms(ss, dim, eps);
      T* o = out + r * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = round_to<T>(buf[d] * inv * scale[d]);
    }
  });
}

template <typename T>
void rotate_heads(T* x, int64_t heads, int64_t head_dim, const T* c, const T* s) {
  // HF layout: out[:half] = x1*cos - x2*sin, out[half:] = x2*cos + x1*sin (each product rounded to T).
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + h * head_dim;
    for (int64_t d = 0; d < half; ++d) {
      const float x1 = to_float(v[d]), x2 = to_float(v[d + half]);
      const float a = to_float(round_to<T>(x1 * to_float(c[d]))), b = to_float(round_to<T>(-x2 * to_float(s[d])));
      const float e = to_float(round_to<T>(x2 * to_float(c[d + half])));
      const float f = to_float(round_to<T>(x1 * to_float(s[d + half])));
      v[d] = round_to<T>(a + b);
      v[d + half] = round_to<T>(e + f);
    }
  }
}

}  // namespace

// x [T, D] (rows may be strided); returns w * normalise(x) as a new contiguous [T, D].
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && x.scalar_type() == w.scalar_type());
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), static_cast<float>(eps), nullptr);
  });
  return out;
}

// x [T, D] bfloat16/half/float32 rows (may be strided), scale [D] float32: x / rms(x) * scale in float32, rounded
// once to x's dtype: Gemma's (1 + w) norms as transformers computes them (Backend.rms_norm_float_scale). Per row the
// same operations whatever the batch.
at::Tensor rms_norm_f32_scale(at::Tensor x, at::Tensor scale, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && scale.is_contiguous() && scale.scalar_type() == at::kFloat &&
              scale.numel() == x.size(1), "x [T, D] with unit stride along D, scale [D] float32");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_f32_scale", [&] {
    rms_norm_scaled_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), scale.data_ptr<float>(),
                                   out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// residual += x (in place), then returns w * normalise(residual): the residual add and the next norm in one pass.
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && residual.is_contiguous() && w.is_contiguous());
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type());
  auto out = at::empty_like(residual);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), static_cast<float>(eps), residual.data_ptr<scalar_t>());
  });
  return out;
}

// qkv [T, (H + 2 KVH) D] (the fused projection's output): rotates q and k in place with cos/sin [T, D] and
// writes k, v into the caches [blocks, block_size, KVH, D] at slot_mapping [T].
void rotary_write_kv(at::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, at::Tensor cos,
                     at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slot_mapping.scalar_type() == at::kLong);
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && (fp8 || qkv.scalar_type() == k_cache.scalar_type()) &&
              k_cache.scalar_type() == v_cache.scalar_type(), "caches of qkv's dtype, or FP8 e4m3");
  const int64_t T = qkv.size(0), D = k_cache.size(3), stride = qkv.stride(0);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D && cos.size(1) == D);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_write_kv", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = sin.data_ptr<scalar_t>();
    const int64_t kv_row = num_kv_heads * D;
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* q = base + t * stride;
        scalar_t* k = q + num_heads * D;
        rotate_heads<scalar_t>(q, num_heads, D, c + t * D, s + t * D);
        rotate_heads<scalar_t>(k, num_kv_heads, D, c + t * D, s + t * D);
        if (fp8) {
          uint8_t* kc = reinterpret_cast<uint8_t*>(k_cache.data_ptr()) + slots[t] * kv_row;
          uint8_t* vc = reinterpret_cast<uint8_t*>(v_cache.data_ptr()) + slots[t] * kv_row;
          for (int64_t i = 0; i < kv_row; ++i) {
            kc[i] = float_to_e4m3(to_float(k[i]));
            vc[i] = float_to_e4m3(to_float(k[kv_row + i]));
          }
        } else {
          std::memcpy(k_cache.data_ptr<scalar_t>() + slots[t] * kv_row, k, kv_row * sizeof(scalar_t));
          std::memcpy(v_cache.data_ptr<scalar_t>() + slots[t] * kv_row, k + kv_row, kv_row * sizeof(scalar_t));
        }
      }
    });
  });
}

// gate_up [T, 2I] -> silu(gate) * up [T, I].
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous());
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* gate = gate_up.data_ptr<scalar_t>() + t * 2 * I;
        const scalar_t* up = gate + I;
        scalar_t* o = out.data_ptr<scalar_t>() + t * I;
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        if constexpr (std::is_same_v<scalar_t, float>) {
          const float* gf = reinterpret_cast<const float*>(gate);
          const float* uf = reinterpret_cast<const float*>(up);
          float* of = reinterpret_cast<float*>(o);
          for (; j + 8 <= I; j += 8)
            _mm256_storeu_ps(of + j, silu_times<Lanes8>(_mm256_loadu_ps(gf + j), _mm256_loadu_ps(uf + j), false));
        } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {  // rounded where torch rounds, 8 at a time
          // the lambda is not a template: the branch is compiled for every dtype, hence the casts
          const auto* gb = reinterpret_cast<const c10::BFloat16*>(gate);
          const auto* ub = reinterpret_cast<const c10::BFloat16*>(up);
          auto* ob = reinterpret_cast<c10::BFloat16*>(o);
#if defined(__AVX512F__)
          for (; j + 16 <= I; j += 16) {  // the 8-wide loop below, 16 at a time: the same per-element math
            const __m512 out16 = silu_times<Lanes16>(bf16x16_to_ps(gb + j), bf16x16_to_ps(ub + j), true);
            store_bf16x16(ob + j, round_to_bf16_ps512(out16));
          }
#endif
          for (; j + 8 <= I; j += 8) {
            const __m256 out8 = silu_times<Lanes8>(bf16x8_to_ps(gb + j), bf16x8_to_ps(ub + j), true);
            store_bf16x8(ob + j, round_to_bf16_ps(out8));
          }
        }
#endif
        for (; j < I; ++j) {
          const float x = to_float(gate[j]);
          const float silu = to_float(round_to<scalar_t>(x / (1.f + std::exp(-x))));
          o[j] = round_to<scalar_t>(silu * to_float(up[j]));
        }
      }
    });
  });
  return out;
}

// The sampler's unnormalised probabilities (engine/sampler.py, rows without top-k/top-p/min-p) from float32
// logits [R, V] into `out` [R, V]: per row top = max (NaN if any logit is NaN), x = (x - top) / temperature, and
// weight = exp(x), 0 below `lowest`. Two passes over a row instead of torch's seven (max, sub, div, compare, clamp,
// exp, fill), into a buffer the sampler keeps (a fresh one pays page faults): ~10% of a 16-row decode step at
// temperature 1. Rows whose top is not finite are not written (the sampler raises on them). Returns top [R].
at::Tensor sampling_weights(const at::Tensor& logits, const at::Tensor& temperature, double lowest,
                               at::Tensor out) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "contiguous float32 [R, V] logits");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == logits.sizes(),
              "a contiguous float32 out of the logits' shape");
  const auto temp = temperature.to(at::kFloat).contiguous();
  TORCH_CHECK(temp.numel() == logits.size(0), "one temperature per row");
  const int64_t R = logits.size(0), V = logits.size(1);
  auto top = at::empty({R}, logits.options());
  const float* lp = logits.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* tp = temp.data_ptr<float>();
  float* topp = top.data_ptr<float>();
  const float low = static_cast<float>(lowest);
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * V;
      float* w = op + r * V;
      float m = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t j = 0;
#if defined(__AVX512F__)
      __m512 mv = _mm512_set1_ps(m);
      __mmask16 unordered = 0;
      for (; j + 16 <= V; j += 16) {
        const __m512 v = _mm512_loadu_ps(x + j);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mv = _mm512_max_ps(mv, v);
      }
      m = _mm512_reduce_max_ps(mv);
      nan = unordered != 0;
#endif
      for (; j < V; ++j) {
        nan = nan || std::isnan(x[j]);
        m = std::max(m, x[j]);
      }
      topp[r] = nan ? std::numeric_limits<float>::quiet_NaN() : m;
      if (nan || !std::isfinite(m)) continue;
      const float t = tp[r];
      j = 0;
#if defined(__AVX512F__)
      const __m512 mm = _mm512_set1_ps(m), tt = _mm512_set1_ps(t), ll = _mm512_set1_ps(low);
      for (; j + 16 <= V; j += 16) {
        const __m512 v = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), mm), tt);
        _mm512_storeu_ps(w + j, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, ll, _CMP_GE_OQ), exp512(v)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      const __m256 mm = _mm256_set1_ps(m), tt = _mm256_set1_ps(t), ll = _mm256_set1_ps(low);
      for (; j + 8 <= V; j += 8) {
        const __m256 v = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), mm), tt);
        _mm256_storeu_ps(w + j, _mm256_and_ps(_mm256_cmp_ps(v, ll, _CMP_GE_OQ), exp256(v)));
      }
#endif
      for (; j < V; ++j) {
        const float v = (x[j] - m) / t;
        w[j] = v < low ? 0.f : std::exp(v);
      }
    }
  });
  return top;
}

// Greedy decoding's token per row of float32 logits [R, V]: the index of the first maximal value, a NaN counting
// as the maximum (its first one), as torch's max(dim=1).indices gives it, which scans a row with scalar compares:
// 2.7 ms for 64 x 49,152 on 2 cores, ~3% of a 64-row decode step (vectors here: each lane keeps its own first
// maximum, the lowest index among the lanes holding the row's maximum wins). Returns int64 [R].
at::Tensor first_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "contiguous float32 [R, V] logits");
  const int64_t R = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "a vocabulary of 1 .. 2^31 - 1 entries");
  auto out = at::empty({R}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * V;
      float m = -std::numeric_limits<float>::infinity();
      int64_t best = 0, j = 0;
      bool nan = false;
#if defined(__AVX512F__)
      if (V >= 16) {
        __m512 mv = _mm512_set1_ps(m);
        __m512i at = _mm512_setzero_si512();  // per lane: the first index of its maximum so far
        __m512i idx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 unordered = 0;
        for (; j + 16 <= V; j += 16) {
          const __m512 v = _mm512_loadu_ps(x + j);
          unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          const __mmask16 greater = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ);  // strictly: a lane keeps its first
          mv = _mm512_mask_mov_ps(mv, greater, v);
          at = _mm512_mask_mov_epi32(at, greater, idx);
          idx = _mm512_add_epi32(idx, step);
        }
        nan = unordered != 0;
        m = _mm512_reduce_max_ps(mv);
        const __mmask16 holders = _mm512_cmp_ps_mask(mv, _mm512_set1_ps(m), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(holders, at);  // all -inf: every lane holds it at its first index
      }
#endif
      for (; j < V && !nan; ++j) {
        if (std::isnan(x[j])) nan = true;
        else if (x[j] > m) m = x[j], best = j;
      }
      if (nan) {  // the first NaN, wherever it is
        for (j = 0; j < V && !std::isnan(x[j]); ++j) {}
        best = j;
      }
      op[r] = best;
    }
  });
  return out;
}
