// Weight-only 8-bit linear layers (W8A16): y = (x @ q.T) * scale (+ b) for bfloat16 x, the weight held as int8
// or as FP8 e4m3 q [N, K] with one float32 scale per output feature (symmetric: w ~ q * scale). FP8 runs on the
// same tiles (no CPU here multiplies FP8): its bytes widen to bfloat16 exactly (e4m3's 3 mantissa bits fit) by
// rebiasing the exponent, which needs its normal numbers: the quantizer (tokenmill/quant/fp8.py) rounds the few
// weights below e4m3's smallest normal to 0 or to it, instead of keeping e4m3's subnormals.
//
// The packed layout is bf16_pack's ([N/16, K/32, 16, 32], the VNNI order of an AMX B tile) with one byte per
// element: half the bytes of the bfloat16 weight, which is what a decode step is bound by. The bytes hold
// u = q + 128 (1..255), because an unsigned byte widens to its exact bfloat16 in three cheap vector ops (through
// float16, see widen_biased) where a signed one takes twice the shuffle-port work, which bounds this kernel at
// small M. For each 32-feature column pair the kernel widens the pair's tiles into a per-thread buffer, runs the
// bfloat16 kernel's loop (AMX tiles, else AVX512-BF16 dot products) over every row block, and in the float32 epilogue takes the offset back out
// (x @ q = x @ u - 128 rowsum(x)) and applies the scale. The offset costs nothing measurable in accuracy: the
// float32 sums carry ~1e-6 relative error against bfloat16's 4e-3. The widening is paid once per call, not per
// row block, and, as for bfloat16, a row's result never depends on the batch it is in.
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "tile_gemm.h"

namespace {

void check_int8_weight(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "int8_pack takes a [N, K] int8 weight");
  TORCH_CHECK(q.size(0) % kTileN == 0 && q.size(1) % kTileK == 0, "int8_pack needs N % 16 == 0 and K % 32 == 0");
}

}  // namespace

// q [N, K] int8 (-127..127) -> [N/16, K/32, 16, 32] uint8 q + 128 in bf16_pack's tile order.
at::Tensor int8_pack(const at::Tensor& q) {
  check_int8_weight(q);
  TORCH_CHECK(q.min().item<int8_t>() >= -127, "int8 weights must lie in [-127, 127]");
  const int64_t N = q.size(0), K = q.size(1);
  const auto biased = (q.to(at::kShort) + 128).to(at::kByte);
  return biased.view({N / kTileN, kTileN, K / kTileK, kTileRows, 2}).permute({0, 2, 3, 1, 4})
      .contiguous().view({N / kTileN, K / kTileK, kTileRows, 2 * kTileN});
}

// q [N, K] float8_e4m3fn -> [N/16, K/32, 16, 32] in bf16_pack's tile order (the bytes as they are).
at::Tensor fp8_pack(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat8_e4m3fn, "fp8_pack takes a [N, K] float8_e4m3fn weight");
  TORCH_CHECK(q.size(0) % kTileN == 0 && q.size(1) % kTileK == 0, "fp8_pack needs N % 16 == 0 and K % 32 == 0");
  const int64_t N = q.size(0), K = q.size(1);
  return q.contiguous().view(at::kByte).view({N / kTileN, kTileN, K / kTileK, kTileRows, 2}).permute({0, 2, 3, 1, 4})
      .contiguous().view({N / kTileN, K / kTileK, kTileRows, 2 * kTileN}).view(at::kFloat8_e4m3fn);
}

// q [2I, K] float8_e4m3fn -> gate/up block pairs [I/16, 2, K/32, 16, 32], as bf16_pack_gate_up.
at::Tensor fp8_pack_gate_up(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.size(0) % (2 * kTileN) == 0, "fp8_pack_gate_up takes [2I, K] with I % 16 == 0");
  const int64_t N = q.size(0), K = q.size(1), blocks = N / (2 * kTileN);
  const auto paired = q.contiguous().view(at::kByte).view({2, blocks, kTileN, K}).transpose(0, 1).reshape({N, K});
  return fp8_pack(paired.view(at::kFloat8_e4m3fn)).view({blocks, 2, K / kTileK, kTileRows, 2 * kTileN});
}

// q [2I, K] int8 (gate rows, then up rows) -> [I/16, 2, K/32, 16, 32] uint8: gate/up block pairs, as
// bf16_pack_gate_up.
at::Tensor int8_pack_gate_up(const at::Tensor& q) {
  check_int8_weight(q);
  TORCH_CHECK(q.size(0) % (2 * kTileN) == 0, "int8_pack_gate_up takes [2I, K] with I % 16 == 0");
  const int64_t N = q.size(0), K = q.size(1), blocks = N / (2 * kTileN);
  const auto paired = q.contiguous().view({2, blocks, kTileN, K}).transpose(0, 1).reshape({N, K});
  return int8_pack(paired).view({blocks, 2, K / kTileK, kTileRows, 2 * kTileN});
}

#ifdef TOKENMILL_DPBF16
namespace {

constexpr int kOffset = 128;  // packed byte = q + kOffset

// 32 bytes u -> 32 bfloat16 u, exactly. With AVX512-FP16: u as float16 (exact), whose exponent and top 7
// mantissa bits, rebiased from float16's 15 to bfloat16's 127, are the bfloat16 (u < 256 has at most 8
// significant bits, so the 3 dropped bits are zero). Otherwise through float32.
inline __m512i widen_biased(const uint8_t* src) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
#if defined(__AVX512FP16__)
  const __m512i h = _mm512_castph_si512(_mm512_cvtepu16_ph(_mm512_cvtepu8_epi16(bytes)));
  return _mm512_add_epi16(_mm512_srli_epi16(h, 3), _mm512_set1_epi16(0x3800));
#else
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1)));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
#endif
}

// 32 FP8 e4m3 bytes (no subnormals) -> 32 bfloat16, exactly: exponent 4 bits rebiased from 7 to 127, the 3
// mantissa bits on top of bfloat16's 7, the sign moved up; zero stays zero.
inline __m512i widen_e4m3(const uint8_t* src) {
  const __m512i t = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  const __m512i magnitude = _mm512_and_si512(_mm512_slli_epi16(t, 4), _mm512_set1_epi16(0x07F0));
  const __mmask32 nonzero = _mm512_test_epi16_mask(t, _mm512_set1_epi16(0x7F));
  const __m512i v = _mm512_maskz_add_epi16(nonzero, magnitude, _mm512_set1_epi16((127 - 7) << 7));
  // (sign bit in place) | v: ternary-logic table of (a & c) | b
  return _mm512_ternarylogic_epi32(_mm512_slli_epi16(t, 8), v, _mm512_set1_epi16(static_cast<int16_t>(0x8000)),
                                   0xEC);
}

// n packed bytes (a multiple of 32) -> n bfloat16.
template <bool Fp8>
inline void widen(const uint8_t* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 32) _mm512_storeu_si512(dst + i, Fp8 ? widen_e4m3(src + i) : widen_biased(src + i));
}

// kOffset * sum(x[m]) for each row, in float32, in one fixed order per row (whatever M): the offset the
// widened bytes add to each product, taken back out in the epilogue.
std::vector<float> offset_sums(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<float> out(M);
  const auto xs = x.stride(1) == 1 ? x : x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < M; ++m) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) acc = _mm512_add_ps(acc, bf16x16_to_ps(xp + m * xs.stride(0) + k));
    out[m] = kOffset * _mm512_reduce_add_ps(acc);
  }
  return out;
}

// gemm_tiles' weight source for an int8_pack'ed (or fp8_pack'ed) weight of NB x KB tiles (512 bytes each).
template <bool Fp8>
auto w8_tiles(const uint8_t* qp, int64_t NB, int64_t KB) {
  return widened_weight(qp, NB, KB, kTileElems,
                        [](const uint8_t* src, uint16_t* dst) { widen<Fp8>(src, dst, kTileElems); });
}

// c[r][j] -= offset[m0 + r] for the rows of a tile result: the float32 of x @ q from that of x @ (q + 128).
inline void remove_offset(float* c, const std::vector<float>& offset, int64_t m0, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 o = _mm512_set1_ps(offset[m0 + r]);
    _mm512_storeu_ps(c + r * 32, _mm512_sub_ps(_mm512_loadu_ps(c + r * 32), o));
    _mm512_storeu_ps(c + r * 32 + 16, _mm512_sub_ps(_mm512_loadu_ps(c + r * 32 + 16), o));
  }
}

struct Int8Problem {
  int64_t M, N, K, NB, KB;
  const uint8_t* qp;
  const float* scale;
};

Int8Problem setup_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, bool fp8) {
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() &&
                  packed.scalar_type() == (fp8 ? at::kFloat8_e4m3fn : at::kByte),
              fp8 ? "a weight packed by fp8_pack" : "a weight packed by int8_pack");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "[M, K] bfloat16 input");
  Int8Problem p;
  p.NB = packed.size(0), p.KB = packed.size(1), p.N = p.NB * kTileN, p.K = p.KB * kTileK, p.M = x.size(0);
  TORCH_CHECK(x.size(1) == p.K, "input has ", x.size(1), " features, the weight ", p.K);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == p.N,
              "one float32 scale per output feature");
  p.qp = static_cast<const uint8_t*>(packed.data_ptr());
  p.scale = scale.data_ptr<float>();
  return p;
}

}  // namespace
#endif

#ifdef TOKENMILL_DPBF16
namespace {

// (x @ q.T) * scale (+ b) for either byte format; int8's bytes carry an offset the epilogue takes back out.
template <bool Fp8>
at::Tensor w8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& bias) {
  const Int8Problem p = setup_int8(x, packed, scale, Fp8);
  auto y = at::empty({p.M, p.N}, x.options());
  const FloatBias b = float_bias(bias);
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const auto offset = Fp8 ? std::vector<float>() : offset_sums(x);
  const auto epilogue = [&](float* c, int64_t m0, int64_t rows, int64_t nb, bool two_cols) {
    if (!Fp8) remove_offset(c, offset, m0, rows);
    write_rows(c, p.scale, b.p, yp, p.N, m0, rows, nb * kTileN, two_cols ? 2 * kTileN : kTileN);
  };
  gemm_tiles(x, p.K, p.NB, widened_scratch(p.KB), w8_tiles<Fp8>(p.qp, p.NB, p.KB), epilogue);
  return y;
}

// silu(x @ gate.T) * (x @ up.T) from gate/up pairs (int8_pack_gate_up, fp8_pack_gate_up) and the [2I] scales in
// gate-then-up order: the 8-bit form of bf16_linear_silu.
template <bool Fp8>
at::Tensor w8_linear_silu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  TORCH_CHECK(packed.dim() == 5 && packed.size(1) == 2, "a gate/up weight packed in pairs");
  const int64_t blocks = packed.size(0), I = blocks * kTileN;
  const Int8Problem p =
      setup_int8(x, packed.view({2 * blocks, packed.size(2), packed.size(3), packed.size(4)}), scale, Fp8);
  auto y = at::empty({p.M, I}, x.options());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const auto offset = Fp8 ? std::vector<float>() : offset_sums(x);
  const auto epilogue = [&](float* c, int64_t m0, int64_t rows, int64_t nb, bool) {
    if (!Fp8) remove_offset(c, offset, m0, rows);
    const int64_t n0 = (nb / 2) * kTileN;
    write_silu_rows(c, p.scale + n0, p.scale + I + n0, yp, I, m0, rows, n0);
  };
  gemm_tiles(x, p.K, p.NB, widened_scratch(p.KB), w8_tiles<Fp8>(p.qp, p.NB, p.KB), epilogue);
  return y;
}

}  // namespace
#define TOKENMILL_W8(call) return call
#else
#define TOKENMILL_W8(call) \
  TORCH_CHECK(false, "this build has no AVX512-BF16 kernels (the CPU it was built for lacks them)"); \
  return at::Tensor()
#endif

// x [M, K] bfloat16, packed from int8_pack, scale [N] float32, bias [N] or none -> [M, N] bfloat16.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TOKENMILL_W8(w8_linear<false>(x, packed, scale, bias));
}

at::Tensor int8_linear_silu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  TOKENMILL_W8(w8_linear_silu<false>(x, packed, scale));
}

// The same with FP8 e4m3 weights from fp8_pack / fp8_pack_gate_up.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& bias) {
  TOKENMILL_W8(w8_linear<true>(x, packed, scale, bias));
}

at::Tensor fp8_linear_silu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
  TOKENMILL_W8(w8_linear_silu<true>(x, packed, scale));
}
