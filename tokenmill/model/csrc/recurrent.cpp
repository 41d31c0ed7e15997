// Recurrent layers' decode steps: one token per request against the fixed-size state its slot holds. A step of
// Gated DeltaNet (Qwen3.5's linear attention) in torch ops is ~15 passes over every request's state matrices, each a
// separate op; here it is two passes per value head, the matrix staying in cache between them, with the token's
// normalisations and gates computed on the way. model/backends/recurrent.py is the reference (same float32 values
// up to the order of sums).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "dtypes.h"
#include "kernels.h"

namespace {

template <typename T>
void delta_steps(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                 const at::Tensor& b, const at::Tensor& a_log, const at::Tensor& dt_bias, at::Tensor& state,
                 const at::Tensor& rows, const at::Tensor& slots, at::Tensor& out, bool tiled) {
  const int64_t steps = rows.size(0), key_heads = k.size(1), key_dim = k.size(2);
  const int64_t heads = v.size(1), value_dim = v.size(2), per_key = heads / key_heads;
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  const T* alog = a_log.data_ptr<T>();
  const T* dt = dt_bias.data_ptr<T>();
  float* sp = state.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const float q_scale = 1.f / std::sqrt(static_cast<float>(key_dim));
  // one (request, value head) per task: its matrix [key_dim, value_dim] is touched by no other
  at::parallel_for(0, steps * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qn(key_dim), kn(key_dim), kv(value_dim), o(value_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / heads, h = task % heads, r = row[i], kh = tiled ? h % key_heads : h / per_key;
      const T* qr = qp + r * q.stride(0) + kh * q.stride(1);
      const T* kr = kp + r * k.stride(0) + kh * k.stride(1);
      float qq = 0.f, kk = 0.f;
      for (int64_t d = 0; d < key_dim; ++d) {
        qn[d] = to_float(qr[d]);
        kn[d] = to_float(kr[d]);
        qq += qn[d] * qn[d];
        kk += kn[d] * kn[d];
      }
      const float qinv = 1.f / std::sqrt(qq + 1e-6f), kinv = 1.f / std::sqrt(kk + 1e-6f);
      for (int64_t d = 0; d < key_dim; ++d) {
        qn[d] = qn[d] * qinv * q_scale;
        kn[d] *= kinv;
      }
      const float x = to_float(ap[r * a.stride(0) + h]) + to_float(dt[h]);
      const float softplus = x > 20.f ? x : std::log1p(std::exp(x));
      const float decay = std::exp(-std::exp(to_float(alog[h])) * softplus);
      const float beta = to_float(round_to<T>(1.f / (1.f + std::exp(-to_float(bp[r * b.stride(0) + h])))));
      float* s = sp + (slot[i] * heads + h) * key_dim * value_dim;
      // pass 1: decay the matrix and read it back with the key
      for (int64_t e = 0; e < value_dim; ++e) kv[e] = 0.f;
      for (int64_t d = 0; d < key_dim; ++d) {
        float* sd = s + d * value_dim;
        const float kd = kn[d];
#pragma omp simd
        for (int64_t e = 0; e < value_dim; ++e) {
          sd[e] *= decay;
          kv[e] += kd * sd[e];
        }
      }
      const T* vr = vp + r * v.stride(0) + h * v.stride(1);
      for (int64_t e = 0; e < value_dim; ++e) {
        kv[e] = (to_float(vr[e]) - kv[e]) * beta;  // the correction the token writes
        o[e] = 0.f;
      }
      // pass 2: write the correction along the key, read the result with the query
      for (int64_t d = 0; d < key_dim; ++d) {
        float* sd = s + d * value_dim;
        const float kd = kn[d], qd = qn[d];
#pragma omp simd
        for (int64_t e = 0; e < value_dim; ++e) {
          sd[e] += kd * kv[e];
          o[e] += qd * sd[e];
        }
      }
      T* orow = op + r * out.stride(0) + h * out.stride(1);
      for (int64_t e = 0; e < value_dim; ++e) orow[e] = round_to<T>(o[e]);
    }
  });
}

}  // namespace

void gated_delta_steps(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor a, at::Tensor b, at::Tensor a_log,
                       at::Tensor dt_bias, at::Tensor state, at::Tensor rows, at::Tensor slots, at::Tensor out,
                       bool tiled) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "gated_delta_steps: heads' elements contiguous");
  TORCH_CHECK(a.stride(1) == 1 && b.stride(1) == 1 && state.is_contiguous() && state.scalar_type() == at::kFloat,
              "gated_delta_steps: a float32 contiguous state and gates with contiguous heads");
  for (const at::Tensor* t : {&q, &k, &a, &b, &a_log, &dt_bias, &out}) {
    TORCH_CHECK(t->scalar_type() == v.scalar_type(), "gated_delta_steps: every input in v's dtype");
  }
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && a_log.is_contiguous() &&
              dt_bias.is_contiguous(), "gated_delta_steps: int64 rows and slots, contiguous a_log and dt_bias");
  TORCH_CHECK(v.size(1) % k.size(1) == 0, "gated_delta_steps: value heads a multiple of key heads");
  if (v.scalar_type() == at::kBFloat16) {
    delta_steps<c10::BFloat16>(q, k, v, a, b, a_log, dt_bias, state, rows, slots, out, tiled);
  } else {
    TORCH_CHECK(v.scalar_type() == at::kFloat, "gated_delta_steps: float32 or bfloat16");
    delta_steps<float>(q, k, v, a, b, a_log, dt_bias, state, rows, slots, out, tiled);
  }
}
