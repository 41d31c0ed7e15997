// llama.cpp's block formats kept at run time: y = x @ w.T (+ b) for bfloat16 x with w held as Q4_0, Q4_1 or
// Q8_0 blocks (32 weights along K with a float16 scale, and for Q4_1 a float16 min), about a third (Q4) or a
// half (Q8_0) of the bytes of bfloat16.
//
// Packed at load (tokenmill/quant/gguf_linear.py) into tiles of 16 features x 32 K -- one block of each of 16
// features -- whose quants sit in the VNNI order of an AMX B tile, followed by the 16 blocks' scales (and mins):
//   Q4_0: 256 bytes of nibble pairs (row r, byte j: feature j's K 2r | K 2r+1 << 4), 16 float16 d  = 288 bytes
//   Q4_1: the same, 16 float16 d, 16 float16 m                                                      = 320 bytes
//   Q8_0: 512 int8 (row r: feature j's K 2r, 2r+1), 16 float16 d                                    = 544 bytes
//   Q4_Z: the Q4 nibbles, 16 float16 s, 16 uint8 zero points z (AWQ's (q - z) * s, formats/awq_format.py) = 304 bytes
// A tile widens to bfloat16 with the arithmetic of the dequantize-at-load path (formats/gguf.py), in float32 in
// the same order and without fused multiply-adds ((q - 8) * d; q * d + m; q * d; (q - z) * s), rounded to nearest-even:
// the very bfloat16 weights that path loads. The loop is the bfloat16 kernel's (tile_gemm.h: AMX tiles, else
// AVX512-BF16 dot products), so a kept model's outputs are bit for bit those of the dequantized one, and
// batch-invariant like them.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "kernels.h"
#include "tile_gemm.h"

namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;  // GGMLQuantizationType
constexpr int64_t kQ4_Z = 256;  // tokenmill's own: 4-bit with an integer zero point (formats/gguf.py Q4_Z)
constexpr int64_t kQ4_KS = 257, kQ6_KS = 258, kQ5_KS = 259;  // K-quant blocks of 32 (formats/kquants.py): quads only

constexpr int64_t kTileBytesQ4_0 = 256 + 32, kTileBytesQ4_1 = 256 + 64, kTileBytesQ8_0 = 512 + 32,
                  kTileBytesQ4_Z = 256 + 32 + 16;

}  // namespace

// The packed bytes per tile of a kept GGML type, 0 if the type is not kept. The sizes differ, so a packed
// weight's last dimension says its type.
int64_t gguf_tile_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return kTileBytesQ4_0;
    case kQ4_1: return kTileBytesQ4_1;
    case kQ8_0: return kTileBytesQ8_0;
    case kQ4_Z: return kTileBytesQ4_Z;
    case 6: return 256 + 96;  // Q5_0 and the K-quants: in the quads layout (gguf_quads.h) only, no AMX tiles
    case kQ4_KS: return 256 + 128;
    case kQ6_KS: return 512 + 64;
    case kQ5_KS: return 256 + 192;
    default: return 0;
  }
}

// Bytes of a packed weight's tiles picked per feature: out[i, kb, b] = packed[rows[i] / 16, kb, sources[rows[i] %
// 16, b]] ^ flip[b], for packed [N/16, K/32, tile bytes], sources [16, block bytes] (int64), flip [block bytes].
// With model/backends/gguf_tiles.py's tables this undoes gguf_pack for a few features: a tied embedding's lookups read
// its LM head's packed copy (one call instead of ~8 torch ops a step).
at::Tensor gather_tile_bytes(const at::Tensor& packed, const at::Tensor& rows, const at::Tensor& sources,
                             const at::Tensor& flip) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed: [N/16, K/32, tile bytes] uint8");
  TORCH_CHECK(sources.dim() == 2 && sources.size(0) == 16 && sources.scalar_type() == at::kLong &&
                  sources.is_contiguous(), "sources: [16, block bytes] int64");
  const int64_t size = sources.size(1), KB = packed.size(1), tile_bytes = packed.size(2), N = packed.size(0) * 16;
  TORCH_CHECK(flip.numel() == size && flip.scalar_type() == at::kByte && flip.is_contiguous(),
              "flip: [block bytes] uint8");
  const auto ids = rows.reshape(-1).to(at::kLong).contiguous();
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* src = sources.data_ptr<int64_t>();
  for (int64_t b = 0; b < 16 * size; ++b) TORCH_CHECK(src[b] >= 0 && src[b] < tile_bytes, "a source past the tile");
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "row ", id[i], " of ", N);
  auto out = at::empty({n, KB, size}, packed.options());
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const uint8_t* f = flip.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* lane = src + (id[i] % 16) * size;
    const uint8_t* tiles = p + (id[i] / 16) * KB * tile_bytes;
    for (int64_t kb = 0; kb < KB; ++kb, o += size)
      for (int64_t b = 0; b < size; ++b) o[b] = tiles[kb * tile_bytes + lane[b]] ^ f[b];
  }
  return out;
}

// Whole rows of GGML blocks [n, KB * block bytes] (Q8_0, Q4_0, Q4_1 or Q4_Z) decoded into out [n, KB * 32]
// (float32, bfloat16 or float16): the values formats/gguf.py's decoders give, float32 arithmetic in their order
// (built without -ffast-math, which may rewrite (q - 8) * d as q * d - 8 * d), then one rounding to out's dtype.
// A kept embedding's lookup in one call instead of ~10 torch ops (~0.07 ms of a decode step).
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
void gguf_decode_rows(const at::Tensor& raw, int64_t type, const at::Tensor& out) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous(), "raw: [n, row bytes] uint8");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == raw.size(0) && out.size(1) % 32 == 0 && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16 ||
                   out.scalar_type() == at::kHalf), "out: [n, cols] float32, bfloat16 or float16");
  const int64_t size = type == kQ8_0 ? 34 : type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ4_Z ? 19 : 0;
  TORCH_CHECK(size > 0, "gguf_decode_rows decodes Q8_0, Q4_0, Q4_1 and Q4_Z blocks, not type ", type);
  const int64_t n = raw.size(0), KB = out.size(1) / 32;
  TORCH_CHECK(raw.size(1) == KB * size, "rows of ", raw.size(1), " bytes are not ", KB, " blocks of ", size);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  const auto half = [](const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
  };
  const auto decode = [&](auto* dst, auto convert) {
    for (int64_t b = 0; b < n * KB; ++b, src += size, dst += 32) {
      const float d = half(src);
      float v[32];
      if (type == kQ8_0) {
        for (int i = 0; i < 32; ++i) v[i] = static_cast<float>(static_cast<int8_t>(src[2 + i])) * d;
      } else {
        const int at = type == kQ4_0 ? 2 : type == kQ4_1 ? 4 : 3;
        const float shift = type == kQ4_0 ? 8.f : type == kQ4_Z ? static_cast<float>(src[2]) : 0.f;
        const float m = type == kQ4_1 ? half(src + 2) : 0.f;
        for (int i = 0; i < 16; ++i) {
          v[i] = static_cast<float>(src[at + i] & 0x0F);
          v[i + 16] = static_cast<float>(src[at + i] >> 4);
        }
        for (int i = 0; i < 32; ++i) v[i] = type == kQ4_1 ? v[i] * d + m : (v[i] - shift) * d;
      }
      for (int i = 0; i < 32; ++i) dst[i] = convert(v[i]);
    }
  };
  if (out.scalar_type() == at::kFloat)
    decode(out.data_ptr<float>(), [](float f) { return f; });
  else if (out.scalar_type() == at::kBFloat16)
    decode(out.data_ptr<at::BFloat16>(), [](float f) { return at::BFloat16(f); });
  else
    decode(out.data_ptr<at::Half>(), [](float f) { return at::Half(f); });
}
#pragma GCC pop_options

#ifdef TOKENMILL_DPBF16
namespace {

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // explicit rounding: never contracted

// 16 per-feature values -> lanes (2j, 2j + 1) = v[j], for features 0-7 (lo) and 8-15 (hi): each VNNI pair is
// one feature's.
inline void feature_pairs(const uint8_t* half16, __m512& lo, __m512& hi) {
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half16)));
  lo = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), v);
  hi = _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), v);
}

// 8 bytes of nibble pairs -> 16 floats: lanes 2j, 2j + 1 = the low, high nibble of byte j.
inline __m512 nibble_pairs(const uint8_t* src) {
  const __m512i x = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  const __m512i t = _mm512_and_si512(_mm512_or_si512(x, _mm512_slli_epi64(x, 28)),
                                     _mm512_set1_epi64(0x0000000F0000000FLL));
  return _mm512_cvtepi32_ps(t);
}

// 16 per-feature bytes (uint8) -> pairs as feature_pairs.
inline void feature_byte_pairs(const uint8_t* bytes16, __m512& lo, __m512& hi) {
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes16))));
  lo = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), v);
  hi = _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), v);
}

inline __m512 int8_values(const uint8_t* src) {  // 16 int8 -> 16 floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
}

inline void store_row(uint16_t* dst, __m512 lo, __m512 hi) {
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// (q - z) * s for 4-bit tiles whose zero points (per feature pair lanes zlo, zhi) are Q4_0's constant 8 or Q4_Z's
// own: q - z is a small integer and s a float16, so the float32 product is exact and only the bfloat16 store rounds.
inline void widen_q4_offset(const uint8_t* t, __m512 slo, __m512 shi, __m512 zlo, __m512 zhi, uint16_t* dst) {
  for (int r = 0; r < 16; ++r) {
    const uint8_t* row = t + r * 16;
    store_row(dst + r * 32, _mm512_mul_round_ps(_mm512_sub_round_ps(nibble_pairs(row), zlo, kRound), slo, kRound),
              _mm512_mul_round_ps(_mm512_sub_round_ps(nibble_pairs(row + 8), zhi, kRound), shi, kRound));
  }
}

void widen_q4_0(const uint8_t* t, uint16_t* dst) {
  __m512 dlo, dhi;
  feature_pairs(t + 256, dlo, dhi);
  const __m512 eight = _mm512_set1_ps(8.f);
  widen_q4_offset(t, dlo, dhi, eight, eight, dst);
}

void widen_q4_1(const uint8_t* t, uint16_t* dst) {
  __m512 dlo, dhi, mlo, mhi;
  feature_pairs(t + 256, dlo, dhi);
  feature_pairs(t + 288, mlo, mhi);
  for (int r = 0; r < 16; ++r) {
    const uint8_t* row = t + r * 16;
    store_row(dst + r * 32, _mm512_add_round_ps(_mm512_mul_round_ps(nibble_pairs(row), dlo, kRound), mlo, kRound),
              _mm512_add_round_ps(_mm512_mul_round_ps(nibble_pairs(row + 8), dhi, kRound), mhi, kRound));
  }
}

void widen_q4_z(const uint8_t* t, uint16_t* dst) {
  __m512 slo, shi, zlo, zhi;
  feature_pairs(t + 256, slo, shi);
  feature_byte_pairs(t + 288, zlo, zhi);
  widen_q4_offset(t, slo, shi, zlo, zhi, dst);
}

void widen_q8_0(const uint8_t* t, uint16_t* dst) {
  __m512 dlo, dhi;
  feature_pairs(t + 512, dlo, dhi);
  for (int r = 0; r < 16; ++r) {
    const uint8_t* row = t + r * 32;
    store_row(dst + r * 32, _mm512_mul_round_ps(int8_values(row), dlo, kRound),
              _mm512_mul_round_ps(int8_values(row + 16), dhi, kRound));
  }
}

// Runs `loop(widen_tile)` with the widening function of the type whose tiles are `tile_bytes` long.
template <typename Loop>
void with_widener(int64_t tile_bytes, const Loop& loop) {
  switch (tile_bytes) {
    case kTileBytesQ4_0: loop(widen_q4_0); break;
    case kTileBytesQ4_1: loop(widen_q4_1); break;
    case kTileBytesQ8_0: loop(widen_q8_0); break;
    case kTileBytesQ4_Z: loop(widen_q4_z); break;
    default: TORCH_CHECK(false, "not a packed Q4_0, Q4_1, Q8_0 or Q4_Z weight (tiles of ", tile_bytes, " bytes)");
  }
}

// gemm_tiles over a packed weight [NB, KB, tile bytes] with its type's widening.
template <typename Epilogue>
void block_tiles(const at::Tensor& x, const at::Tensor& packed, const Epilogue& epilogue) {
  const int64_t NB = packed.size(0), KB = packed.size(1), tile_bytes = packed.size(2);
  with_widener(tile_bytes, [&](auto widen) {
    gemm_tiles(x, KB * kTileK, NB, widened_scratch(KB),
              widened_weight(packed.data_ptr<uint8_t>(), NB, KB, tile_bytes, widen), epilogue);
  });
}

void check_packed(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "a weight packed by gguf_pack: [N/16, K/32, tile bytes] uint8");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "[M, K] bfloat16 input");
  TORCH_CHECK(x.size(1) == packed.size(1) * kTileK, "input has ", x.size(1), " features, the weight ",
              packed.size(1) * kTileK);
}

}  // namespace
#endif

// x [M, K] bfloat16, packed [N/16, K/32, tile bytes] (the type from the tile size), bias [N] or none -> [M, N]
// bfloat16.
at::Tensor gguf_tiles_linear(const at::Tensor& x, const at::Tensor& packed,
                             const c10::optional<at::Tensor>& bias) {
#ifdef TOKENMILL_DPBF16
  check_packed(x, packed);
  const int64_t NB = packed.size(0), KB = packed.size(1), N = NB * kTileN, M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  const FloatBias b = float_bias(bias);
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const auto epilogue = [&](float* c, int64_t m0, int64_t rows, int64_t nb, bool two_cols) {
    write_rows(c, nullptr, b.p, yp, N, m0, rows, nb * kTileN, two_cols ? 2 * kTileN : kTileN);
  };
  block_tiles(x, packed, epilogue);
  return y;
#else
  TORCH_CHECK(false, "this build has no AVX512-BF16 kernels (the CPU it was built for lacks them)");
#endif
}

// silu(x @ gate.T) * (x @ up.T) from a gate/up weight packed in gate, up block pairs ([I/16, 2, K/32, tile
// bytes], gguf_pack with pairs): [M, K] -> [M, I], as bf16_linear_silu for bfloat16.
at::Tensor gguf_tiles_linear_silu(const at::Tensor& x, const at::Tensor& pairs) {
#ifdef TOKENMILL_DPBF16
  TORCH_CHECK(pairs.dim() == 4 && pairs.size(1) == 2, "a gate/up weight packed by gguf_pack in pairs");
  const auto packed = pairs.view({2 * pairs.size(0), pairs.size(2), pairs.size(3)});
  check_packed(x, packed);
  const int64_t NB = packed.size(0), KB = packed.size(1), I = NB / 2 * kTileN, M = x.size(0);
  auto y = at::empty({M, I}, x.options());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const auto epilogue = [&](float* c, int64_t m0, int64_t rows, int64_t nb, bool) {
    write_silu_rows(c, nullptr, nullptr, yp, I, m0, rows, (nb / 2) * kTileN);
  };
  block_tiles(x, packed, epilogue);
  return y;
#else
  TORCH_CHECK(false, "this build has no AVX512-BF16 kernels (the CPU it was built for lacks them)");
#endif
}

// The kept-GGUF kernel this build and process run: "amx" (tiles, bit for bit the dequantized model), "vnni" (int8
// activations, gguf_vnni.cpp), "avx2" (the same int8 products with AVX2, gguf_avx2.cpp), or "" (none: the blocks
// are dequantized at load).
std::string gguf_kernel() {
#ifdef TOKENMILL_AMX
  if (request_amx()) return "amx";
#endif
#if defined(TOKENMILL_VNNI)
  return "vnni";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)  // gguf_quads.h's TOKENMILL_INT8_ROWS
  return "avx2";
#else
  return "";
#endif
}

// Which kernel multiplies a packed weight of `tile_bytes` tiles by x: this process's (gguf_kernel(); gguf_pack laid
// the weight out for it), but float32 x (a model computing in float32) takes the AVX2 kernel on a VNNI CPU too
// (it alone reads float32 rows; the quads are the same), and on AMX the types without a tile layout (Q5_0 and the
// re-cut K-quants, packed as quads: model/backends/gguf_tiles.py kernel_layout) take the VNNI kernel (every AMX CPU has
// AVX512-VNNI).
enum class GgufPath { kTiles, kVnni, kAvx2 };

GgufPath gguf_path(const at::Tensor& x, int64_t tile_bytes) {
  static const std::string kernel = gguf_kernel();  // fixed for the process: compared once, not per call
  static const bool avx2 = kernel == "avx2", vnni = kernel == "vnni", amx = kernel == "amx";
  if (avx2 || (vnni && x.scalar_type() == at::kFloat)) return GgufPath::kAvx2;
  const bool quads_only = tile_bytes == gguf_tile_bytes(6) || tile_bytes == gguf_tile_bytes(kQ4_KS) ||
                          tile_bytes == gguf_tile_bytes(kQ6_KS) || tile_bytes == gguf_tile_bytes(kQ5_KS);
  return vnni || (amx && quads_only) ? GgufPath::kVnni : GgufPath::kTiles;
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias) {
  switch (gguf_path(x, packed.size(-1))) {
    case GgufPath::kAvx2: return gguf_avx2_linear(x, packed, bias);
    case GgufPath::kVnni: return gguf_vnni_linear(x, packed, bias);
    default: return gguf_tiles_linear(x, packed, bias);
  }
}

at::Tensor gguf_linear_silu(const at::Tensor& x, const at::Tensor& pairs) {
  switch (gguf_path(x, pairs.size(-1))) {
    case GgufPath::kAvx2: return gguf_avx2_linear_silu(x, pairs);
    case GgufPath::kVnni: return gguf_vnni_linear_silu(x, pairs);
    default: return gguf_tiles_linear_silu(x, pairs);
  }
}
