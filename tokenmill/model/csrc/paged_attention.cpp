// Paged attention for query tokens that read their context straight from the block-structured KV cache: the
// float32 vector kernel (AVX2 and AVX-512 forms), and the entry points that send a bfloat16 or FP8 cache to
// tile_attention.cpp's bf16 dot products where they apply.
//
// Each query token t belongs to a block-table row and sees kv_lens[t] keys (causal: a prefill chunk's
// tokens see growing lengths). Work is split over (query token, KV head) pairs; the G query heads that
// share a KV head are computed together, so each K/V row is read once per group. Softmax is computed
// online, one block at a time, in float32 whatever the cache dtype.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "dtypes.h"
#include "kernels.h"
#include "simd.h"
#include "work_split.h"

namespace {

template <typename T>
void from_float(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

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

