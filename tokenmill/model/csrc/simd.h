// Vector helpers shared by the kernel sources (header-only: each source is built with its own ISA guards), the
// 8-wide (AVX2) and 16-wide (AVX-512) forms of each side by side, and the AMX tile configuration.
#pragma once

#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// `rows` rows of `row_bytes`, `row_stride_bytes` apart, towards L1 (into_l1) or L2; a no-op where the build has no
// x86 prefetch. Kept a loop: unrolled (a block's 32 prefetches back to back) paged attention ran 2.5x slower on Zen 5.
// The instructions are volatile asm, not _mm_prefetch: GCC 12 takes a function whose only effects are prefetches
// for a const one and drops the calls it did not inline early (a lambda prefetching a block vanished whole).
template <bool into_l1>
inline void prefetch_rows(const void* base, int64_t row_stride_bytes, int64_t rows, int64_t row_bytes) {
#if defined(__AVX2__)
  const char* b = static_cast<const char*>(base);
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t off = 0; off < row_bytes; off += 64) {
      const char* line = b + j * row_stride_bytes + off;
      if constexpr (into_l1)
        asm volatile("prefetcht0 %0" : : "m"(*line));
      else
        asm volatile("prefetcht1 %0" : : "m"(*line));
    }
#endif
}

#if defined(__AVX2__) && defined(__FMA__)

// The sum of v's 8 lanes.
inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
}

// exp(x) for 8 floats: 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial
// (relative error ~2e-7, like expf); -inf and very negative inputs give 0.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945f));  // in [-ln2/2, ln2/2]
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// 8 bfloat16 values as floats (the bit pattern shifted into the high half).
inline __m256 bf16x8_to_ps(const void* p) {
  const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// v rounded to the nearest bfloat16, ties to even (as c10::BFloat16 rounds), still as floats.
inline __m256 round_to_bf16_ps(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 8 floats already rounded by round_to_bf16_ps, stored as bfloat16.
inline void store_bf16x8(void* p, __m256 rounded) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(static_cast<__m128i*>(p), packed);
}

#endif

#if defined(__AVX512F__)

// exp(x) for 16 floats: 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial
// (relative error ~2e-7, like expf). Per element the same operations in the same order as exp256 above, so
// the two agree bit for bit.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945f));
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// 16 bfloat16 values (raw bits) as floats.
inline __m512 bf16x16_to_ps(const void* p) {
  const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// v rounded to the nearest bfloat16, ties to even (as c10::BFloat16 rounds), still as floats.
inline __m512 round_to_bf16_ps512(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 16 floats already rounded by round_to_bf16_ps512, stored as bfloat16 (raw bits).
inline void store_bf16x16(void* p, __m512 rounded) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(rounded), 16);
  _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16(high));
}
#endif

// Lanes8 (AVX2) and Lanes16 (AVX-512): one vector of float32 lanes (F) and of int32 lanes (I), each operation one
// instruction of its width. Float steps that an AVX2 kernel and its AVX-512 twin must take identically, lane for lane
// (gguf_quads.h's GGUF block step, scaled_biased and silu_times below), are written once as templates over these, so
// a change reaches both widths.
#if defined(__AVX2__) && defined(__FMA__)
struct Lanes8 {
  using F = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static I set1_i32(int32_t x) { return _mm256_set1_epi32(x); }
  static F load(const void* p) { return _mm256_loadu_ps(static_cast<const float*>(p)); }
#if defined(__F16C__)
  // kLanes float16 values as floats
  static F halves(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
#endif
  // kLanes bytes as floats: int8 (is_signed) or uint8
  static F bytes(const void* p, bool is_signed) {
    const __m128i v = _mm_loadl_epi64(static_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
  }
  // kLanes uint8 values as int32
  static I ubytes_i32(const void* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p))); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, one rounding
  static F exp(F x) { return exp256(x); }
  static F round_bf16(F v) { return round_to_bf16_ps(v); }
};
#endif

#if defined(__AVX512F__)
struct Lanes16 {
  using F = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static I set1_i32(int32_t x) { return _mm512_set1_epi32(x); }
  static F load(const void* p) { return _mm512_loadu_ps(p); }
  static F halves(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p))); }
  static F bytes(const void* p, bool is_signed) {
    const __m128i v = _mm_loadu_si128(static_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
  }
  static I ubytes_i32(const void* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F exp(F x) { return exp512(x); }
  static F round_bf16(F v) { return round_to_bf16_ps512(v); }
};
#endif

// v times scale, then plus bias (scale, bias: V::kLanes floats each, or null), the order a dequantize-then-matmul
// reference with a bias applies them in; the caller rounds the result as it stores it.
template <typename V>
inline typename V::F scaled_biased(typename V::F v, const float* scale, const float* bias) {
  if (scale != nullptr) v = V::mul(v, V::load(scale));
  if (bias != nullptr) v = V::add(v, V::load(bias));
  return v;
}

// silu(g) * u, as silu_mul computes it: silu = g / (1 + exp(-g)) (exp's input capped at 88, where exp is still
// finite), rounded to bfloat16 first where round_bf16 (bfloat16 tensors: torch rounds silu's output), then times u.
// The product is returned unrounded: the caller rounds it as it stores it.
template <typename V>
inline typename V::F silu_times(typename V::F g, typename V::F u, bool round_bf16) {
  const typename V::F e = V::exp(V::min(V::sub(V::zero(), g), V::set1(88.f)));
  typename V::F silu = V::div(g, V::add(V::set1(1.f), e));
  if (round_bf16) silu = V::round_bf16(silu);
  return V::mul(silu, u);
}

#if defined(__AMX_TILE__)
// The 64-byte operand of LDTILECFG: palette 1, then each tile's bytes per row and rows.
struct alignas(64) AmxTileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif
