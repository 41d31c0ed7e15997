// Recurrent layers over each request's span of rows, against the fixed-size state its slot holds: Gated DeltaNet's
// delta rule (Qwen3.5's linear attention), the causal depthwise convolution before it (and LFM2's), and its gated
// output norm. In torch ops a decode step of these is dozens of small ops per layer, and a prompt's delta rule is
// the chunked form's small batched matmuls; here a request's tokens go through the recurrence one by one, each
// (request, head) or (request, channel block) a task of its own: the state matrix of a head (64 KiB at 128 x 128)
// stays in cache from token to token, and a row's result depends on its own request's rows only, never on the
// batch or on how its prompt was cut into chunks. model/backends/recurrent.py and base.py are the references.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "dtypes.h"
#include "kernels.h"

namespace {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// spans [n, 3] int64: (first row, end row, state slot) per request
struct Span {
  int64_t start, end, slot;
};

std::vector<Span> read_spans(const at::Tensor& spans) {
  TORCH_CHECK(spans.scalar_type() == at::kLong && spans.dim() == 2 && spans.size(1) == 3 && spans.is_contiguous(),
              "spans: a contiguous int64 [n, 3] of (start, end, slot)");
  const int64_t* p = spans.data_ptr<int64_t>();
  std::vector<Span> out(spans.size(0));
  for (size_t i = 0; i < out.size(); ++i) out[i] = {p[3 * i], p[3 * i + 1], p[3 * i + 2]};
  return out;
}

// The token's two passes over one head's state matrix s [key_dim, value_dim]: decay it and read it with the key
// (kv), then write the correction along the key and read the result with the query (o). VD > 0: value_dim is that
// constant, and the value vectors stay in registers through each pass (128 floats: 8 AVX-512 or 16 AVX2 registers);
// VD = 0: any value_dim, the vectors in `scratch` (2 x value_dim).
template <int64_t VD>
inline void delta_passes(float* __restrict s, const float* __restrict kn, const float* __restrict qn,
                         const float* __restrict v, float decay, float beta, int64_t key_dim, int64_t value_dim,
                         float* __restrict scratch, float* __restrict o) {
  constexpr int64_t kLocal = VD > 0 ? VD : 1;
  float kv_local[kLocal], acc_local[kLocal];
  const int64_t width = VD > 0 ? VD : value_dim;
  float* __restrict kv = VD > 0 ? kv_local : scratch;
  float* __restrict acc = VD > 0 ? acc_local : scratch + value_dim;
  for (int64_t e = 0; e < width; ++e) kv[e] = 0.f;
  for (int64_t d = 0; d < key_dim; ++d) {
    float* __restrict sd = s + d * width;
    const float kd = kn[d];
#pragma omp simd
    for (int64_t e = 0; e < width; ++e) {
      sd[e] *= decay;
      kv[e] += kd * sd[e];
    }
  }
  for (int64_t e = 0; e < width; ++e) {
    kv[e] = (v[e] - kv[e]) * beta;  // what the token writes
    acc[e] = 0.f;
  }
  for (int64_t d = 0; d < key_dim; ++d) {
    float* __restrict sd = s + d * width;
    const float kd = kn[d], qd = qn[d];
#pragma omp simd
    for (int64_t e = 0; e < width; ++e) {
      sd[e] += kd * kv[e];
      acc[e] += qd * sd[e];
    }
  }
  for (int64_t e = 0; e < width; ++e) o[e] = acc[e];
}

template <typename T>
void delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& a,
                const at::Tensor& b, const at::Tensor& a_log, const at::Tensor& dt_bias, at::Tensor& state,
                const std::vector<Span>& spans, at::Tensor& out, bool tiled) {
  const int64_t key_heads = k.size(1), key_dim = k.size(2);
  const int64_t heads = v.size(1), value_dim = v.size(2), per_key = heads / key_heads;
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
  const int64_t tasks = static_cast<int64_t>(spans.size()) * heads;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qn(key_dim), kn(key_dim), vf(value_dim), scratch(2 * value_dim), o(value_dim);
    for (int64_t task = begin; task < end; ++task) {
      const Span& span = spans[task / heads];
      const int64_t h = task % heads, kh = tiled ? h % key_heads : h / per_key;
      float* s = sp + (span.slot * heads + h) * key_dim * value_dim;
      const float a_scale = -std::exp(to_float(alog[h])), dt_h = to_float(dt[h]);
      for (int64_t r = span.start; r < span.end; ++r) {
        const T* qr = qp + r * q.stride(0) + kh * q.stride(1);
        const T* kr = kp + r * k.stride(0) + kh * k.stride(1);
        float qq = 0.f, kk = 0.f;
        for (int64_t d = 0; d < key_dim; ++d) {
          qn[d] = to_float(qr[d]);
          kn[d] = to_float(kr[d]);
          qq += qn[d] * qn[d];
          kk += kn[d] * kn[d];
        }
        const float qinv = q_scale / std::sqrt(qq + 1e-6f), kinv = 1.f / std::sqrt(kk + 1e-6f);
        for (int64_t d = 0; d < key_dim; ++d) {
          qn[d] *= qinv;
          kn[d] *= kinv;
        }
        const float x = to_float(ap[r * a.stride(0) + h]) + dt_h;
        const float decay = std::exp(a_scale * (x > 20.f ? x : std::log1p(std::exp(x))));
        // sigmoid in the model's dtype first, as the reference rounds it
        const float beta = to_float(round_to<T>(1.f / (1.f + std::exp(-to_float(bp[r * b.stride(0) + h])))));
        const T* vr = vp + r * v.stride(0) + h * v.stride(1);
        for (int64_t e = 0; e < value_dim; ++e) vf[e] = to_float(vr[e]);
        if (value_dim == 128) {
          delta_passes<128>(s, kn.data(), qn.data(), vf.data(), decay, beta, key_dim, 128, nullptr, o.data());
        } else {
          delta_passes<0>(s, kn.data(), qn.data(), vf.data(), decay, beta, key_dim, value_dim, scratch.data(),
                          o.data());
        }
        T* orow = op + r * out.stride(0) + h * out.stride(1);
        for (int64_t e = 0; e < value_dim; ++e) orow[e] = round_to<T>(o[e]);
      }
    }
  });
}

// Mamba2's scan for one head of one request, token by token: s [P, N] <- exp(dt A) s + dt x b^T, y = s c + d x.
template <typename T>
void scan_spans(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& b, const at::Tensor& c,
                const at::Tensor& a_log, const at::Tensor& d, const at::Tensor& dt_bias, at::Tensor& state,
                const std::vector<Span>& spans, at::Tensor& out) {
  const int64_t heads = x.size(1), head_dim = x.size(2), groups = b.size(1), size = b.size(2);
  const int64_t per_group = heads / groups;
  const T* xp = x.data_ptr<T>();
  const T* dtp = dt.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  const T* cp = c.data_ptr<T>();
  const T* alog = a_log.data_ptr<T>();
  const T* dp = d.data_ptr<T>();
  const T* biasp = dt_bias.data_ptr<T>();
  float* sp = state.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(spans.size()) * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> bv(size), cv(size);
    for (int64_t task = begin; task < end; ++task) {
      const Span& span = spans[task / heads];
      const int64_t h = task % heads, g = h / per_group;
      float* s = sp + (span.slot * heads + h) * head_dim * size;
      const float a = -std::exp(to_float(alog[h])), skip = to_float(dp[h]), bias = to_float(biasp[h]);
      for (int64_t r = span.start; r < span.end; ++r) {
        const float raw = to_float(dtp[r * dt.stride(0) + h]) + bias;
        const float step = raw > 20.f ? raw : std::log1p(std::exp(raw));
        const float decay = std::exp(step * a);
        const T* br = bp + r * b.stride(0) + g * b.stride(1);
        const T* cr = cp + r * c.stride(0) + g * c.stride(1);
        for (int64_t n = 0; n < size; ++n) {
          bv[n] = to_float(br[n]);
          cv[n] = to_float(cr[n]);
        }
        const T* xr = xp + r * x.stride(0) + h * x.stride(1);
        T* orow = op + r * out.stride(0) + h * out.stride(1);
        for (int64_t p = 0; p < head_dim; ++p) {
          float* __restrict sr = s + p * size;
          const float xv = to_float(xr[p]), w = step * xv;
          const float* __restrict bb = bv.data();
          const float* __restrict cc = cv.data();
          float y = 0.f;
#pragma omp simd reduction(+ : y)
          for (int64_t n = 0; n < size; ++n) {
            sr[n] = sr[n] * decay + w * bb[n];
            y += sr[n] * cc[n];
          }
          orow[p] = round_to<T>(y + xv * skip);
        }
      }
    }
  });
}

constexpr int64_t CONV_CHANNELS = 256;  // channels per task of the convolution

template <typename T>
void conv_spans(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, at::Tensor& state,
                const std::vector<Span>& spans, at::Tensor& out, bool apply_silu) {
  const int64_t channels = x.size(1), taps = weight.size(1), kept = taps - 1;
  const int64_t blocks = (channels + CONV_CHANNELS - 1) / CONV_CHANNELS;
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  const T* bp = bias.defined() ? bias.data_ptr<T>() : nullptr;
  float* sp = state.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(spans.size()) * blocks, 1, [&](int64_t begin, int64_t end) {
    // w: the block's taps [taps][CONV_CHANNELS]; inputs: the kept inputs before the span, then the span's own
    std::vector<float> w(taps * CONV_CHANNELS), b(CONV_CHANNELS), acc(CONV_CHANNELS), inputs;
    for (int64_t task = begin; task < end; ++task) {
      const Span& span = spans[task / blocks];
      const int64_t c0 = task % blocks * CONV_CHANNELS, n = std::min(CONV_CHANNELS, channels - c0);
      const int64_t len = span.end - span.start;
      for (int64_t j = 0; j < taps; ++j)
        for (int64_t c = 0; c < n; ++c) w[j * CONV_CHANNELS + c] = to_float(wp[(c0 + c) * taps + j]);
      for (int64_t c = 0; c < n; ++c) b[c] = bp != nullptr ? to_float(bp[c0 + c]) : 0.f;
      float* s = sp + span.slot * kept * channels + c0;  // [kept, channels]: the last inputs, oldest first
      inputs.resize((kept + len) * CONV_CHANNELS);
      for (int64_t j = 0; j < kept; ++j)
        for (int64_t c = 0; c < n; ++c) inputs[j * CONV_CHANNELS + c] = s[j * channels + c];
      for (int64_t i = 0; i < len; ++i) {
        const T* xr = xp + (span.start + i) * x.stride(0) + c0;
        float* in = inputs.data() + (kept + i) * CONV_CHANNELS;
        for (int64_t c = 0; c < n; ++c) in[c] = to_float(xr[c]);
      }
      for (int64_t i = 0; i < len; ++i) {
        // the same order of sums as the reference: tap 0 (the oldest input) first, the bias last
        const float* in = inputs.data() + i * CONV_CHANNELS;
#pragma omp simd
        for (int64_t c = 0; c < CONV_CHANNELS; ++c) acc[c] = in[c] * w[c];
        for (int64_t j = 1; j < taps; ++j) {
          const float* inj = in + j * CONV_CHANNELS;
          const float* wj = w.data() + j * CONV_CHANNELS;
#pragma omp simd
          for (int64_t c = 0; c < CONV_CHANNELS; ++c) acc[c] += inj[c] * wj[c];
        }
        if (apply_silu) {  // its own loop, so the compiler vectorizes the exp (the rounding below would not let it)
#pragma omp simd
          for (int64_t c = 0; c < CONV_CHANNELS; ++c) acc[c] = silu(acc[c] + b[c]);
        } else {
#pragma omp simd
          for (int64_t c = 0; c < CONV_CHANNELS; ++c) acc[c] += b[c];
        }
        T* orow = op + (span.start + i) * out.stride(0) + c0;
        for (int64_t c = 0; c < n; ++c) orow[c] = round_to<T>(acc[c]);
      }
      for (int64_t j = 0; j < kept; ++j)  // the last kept inputs, for the request's next rows
        for (int64_t c = 0; c < n; ++c) s[j * channels + c] = inputs[(len + j) * CONV_CHANNELS + c];
    }
  });
}

template <typename T>
void gated_norm_rows(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps,
                     at::Tensor& out) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* gp = gate.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * x.stride(0);
      const T* gr = gp + r * gate.stride(0);
      float ss = 0.f;
      for (int64_t d = 0; d < dim; ++d) ss += to_float(xr[d]) * to_float(xr[d]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + static_cast<float>(eps));
      T* orow = op + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        // rounded where the reference rounds: the normalised x, then the weight's product
        const float scaled = to_float(round_to<T>(to_float(wp[d]) * to_float(round_to<T>(to_float(xr[d]) * inv))));
        orow[d] = round_to<T>(scaled * silu(to_float(gr[d])));
      }
    }
  });
}

template <typename F>
void by_dtype(const at::Tensor& t, const char* name, F&& f) {
  if (t.scalar_type() == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    TORCH_CHECK(t.scalar_type() == at::kFloat, name, ": float32 or bfloat16");
    f(float{});
  }
}

}  // namespace

void gated_delta_rule(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor a, at::Tensor b, at::Tensor a_log,
                      at::Tensor dt_bias, at::Tensor state, at::Tensor spans, at::Tensor out, bool tiled) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "gated_delta_rule: heads' elements contiguous");
  TORCH_CHECK(a.stride(1) == 1 && b.stride(1) == 1 && state.is_contiguous() && state.scalar_type() == at::kFloat,
              "gated_delta_rule: a float32 contiguous state and gates with contiguous heads");
  for (const at::Tensor* t : {&q, &k, &a, &b, &a_log, &dt_bias, &out}) {
    TORCH_CHECK(t->scalar_type() == v.scalar_type(), "gated_delta_rule: every input in v's dtype");
  }
  TORCH_CHECK(a_log.is_contiguous() && dt_bias.is_contiguous() && v.size(1) % k.size(1) == 0,
              "gated_delta_rule: contiguous a_log and dt_bias, value heads a multiple of key heads");
  const std::vector<Span> s = read_spans(spans);
  by_dtype(v, "gated_delta_rule", [&](auto tag) {
    delta_rule<decltype(tag)>(q, k, v, a, b, a_log, dt_bias, state, s, out, tiled);
  });
}

void causal_conv(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias, at::Tensor state, at::Tensor spans,
                 at::Tensor out, bool apply_silu) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.is_contiguous() && weight.is_contiguous(),
              "causal_conv: rows of x with contiguous channels, a contiguous weight [C, K] and output");
  TORCH_CHECK(state.is_contiguous() && state.scalar_type() == at::kFloat && weight.scalar_type() == x.scalar_type() &&
              out.scalar_type() == x.scalar_type(), "causal_conv: a float32 contiguous state, weights in x's dtype");
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const std::vector<Span> s = read_spans(spans);
  by_dtype(x, "causal_conv", [&](auto tag) { conv_spans<decltype(tag)>(x, weight, b, state, s, out, apply_silu); });
}

at::Tensor gated_rms_norm(at::Tensor x, at::Tensor gate, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && gate.stride(1) == 1 && weight.is_contiguous() &&
              gate.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "gated_rms_norm: rows with contiguous elements, all in one dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  by_dtype(x, "gated_rms_norm", [&](auto tag) { gated_norm_rows<decltype(tag)>(x, gate, weight, eps, out); });
  return out;
}

void mamba2_scan(at::Tensor x, at::Tensor dt, at::Tensor b, at::Tensor c, at::Tensor a_log, at::Tensor d,
                 at::Tensor dt_bias, at::Tensor state, at::Tensor spans, at::Tensor out) {
  TORCH_CHECK(x.stride(2) == 1 && b.stride(2) == 1 && c.stride(2) == 1 && dt.stride(1) == 1 && out.stride(2) == 1,
              "mamba2_scan: heads' and groups' elements contiguous");
  TORCH_CHECK(state.is_contiguous() && state.scalar_type() == at::kFloat && b.size(1) > 0 &&
              x.size(1) % b.size(1) == 0, "mamba2_scan: a float32 contiguous state, heads a multiple of groups");
  for (const at::Tensor* t : {&dt, &b, &c, &a_log, &d, &dt_bias, &out}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "mamba2_scan: every input in x's dtype");
  }
  TORCH_CHECK(a_log.is_contiguous() && d.is_contiguous() && dt_bias.is_contiguous(),
              "mamba2_scan: contiguous a_log, d, dt_bias");
  const std::vector<Span> s = read_spans(spans);
  by_dtype(x, "mamba2_scan", [&](auto tag) {
    scan_spans<decltype(tag)>(x, dt, b, c, a_log, d, dt_bias, state, s, out);
  });
}
