// A tensor element's dtype to and from float32, one scalar at a time, and the FP8 e4m3 codes of the KV cache
// (--kv-cache-dtype fp8): its decoding (paged_attention.cpp reads the cache) beside its encoding (elementwise.cpp's
// rotary_write_kv writes it), so the two sides of the format sit in one place.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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

}  // namespace
