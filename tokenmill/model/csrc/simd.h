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
