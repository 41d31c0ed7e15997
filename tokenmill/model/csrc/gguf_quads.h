// What the int8-activation kernels of kept GGUF blocks share (gguf_vnni.cpp: AVX512-VNNI; gguf_avx2.cpp: AVX2):
// the block types they multiply, their tiles' sizes in the "quads" layout (model/backends/gguf_tiles.py), and x's rounding
// to int8 blocks of 32 (llama.cpp's Q8 activations), split in two (quantize_rows). One rounding for both kernels,
// so they agree bit for bit.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8;  // GGMLQuantizationType
constexpr int64_t kQ4_Z = 256;  // tokenmill's own: 4-bit with an integer zero point (formats/awq_format.py)
constexpr int64_t kQ4_KS = 257, kQ6_KS = 258, kQ5_KS = 259;  // K-quant blocks re-cut to 32 weights (formats/kquants.py)

// The bytes of a quads tile (16 features x 32 K) of each type: the quants, then the per-feature fields.
constexpr int64_t kQuadsQ4_0 = 256 + 32, kQuadsQ4_1 = 256 + 64, kQuadsQ8_0 = 512 + 32, kQuadsQ4_Z = 256 + 48,
                  kQuadsQ5_0 = 256 + 96, kQuadsQ4_KS = 256 + 128, kQuadsQ6_KS = 512 + 64, kQuadsQ5_KS = 256 + 192;

template <int64_t Type>
constexpr int64_t quant_bytes() { return Type == kQ8_0 || Type == kQ6_KS ? 512 : 256; }

// Types with a fifth bit per quant (16 uint32 fields in the tile, bit k: K k's), and where those fields start.
template <int64_t Type>
constexpr bool has_fifth_bits() { return Type == kQ5_0 || Type == kQ5_KS; }
template <int64_t Type>
constexpr int64_t fifth_bits_at() { return Type == kQ5_0 ? 256 + 32 : 256 + 128; }  // after d; after d sc, -dmin m

// Types whose blocks carry float32 d * sc and -(dmin * m) (the re-cut Q4_K and Q5_K sub-blocks).
template <int64_t Type>
constexpr bool has_float_scale_min() { return Type == kQ4_KS || Type == kQ5_KS; }

// Runs body(std::integral_constant<int64_t, Type>) for the type whose quads tiles are `tile_bytes` long.
template <typename Body>
void with_quads_type(int64_t tile_bytes, const Body& body) {
  switch (tile_bytes) {
    case kQuadsQ4_0: body(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQuadsQ4_1: body(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQuadsQ8_0: body(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQuadsQ4_Z: body(std::integral_constant<int64_t, kQ4_Z>{}); break;
    case kQuadsQ5_0: body(std::integral_constant<int64_t, kQ5_0>{}); break;
    case kQuadsQ4_KS: body(std::integral_constant<int64_t, kQ4_KS>{}); break;
    case kQuadsQ6_KS: body(std::integral_constant<int64_t, kQ6_KS>{}); break;
    case kQuadsQ5_KS: body(std::integral_constant<int64_t, kQ5_KS>{}); break;
    default: TORCH_CHECK(false, "not a packed Q4_0, Q4_1, Q5_0, Q8_0, Q4_Z, Q4_KS, Q5_KS or Q6_KS weight (tiles of ",
                         tile_bytes, " bytes)");
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENMILL_INT8_ROWS 1

// x [M, K] as int8 blocks of 32: per block its quants, the scale dx = max|x| / 127, the sum of its quants sx (and
// of its first 16: Q6_KS's halves), and dx * sx in float32 (Q4_1's min term: one broadcast operand in the block
// loop instead of three scalar ops). Stored in panels of `panel` rows (kPanelRows, or all M when fewer), block by
// block ([M/8][K/32][8 rows]): the rows a kernel block multiplies sit at fixed offsets from one pointer. Row by
// row, each of 8 rows kept its own pointer, and the compiler, short of general registers, parked them in vector
// registers and moved them back (44 vmovq per tile beside 64 vpdpbusd).
constexpr int64_t kPanelRows = 8;

struct QuantizedRows {
  int64_t KB, panel;
  std::vector<int8_t> q;  // 32 a block
  std::vector<float> scale;
  std::vector<int32_t> sum;
  std::vector<int32_t> sum_lo;  // of the block's first 16 quants
  std::vector<float> scaled_sum;
  // the index of row m's block kb (times 32 for its quants)
  int64_t block(int64_t m, int64_t kb) const { return ((m / panel) * KB + kb) * panel + m % panel; }
};

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline float hmax_ps(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Built without -ffast-math: 127 / max|x| must be a true division (not a reciprocal estimate), so x's rounding
// is reproducible (a value at k + 0.5 rounds the same here and in a reference). x is bfloat16 or float32.
//
// Each row of x becomes two rows of int8 blocks, row 2m its rounding as above and row 2m + 1 the rounding of what
// that left (x - q dx, at most dx / 2 a value, so its own step is ~254x finer). A kernel that multiplies both and
// adds each pair's results (add_split_rows) has x to ~3e-5 of a block's largest value instead of ~4e-3: the kept
// blocks then track the dequantized weights as closely as x's own dtype does, for twice the integer products on
// the same weight bytes. One rounding alone flipped the default model's first answer to a near-tie on AVX2 (float32
// x) and on AVX512-VNNI (bfloat16 x) CPUs (docs/performance/quantization.md, quality per CPU kind).
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
inline QuantizedRows quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "[M, K] bfloat16 or float32 input");
  const int64_t M = x.size(0), K = x.size(1), KB = K / 32, rows = 2 * M;
  const auto xs = x.stride(1) == 1 ? x : x.contiguous();
  const bool bf16 = xs.scalar_type() == at::kBFloat16;
  const char* xp = static_cast<const char*>(xs.data_ptr());
  const int64_t row_bytes = xs.stride(0) * xs.element_size();
  const int64_t panel = std::min<int64_t>(rows, kPanelRows), blocks = (rows + panel - 1) / panel * panel * KB;
  QuantizedRows out{KB, panel, std::vector<int8_t>(blocks * 32), std::vector<float>(blocks),
                    std::vector<int32_t>(blocks), std::vector<int32_t>(blocks), std::vector<float>(blocks)};
  // one block of 32 values (v) of row `row` rounded into `out`; v becomes what the rounding left
  const auto round_block = [&out](__m256 (&v)[4], int64_t row, int64_t kb) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs' lane-wise order back to K order
    const __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    const float amax = hmax_ps(top);
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    // nearest, ties to even (the default rounding mode); |x| * 127 / amax rounds to at most 127
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
      v[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q[i]), _mm256_set1_ps(d), v[i]);  // one rounding: x - q d
    }
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
    const int64_t at = out.block(row, kb);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + at * 32), bytes);
    const int32_t sum_lo = hsum_epi32(_mm256_add_epi32(q[0], q[1]));
    const int32_t sum = sum_lo + hsum_epi32(_mm256_add_epi32(q[2], q[3]));
    out.scale[at] = d;
    out.sum[at] = sum;
    out.sum_lo[at] = sum_lo;
    out.scaled_sum[at] = d * static_cast<float>(sum);
  };
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t kb = 0; kb < KB; ++kb) {
        __m256 v[4];
        for (int i = 0; i < 4; ++i) {
          const int64_t k = kb * 32 + 8 * i;
          v[i] = bf16 ? bf16x8_to_ps(xp + m * row_bytes + 2 * k)
                      : _mm256_loadu_ps(reinterpret_cast<const float*>(xp + m * row_bytes) + k);
        }
        round_block(v, 2 * m, kb);
        round_block(v, 2 * m + 1, kb);
      }
    }
  });
  return out;
}
#pragma GCC pop_options

// Results of `rows` rows of int8 blocks (quantize_rows' pairs; row stride 32 floats in c) as rows / 2 rows of x: row
// r = row 2r + row 2r + 1, in place.
inline void add_split_rows(float* c, int64_t rows) {
  for (int64_t r = 0; r < rows / 2; ++r)
    for (int j = 0; j < 32; j += 8)
      _mm256_storeu_ps(c + r * 32 + j, _mm256_add_ps(_mm256_loadu_ps(c + 2 * r * 32 + j),
                                                     _mm256_loadu_ps(c + (2 * r + 1) * 32 + j)));
}


// The float32 steps of one block (a tile's 32 K) of one row of int8 blocks, for V::kLanes features from feature f0
// of the tile (all 16 at once: gguf_vnni.cpp; 8 and 8: gguf_avx2.cpp), given the row's exact integer sums of the
// weight's quants times x's (each kernel's own instructions). Written once for both kernels, so for bfloat16 x they
// agree bit for bit: the scale d dx, the zero point's integer term, Q4_1's and the K-quants' min term, Q6_KS's two
// scales, and the order the terms join the accumulator. The constructor reads the tile's fields (after its quants):
// float16 d at 2 f0, float32 d sc at 4 f0 (Q4_KS, Q5_KS: then -(dmin m) at 64 + 4 f0), Q4_1's float16 m at
// 32 + 2 f0, Q4_Z's zero points and Q6_KS's int8 scales (K 0..15, then 16..31) at 32 + f0 and 48 + f0.
// Q8Biased: Q8_0's quants are the bytes q + 128 (zero point 128: VPDPBUSD takes unsigned bytes); else q itself.
template <int64_t Type, typename V, bool Q8Biased>
struct BlockStep {
  using F = typename V::F;
  using I = typename V::I;
  static constexpr bool kZeroPoint = Type == kQ4_0 || Type == kQ5_0 || Type == kQ4_Z || (Type == kQ8_0 && Q8Biased);
  static constexpr bool kMins = Type == kQ4_1 || has_float_scale_min<Type>();
  F d{}, mins{}, d_lo{}, d_hi{};
  I zero_points{};

  BlockStep(const uint8_t* fields, int f0) {
    if constexpr (Type == kQ6_KS) {  // two 16-wide halves of K, each with its scale, and the zero point 32
      const F d16 = V::halves(fields + 2 * f0);
      d_lo = V::mul(d16, V::bytes(fields + 32 + f0, true));
      d_hi = V::mul(d16, V::bytes(fields + 48 + f0, true));
    } else {
      d = has_float_scale_min<Type>() ? V::load(fields + 4 * f0) : V::halves(fields + 2 * f0);
      if constexpr (has_float_scale_min<Type>()) mins = V::load(fields + 64 + 4 * f0);
      if constexpr (Type == kQ4_1) mins = V::halves(fields + 32 + 2 * f0);
      if constexpr (Type == kQ4_Z) zero_points = V::ubytes_i32(fields + 32 + f0);
      else zero_points = V::set1_i32(Type == kQ4_0 ? 8 : Type == kQ5_0 ? 16 : Type == kQ8_0 ? 128 : 0);
    }
  }

  // acc += the block's product for a row whose int8 block has scale dx, quant sum `sum` and dx * sum
  // `scaled_sum` (QuantizedRows), s lane j's sum over the block of feature j's quants times x's quants.
  void add(F& acc, I s, float dx, int32_t sum, float scaled_sum) const {
    static_assert(Type != kQ6_KS, "Q6_KS takes its two halves' sums: add_halves");
    if constexpr (kZeroPoint) s = V::sub(s, V::mullo(zero_points, V::set1_i32(sum)));
    acc = V::fmadd(V::mul(d, V::set1(dx)), V::to_float(s), acc);
    if constexpr (kMins) acc = V::fmadd(mins, V::set1(scaled_sum), acc);
  }

  // Q6_KS: the same with the sums over K 0..15 (lo) and 16..31 (hi), and sum_lo the row's quant sum over K 0..15.
  void add_halves(F& acc, I lo, I hi, float dx, int32_t sum, int32_t sum_lo) const {
    static_assert(Type == kQ6_KS, "one scale a block: add");
    const F dxv = V::set1(dx);
    const I s_lo = V::sub(lo, V::set1_i32(32 * sum_lo));
    const I s_hi = V::sub(hi, V::set1_i32(32 * (sum - sum_lo)));
    acc = V::fmadd(V::mul(d_lo, dxv), V::to_float(s_lo), acc);
    acc = V::fmadd(V::mul(d_hi, dxv), V::to_float(s_hi), acc);
  }
};

#endif  // TOKENMILL_INT8_ROWS
