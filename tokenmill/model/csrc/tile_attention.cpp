// Paged attention over a bfloat16 KV cache with bfloat16 dot products: the product of the query heads with a
// block's keys, and of the probabilities with its values, are bf16-in, float32-out dot products, on Intel AMX
// tiles where the CPU has them, else with AVX512-BF16 (Zen4, Cooper Lake), instead of one key at a time in float32
// vectors with every cache element converted. The online softmax between them stays in float32 vectors.
//
// A work item is a KV head of a tile of query tokens: up to 16 / G consecutive tokens of one request (a prefill
// chunk; a decode token is a tile of one), whose M = tokens x G query heads are the columns of S^T and the
// rows of P and O. Per cache block of 16 keys:
//   S^T [16 x M] = K [16 x D] . Q^T        K's rows loaded into A tiles straight from the cache, Q^T (in the
//                                          VNNI order B tiles take) built once per work item; S^T is turned
//                                          back into rows (a gather per row, or a 16 x 16 transpose);
//   P           = exp(S * scale - running max), rounded to bfloat16 (as PyTorch's CPU flash attention rounds
//                 its probabilities before the second product), 0 for keys a row does not see;
//   O [M x D]  += P [M x 16] . V          V's rows interleaved in pairs (VNNI), 16 output dims per tile.
// Without AMX the same products run on AVX512-BF16 (`Dots`). A decode's few rows go row by row (`RowBlock`): S
// with the keys in the vector lanes (each 32-dim chunk of K transposed into dim pairs in registers once per
// block), P.V with 16 dims in the lanes (V's key pairs interleaved in registers as they are read). A prefill
// tile's rows (M > 4) sit in the lanes instead (`lanes_block`): S^T one key at a time against Q^T with the key's
// dim pairs broadcast straight from the cache (no transpose), the softmax down the 16 keys (maxima, exponentials
// and sums as vertical vector ops, not a horizontal reduction per row), and O^T one dim at a time. Both take the
// same operands in the same order element by element (the sums through `add_ordered`, which -ffast-math may not
// re-associate), so a token computes the same bits in either.
// Every row is its own computation: a tile dot product computes each output element from its own A row and B
// column, and a row's softmax never looks at another row. A token walks its blocks in the same order with the
// same masks alone or in a tile (blocks past its context add exact zeros), so decode and prefill, alone or
// batched, chunked any way, agree bit for bit: the batch invariance the vector kernel gives, kept.
// An FP8 e4m3 cache (--kv-cache-dtype fp8) runs the same tiles: each block's K and V rows are widened to bfloat16
// first (exactly), so it computes what a bfloat16 cache holding the same values would.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TOKENMILL_DP_ATTENTION 1
#include <immintrin.h>

#include "simd.h"
#include "work_split.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define TOKENMILL_AMX_ATTENTION 1
#endif
#endif

std::string bf16_kernel();  // bf16_linear.cpp: "amx" once the OS has granted this process the tile state

namespace {

#ifdef TOKENMILL_DP_ATTENTION
constexpr int64_t kKeys = 16;     // keys per cache block: the rows of K, the columns of S
constexpr int64_t kMaxDim = 256;  // head_dim this kernel takes (a multiple of 32)

#ifdef TOKENMILL_AMX_ATTENTION
// Tiles: 0 K (A, 16 keys x 32 dims), 1 Q^T (B, 16 dim pairs x M), 2 S^T (C, 16 keys x M), 3 P (A, M x 16 keys),
// 4 V (B, 8 key pairs x 16 dims), 5 P.V (C, M x 16 dims).
void configure_tiles(int64_t M) {
  AmxTileConfig cfg;
  const uint8_t m = static_cast<uint8_t>(M);
  const uint16_t mb = static_cast<uint16_t>(4 * M);
  const uint8_t rows[6] = {16, 16, 16, m, 8, m};
  const uint16_t colsb[6] = {64, mb, mb, 32, 64, 64};
  for (int t = 0; t < 6; ++t) {
    cfg.rows[t] = rows[t];
    cfg.colsb[t] = colsb[t];
  }
  _tile_loadconfig(&cfg);
}
#endif

// Transpose of a 16 x 16 matrix of 32-bit elements held as 16 rows.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c] holds column c (then c + 4, 8, 12 per 128-bit lane) of rows 4i..4i+3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int h = 0; h < 2; ++h) {  // v[8h + 2c] columns c, c + 8; v[8h + 2c + 1] columns c + 4, c + 12
    for (int c = 0; c < 4; ++c) {
      t[8 * h + 2 * c] = _mm512_shuffle_i32x4(u[8 * h + c], u[8 * h + 4 + c], 0x88);
      t[8 * h + 2 * c + 1] = _mm512_shuffle_i32x4(u[8 * h + c], u[8 * h + 4 + c], 0xdd);
    }
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[2 * c], t[8 + 2 * c], 0x88);
    r[c + 8] = _mm512_shuffle_i32x4(t[2 * c], t[8 + 2 * c], 0xdd);
    r[c + 4] = _mm512_shuffle_i32x4(t[2 * c + 1], t[8 + 2 * c + 1], 0x88);
    r[c + 12] = _mm512_shuffle_i32x4(t[2 * c + 1], t[8 + 2 * c + 1], 0xdd);
  }
}

// 32 FP8 e4m3 codes -> their 32 bfloat16 values, exactly: the code's 7 magnitude bits shifted into a float16's
// exponent and mantissa give the value / 2^8 (e4m3's bias is 7, float16's 15; its subnormals land on float16
// subnormals), so widening to float32 and scaling by 256 is exact, and so is the bfloat16 of it (4 significant
// bits). The NaN codes are never written (the cache writes saturate at +-448).
inline __m512i e4m3_to_bf16(const uint8_t* src) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  const __m512i h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x7F)), 7),
                                    _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
  const __m512 k256 = _mm512_set1_ps(256.f);
  const __m512 lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), k256);
  const __m512 hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), k256);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

struct Scratch {
  alignas(64) uint32_t qt[kMaxDim / 32][16][16];    // B per 32 dims: [dim pair][row] (bf16 pairs of Q)
  alignas(64) float st[16][16];                     // S^T: [key][row]
  alignas(64) uint32_t kt[kMaxDim / 32][16][16];    // K per 32 dims: [dim pair][key] (Dots)
  alignas(64) float s[16][16];                      // S: [row][key]
  alignas(64) uint16_t p[16][16];                   // P in bfloat16: [row][key]
  alignas(64) uint16_t v[kMaxDim / 16][8][32];      // B per 16 dims: [key pair][dim][2]
  alignas(64) float pv[16][16];                     // P.V for 16 dims: [row][dim]
  alignas(64) float acc[16][kMaxDim];               // the output rows, unnormalised
  alignas(64) float acc_t[kMaxDim][16];             // ... as columns, [dim][row] (lanes_block)
  alignas(64) uint16_t kb[16][kMaxDim];             // an FP8 block's K rows widened to bfloat16
  alignas(64) uint16_t vb[16][kMaxDim];             // ... and its V rows
  alignas(64) float m[16], l[16], corr[16];          // per row: running max, sum of P, this block's rescale
  alignas(64) float new_m[16], sum[16];              // per row: this block's max and sum of P (row path)
};

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // explicit rounding: never re-associated

// a + b, a * b and a - b as operations -ffast-math may not re-associate or contract: the row and lane paths
// must sum in the same order to agree bit for bit.
inline __m512 add_ordered(__m512 a, __m512 b) { return _mm512_add_round_ps(a, b, kRound); }
inline __m512 mul_ordered(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, kRound); }
inline __m512 sub_ordered(__m512 a, __m512 b) { return _mm512_sub_round_ps(a, b, kRound); }

// The sum of x's 16 lanes: lane k + lane k ^ 8, then k ^ 4, k ^ 2, k ^ 1 (the order sum_of_keys follows).
inline float sum_of_lanes(__m512 x) {
  x = add_ordered(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = add_ordered(x, _mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1)));
  x = add_ordered(x, _mm512_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
  x = add_ordered(x, _mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(x);
}

// The sum of 16 vectors, lane by lane, in sum_of_lanes' order.
inline __m512 sum_of_keys(__m512 r[16]) {
  for (int step = 8; step >= 1; step /= 2)
    for (int k = 0; k < step; ++k) r[k] = add_ordered(r[k], r[k + step]);
  return r[0];
}

// 16 bfloat16 (raw bits) as floats.
inline __m512 widen_bf16(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }

// The running softmax state after a block, for all 16 rows at once (both paths): rescale by exp(m - new max),
// add the block's sum of P.
inline void advance_softmax(Scratch& w, __m512 new_m, __m512 sum) {
  const __m512 m = _mm512_load_ps(w.m);
  const __m512 corr = exp512(sub_ordered(m, new_m));  // ~0 on a row's first block (m = -inf); 1 where no key
  _mm512_store_ps(w.corr, corr);
  _mm512_store_ps(w.l, _mm512_fmadd_ps(_mm512_load_ps(w.l), corr, sum));
  _mm512_store_ps(w.m, new_m);
}

// Word indices interleaving two rows a, b of 32 bfloat16 into key pairs (a0 b0 a1 b1 ...): the low 16 dims, the high.
alignas(64) constexpr uint16_t kPairsLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr uint16_t kPairsHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                               24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// One block's V tiles from its first n keys (the rest zero: stale cache rows must not reach P.V, where
// 0 x NaN would be NaN).
inline void load_values(Scratch& w, const uint16_t* v, int64_t stride, int64_t n, int64_t D) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i lo = _mm512_load_si512(kPairsLo), hi = _mm512_load_si512(kPairsHi);
  for (int64_t pr = 0; pr < kKeys / 2; ++pr) {
    const int64_t a = 2 * pr, b = 2 * pr + 1;
    for (int64_t half = 0; half < D / 32; ++half) {
      const __m512i va = a < n ? _mm512_loadu_si512(v + a * stride + 32 * half) : zero;
      const __m512i vb = b < n ? _mm512_loadu_si512(v + b * stride + 32 * half) : zero;
      _mm512_store_si512(w.v[2 * half][pr], _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_store_si512(w.v[2 * half + 1][pr], _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// S from S^T: one gather per row for a few rows (a decode's G), a 16 x 16 transpose for more.
inline void rows_of(Scratch& w, int64_t M) {
  if (M <= 4) {
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    for (int64_t r = 0; r < M; ++r)
      _mm512_store_ps(w.s[r], _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int>(r))),
                                                  &w.st[0][0], 4));
    return;
  }
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(w.st[i]);
  transpose16(r);
  for (int64_t i = 0; i < M; ++i) _mm512_store_si512(w.s[i], r[i]);
}
#endif

}  // namespace

// Whether tile_attention takes a bfloat16 cache of this shape on this machine (AMX or AVX512-BF16).
bool tile_attention_applies(int64_t block_size, int64_t head_dim, int64_t num_heads, int64_t num_kv_heads) {
#ifdef TOKENMILL_DP_ATTENTION
  return block_size == kKeys && head_dim % 32 == 0 && head_dim <= kMaxDim && num_kv_heads > 0 &&
         num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= 16;
#else
  return false;
#endif
}

// ... and does so on AMX tiles.
bool amx_attention_applies(int64_t block_size, int64_t head_dim, int64_t num_heads, int64_t num_kv_heads) {
#ifdef TOKENMILL_AMX_ATTENTION
  static const bool amx = bf16_kernel() == "amx";
  return amx && tile_attention_applies(block_size, head_dim, num_heads, num_kv_heads);
#else
  return false;
#endif
}

namespace {
#ifdef TOKENMILL_AMX_ATTENTION
// A block's two products on AMX tiles.
struct Tiles {
  int64_t configured = -1;
  void start(int64_t M) {
    if (M != configured) configure_tiles(M);
    configured = M;
  }
  // S [M x 16] = Q . K^T: S^T = K [16 x D] . Q^T on tiles (rows past n are stale cache slots: their scores are
  // masked), then turned into rows.
  void scores(Scratch& w, const uint16_t* k_rows, int64_t rows_stride, int64_t M, int64_t D) const {
    _tile_zero(2);
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(0, k_rows + 32 * c, rows_stride * sizeof(uint16_t));
      _tile_loadd(1, w.qt[c], 64);
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_stored(2, w.st, 64);
    rows_of(w, M);
  }
  // pv [M x 16] = P [M x 16 keys] . V for dims [16 sl, 16 sl + 16) (P is loaded once, at sl = 0).
  void values(Scratch& w, int64_t sl, int64_t) const {
    if (sl == 0) _tile_loadd(3, w.p, 32);
    _tile_zero(5);
    _tile_loadd(4, w.v[sl], 64);
    _tile_dpbf16ps(5, 3, 4);
    _tile_stored(5, w.pv, 64);
  }
  void finish() const { _tile_release(); }
};
#endif

#ifdef TOKENMILL_DP_ATTENTION
// The same products with AVX512-BF16 dot products, row by row.
struct Dots {
  void start(int64_t) const {}
  // S row r: the 16 keys in the lanes, summed over Q's dim pairs against K transposed into dim pairs.
  void scores(Scratch& w, const uint16_t* k_rows, int64_t rows_stride, int64_t M, int64_t D) const {
    for (int64_t c = 0; c < D / 32; ++c) {
      __m512i r[16];  // key j's 16 dim pairs of this chunk
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(k_rows + j * rows_stride + 32 * c);
      transpose16(r);  // r[i]: dim pair i of the 16 keys
      for (int i = 0; i < 16; ++i) _mm512_store_si512(w.kt[c][i], r[i]);
    }
    for (int64_t row = 0; row < M; ++row) {  // 4 chains of dim pairs (i mod 4), not one D / 2 latencies long
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t c = 0; c < D / 32; ++c)
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
          acc[i % 4] = _mm512_dpbf16_ps(acc[i % 4], (__m512bh)_mm512_set1_epi32(static_cast<int>(w.qt[c][i][row])),
                                        (__m512bh)_mm512_load_si512(w.kt[c][i]));
      _mm512_store_ps(w.s[row], add_ordered(add_ordered(acc[0], acc[1]), add_ordered(acc[2], acc[3])));
    }
  }
  void finish() const {}
};

// S for a decode's M <= 3 rows, as Dots::scores computes it (the same chains in the same order), but from each
// chunk's transposed K in registers: no K^T stored and loaded again per row.
template <int M>
inline void row_scores(Scratch& w, const uint16_t* k_rows, int64_t rows_stride, int64_t D) {
  __m512 acc[M][4];
  for (auto& row : acc)
    for (auto& chain : row) chain = _mm512_setzero_ps();
  for (int64_t c = 0; c < D / 32; ++c) {
    __m512i k[16];  // key j's 16 dim pairs of this chunk, then (transposed) dim pair i of the 16 keys
    for (int j = 0; j < 16; ++j) k[j] = _mm512_loadu_si512(k_rows + j * rows_stride + 32 * c);
    transpose16(k);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
#pragma GCC unroll 4
      for (int r = 0; r < M; ++r)
        acc[r][i % 4] = _mm512_dpbf16_ps(acc[r][i % 4], (__m512bh)_mm512_set1_epi32(static_cast<int>(w.qt[c][i][r])),
                                         (__m512bh)k[i]);
  }
  for (int r = 0; r < M; ++r)
    _mm512_store_ps(w.s[r], add_ordered(add_ordered(acc[r][0], acc[r][1]), add_ordered(acc[r][2], acc[r][3])));
}

// O [M x D] = O * corr + P . V for a decode's M <= 4 rows, S slices of 16 dims from dim d0: V's key pairs
// interleaved in registers as they are read (load_values' order, not stored), each row's P pair broadcast once
// per key pair, the sums over the 2 chains of key pairs (pr mod 2) the lane path uses. Keys past n read as zero.
template <int M, int S>
inline void row_values(Scratch& w, const uint16_t* v_rows, int64_t stride, int64_t n, int64_t d0) {
  const __m512i lo = _mm512_load_si512(kPairsLo), hi = _mm512_load_si512(kPairsHi), zero = _mm512_setzero_si512();
  __m512 acc[M][S][2];
  for (auto& row : acc)
    for (auto& slice : row)
      for (auto& chain : slice) chain = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int pr = 0; pr < kKeys / 2; ++pr) {
    __m512bh p[M];
    for (int r = 0; r < M; ++r)
      p[r] = (__m512bh)_mm512_set1_epi32(static_cast<int>(reinterpret_cast<const uint32_t*>(w.p[r])[pr]));
    const int64_t a = 2 * pr, b = 2 * pr + 1;
#pragma GCC unroll 2
    for (int h = 0; h < S / 2; ++h) {  // 32 dims: slices 2h, 2h + 1
      const __m512i va = a < n ? _mm512_loadu_si512(v_rows + a * stride + d0 + 32 * h) : zero;
      const __m512i vb = b < n ? _mm512_loadu_si512(v_rows + b * stride + d0 + 32 * h) : zero;
      const __m512bh v_lo = (__m512bh)_mm512_permutex2var_epi16(va, lo, vb);
      const __m512bh v_hi = (__m512bh)_mm512_permutex2var_epi16(va, hi, vb);
      for (int r = 0; r < M; ++r) {
        acc[r][2 * h][pr % 2] = _mm512_dpbf16_ps(acc[r][2 * h][pr % 2], p[r], v_lo);
        acc[r][2 * h + 1][pr % 2] = _mm512_dpbf16_ps(acc[r][2 * h + 1][pr % 2], p[r], v_hi);
      }
    }
  }
  for (int r = 0; r < M; ++r) {
    const __m512 corr = _mm512_set1_ps(w.corr[r]);
    for (int sl = 0; sl < S; ++sl) {
      float* o = w.acc[r] + d0 + 16 * sl;
      _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(o), corr, add_ordered(acc[r][sl][0], acc[r][sl][1])));
    }
  }
}

// A decode's block with the rows in registers (Dots, M <= 4): S, then (after the softmax) P.V.
struct RowBlock {
  static void scores(Scratch& w, const uint16_t* k_rows, int64_t rows_stride, int64_t M, int64_t D) {
    switch (M) {
      case 1: row_scores<1>(w, k_rows, rows_stride, D); break;
      case 2: row_scores<2>(w, k_rows, rows_stride, D); break;
      case 3: row_scores<3>(w, k_rows, rows_stride, D); break;
      default: Dots().scores(w, k_rows, rows_stride, M, D); break;  // 4 rows' chains and K^T: too many registers
    }
  }
  // 3 rows x 4 slices x 2 chains fill 24 registers; 4 rows take 2 slices at a time
  template <int M, int S>
  static void values_by(Scratch& w, const uint16_t* v_rows, int64_t stride, int64_t n, int64_t D) {
    int64_t d0 = 0;
    for (; d0 + 16 * S <= D; d0 += 16 * S) row_values<M, S>(w, v_rows, stride, n, d0);
    if (d0 < D) row_values<M, 2>(w, v_rows, stride, n, d0);  // D is a multiple of 32
  }
  static void values(Scratch& w, const uint16_t* v_rows, int64_t stride, int64_t n, int64_t M, int64_t D) {
    switch (M) {
      case 1: values_by<1, 4>(w, v_rows, stride, n, D); break;
      case 2: values_by<2, 4>(w, v_rows, stride, n, D); break;
      case 3: values_by<3, 4>(w, v_rows, stride, n, D); break;
      default: values_by<4, 2>(w, v_rows, stride, n, D); break;
    }
  }
};

// One block for a tile whose M > 4 rows sit in the vector lanes (lane r = row r; lanes past M are masked
// throughout): what RowBlock (Dots::scores' chains), the row softmax and RowBlock::values compute for each row,
// element by element the same operations in the same order, with no transposes or horizontal sums. `seen` holds
// each row's count of this block's keys it sees; the block's V is already in w.v (load_values).
inline void lanes_block(Scratch& w, const uint16_t* k_rows, int64_t rows_stride, __m512i seen, float scale,
                        int64_t D) {
  for (int j0 = 0; j0 < kKeys; j0 += 4) {  // S^T, 4 keys at a time, each over the 4 chains Dots::scores uses
    __m512 a[4][4];
    for (auto& key : a)
      for (auto& chain : key) chain = _mm512_setzero_ps();
    const int32_t* k0 = reinterpret_cast<const int32_t*>(k_rows + j0 * rows_stride);  // key j0's dim pairs
    const int32_t* k1 = reinterpret_cast<const int32_t*>(k_rows + (j0 + 1) * rows_stride);
    const int32_t* k2 = reinterpret_cast<const int32_t*>(k_rows + (j0 + 2) * rows_stride);
    const int32_t* k3 = reinterpret_cast<const int32_t*>(k_rows + (j0 + 3) * rows_stride);
    for (int64_t c = 0; c < D / 32; ++c) {
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const __m512bh q = (__m512bh)_mm512_load_si512(w.qt[c][i]);
        const int64_t at = 16 * c + i;
        a[0][i % 4] = _mm512_dpbf16_ps(a[0][i % 4], q, (__m512bh)_mm512_set1_epi32(k0[at]));
        a[1][i % 4] = _mm512_dpbf16_ps(a[1][i % 4], q, (__m512bh)_mm512_set1_epi32(k1[at]));
        a[2][i % 4] = _mm512_dpbf16_ps(a[2][i % 4], q, (__m512bh)_mm512_set1_epi32(k2[at]));
        a[3][i % 4] = _mm512_dpbf16_ps(a[3][i % 4], q, (__m512bh)_mm512_set1_epi32(k3[at]));
      }
    }
    for (int jj = 0; jj < 4; ++jj)
      _mm512_store_ps(w.st[j0 + jj], add_ordered(add_ordered(a[jj][0], a[jj][1]), add_ordered(a[jj][2], a[jj][3])));
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 sv[kKeys];
  __mmask16 sees[kKeys];
  __m512 new_m = _mm512_load_ps(w.m);
  for (int j = 0; j < kKeys; ++j) {
    sv[j] = mul_ordered(_mm512_load_ps(w.st[j]), vscale);
    sees[j] = _mm512_cmpgt_epi32_mask(seen, _mm512_set1_epi32(j));
    new_m = _mm512_mask_max_ps(new_m, sees[j], new_m, sv[j]);
  }
  __m512i pairs[kKeys / 2];  // P's key pairs (2 pr, 2 pr + 1) of every row, as bfloat16 pairs
  __m512 rounded[kKeys];
  for (int j = 0; j < kKeys; ++j) {
    const __m512 e = _mm512_maskz_mov_ps(sees[j], exp512(sub_ordered(sv[j], new_m)));
    const __m256i pb = (__m256i)_mm512_cvtneps_pbh(e);
    rounded[j] = widen_bf16(pb);
    const __m512i wide = _mm512_cvtepu16_epi32(pb);
    pairs[j / 2] = j % 2 == 0 ? wide : _mm512_or_si512(pairs[j / 2], _mm512_slli_epi32(wide, 16));
  }
  advance_softmax(w, new_m, sum_of_keys(rounded));
  const __m512 corr = _mm512_load_ps(w.corr);
  for (int64_t d0 = 0; d0 < D; d0 += 8) {  // O^T, 8 dims at a time, each over the 2 chains RowBlock::values uses
    __m512 a[8][2];
    for (auto& dim : a)
      for (auto& chain : dim) chain = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int pr = 0; pr < kKeys / 2; ++pr) {
      const int32_t* v = reinterpret_cast<const int32_t*>(w.v[d0 / 16][pr]) + d0 % 16;
      for (int dd = 0; dd < 8; ++dd)
        a[dd][pr % 2] = _mm512_dpbf16_ps(a[dd][pr % 2], (__m512bh)pairs[pr], (__m512bh)_mm512_set1_epi32(v[dd]));
    }
    for (int dd = 0; dd < 8; ++dd) {
      float* o = w.acc_t[d0 + dd];
      _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(o), corr, add_ordered(a[dd][0], a[dd][1])));
    }
  }
}

// attend() (paged_attention.cpp) with bfloat16 products (Products: Tiles or Dots) for a bfloat16 cache (C = uint16_t, bf16 bits) or an FP8 e4m3 one
// (C = uint8_t codes: each block's rows are widened to bfloat16 first, exactly, so the products are the very
// ones of a bfloat16 cache holding the same values).
template <typename Products, typename C>
void attend_tiles(const uint16_t* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                  const int64_t* q_rows, const int64_t* kv_lens, uint16_t* out, int64_t num_tokens, int64_t num_heads,
                  int64_t num_kv_heads, int64_t D, int64_t max_blocks, float scale) {
  constexpr bool fp8 = std::is_same_v<C, uint8_t>;
  const int64_t G = num_heads / num_kv_heads;
  const int64_t max_tokens = 16 / G, stride = num_kv_heads * D;
  std::vector<int64_t> tiles;  // first token of each tile: consecutive tokens of one request, up to max_tokens
  for (int64_t t = 0; t < num_tokens;) {
    tiles.push_back(t);
    int64_t n = 1;
    while (n < max_tokens && t + n < num_tokens && q_rows[t + n] == q_rows[t] && kv_lens[t + n] == kv_lens[t + n - 1] + 1)
      ++n;
    t += n;
  }
  tiles.push_back(num_tokens);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size()) - 1;
  const int64_t items = num_tiles * num_kv_heads;
  parallel_take(items, 1, [&](WorkQueue& work) {
    // each thread's scratch (~75 KB) kept from call to call: a decode step calls this once a layer
    static thread_local std::unique_ptr<Scratch> kept;
    if (!kept) kept = std::make_unique<Scratch>();
    Scratch* w = kept.get();
    Products products;
    for (int64_t begin, end; work.take(begin, end);) for (int64_t i = begin; i < end; ++i) {
      const int64_t item = items - 1 - i;  // the last tiles first: a causal prefill's read the most blocks
      const int64_t tile = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t t0 = tiles[tile], ntok = tiles[tile + 1] - t0, M = ntok * G;
      // Dots with a prefill tile's rows: rows in the lanes (the same bits as row by row, fewer instructions)
      const bool in_lanes = std::is_same_v<Products, Dots> && M > 4;
      products.start(M);
      for (int64_t r = 0; r < M; ++r) {  // Q^T in bf16 pairs: qt[chunk][pair][row]
        const uint32_t* qr = reinterpret_cast<const uint32_t*>(q + ((t0 + r / G) * num_heads + h * G + r % G) * D);
        for (int64_t c = 0; c < D / 32; ++c)
          for (int64_t i = 0; i < 16; ++i) w->qt[c][i][r] = qr[16 * c + i];
      }
      alignas(64) int32_t kv_len[16] = {};  // each row's context (0 past M: those lanes see nothing)
      for (int64_t r = 0; r < M; ++r) kv_len[r] = static_cast<int32_t>(kv_lens[t0 + r / G]);
      std::fill(w->m, w->m + 16, -std::numeric_limits<float>::infinity());
      std::fill(w->l, w->l + 16, 0.f);
      if (in_lanes)
        for (int64_t d = 0; d < D; ++d) _mm512_store_ps(w->acc_t[d], _mm512_setzero_ps());
      else
        for (int64_t r = 0; r < M; ++r) std::fill(w->acc[r], w->acc[r] + D, 0.f);
      const int64_t* table = block_tables + q_rows[t0] * max_blocks;
      const int64_t len = kv_lens[t0 + ntok - 1];
      for (int64_t start = 0; start < len; start += kKeys) {
        const int64_t n = std::min(kKeys, len - start);
        const int64_t base = (table[start / kKeys] * kKeys * num_kv_heads + h) * D;
        // Blocks sit anywhere in the pool (no hardware prefetcher can guess the next): the next one into L2.
        // Without it DRAM-resident pools run at half speed. Into L1 instead (with the block after into L2, as on
        // Zen 5 before) the prefetches stall the loads in use: on Zen 4, 64 decodes x ~400 keys over pools that
        // miss L3 take 0.97 ms a layer with L2 alone, 1.23 ms with both (BENCHMARKS.md, "paged attention's prefetch").
        if (start + kKeys < len) {
          const int64_t next = (table[start / kKeys + 1] * kKeys * num_kv_heads + h) * D;
          prefetch_rows<false>(k_cache + next, stride * sizeof(C), kKeys, D * sizeof(C));
          prefetch_rows<false>(v_cache + next, stride * sizeof(C), kKeys, D * sizeof(C));
        }
        const uint16_t* k_rows;  // the block's K and V rows as bfloat16, rows_stride elements apart
        const uint16_t* v_rows;
        int64_t rows_stride;
        if constexpr (fp8) {
          for (int64_t j = 0; j < kKeys; ++j)
            for (int64_t c = 0; c < D / 32; ++c) {
              _mm512_store_si512(w->kb[j] + 32 * c, e4m3_to_bf16(k_cache + base + j * stride + 32 * c));
              _mm512_store_si512(w->vb[j] + 32 * c, e4m3_to_bf16(v_cache + base + j * stride + 32 * c));
            }
          k_rows = &w->kb[0][0], v_rows = &w->vb[0][0], rows_stride = kMaxDim;
        } else {
          k_rows = k_cache + base, v_rows = v_cache + base, rows_stride = stride;
        }
        constexpr bool row_block = std::is_same_v<Products, Dots>;  // a decode's rows on AVX512-BF16: RowBlock
        if (!row_block || in_lanes) load_values(*w, v_rows, rows_stride, n, D);
        if (in_lanes) {
          const __m512i seen = _mm512_sub_epi32(_mm512_load_si512(kv_len), _mm512_set1_epi32(static_cast<int>(start)));
          lanes_block(*w, k_rows, rows_stride, seen, scale, D);
          continue;
        }
        if constexpr (row_block)
          RowBlock::scores(*w, k_rows, rows_stride, M, D);
        else
          products.scores(*w, k_rows, rows_stride, M, D);
        for (int64_t r = 0; r < M; ++r) {  // online softmax, one row (query head) at a time
          const int64_t seen = kv_len[r] - start;  // keys of this block the row sees
          const __mmask16 mask = seen >= kKeys ? __mmask16(0xFFFF) : seen <= 0 ? __mmask16(0) : __mmask16((1u << seen) - 1);
          if (mask == 0) {
            _mm256_store_si256(reinterpret_cast<__m256i*>(w->p[r]), _mm256_setzero_si256());
            w->new_m[r] = w->m[r];
            w->sum[r] = 0.f;
            continue;
          }
          const __m512 sv = mul_ordered(_mm512_load_ps(w->s[r]), _mm512_set1_ps(scale));
          const float new_m = std::max(w->m[r], _mm512_mask_reduce_max_ps(mask, sv));
          const __m512 e = _mm512_maskz_mov_ps(mask, exp512(sub_ordered(sv, _mm512_set1_ps(new_m))));
          const __m256i pb = (__m256i)_mm512_cvtneps_pbh(e);
          _mm256_store_si256(reinterpret_cast<__m256i*>(w->p[r]), pb);
          // the sum of the probabilities as rounded for P.V, so the weights P.V applies are normalised exactly
          w->sum[r] = sum_of_lanes(widen_bf16(pb));
          w->new_m[r] = new_m;
        }
        advance_softmax(*w, _mm512_load_ps(w->new_m), _mm512_load_ps(w->sum));
        if constexpr (row_block) {
          RowBlock::values(*w, v_rows, rows_stride, n, M, D);
        } else {
          for (int64_t sl = 0; sl < D / 16; ++sl) {
            products.values(*w, sl, M);
            for (int64_t r = 0; r < M; ++r) {
              float* a = w->acc[r] + 16 * sl;
              const __m512 corr = _mm512_set1_ps(w->corr[r]);
              _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(a), corr, _mm512_load_ps(w->pv[r])));
            }
          }
        }
      }
      float inv[16];
      for (int64_t r = 0; r < M; ++r) inv[r] = w->l[r] > 0.f ? 1.f / w->l[r] : 0.f;
      for (int64_t d = 0; d < D; d += 16) {
        __m512i cols[16];  // in lanes: rows [d, d + 16) of acc_t, turned into 16 dims of each row
        if (in_lanes) {
          for (int i = 0; i < 16; ++i) cols[i] = _mm512_load_si512(w->acc_t[d + i]);
          transpose16(cols);
        }
        for (int64_t r = 0; r < M; ++r) {
          const __m512 x = in_lanes ? _mm512_castsi512_ps(cols[r]) : _mm512_load_ps(w->acc[r] + d);
          const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(inv[r]));
          uint16_t* o = out + ((t0 + r / G) * num_heads + h * G + r % G) * D;
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + d), (__m256i)_mm512_cvtneps_pbh(y));
        }
      }
    }
    products.finish();
  });
}
#endif

}  // namespace

// attend_tiles for a bfloat16 cache (C = uint16_t, raw bf16 bits) or an FP8 e4m3 one (C = uint8_t codes), on AMX
// tiles where this process has them, else AVX512-BF16; q and out are bfloat16 bits. Returns false (and computes
// nothing) where this kernel does not apply: no AVX512-BF16 here, a block size other than 16, head_dim not a
// multiple of 32 up to 256, or more than 16 query heads per KV head. Arguments as paged_attention's.
template <typename C>
bool tile_attention(const uint16_t* q, const C* k_cache, const C* v_cache, const int64_t* block_tables,
                    const int64_t* q_rows, const int64_t* kv_lens, uint16_t* out, int64_t num_tokens,
                    int64_t num_heads, int64_t num_kv_heads, int64_t D, int64_t block_size, int64_t max_blocks,
                    float scale) {
#ifdef TOKENMILL_DP_ATTENTION
  if (!tile_attention_applies(block_size, D, num_heads, num_kv_heads)) return false;
#ifdef TOKENMILL_AMX_ATTENTION
  if (amx_attention_applies(block_size, D, num_heads, num_kv_heads)) {
    attend_tiles<Tiles>(q, k_cache, v_cache, block_tables, q_rows, kv_lens, out, num_tokens, num_heads,
                        num_kv_heads, D, max_blocks, scale);
    return true;
  }
#endif
  attend_tiles<Dots>(q, k_cache, v_cache, block_tables, q_rows, kv_lens, out, num_tokens, num_heads, num_kv_heads,
                     D, max_blocks, scale);
  return true;
#else
  return false;
#endif
}

#define TOKENMILL_TILE_ATTENTION_FOR(C)                                                                          \
  template bool tile_attention<C>(const uint16_t*, const C*, const C*, const int64_t*, const int64_t*,          \
                                  const int64_t*, uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, \
                                  float);
TOKENMILL_TILE_ATTENTION_FOR(uint16_t)
TOKENMILL_TILE_ATTENTION_FOR(uint8_t)
#undef TOKENMILL_TILE_ATTENTION_FOR
