// Kept GGUF blocks on CPUs with AVX2 but no AVX512-VNNI (Haswell to Alder Lake, Zen 1-3): the int8 products of
// gguf_vnni.cpp with 256-bit VPMADDUBSW (unsigned bytes times signed bytes, adjacent pairs summed into int16)
// instead of VPDPBUSD, on the same packed tiles (the "quads" layout: half a 64-byte vector is 8 features' quads)
// and the same int8 rounding of x (gguf_quads.h). The integer sums are exact, and each block's float32 arithmetic
// is gguf_vnni.cpp's, the same code (gguf_quads.h's BlockStep over simd.h's lanes), so for bfloat16 x the two kernels
// agree bit for bit; x may be float32 too (an AVX2 CPU runs models in float32: model/backends/__init__.py
// auto_dtype), y then float32. Either way x is rounded in two int8 parts (quantize_rows), so a model tracks its
// dequantized weights in x's dtype.
//
// VPMADDUBSW saturates its int16 pair sums. With x's quants in [-127, 127]: a 4-bit quant's pair is at most
// 2 x 15 x 127 = 3810, so 8 of them add up in int16 before widening (30480 < 32767); Q5_0's and Q5_KS's 4 (31496),
// Q6_KS's 2 (32004). Q8_0's bytes (q + 128, up to 255) would overflow a single pair (64770), so the sign moves to x
// (llama.cpp's trick): |q| unsigned times x * sign(q), at most 2 x 128 x 127 = 32512.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>

#include "gguf_quads.h"
#include "work_split.h"

constexpr int64_t kAvx2TileN = 16;  // features per packed tile (two 8-lane halves)

#ifdef TOKENMILL_INT8_ROWS
namespace {

// How many of a type's VPMADDUBSW results add up in int16 before one VPMADDWD widens them (see above).
template <int64_t Type>
constexpr int int16_group() {
  return Type == kQ8_0 ? 1 : Type == kQ6_KS ? 2 : has_fifth_bits<Type>() ? 4 : 8;
}

// Q5_0's fifth bits into half h's quads: vector t holds K first .. first + 3 (first = 4t, or 16 + 4(t - 4)), and
// lane j's 32 bits are feature j's; each byte takes bit first + i of its lane (one byte of the lane holds all four:
// a shuffle copies it to the lane's 4 bytes, a compare with that byte's bit gives 0xFF where set), + 16 there.
inline void add_fifth_bits(__m256i (&w)[8], const __m256i bits) {
  const __m256i sixteen = _mm256_set1_epi8(16);
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
    const int first = t < 4 ? 4 * t : 16 + 4 * (t - 4), byte = first / 8, shift = first % 8;
    const __m256i pick = _mm256_setr_epi32(byte * 0x01010101, (4 + byte) * 0x01010101, (8 + byte) * 0x01010101,
                                           (12 + byte) * 0x01010101, byte * 0x01010101, (4 + byte) * 0x01010101,
                                           (8 + byte) * 0x01010101, (12 + byte) * 0x01010101);
    const __m256i mask = _mm256_set1_epi32(static_cast<int32_t>(0x08040201u << shift));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(bits, pick), mask), mask);
    w[t] = _mm256_or_si256(w[t], _mm256_and_si256(set, sixteen));
  }
}

// Half h (features 8h .. 8h + 7) of a tile's quants as 8 vectors, vector t holding K quad t of each feature:
// unsigned bytes, except Q8_0's, which are q itself (signed; the + 128 undone).
template <int64_t Type>
inline void load_half_quads(const uint8_t* tile, int h, __m256i (&w)[8]) {
  if constexpr (Type == kQ8_0 || Type == kQ6_KS) {
    for (int t = 0; t < 8; ++t) w[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * t + 32 * h));
    if constexpr (Type == kQ8_0)
      for (int t = 0; t < 8; ++t) w[t] = _mm256_xor_si256(w[t], _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 64 * t + 32 * h));
      w[t] = _mm256_and_si256(v, low);
      w[t + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    if constexpr (has_fifth_bits<Type>())
      add_fifth_bits(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + fifth_bits_at<Type>() + 32 * h)));
  }
}

// One VPMADDUBSW: w's quad times x's 4 bytes (broadcast), int16 pair sums.
template <int64_t Type>
inline __m256i pair_products(const __m256i w, const int8_t* quad) {
  const __m256i x = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(quad));
  if constexpr (Type == kQ8_0) return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_maddubs_epi16(w, x);
}

// The int32 dot products (lane j: feature j's quants times x's, over K 0..15 in lo, 16..31 in hi) of a half tile's
// quads with each of Rows rows' 32 int8 activations (row r's at qx + 32 r). Exact integers.
template <int64_t Type, int Rows>
inline void half_dots(const __m256i (&w)[8], const int8_t* qx, __m256i (&lo)[Rows], __m256i (&hi)[Rows]) {
  constexpr int G = int16_group<Type>();
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int g = 0; g < 8; g += G) {
#pragma GCC unroll 4
    for (int r = 0; r < Rows; ++r) {
      __m256i p = pair_products<Type>(w[g], qx + 32 * r + 4 * g);
#pragma GCC unroll 8
      for (int t = g + 1; t < g + G; ++t) p = _mm256_add_epi16(p, pair_products<Type>(w[t], qx + 32 * r + 4 * t));
      const __m256i s = _mm256_madd_epi16(p, ones);
      if (g < 4) lo[r] = _mm256_add_epi32(lo[r], s);
      else hi[r] = _mm256_add_epi32(hi[r], s);
    }
  }
}

// Rows [m0, m0 + Rows) times column blocks nb .. nb + Cols - 1: float32 results into c [Rows x 32] (row stride 32,
// block j's 16 features at column 16 j). The float32 steps per block are BlockStep's, as vnni_block's.
// prefetch_until: as there (each tile's counterpart two column blocks on, into L2).
template <int64_t Type, int Rows, int Cols>
void avx2_block(const QuantizedRows& xq, int64_t m0, const uint8_t* w0, int64_t KB, int64_t tile_bytes, float* c,
                const uint8_t* prefetch_until) {
  __m256 acc[Rows][2 * Cols];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < 2 * Cols; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t first = xq.block(m0, 0);  // rows m0 .. m0 + Rows - 1 lie in one panel, block after block
  const int8_t* qx_panel = xq.q.data() + first * 32;
  const float* scale = xq.scale.data() + first;
  const int32_t* sum = xq.sum.data() + first;
  const int32_t* sum_lo = xq.sum_lo.data() + first;
  const float* scaled_sum = xq.scaled_sum.data() + first;
  const int64_t panel = xq.panel;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int8_t* qx = qx_panel + kb * panel * 32;
#pragma GCC unroll 2
    for (int j = 0; j < Cols; ++j) {
      const uint8_t* tile = w0 + (j * KB + kb) * tile_bytes;
      const uint8_t* fields = tile + quant_bytes<Type>();
      if (prefetch_until != nullptr && prefetch_until - tile > 2 * KB * tile_bytes)  // no pointer past the end
        prefetch_rows<false>(tile + 2 * KB * tile_bytes, 0, 1, tile_bytes);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256i w[8];
        load_half_quads<Type>(tile, h, w);
        __m256i lo[Rows], hi[Rows];
        half_dots<Type, Rows>(w, qx, lo, hi);
        // features 8h .. 8h + 7; Q8_0's quants are signed already (zero point 0 here, 128 in the VNNI kernel's
        // bytes: the same sums)
        const BlockStep<Type, Lanes8, false> step(fields, 8 * h);
#pragma GCC unroll 8
        for (int r = 0; r < Rows; ++r) {
          const int64_t row = kb * panel + r;
          __m256& a = acc[r][2 * j + h];
          if constexpr (Type == kQ6_KS) step.add_halves(a, lo[r], hi[r], scale[row], sum[row], sum_lo[row]);
          else step.add(a, _mm256_add_epi32(lo[r], hi[r]), scale[row], sum[row], scaled_sum[row]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < 2 * Cols; ++j) _mm256_storeu_ps(c + r * 32 + j * 8, acc[r][j]);
}

// Rows per avx2_block: up to 2 by both column blocks of a pair (a decode step's one row: 4 accumulators, and two
// tiles' loads in flight), 3-4 by one column block at a time (16 registers hold no more accumulators beside the 8
// quads). Every element's sums are the same whatever the block: a row's result never depends on its batch.
constexpr int64_t kAvx2Rows = 4;
static_assert(kPanelRows % kAvx2Rows == 0, "a block of rows within a panel");

template <int64_t Type>
void avx2_rows(const QuantizedRows& xq, int64_t m0, int64_t rows, bool two_cols, const uint8_t* w0, int64_t KB,
               int64_t tile_bytes, float* c, const uint8_t* prefetch_until) {
  if (rows <= 2 && two_cols) {
    if (rows == 2) avx2_block<Type, 2, 2>(xq, m0, w0, KB, tile_bytes, c, prefetch_until);
    else avx2_block<Type, 1, 2>(xq, m0, w0, KB, tile_bytes, c, prefetch_until);
    return;
  }
  for (int j = 0; j < (two_cols ? 2 : 1); ++j) {
    const uint8_t* wj = w0 + j * KB * tile_bytes;
    float* cj = c + 16 * j;
    switch (rows) {
      case 4: avx2_block<Type, 4, 1>(xq, m0, wj, KB, tile_bytes, cj, prefetch_until); break;
      case 3: avx2_block<Type, 3, 1>(xq, m0, wj, KB, tile_bytes, cj, prefetch_until); break;
      case 2: avx2_block<Type, 2, 1>(xq, m0, wj, KB, tile_bytes, cj, prefetch_until); break;
      default: avx2_block<Type, 1, 1>(xq, m0, wj, KB, tile_bytes, cj, prefetch_until); break;
    }
  }
}

// The loop over 32-feature column pairs and 4-row blocks of x [M, K]: float32 results of rows [m0, m0 + rows) and
// column blocks nb, nb + 1 go to epilogue(c, m0, rows, nb, two_cols). x is rounded in two int8 parts
// (quantize_rows): rows 2m and 2m + 1 share each tile's unpacked quads, and their results are added before the
// epilogue sees row m.
template <typename Epilogue>
void avx2_tiles(const at::Tensor& x, const at::Tensor& packed, const Epilogue& epilogue) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "a weight packed by gguf_pack(layout='quads'): [N/16, K/32, tile bytes] uint8");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "[M, K] bfloat16 or float32 input");
  TORCH_CHECK(x.size(1) == packed.size(1) * 32, "input has ", x.size(1), " features, the weight ",
              packed.size(1) * 32);
  const int64_t NB = packed.size(0), KB = packed.size(1), tile_bytes = packed.size(2);
  const int64_t M = 2 * x.size(0);  // rows of int8 blocks
  static_assert(kAvx2Rows % 2 == 0, "a row's two halves in one block of rows");
  if (M == 0) return;
  with_quads_type(tile_bytes, [&](auto type) {
    constexpr int64_t Type = decltype(type)::value;
    const QuantizedRows xq = quantize_rows(x);
    const uint8_t* wp = packed.data_ptr<uint8_t>();
    const uint8_t* weight_end = wp + NB * KB * tile_bytes;
    parallel_take((NB + 1) / 2, 1, [&](WorkQueue& work) {
      alignas(32) float c[kAvx2Rows * 32];
      for (int64_t begin, end; work.take(begin, end);) for (int64_t q = begin; q < end; ++q) {
        const int64_t nb = 2 * q;
        const bool two_cols = nb + 1 < NB;
        for (int64_t m0 = 0; m0 < M; m0 += kAvx2Rows) {
          const int64_t rows = std::min(kAvx2Rows, M - m0);
          avx2_rows<Type>(xq, m0, rows, two_cols, wp + nb * KB * tile_bytes, KB, tile_bytes, c,
                          m0 == 0 ? weight_end : nullptr);  // the next pair's tiles, once
          add_split_rows(c, rows);
          epilogue(c, m0 / 2, rows / 2, nb, two_cols);
        }
      }
    }, at::get_num_threads());
  });
}

// 8 float32 results stored as y's dtype: float32 as they are, bfloat16 rounded to nearest-even.
inline void store8(void* y, bool bf16, __m256 v) {
  if (bf16) store_bf16x8(y, round_to_bf16_ps(v));
  else _mm256_storeu_ps(static_cast<float*>(y), v);
}

inline __m256 round_if(bool bf16, __m256 v) { return bf16 ? round_to_bf16_ps(v) : v; }

}  // namespace
#endif

// x [M, K] bfloat16 or float32, packed [N/16, K/32, tile bytes] in the quads layout, bias [N] or none -> [M, N] in
// x's dtype. Bias added in float32 before the one rounding (as gguf_vnni_linear).
at::Tensor gguf_avx2_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
#ifdef TOKENMILL_INT8_ROWS
  const int64_t N = packed.size(0) * kAvx2TileN;
  auto y = at::empty({x.size(0), N}, x.options());
  const at::Tensor b = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t es = y.element_size();
  avx2_tiles(x, packed, [&](const float* c, int64_t m0, int64_t rows, int64_t nb, bool two_cols) {
    const int64_t n0 = nb * kAvx2TileN;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < (two_cols ? 32 : 16); j += 8) {
        const float* bias_j = bp == nullptr ? nullptr : bp + n0 + j;
        const __m256 v = scaled_biased<Lanes8>(Lanes8::load(c + r * 32 + j), nullptr, bias_j);
        store8(yp + ((m0 + r) * N + n0 + j) * es, bf16, v);
      }
  });
  return y;
#else
  TORCH_CHECK(false, "this build has no AVX2 int8 kernels (the CPU it was built for lacks AVX2, FMA or F16C)");
  return at::Tensor();
#endif
}

// silu(x @ gate.T) * (x @ up.T) from gate/up block pairs in the quads layout ([I/16, 2, K/32, tile bytes]): gate
// and up each rounded to x's dtype as their plain products are, then silu_mul's arithmetic (elementwise.cpp).
at::Tensor gguf_avx2_linear_silu(const at::Tensor& x, const at::Tensor& pairs) {
#ifdef TOKENMILL_INT8_ROWS
  TORCH_CHECK(pairs.dim() == 4 && pairs.size(1) == 2, "a gate/up weight packed by gguf_pack in pairs");
  const int64_t I = pairs.size(0) * kAvx2TileN;
  auto y = at::empty({x.size(0), I}, x.options());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t es = y.element_size();
  avx2_tiles(x, pairs.view({2 * pairs.size(0), pairs.size(2), pairs.size(3)}),
             [&](const float* c, int64_t m0, int64_t rows, int64_t nb, bool) {
               const int64_t n0 = (nb / 2) * kAvx2TileN;
               for (int64_t r = 0; r < rows; ++r)
                 for (int64_t j = 0; j < 16; j += 8) {
                   const __m256 g = round_if(bf16, _mm256_loadu_ps(c + r * 32 + j));
                   const __m256 u = round_if(bf16, _mm256_loadu_ps(c + r * 32 + 16 + j));
                   store8(yp + ((m0 + r) * I + n0 + j) * es, bf16, silu_times<Lanes8>(g, u, bf16));
                 }
             });
  return y;
#else
  TORCH_CHECK(false, "this build has no AVX2 int8 kernels (the CPU it was built for lacks AVX2, FMA or F16C)");
  return at::Tensor();
#endif
}
