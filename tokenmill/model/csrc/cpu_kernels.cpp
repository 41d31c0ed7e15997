// CPU kernels: paged attention, the skinny (decode-shaped) linear layer, and the small fused ops of a decoder
// layer (RMSNorm with the residual add, rotary + KV-cache write, SiLU-and-multiply). On a 2-core CPU one decode
// step of a 30-layer model runs ~1,300 tiny torch ops, and their dispatch overhead rivals the matmuls; these
// collapse each layer's elementwise work into 4 calls. Each rounds like the torch code it replaces (products and
// sums rounded to the tensor dtype where torch rounds them), so results match the reference.
//
// Paged attention for query tokens that read their context straight from the block-structured KV cache.
//
// Each query token t belongs to a block-table row and sees kv_lens[t] keys (causal: a prefill chunk's
// tokens see growing lengths). Work is split over (query token, KV head) pairs; the G query heads that
// share a KV head are computed together, so each K/V row is read once per group. Softmax is computed
// online, one block at a time, in float32 whatever the cache dtype.
// torch/extension.h (the whole C++ frontend) took 37 s of this file's 51 s build; pybind.h, the Tensor casters
// the module needs, and the ops it calls take a few.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>

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

#include "simd.h"
#include "work_split.h"

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
inline T round_to(float x) { return static_cast<T>(x); }

// FP8 e4m3 ("fn": no infinities, one NaN code per sign) for the KV cache (--kv-cache-dtype fp8): a cache element is
// the byte of its code. Decoding is a table lookup (every code is exact in float32); encoding rounds to nearest
// even, saturating at +-448 as the cache writes of the reference do (it clamps before casting).
struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 15, m = c & 7;
      const float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
      value[c] = (e == 15 && m == 7) ? std::numeric_limits<float>::quiet_NaN() : ((c & 128) ? -mag : mag);
    }
  }
};
inline const E4m3Table& e4m3_table() {
  static const E4m3Table table;
  return table;
}

inline uint8_t float_to_e4m3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint8_t sign = (bits >> 24) & 0x80;
  if (std::isnan(x)) return sign | 0x7F;
  const float a = std::fabs(x);
  if (a >= 448.f) return sign | 0x7E;  // saturate (448 is the largest finite code)
  if (a < 0.015625f) {  // below the smallest normal 2^-6: multiples of 2^-9, rounded to nearest even
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.f));  // 8 -> 0x08, the smallest normal: right
  }
  int exp = static_cast<int>((bits >> 23) & 0xFF) - 127;
  uint32_t mant = bits & 0x7FFFFF, keep = mant >> 20;
  const uint32_t rest = mant & 0xFFFFF;
  if (rest > 0x80000 || (rest == 0x80000 && (keep & 1))) ++keep;
  if (keep == 8) keep = 0, ++exp;
  const int e = exp + 7;
  if (e > 15 || (e == 15 && keep == 7)) return sign | 0x7E;
  return sign | static_cast<uint8_t>((e << 3) | keep);
}

template <typename T>
void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
}
#endif

// s[j] = exp(s[j] - m) for j < n; returns their sum.
inline float exp_shifted(float* s, int64_t n, float m) {
  int64_t j = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float v : lanes) sum += v;
#endif
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 16 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
    }
    return hsum(_mm256_add_ps(s0, s1));
  }
#endif
  float s = 0.f;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float p, const float* x, float* y, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    const __m256 pv = _mm256_set1_ps(p);
    for (int64_t d = 0; d < n; d += 8)
      _mm256_storeu_ps(y + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
    return;
  }
#endif
  for (int64_t d = 0; d < n; ++d) y[d] += p * x[d];
}

// bfloat16 -> float32 is the bit pattern shifted into the high half: 16 (AVX-512) or 8 (AVX2) at a time.
inline void bf16_to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= n; d += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + d)));
    _mm512_storeu_ps(dst + d, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
#endif
#if defined(__AVX2__)
  for (; d + 8 <= n; d += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + d)));
    _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
#endif
  for (; d < n; ++d) dst[d] = to_float(src[d]);
}

// A cache row as floats: the row itself for float caches, else converted into `buf` (bfloat16 vectorised).
template <typename T>
inline const float* as_float(const T* row, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else if constexpr (std::is_same_v<T, uint8_t>) {  // FP8 e4m3 codes
    const float* table = e4m3_table().value;
    for (int64_t d = 0; d < n; ++d) buf[d] = table[row[d]];
    return buf;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    bf16_to_float(row, buf, n);
    return buf;
  } else {
    for (int64_t d = 0; d < n; ++d) buf[d] = to_float(row[d]);
    return buf;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Scores of one block: s[g * bs + j] = q_g . k_j for the G query heads of a KV head and the n keys of the block.
// Each K row is loaded once for all G heads; G is a template argument so the accumulators live in registers.
template <int G>
void block_scores_avx(const float* qf, const float* const* k_rows, float* s, int64_t n, int64_t bs, int64_t D) {
  constexpr int U = G <= 4 ? 2 : 1;  // keys per iteration: U * G independent FMA chains, within 16 registers
  int64_t j = 0;
  for (; j + U <= n; j += U) {
    __m256 acc[U][G];
    for (int u = 0; u < U; ++u)
      for (int g = 0; g < G; ++g) acc[u][g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      for (int u = 0; u < U; ++u) {
        const __m256 kv = _mm256_loadu_ps(k_rows[j + u] + d);
        for (int g = 0; g < G; ++g) acc[u][g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + d), kv, acc[u][g]);
      }
    }
    for (int u = 0; u < U; ++u)
      for (int g = 0; g < G; ++g) s[g * bs + j + u] = hsum(acc[u][g]);
  }
  for (; j < n; ++j)
    for (int g = 0; g < G; ++g) s[g * bs + j] = dot(qf + g * D, k_rows[j], D);
}

// acc_g += sum_j p[g * bs + j] * v_j for the G heads, 8 dims at a time: the G partial sums stay in registers
// across the block's rows instead of a load and a store of acc per row.
template <int G>
void block_values_avx(const float* p, const float* const* v_rows, float* acc, int64_t n, int64_t bs, int64_t D) {
  constexpr int U = G <= 4 ? 2 : 1;  // 8-float column groups per pass: U * G independent FMA chains
  int64_t d = 0;
  for (; d + 8 * U <= D; d += 8 * U) {
    __m256 a[U][G];
    for (int u = 0; u < U; ++u)
      for (int g = 0; g < G; ++g) a[u][g] = _mm256_loadu_ps(acc + g * D + d + 8 * u);
    for (int64_t j = 0; j < n; ++j) {
      for (int u = 0; u < U; ++u) {
        const __m256 vv = _mm256_loadu_ps(v_rows[j] + d + 8 * u);
        for (int g = 0; g < G; ++g) a[u][g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * bs + j), vv, a[u][g]);
      }
    }
    for (int u = 0; u < U; ++u)
      for (int g = 0; g < G; ++g) _mm256_storeu_ps(acc + g * D + d + 8 * u, a[u][g]);
  }
  for (; d < D; d += 8) {
    __m256 a[G];
    for (int g = 0; g < G; ++g) a[g] = _mm256_loadu_ps(acc + g * D + d);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 vv = _mm256_loadu_ps(v_rows[j] + d);
      for (int g = 0; g < G; ++g) a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * bs + j), vv, a[g]);
    }
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(acc + g * D + d, a[g]);
  }
}

template <int G>
bool block_avx(bool values, const float* x, const float* const* rows, float* y, int64_t group, int64_t n,
               int64_t bs, int64_t D) {
  if constexpr (G > 8) {
    return false;
  } else {
    if (group != G) return block_avx<G + 1>(values, x, rows, y, group, n, bs, D);
    if (values) block_values_avx<G>(x, rows, y, n, bs, D);
    else block_scores_avx<G>(x, rows, y, n, bs, D);
    return true;
  }
}
#endif

#if defined(__AVX512F__)
// The four sums of a, b, c, d's 16 lanes, as one 4-lane vector: three horizontal adds serve four reductions.
inline __m128 hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
  const auto fold = [](__m512 v) {  // 16 -> 8 lanes (AVX512F alone: no 32x8 extract)
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  const __m256 ab = _mm256_hadd_ps(fold(a), fold(b)), cd = _mm256_hadd_ps(fold(c), fold(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // [a b c d] partial sums in each 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// block_scores_avx with 16 lanes: four keys per pass, their G x 4 dot products reduced four at a time.
template <int G>
void block_scores_avx512(const float* qf, const float* const* k_rows, float* s, int64_t n, int64_t bs, int64_t D) {
  int64_t j = 0;
  if constexpr (G <= 6) {  // 4 G accumulators + 4 keys + 1 query within 32 registers
    for (; j + 4 <= n; j += 4) {
      __m512 acc[4][G];
      for (int u = 0; u < 4; ++u)
        for (int g = 0; g < G; ++g) acc[u][g] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        __m512 kv[4];
        for (int u = 0; u < 4; ++u) kv[u] = _mm512_loadu_ps(k_rows[j + u] + d);
        for (int g = 0; g < G; ++g) {
          const __m512 qv = _mm512_loadu_ps(qf + g * D + d);
          for (int u = 0; u < 4; ++u) acc[u][g] = _mm512_fmadd_ps(qv, kv[u], acc[u][g]);
        }
      }
      for (int g = 0; g < G; ++g) _mm_storeu_ps(s + g * bs + j, hsum4_512(acc[0][g], acc[1][g], acc[2][g], acc[3][g]));
    }
  }
  for (; j < n; ++j) {
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + d), _mm512_loadu_ps(k_rows[j] + d), acc);
      s[g * bs + j] = _mm512_reduce_add_ps(acc);
    }
  }
}

// block_values_avx with 16 lanes.
template <int G>
void block_values_avx512(const float* p, const float* const* v_rows, float* acc, int64_t n, int64_t bs, int64_t D) {
  constexpr int U = G <= 4 ? 2 : 1;  // 16-float column groups per pass: U * G independent FMA chains
  int64_t d = 0;
  for (; d + 16 * U <= D; d += 16 * U) {
    __m512 a[U][G];
    for (int u = 0; u < U; ++u)
      for (int g = 0; g < G; ++g) a[u][g] = _mm512_loadu_ps(acc + g * D + d + 16 * u);
    for (int64_t j = 0; j < n; ++j) {
      for (int u = 0; u < U; ++u) {
        const __m512 vv = _mm512_loadu_ps(v_rows[j] + d + 16 * u);
        for (int g = 0; g < G; ++g) a[u][g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * bs + j]), vv, a[u][g]);
      }
    }
    for (int u = 0; u < U; ++u)
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(acc + g * D + d + 16 * u, a[u][g]);
  }
  for (; d < D; d += 16) {
    __m512 a[G];
    for (int g = 0; g < G; ++g) a[g] = _mm512_loadu_ps(acc + g * D + d);
    for (int64_t j = 0; j < n; ++j) {
      const __m512 vv = _mm512_loadu_ps(v_rows[j] + d);
      for (int g = 0; g < G; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * bs + j]), vv, a[g]);
    }
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(acc + g * D + d, a[g]);
  }
}

template <int G>
bool block_avx512(bool values, const float* x, const float* const* rows, float* y, int64_t group, int64_t n,
                  int64_t bs, int64_t D) {
  if constexpr (G > 8) {
    return false;
  } else {
    if (group != G) return block_avx512<G + 1>(values, x, rows, y, group, n, bs, D);
    if (values) block_values_avx512<G>(x, rows, y, n, bs, D);
    else block_scores_avx512<G>(x, rows, y, n, bs, D);
    return true;
  }
}
#endif

// Scores of one block for the G query heads of a KV head (see block_scores_avx).
inline void block_scores(const float* qf, const float* const* k_rows, float* s, int64_t group, int64_t n,
                         int64_t bs, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0 && block_avx512<1>(false, qf, k_rows, s, group, n, bs, D)) return;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0 && block_avx<1>(false, qf, k_rows, s, group, n, bs, D)) return;
#endif
  for (int64_t j = 0; j < n; ++j)
    for (int64_t g = 0; g < group; ++g) s[g * bs + j] = dot(qf + g * D, k_rows[j], D);
}

// The block's probability-weighted values added into the G heads' accumulators (see block_values_avx).
inline void block_values(const float* p, const float* const* v_rows, float* acc, int64_t group, int64_t n,
                         int64_t bs, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0 && block_avx512<1>(true, p, v_rows, acc, group, n, bs, D)) return;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0 && block_avx<1>(true, p, v_rows, acc, group, n, bs, D)) return;
#endif
  for (int64_t j = 0; j < n; ++j)
    for (int64_t g = 0; g < group; ++g) axpy(p[g * bs + j], v_rows[j], acc + g * D, D);
}

// Online-softmax update of heads [g0, g0 + heads) with the scores of a block of n keys (s[g * stride + j]), then
// their probability-weighted values added into acc.
inline void softmax_block(float* scores, const float* const* v_rows, float* acc, float* m, float* l, int64_t g0,
                          int64_t heads, int64_t n, int64_t stride, int64_t D) {
  for (int64_t g = g0; g < g0 + heads; ++g) {
    float* sg = scores + g * stride;
    const float new_m = std::max(m[g], *std::max_element(sg, sg + n));
    const float correction = std::exp(m[g] - new_m);
    if (correction != 1.f) {
      l[g] *= correction;
      float* ag = acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] *= correction;
    }
    l[g] += exp_shifted(sg, n, new_m);
    m[g] = new_m;
  }
  block_values(scores + g0 * stride, v_rows, acc + g0 * D, heads, n, stride, D);
}

// One work item is a KV head of a tile of query tokens: one token, or two consecutive tokens of one request
// (a prefill), whose 2G query heads then share each K/V row's load and conversion. A token's G query heads walk
// its context block by block with an online softmax, and its arithmetic is the same in a tile as alone (a tile is
// only formed where the 2G-head kernels take the same path as the G-head ones), so decode and prefill, alone or
// batched, agree bit for bit. Blocks sit anywhere in the pool, so the next block's rows are prefetched while this
// one is computed (a hardware prefetcher cannot guess the jump).
// window > 0 (a sliding-window layer, Gemma 3's local ones): a token sees only its last `window` keys, itself
// included; its walk starts at the block holding the first of them, whose earlier keys it skips. Such tokens go
// one per tile (their windows start at different keys).
template <typename T, typename C = T>  // C: the cache element (T, or uint8_t for FP8 e4m3 codes)
void attend(const T* q, const C* k_cache, const C* v_cache, const int64_t* block_tables, const int64_t* q_rows,
            const int64_t* kv_lens, T* out, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window = 0) {
  const int64_t group = num_heads / num_kv_heads, D = head_dim, bs = block_size;
  const int64_t row_stride = num_kv_heads * D;  // elements between consecutive tokens' rows of one head
  const bool pairs = window <= 0 && 2 * group <= 6;  // block_scores_avx512 reduces four keys at once up to 6 heads
  std::vector<int64_t> tiles;  // first token of each tile; a tile is 1 or 2 tokens
  for (int64_t t = 0; t < num_tokens;) {
    tiles.push_back(t);
    t += pairs && t + 1 < num_tokens && q_rows[t + 1] == q_rows[t] && kv_lens[t + 1] == kv_lens[t] + 1 ? 2 : 1;
  }
  tiles.push_back(num_tokens);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size()) - 1;
  const int64_t items = num_tiles * num_kv_heads;
  parallel_take(items, 1, [&](WorkQueue& work) {
    const int64_t heads_max = 2 * group;
    std::vector<float> qf(heads_max * D), acc(heads_max * D), scores(heads_max * bs), m(heads_max), l(heads_max);
    std::vector<float> res(D), kbuf(std::is_same_v<C, float> ? 0 : bs * D), vbuf(kbuf.size());
    std::vector<const float*> k_rows(bs), v_rows(bs);
    for (int64_t begin, end; work.take(begin, end);) for (int64_t i = begin; i < end; ++i) {
      const int64_t item = items - 1 - i;  // the last tiles first: a causal prefill's read the most blocks
      const int64_t tile = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t t0 = tiles[tile], ntok = tiles[tile + 1] - t0, heads = ntok * group;
      const int64_t len = kv_lens[t0 + ntok - 1];  // the tile's longest context (its last token's)
      const int64_t* table = block_tables + q_rows[t0] * max_blocks;
      for (int64_t i = 0; i < ntok; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const T* qp = q + ((t0 + i) * num_heads + h * group + g) * D;
          for (int64_t d = 0; d < D; ++d) qf[(i * group + g) * D + d] = to_float(qp[d]) * scale;
        }
      }
      std::fill(m.begin(), m.begin() + heads, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + heads, 0.f);
      std::fill(acc.begin(), acc.begin() + heads * D, 0.f);
      // the first key seen (a window's tile is one token)
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      for (int64_t start = first - first % bs; start < len; start += bs) {
        const int64_t skip = std::max<int64_t>(0, first - start);  // keys of this block before the window
        const int64_t n = std::min(bs, len - start) - skip;
        const C* k_blk = k_cache + ((table[start / bs] * bs + skip) * num_kv_heads + h) * D;
        const C* v_blk = v_cache + ((table[start / bs] * bs + skip) * num_kv_heads + h) * D;
        if (start + bs < len) {  // the next block into L2 (as tile_attention.cpp does; into L1 it stalls loads)
          const int64_t next = table[start / bs + 1] * bs * num_kv_heads + h;
          const int64_t next_n = std::min(bs, len - start - bs);
          prefetch_rows<false>(k_cache + next * D, row_stride * sizeof(C), next_n, D * sizeof(C));
          prefetch_rows<false>(v_cache + next * D, row_stride * sizeof(C), next_n, D * sizeof(C));
        }
        for (int64_t j = 0; j < n; ++j) {
          k_rows[j] = as_float(k_blk + j * row_stride, kbuf.data() + j * D, D);
          v_rows[j] = as_float(v_blk + j * row_stride, vbuf.data() + j * D, D);
        }
        const int64_t n_first = std::min(bs, kv_lens[t0] - start);  // keys of this block the first token sees
        if (ntok == 1 || n_first == n) {  // every token of the tile sees the whole block
          block_scores(qf.data(), k_rows.data(), scores.data(), heads, n, bs, D);
          softmax_block(scores.data(), v_rows.data(), acc.data(), m.data(), l.data(), 0, heads, n, bs, D);
        } else {  // the tile's last block: each token alone, with the keys it sees
          for (int64_t i = 0; i < ntok; ++i) {
            const int64_t ni = std::min(bs, kv_lens[t0 + i] - start);
            if (ni <= 0) continue;
            block_scores(qf.data() + i * group * D, k_rows.data(), scores.data() + i * group * bs, group, ni, bs, D);
            softmax_block(scores.data(), v_rows.data(), acc.data(), m.data(), l.data(), i * group, group, ni, bs, D);
          }
        }
      }
      for (int64_t i = 0; i < ntok; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t hg = i * group + g;
          const float inv = l[hg] > 0.f ? 1.f / l[hg] : 0.f;
          for (int64_t d = 0; d < D; ++d) res[d] = acc[hg * D + d] * inv;
          from_float(res.data(), out + ((t0 + i) * num_heads + h * group + g) * D, D);
        }
      }
    }
  });
}

}  // namespace

// csrc/tile_attention.cpp, for C = uint16_t (a bfloat16 cache) and uint8_t (FP8 e4m3 codes)
template <typename C>
bool tile_attention(const uint16_t* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                   const int64_t* q_rows, const int64_t* kv_lens, uint16_t* out, int64_t num_tokens, int64_t num_heads,
                   int64_t num_kv_heads, int64_t D, int64_t block_size, int64_t max_blocks, float scale);

bool amx_attention_applies(int64_t block_size, int64_t head_dim, int64_t num_heads, int64_t num_kv_heads);
bool tile_attention_applies(int64_t block_size, int64_t head_dim, int64_t num_heads, int64_t num_kv_heads);

// q [T, H, D]; k_cache, v_cache [blocks, block_size, KVH, D]; block_tables [R, max_blocks] int64;
// q_rows [T] int64 (row of block_tables per query token); kv_lens [T] int64; returns [T, H, D].
// tiles: a bfloat16 cache goes to the bf16 dot-product kernel (AMX or AVX512-BF16) where it applies (false:
// always the vector kernel below). window > 0: each token sees its last `window` keys only (the vector kernel).
at::Tensor attention_on(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                           at::Tensor q_rows, at::Tensor kv_lens, double scale, bool tiles, int64_t window = 0) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.is_contiguous() && q_rows.is_contiguous() && kv_lens.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && q_rows.scalar_type() == at::kLong &&
              kv_lens.scalar_type() == at::kLong, "int64 index tensors");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches of one dtype");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || q.scalar_type() == k_cache.scalar_type(), "the cache holds q's dtype, or FP8 e4m3");
  auto out = at::empty_like(q);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(2), BS = k_cache.size(1), MB = block_tables.size(1);
  TORCH_CHECK(H % KVH == 0, "heads must be a multiple of KV heads");
  if (fp8) {  // bf16 products over rows widened to bfloat16 where they apply, else the vector kernel
    const uint8_t* kc = reinterpret_cast<const uint8_t*>(k_cache.data_ptr());
    const uint8_t* vc = reinterpret_cast<const uint8_t*>(v_cache.data_ptr());
    if (tiles && window <= 0 && q.scalar_type() == at::kBFloat16 &&
        tile_attention(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), kc, vc,
                      block_tables.data_ptr<int64_t>(), q_rows.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(),
                      reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), T, H, KVH, D, BS, MB,
                      static_cast<float>(scale)))
      return out;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_fp8", [&] {
      attend<scalar_t, uint8_t>(q.data_ptr<scalar_t>(), kc, vc, block_tables.data_ptr<int64_t>(),
                                q_rows.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                                T, H, KVH, D, BS, MB, static_cast<float>(scale), window);
    });
    return out;
  }
  if (tiles && window <= 0 && q.scalar_type() == at::kBFloat16 &&
      tile_attention(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
                    reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                    reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()),
                    block_tables.data_ptr<int64_t>(), q_rows.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(),
                    reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), T, H, KVH, D, BS, MB,
                    static_cast<float>(scale)))
    return out;  // AMX tiles or AVX512-BF16 (csrc/tile_attention.cpp)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int64_t>(), q_rows.data_ptr<int64_t>(), kv_lens.data_ptr<int64_t>(),
                     out.data_ptr<scalar_t>(), T, H, KVH, D, BS, MB, static_cast<float>(scale), window);
  });
  return out;
}

at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                              at::Tensor block_tables, at::Tensor q_rows, at::Tensor kv_lens,
                              double scale) {
  return attention_on(q, k_cache, v_cache, block_tables, q_rows, kv_lens, scale, true);
}

// A sliding-window layer's paged attention: each token sees its last `window` keys (itself included).
at::Tensor paged_attention_window(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor q_rows, at::Tensor kv_lens, double scale, int64_t window) {
  TORCH_CHECK(window > 0, "a window of at least one key");
  return attention_on(q, k_cache, v_cache, block_tables, q_rows, kv_lens, scale, true, window);
}

// The vector kernel whatever the dtype (benchmarks and tests compare it with the bf16 dot-product one).
at::Tensor paged_attention_vectors(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                      at::Tensor block_tables, at::Tensor q_rows, at::Tensor kv_lens,
                                      double scale) {
  return attention_on(q, k_cache, v_cache, block_tables, q_rows, kv_lens, scale, false);
}

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

// ---- fused elementwise ops ---------------------------------------------------------------------------------------

namespace {

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
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
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
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
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
          const __m256 one = _mm256_set1_ps(1.f), cap = _mm256_set1_ps(88.f);  // exp(88) is still finite
          const float* gf = reinterpret_cast<const float*>(gate);
          const float* uf = reinterpret_cast<const float*>(up);
          float* of = reinterpret_cast<float*>(o);
          for (; j + 8 <= I; j += 8) {
            const __m256 x = _mm256_loadu_ps(gf + j);
            const __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), cap));
            const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(of + j, _mm256_mul_ps(silu, _mm256_loadu_ps(uf + j)));
          }
        } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {  // rounded where torch rounds, 8 at a time
          const __m256 one = _mm256_set1_ps(1.f), cap = _mm256_set1_ps(88.f);
          // the lambda is not a template: the branch is compiled for every dtype, hence the casts
          const auto* gb = reinterpret_cast<const c10::BFloat16*>(gate);
          const auto* ub = reinterpret_cast<const c10::BFloat16*>(up);
          auto* ob = reinterpret_cast<c10::BFloat16*>(o);
#if defined(__AVX512F__)
          const __m512 one16 = _mm512_set1_ps(1.f), cap16 = _mm512_set1_ps(88.f);
          for (; j + 16 <= I; j += 16) {  // the 8-wide loop below, 16 at a time: the same per-element math
            const __m512 x = bf16x16_to_ps(gb + j);
            const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), cap16));
            const __m512 silu = round_to_bf16_ps512(_mm512_div_ps(x, _mm512_add_ps(one16, e)));
            store_bf16x16(ob + j, round_to_bf16_ps512(_mm512_mul_ps(silu, bf16x16_to_ps(ub + j))));
          }
#endif
          for (; j + 8 <= I; j += 8) {
            const __m256 x = bf16x8_to_ps(gb + j);
            const __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), cap));
            const __m256 silu = round_to_bf16_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)));
            store_bf16x8(ob + j, round_to_bf16_ps(_mm256_mul_ps(silu, bf16x8_to_ps(ub + j))));
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

// x @ w.T (+ b) with w prepacked in oneDNN's blocked layout (model/linear.py prepacks it once at load). Called
// through the dispatcher: the op is registered by torch, its C++ symbol is not exported.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& b) {
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, std::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>();
  return op.call(x, packed, b, "none", c10::List<std::optional<at::Scalar>>(), std::optional<std::string_view>(""));
}

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
// lora.cpp: LoRA adapters' grouped low-rank update, run by run
void lora_add(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& as,
              const std::vector<at::Tensor>& bs, const std::vector<int64_t>& col0s,
              const std::vector<at::Tensor>& ranks, const at::Tensor& runs, int64_t matmul_rows);
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);

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

namespace {

// One projection's LoRA slots as model/lora.py's LoRASlots holds them (per part: A, B, ranks, first column); no
// parts: no adapter there. Their tensors are the slots' own, so refilled slots are seen without a new stack.
struct LoRAProjection {
  std::vector<at::Tensor> as, bs, ranks;
  std::vector<int64_t> col0s;
  void add(at::Tensor& y, const at::Tensor& x, const at::Tensor& runs, int64_t matmul_rows) const {
    if (!as.empty() && runs.size(0) > 0) lora_add(y, x, as, bs, col0s, ranks, runs, matmul_rows);
  }
};
using LayerLoRA = std::vector<LoRAProjection>;  // qkv_proj, o_proj, gate_up_proj, down_proj

// A decoder layer, for a batch whose tokens all read their context from the cache (decodes and later prefill
// chunks), from its normed input xn to its MLP output, with the attention's residual added to x in place (the MLP's
// is left to the caller). `w` holds input_norm, qkv weight, qkv bias (or an empty tensor), o_proj, post_norm,
// gate_up, down, then the packed copies of qkv, o_proj, gate_up and down (or empty tensors), then their
// per-feature scales (int8 weights; else empty tensors).
at::Tensor layer_to_mlp(at::Tensor x, const at::Tensor& xn, const std::vector<at::Tensor>& w, int64_t num_heads,
                        int64_t num_kv_heads, double eps, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& q_rows, const at::Tensor& kv_lens,
                        const LayerLoRA* lora, const at::Tensor& lora_runs, int64_t lora_matmul_rows) {
  const int64_t T = x.size(0), D = k_cache.size(3);
  c10::optional<at::Tensor> qkv_bias;
  if (w[2].numel() > 0) qkv_bias = w[2];
  auto qkv = linear_any(xn, w[1], w[7], w[11], qkv_bias);
  if (lora) (*lora)[0].add(qkv, xn, lora_runs, lora_matmul_rows);
  rotary_write_kv(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping);
  // q's heads in place (one token: already contiguous), one view instead of narrow + contiguous + view
  auto q = qkv.as_strided({T, num_heads, D}, {qkv.stride(0), D, 1});
  if (T > 1) q = q.contiguous();
  auto attn = paged_attention(q, k_cache, v_cache, block_tables, q_rows, kv_lens, 1.0 / std::sqrt(double(D)));
  auto attn_rows = attn.view({T, num_heads * D});
  auto h = linear_any(attn_rows, w[3], w[8], w[12], c10::nullopt);
  if (lora) (*lora)[1].add(h, attn_rows, lora_runs, lora_matmul_rows);
  auto normed = add_rms_norm(h, x, w[4], eps);
  at::Tensor act;
  if (lora && !(*lora)[2].as.empty()) {  // the adapter changes gate and up before SiLU (gate_up packed plain)
    auto gate_up = linear_any(normed, w[5], w[9], w[13], c10::nullopt);
    (*lora)[2].add(gate_up, normed, lora_runs, lora_matmul_rows);
    act = silu_mul(gate_up);
  } else {
    act = gate_up_silu(normed, w[5], w[9], w[13]);
  }
  auto out = linear_any(act, w[6], w[10], w[14], c10::nullopt);
  if (lora) (*lora)[3].add(out, act, lora_runs, lora_matmul_rows);
  return out;
}

}  // namespace

// Every decoder layer of a model (each layer's weights as layer_to_mlp takes them), held once and run in one call
// a step, composed of the kernels above: Python crosses into C++ once a step instead of once a layer (or once an
// op), and each layer's residual add joins the next layer's input norm in one pass (add_rms_norm rounds the sum as
// the add does, then normalises it: the same bits as the add, then the norm). In a one-stream decode step on Zen 4
// the small ops between matmuls took ~3 us each (their code and data cold after the weights streamed through the
// caches).
class DecoderStack {
 public:
  explicit DecoderStack(std::vector<std::vector<at::Tensor>> layers) : layers_(std::move(layers)) {
    for (const auto& w : layers_) TORCH_CHECK(w.size() == 15, "a decoder layer takes 15 weight tensors");
  }
  int64_t size() const { return static_cast<int64_t>(layers_.size()); }
  // LoRA slots per layer and projection (qkv, o, gate_up, down), per part: A, B, ranks (model/lora.py LoRASlots)
  // and first columns; a projection without parts has no adapters.
  void set_lora(const std::vector<std::vector<std::vector<at::Tensor>>>& as,
                const std::vector<std::vector<std::vector<at::Tensor>>>& bs,
                const std::vector<std::vector<std::vector<at::Tensor>>>& ranks,
                const std::vector<std::vector<std::vector<int64_t>>>& col0s, int64_t matmul_rows) {
    TORCH_CHECK(as.size() == layers_.size() && bs.size() == as.size() && ranks.size() == as.size() &&
                    col0s.size() == as.size(), "LoRA slots for every layer");
    lora_.assign(as.size(), LayerLoRA(4));
    for (size_t i = 0; i < as.size(); ++i) {
      TORCH_CHECK(as[i].size() == 4 && bs[i].size() == 4 && ranks[i].size() == 4 && col0s[i].size() == 4,
                  "a layer's LoRA slots: qkv, o, gate_up, down");
      for (size_t j = 0; j < 4; ++j) lora_[i][j] = LoRAProjection{as[i][j], bs[i][j], ranks[i][j], col0s[i][j]};
    }
    lora_matmul_rows_ = matmul_rows;
  }
  bool has_lora() const { return !lora_.empty(); }
  // x [T, hidden] updated in place through every layer; k_caches / v_caches one per layer; lora_runs [n, 3] (first
  // row, end row, slot) of rows through LoRA slots (set_lora), or empty.
  void run(at::Tensor x, int64_t num_heads, int64_t num_kv_heads, double eps, const at::Tensor& cos,
           const at::Tensor& sin, const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
           const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& q_rows,
           const at::Tensor& kv_lens, const c10::optional<at::Tensor>& lora_runs = c10::nullopt) const {
    const bool lora = lora_runs.has_value() && lora_runs->size(0) > 0;
    TORCH_CHECK(!lora || has_lora(), "LoRA runs given to a stack without LoRA slots");
    const at::Tensor runs = lora ? *lora_runs : at::Tensor();
    const size_t n = layers_.size();
    TORCH_CHECK(k_caches.size() == n && v_caches.size() == n, "one K and one V cache per layer");
    if (n == 0) return;
    at::Tensor xn = rms_norm(x, layers_[0][0], eps);
    for (size_t i = 0; i < n; ++i) {
      auto mlp = layer_to_mlp(x, xn, layers_[i], num_heads, num_kv_heads, eps, cos, sin, k_caches[i], v_caches[i],
                              slot_mapping, block_tables, q_rows, kv_lens, lora ? &lora_[i] : nullptr, runs,
                              lora_matmul_rows_);
      if (i + 1 < n) xn = add_rms_norm(mlp, x, layers_[i + 1][0], eps);  // x += mlp; the next layer's input norm
      else x.add_(mlp);
    }
  }

 private:
  std::vector<std::vector<at::Tensor>> layers_;
  std::vector<LayerLoRA> lora_;
  int64_t lora_matmul_rows_ = 0;
};

// Token ids -> embedding rows, as the model's VocabEmbedding looks them up on this backend (backends/cpu.py says
// which kind): "dense" a plain table, "tiles" rows of a bfloat16 tile-packed tied head (tile_rows), "int8" rows of
// an int8 tile-packed tied head times its per-row scales, "gguf" GGML block rows of a tied head packed by gguf_pack
// (gather_tile_bytes with model/backends/gguf_tiles.py's byte sources, then gguf_decode_rows), each the same ops in the same
// order as the Python lookup, so the rows are the same bits.
class RowLookup {
 public:
  RowLookup(std::string kind, at::Tensor table, at::Tensor sources, at::Tensor flip, int64_t ggml_type,
            at::Tensor scale, at::Tensor like)
      : kind_(std::move(kind)), table_(std::move(table)), sources_(std::move(sources)), flip_(std::move(flip)),
        type_(ggml_type), scale_(std::move(scale)), dtype_(like.scalar_type()) {
    TORCH_CHECK(kind_ == "dense" || kind_ == "tiles" || kind_ == "int8" || kind_ == "gguf",
                "row lookup kinds: dense, tiles, int8, gguf; not ", kind_);
  }
  at::Tensor rows(const at::Tensor& ids) const {
    if (kind_ == "dense") return table_.index_select(0, ids);
    if (kind_ == "tiles") return tile_rows(table_, ids);
    if (kind_ == "int8") {
      auto q = tile_rows(table_, ids).bitwise_xor(0x80).view(at::kChar);
      return q.to(at::kFloat).mul(scale_.index_select(0, ids).unsqueeze(-1)).to(dtype_);
    }
    const int64_t n = ids.numel();
    auto raw = gather_tile_bytes(table_, ids, sources_, flip_).reshape({n, -1});
    auto out = at::empty({n, table_.size(1) * 32}, at::TensorOptions().dtype(dtype_));
    gguf_decode_rows(raw, type_, out);
    return out;
  }

 private:
  std::string kind_;
  at::Tensor table_, sources_, flip_;
  int64_t type_;
  at::Tensor scale_;
  at::ScalarType dtype_;
};

// The whole model for decode steps: a step in one call (`logits`: embedding rows, the rotary rows of each position,
// every layer (DecoderStack), the final norm, the LM head through linear_any, the kernel the Python head picks for
// the same packed copy), and greedy decode for up to `steps` tokens in one call (`run`: each step's first argmax fed
// back as the next input). The same calls the Python step makes, so the same logits and tokens; what goes is a
// step's Python (~0.3 ms of a 4 ms one-stream step on Zen 4, its code and data cold after the weights streamed
// through the caches).
class DecodeModel {
 public:
  DecodeModel(const DecoderStack& stack, const RowLookup& embed, at::Tensor norm, double eps, at::Tensor head_w,
                at::Tensor head_packed, at::Tensor head_scale, at::Tensor head_bias, at::Tensor cos, at::Tensor sin,
                int64_t num_heads, int64_t num_kv_heads)
      : stack_(stack), embed_(embed), norm_(std::move(norm)), eps_(eps), head_w_(std::move(head_w)),
        head_packed_(std::move(head_packed)), head_scale_(std::move(head_scale)), head_bias_(std::move(head_bias)),
        cos_(std::move(cos)), sin_(std::move(sin)), num_heads_(num_heads), num_kv_heads_(num_kv_heads) {
    TORCH_CHECK(cos_.dim() == 2 && sin_.sizes() == cos_.sizes(), "rotary tables: [positions, head_dim]");
  }
  // One decode step: ids [B] at positions [B] through the model, their K/V written to the slots block_tables [B,
  // blocks] give them; -> float32 logits [B, V], as compute_logits gives them.
  at::Tensor logits(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& block_tables,
                    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches) const {
    const int64_t B = ids.numel();
    TORCH_CHECK(!k_caches.empty() && positions.numel() == B && block_tables.dim() == 2 && block_tables.size(0) == B,
                "one position and one block table row per id");
    TORCH_CHECK(ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                    block_tables.scalar_type() == at::kLong, "int64 ids, positions and block tables");
    const auto tables = block_tables.contiguous();
    const auto pos = positions.contiguous();
    const int64_t bs = k_caches[0].size(1), M = tables.size(1), P = cos_.size(0);
    auto slots = at::empty({B}, ids.options()), kv_lens = at::empty({B}, ids.options());
    const int64_t* p = pos.data_ptr<int64_t>();
    const int64_t* bt = tables.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(p[b] >= 0 && p[b] < P && p[b] / bs < M, "position ", p[b], " past the tables");
      slots.data_ptr<int64_t>()[b] = bt[b * M + p[b] / bs] * bs + p[b] % bs;
      kv_lens.data_ptr<int64_t>()[b] = p[b] + 1;
    }
    auto x = embed_.rows(ids).contiguous();
    stack_.run(x, num_heads_, num_kv_heads_, eps_, cos_.index_select(0, pos), sin_.index_select(0, pos), k_caches,
               v_caches, slots, tables, at::arange(B, ids.options()), kv_lens);
    c10::optional<at::Tensor> bias;
    if (head_bias_.numel() > 0) bias = head_bias_;
    return linear_any(rms_norm(x, norm_, eps_), head_w_, head_packed_, head_scale_, bias).to(at::kFloat).contiguous();
  }

  // Up to `steps` greedy steps: each step's first argmax fed back as the next input, a row ending when its token is
  // one of its stop_ids [B, S] (-1 pads), the run when every row has. Returns the tokens [steps run, B].
  at::Tensor run(at::Tensor ids, at::Tensor positions, const at::Tensor& block_tables,
                 const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches, int64_t steps,
                 const at::Tensor& stop_ids) const {
    const int64_t B = ids.numel();
    TORCH_CHECK(stop_ids.dim() == 2 && stop_ids.size(0) == B && stop_ids.scalar_type() == at::kLong,
                "one int64 row of stop ids per id");
    const auto stops = stop_ids.contiguous();
    const int64_t S = stops.size(1);
    positions = positions.contiguous().clone();
    auto out = at::empty({steps, B}, ids.options());
    std::vector<char> ended(B, 0);
    int64_t done = 0;
    while (done < steps) {
      ids = first_argmax(logits(ids, positions, block_tables, k_caches, v_caches));
      out[done].copy_(ids);
      ++done;
      const int64_t* tok = ids.data_ptr<int64_t>();
      const int64_t* st = stops.data_ptr<int64_t>();
      int64_t* pos = positions.data_ptr<int64_t>();
      bool all = true;
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t k = 0; k < S && !ended[b]; ++k) ended[b] = st[b * S + k] == tok[b];
        all = all && ended[b];
        ++pos[b];
      }
      if (all) break;
    }
    return out.narrow(0, 0, done);
  }

 private:
  const DecoderStack& stack_;
  const RowLookup& embed_;
  at::Tensor norm_;
  double eps_;
  at::Tensor head_w_, head_packed_, head_scale_, head_bias_, cos_, sin_;
  int64_t num_heads_, num_kv_heads_;
};

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, int64_t first,
                       const std::vector<at::Tensor>& gate_up_w, const std::vector<at::Tensor>& gate_up_packed,
                       const std::vector<at::Tensor>& gate_up_scale, const std::vector<at::Tensor>& down_w,
                       const std::vector<at::Tensor>& down_packed, const std::vector<at::Tensor>& down_scale);

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
