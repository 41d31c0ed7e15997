// CPU kernels: paged attention and the skinny (decode-shaped) linear layer.
//
// Paged attention for query tokens that read their context straight from the block-structured KV cache.
//
// Each query token t belongs to a block-table row and sees kv_lens[t] keys (causal: a prefill chunk's
// tokens see growing lengths). Work is split over (query token, KV head) pairs; the G query heads that
// share a KV head are computed together, so each K/V row is read once per group. Softmax is computed
// online, one block at a time, in float32 whatever the cache dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables, const int64_t* q_rows,
            const int64_t* kv_lens, T* out, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_tokens * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores(group * block_size);
    std::vector<float> m(group), l(group), kf(head_dim), vf(head_dim), res(head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t len = kv_lens[t];
      const int64_t* table = block_tables + q_rows[t] * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        const T* qp = q + (t * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = to_float(qp[d]) * scale;
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t blk = table[start / block_size];
        const int64_t n = std::min(block_size, len - start);
        for (int64_t j = 0; j < n; ++j) {
          const T* kp = k_cache + ((blk * block_size + j) * num_kv_heads + h) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) kf[d] = to_float(kp[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * head_dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * kf[d];
            scores[g * block_size + j] = s;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* sg = scores.data() + g * block_size;
          float block_max = *std::max_element(sg, sg + n);
          const float new_m = std::max(m[g], block_max);
          const float correction = std::exp(m[g] - new_m);
          l[g] *= correction;
          float* ag = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ag[d] *= correction;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < n; ++j) {
            const float e = std::exp(sg[j] - new_m);
            sg[j] = e;
            sum += e;
          }
          l[g] += sum;
          m[g] = new_m;
        }
        for (int64_t j = 0; j < n; ++j) {
          const T* vp = v_cache + ((blk * block_size + j) * num_kv_heads + h) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) vf[d] = to_float(vp[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * block_size + j];
            float* ag = acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * vf[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < head_dim; ++d) res[d] = acc[g * head_dim + d] * inv;
        from_float(res.data(), out + (t * num_heads + h * group + g) * head_dim, head_dim);
      }
    }
  });
}

}  // namespace

// q [T, H, D]; k_cache, v_cache [blocks, block_size, KVH, D]; block_tables [R, max_blocks] int64;
// q_rows [T] int64 (row of block_tables per query token); kv_lens [T] int64; returns [T, H, D].
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor q_rows, torch::Tensor kv_lens,
                              double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.is_contiguous() && q_rows.is_contiguous() && kv_lens.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && q_rows.scalar_type() == at::kLong &&
              kv_lens.scalar_type() == at::kLong, "int64 index tensors");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type());
  auto out = torch::empty_like(q);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(2), BS = k_cache.size(1), MB = block_tables.size(1);
  TORCH_CHECK(H % KVH == 0, "heads must be a multiple of KV heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int64_t>(), q_rows.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(),
                     out.data_ptr<scalar_t>(), T, H, KVH, D, BS, MB, static_cast<float>(scale));
  });
  return out;
}

// Skinny matmul (few rows, as in decode): y = x @ w.T + b with w [N, K]. A single-row product runs on one
// core inside BLAS and cannot pull full memory bandwidth; here the output features are split across the
// intra-op threads, each calling the (then single-threaded) BLAS on its slice of w.
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  auto x_c = x.contiguous();
  const int64_t N = w.size(0);
  auto out_t = torch::empty({N, x.size(0)}, x.options());
  const int64_t threads = at::get_num_threads();
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over block tables (CPU)");
  m.def("skinny_linear", &skinny_linear, "x @ w.T (+ b) for few rows, output features split over threads");
}
